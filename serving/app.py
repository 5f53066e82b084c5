"""The HTTP app: Server (what the handlers share: the engine and its thread, the tokenizer, the metrics, the calls
in flight, the shutdown) and make_app, the FastAPI app with its routes behind Gate. serve.py is the command that
loads a model and runs it with uvicorn.

Threads: serve.py steps the engine (Engine.run_forever) on the main thread, where torch's CPU ops run fastest, and
runs uvicorn's asyncio loop on another; make_app(engine_thread=True), for tests and embedding, gives the engine a
thread of its own instead. A handler parses its body (protocol.parse_body) on a worker thread, submits the call's
engine Requests, whose on_event callbacks, called on the engine thread, put each Event and its arrival time in the
server's outbox; once a step (Engine.on_step_events) one loop.call_soon_threadsafe delivers them all to their handlers'
asyncio.Queues, and the handler shapes the answer from them (answer.Answer). A call
whose client goes away is aborted (Server.release), so its KV blocks return to the pool at the engine's next step.
"""
import asyncio
import bisect
import collections
import functools
import logging
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from features.constraint import Constraint, Grammar
from features.embed import embed
from features.grammar import Compiler
from features.reasoning import tags_named
from serving import messages, responses
from serving.answer import Answer
from serving.contract import Event, Request, Unavailable
from serving.embeddings import embeddings_body, parse_embeddings
from serving.engine import Engine, QueueFull
from serving.gate import Gate, GateState, QuietLoopErrors, ServeConfig, error
from serving.llamacpp import InfillAnswer, parse_infill
from serving.protocol import (BadRequest, Call, longest_token, parse_body, parse_detokenize, parse_json, parse_tokenize,
                              tokenize_answer)

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # seconds
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)  # seconds
RETRY_AFTER_S = 1  # told to a client refused with 429: the queue moves at the engine's pace, a step or a few
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
        self.finished: dict[str, int] = {}  # engine finish_reason -> count ("abort": the client went away)
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)

    def finish(self, reason: str, last: Event | None, tpot: float | None = None) -> None:
        """A choice ended: count it and its tokens (as of its last event, if any; a prompt once, with its first
        choice)."""
        self.finished[reason] = self.finished.get(reason, 0) + 1
        if last is not None:
            self.prompt_tokens += last.prompt_tokens if last.index == 0 else 0
            self.completion_tokens += last.completion_tokens
        if tpot is not None:
            self.tpot.observe(tpot)

    def render(self, stats: dict, responses: dict[tuple[str, int], int]) -> str:
        """The Prometheus text exposition of these metrics, of the engine's stats() and of the responses counted by
        (endpoint, HTTP status) (GateState.responses)."""
        def family(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> list[str]:
            return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *(f"{name}{lab} {v}" for lab, v in samples)]

        lines = family("llm_http_requests_total", "counter", "HTTP requests by endpoint and status code.",
                       [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in sorted(responses.items())])
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
        self.reasoning = tags_named(config.reasoning_parser, tokenizer.chat_template)
        self.responses = responses.Store()  # for /v1/responses' previous_response_id
        self.max_chars = (self.max_len - 1) * longest_token(tokenizer)  # a longer prompt text surely does not fit
        self.open: dict[asyncio.Queue, list[int]] = {}  # the calls in flight: their engine requests
        self.compiler: Compiler | None = None  # built at the first structured-output request
        self.compiler_lock = threading.Lock()  # requests are parsed on worker threads
        self.gate = GateState()  # serving, draining, closing or failed; the requests in flight; responses
        self.drainer: asyncio.Task | None = None
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        # The events on their way from the engine thread to the loop: one wake-up carries a step's events (a wake-up
        # each cost the engine thread a loop pass apiece: 361 against 121 us for 8 events, dev/LOG.md).
        self.outbox: collections.deque[tuple[asyncio.Queue, tuple]] = collections.deque()
        self.delivery_posted = False  # a deliver() is scheduled on the loop and has not begun
        engine.on_step_events = self.hand_over

    def limits(self) -> dict:
        """protocol.parse_request's keyword arguments for this server."""
        return dict(max_len=self.max_len, max_chars=self.max_chars, compile_grammar=self.compile_grammar,
                    special=self.config.special, tool_parser=self.config.tool_parser, reasoning=self.reasoning,
                    sampling_defaults=dict(self.config.sampling_defaults))

    def answering(self, asked: str | None) -> str:
        """The model name an answer gives: the one the request asked for when it is served, else the first."""
        return asked if asked in self.names else self.model_name

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
        self.gate.phase, self.gate.why = state, why
        self.engine.fail_jobs(why)  # the embeddings waiting for the engine
        for queue in list(self.open):
            queue.put_nowait((time.perf_counter(), None, None))

    def begin_shutdown(self) -> None:
        """SIGTERM or SIGINT (on the event loop): stop admitting and drain; a second signal ends the rest now."""
        if self.gate.phase == "serving":
            self.gate.phase = "draining"
            self.drainer = asyncio.ensure_future(self.drain())
        elif self.gate.phase == "draining":
            self.end_all("closing", "the server is shutting down")

    async def drain(self) -> None:
        """Let the requests in flight finish within config.shutdown_timeout_s, end those left (streams get an error
        event and [DONE]), then stop the engine: run_engine returns and the process exits."""
        loop = asyncio.get_running_loop()
        log.info(f"shutting down: {self.gate.inflight} requests in flight get up to {self.config.shutdown_timeout_s} s")
        deadline = loop.time() + self.config.shutdown_timeout_s
        while self.gate.inflight and loop.time() < deadline and self.gate.phase == "draining":
            await asyncio.sleep(0.05)
        if self.gate.inflight:
            log.info(f"shutting down: ending {self.gate.inflight} requests still in flight")
            if self.gate.phase == "draining":
                self.end_all("closing", "the server is shutting down")
            deadline = loop.time() + 5  # they only write their error now; a client that reads nothing is left
            while self.gate.inflight and loop.time() < deadline:
                await asyncio.sleep(0.05)
        self.stop.set()
        self.engine.stop_waiting()

    def submit(self, requests: list[Request]) -> tuple[list[int], asyncio.Queue]:
        """Submit a call's requests to the engine; their events arrive on one queue as (time.perf_counter(), the
        request's index, Event). All or none are submitted."""
        queue, ids = asyncio.Queue(), []
        for i, request in enumerate(requests):
            def on_event(event: Event, i: int = i) -> None:  # on the engine thread; hand_over() sends it
                self.outbox.append((queue, (time.perf_counter(), i, event)))

            request.on_event = on_event
            try:
                ids.append(self.engine.submit(request))
            except Exception:
                for request_id in ids:
                    self.engine.abort(request_id)
                raise
        self.open[queue] = ids
        return ids, queue

    def hand_over(self) -> None:
        """On the engine thread, after a step's events: wake the loop to deliver them, unless a wake-up is pending."""
        if self.outbox and not self.delivery_posted:
            self.delivery_posted = True
            try:
                self.loop.call_soon_threadsafe(self.deliver)
            except RuntimeError:  # the loop is closed (uvicorn has gone): nobody is left to read them
                self.outbox.clear()

    def deliver(self) -> None:
        """On the loop: put every event in the outbox on its call's queue, in the order the engine sent them. (The
        flag is cleared first: an event appended after it is read is taken now, or by the wake-up it posts.)"""
        self.delivery_posted = False
        while self.outbox:
            queue, item = self.outbox.popleft()
            queue.put_nowait(item)

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
                    raise Failed(self.gate.why, 500 if self.gate.phase == "failed" else 503)
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


@dataclass(frozen=True)
class Api:
    """What each generation endpoint does its own way: parse a raw body into a Call (on a worker thread), shape the
    answer (an answer.Answer, or one with its methods: opening, add, closing, body, error_event, done), and write an
    error: (status, message, kind, param, headers) -> a response."""
    parse: Callable[[Server, bytes], Call]
    answer: Callable[[Server, Call], Answer]
    error: Callable[..., Response] = error


def openai_answer(server: Server, call: Call) -> Answer:
    chat = call.chat
    head = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            "object": ("chat.completion" if chat else "text_completion") + (".chunk" if chat and call.stream else ""),
            "created": int(time.time()), "model": server.answering(call.model)}
    return Answer(call, server.tokenizer, head)


def anthropic_error(status: int, message: str, kind: str | None = None, param: str | None = None,
                    headers: dict[str, str] | None = None) -> Response:
    return JSONResponse(messages.error_body(status, message), status, headers)


COMPLETIONS = Api(lambda server, raw: parse_body(raw, False, server.tokenizer, **server.limits()), openai_answer)
CHAT = Api(lambda server, raw: parse_body(raw, True, server.tokenizer, **server.limits()), openai_answer)
MESSAGES = Api(lambda server, raw: messages.parse_messages(raw, server.tokenizer, **server.limits()),
               lambda server, call: messages.MessagesAnswer(call, server.tokenizer, server.answering(call.model)),
               anthropic_error)
INFILL = Api(lambda server, raw: infill_call(server, raw),  # llama.cpp's /infill
             lambda server, call: InfillAnswer(call, server.tokenizer, server.answering(call.model),
                                               call.context["return_tokens"]))
RESPONSES = Api(lambda server, raw: responses.parse_responses(raw, server.tokenizer, server.responses,
                                                              **server.limits()),
                lambda server, call: responses.ResponsesAnswer(call, server.tokenizer, server.answering(call.model),
                                                               server.responses))


def infill_call(server: Server, raw: bytes) -> Call:
    """llama.cpp's POST /infill body -> its Call (return_tokens in its context, for the answer)."""
    call, return_tokens = parse_infill(parse_json(raw), server.tokenizer, max_len=server.max_len,
                                       max_chars=server.max_chars)
    call.context["return_tokens"] = return_tokens
    return call


async def admit_call(server: Server, http: HTTPRequest, api: Api) -> tuple[Call, list[int], asyncio.Queue] | Response:
    """Read, parse and submit a generation request; its call, engine request ids and event queue, or the error
    response that refuses it."""
    try:
        raw = await http.body()  # at most config.max_body_bytes, or Gate answers 413
        call = await asyncio.to_thread(api.parse, server, raw)
        if call.ignored:
            log.warning(f"{http.url.path}: ignoring unknown fields {', '.join(f[:40] for f in call.ignored[:10])}")
        if server.gate.phase in ("closing", "failed"):
            return api.error(503, server.gate.why, "server_error")
        ids, queue = server.submit(call.requests)
    except BadRequest as e:
        return api.error(400, str(e), param=e.param)
    except QueueFull as e:
        return api.error(429, f"the server is busy: {e}; retry later", "rate_limit_error",
                         headers={"Retry-After": str(RETRY_AFTER_S)})
    except Unavailable as e:
        return api.error(503, f"{e}; retry later", "server_error", headers={"Retry-After": str(RETRY_AFTER_S)})
    except ValueError as e:  # the engine's checks: prompt longer than the context, more KV blocks than the pool
        return api.error(400, str(e))
    return call, ids, queue


async def generation(server: Server, http: HTTPRequest, api: Api) -> Response:
    """A generation endpoint: POST /v1/completions, /v1/chat/completions, /v1/messages, /v1/responses, /infill."""
    t0 = time.perf_counter()
    admitted = await admit_call(server, http, api)
    if isinstance(admitted, Response):
        return admitted
    return await respond(server, http, api, admitted, api.answer(server, admitted[0]), t0)


async def respond(server: Server, http: HTTPRequest, api: Api, admitted: tuple, answer, t0: float) -> Response:
    """The answer to an admitted call (call, engine ids, event queue) from its events: the body, or the stream.
    answer: answer.Answer's interface (opening, add, closing, body, error_event, done)."""
    call, ids, queue = admitted
    choices = len(call.requests) * call.n
    if not call.stream:
        watcher = asyncio.create_task(abort_on_disconnect(http.receive, server, queue))
        try:
            async with aclosing(server.events(ids, queue, choices, t0)) as events:
                async for i, event in events:
                    answer.add(i, event)
        except Failed as e:
            return api.error(e.status, str(e), "server_error")
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
            yield answer.error_event(str(e), e.status)
        for chunk in answer.done():
            yield chunk

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
    app.add_middleware(Gate, config=config, state=server.gate)

    @app.exception_handler(HTTPException)
    async def http_error(http: HTTPRequest, e: HTTPException) -> Response:  # unknown path, wrong method
        return error(e.status_code, str(e.detail))

    add_generation_routes(app, server)
    add_embedding_routes(app, server)
    add_model_routes(app, server)
    add_tokenizer_routes(app, server)
    add_status_routes(app, server)
    return app


def add_generation_routes(app: FastAPI, server: Server) -> None:
    """POST /v1/completions, /v1/chat/completions and llama.cpp's /infill."""
    @app.post("/v1/completions")
    async def completions(http: HTTPRequest) -> Response:
        return await generation(server, http, COMPLETIONS)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest) -> Response:
        return await generation(server, http, CHAT)

    @app.post("/v1/messages")
    async def anthropic_messages(http: HTTPRequest) -> Response:
        return await generation(server, http, MESSAGES)

    @app.post("/v1/responses")
    async def create_response(http: HTTPRequest) -> Response:
        return await generation(server, http, RESPONSES)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        stored = server.responses.get(response_id)
        if stored is None:
            return error(404, f"no stored response {response_id[:60]!r}", param="response_id")
        return JSONResponse(stored[0])

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        if not server.responses.delete(response_id):
            return error(404, f"no stored response {response_id[:60]!r}", param="response_id")
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(http: HTTPRequest) -> Response:
        try:
            n = await asyncio.to_thread(messages.count_tokens, await http.body(), server.tokenizer, **server.limits())
        except BadRequest as e:
            return anthropic_error(400, str(e))
        return JSONResponse({"input_tokens": n})

    @app.post("/infill")
    async def infill_route(http: HTTPRequest) -> Response:
        return await generation(server, http, INFILL)


def add_embedding_routes(app: FastAPI, server: Server) -> None:
    """POST /v1/embeddings: each input's vector from its own forward, run as an engine job (Engine.run_job: the
    engine's thread owns the model), pooled as config.pooling says."""
    model = server.engine.model

    @app.post("/v1/embeddings")
    async def embeddings(http: HTTPRequest) -> Response:
        try:
            body = parse_json(await http.body())
            call = await asyncio.to_thread(parse_embeddings, body, server.tokenizer, max_len=server.max_len,
                                           max_chars=server.max_chars, dim=model.args.dim,
                                           special=server.config.special)
        except BadRequest as e:
            return error(400, str(e), param=e.param)
        if call.ignored:
            log.warning(f"{http.url.path}: ignoring unknown fields {', '.join(f[:40] for f in call.ignored[:10])}")
        if server.gate.phase in ("closing", "failed"):
            return error(503, server.gate.why, "server_error")
        jobs = [server.engine.run_job(functools.partial(embed, model, [ids], server.config.pooling))
                for ids in call.inputs]
        try:
            vectors = [v for job in jobs for v in await asyncio.wrap_future(job)]
        except Exception as e:  # the engine stopped (fail_jobs: RuntimeError) or the forward failed
            return error(503 if server.gate.phase == "closing" else 500, str(e), "server_error")
        finally:
            for job in jobs:  # those not started yet, when this handler ends early (its client went away)
                job.cancel()
        return JSONResponse(embeddings_body(call, vectors, server.model_name))


def add_model_routes(app: FastAPI, server: Server) -> None:
    """GET /v1/models and /v1/models/{name}: the one model, under each of its names."""
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


def add_tokenizer_routes(app: FastAPI, server: Server) -> None:
    """vLLM's POST /tokenize and /detokenize, and GET /tokenizer_info."""
    tokenizer = server.tokenizer

    @app.post("/tokenize")
    async def tokenize(http: HTTPRequest) -> Response:
        try:
            body = parse_json(await http.body())
            ids = await asyncio.to_thread(parse_tokenize, body, tokenizer, server.max_chars)
            return JSONResponse(tokenize_answer(body, ids, tokenizer, server.max_len))
        except BadRequest as e:
            return error(400, str(e), param=e.param)

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


def add_status_routes(app: FastAPI, server: Server) -> None:
    """GET /health (503 unless serving) and /metrics (Prometheus text)."""
    @app.get("/health")
    async def health() -> Response:
        status = {"serving": "ok", "failed": "error"}.get(server.gate.phase, "draining")
        return JSONResponse({"status": status, "error": server.gate.why if status == "error" else None,
                             "model": server.model_name, "engine": server.engine.stats()},
                            200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(server.engine.stats(), server.gate.responses),
                        media_type="text/plain; version=0.0.4")
