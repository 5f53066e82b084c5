"""What every request passes before the OpenAI routes see it: Gate, an ASGI middleware that refuses what this
server does not serve (Host, Origin, API key, shutdown, Content-Type, body size and time), and beneath it
GuardedH11Protocol, uvicorn's h11 protocol with the limits it lacks (header timeout, connection cap, 431)."""
import asyncio
import hmac
import json
import logging
from dataclasses import dataclass, field
from http import HTTPStatus

import h11
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from serving.messages import error_body as anthropic_error_body
from serving.protocol import error_body

log = logging.getLogger("uvicorn.error")  # uvicorn's own log: its format, and --quiet silences it


ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/infill", "/v1/models", "/tokenize",
          "/detokenize", "/tokenizer_info", "/health", "/metrics")


OPEN_ROUTES = ("/health", "/metrics")


LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]")  # Host header names served by default, besides the bound host


MAX_HEAD_BYTES = 16 * 2 ** 10  # request line and headers (h11's default, Node's too); a longer head gets 431


MAX_HEADERS = 100  # header fields in one request (Apache's LimitRequestFields); more get 431


LINGER_S = 2.0  # how long a connection closed after an error answer is still read (see GuardedH11Protocol.answer)


REFUSING_MAX = 32  # connections over --max-connections answered 503 at a time; beyond, they are reset (a flood)


BACKLOG = 64  # connections the kernel queues for accept(), and asyncio accepts at once before any is refused


FD_RESERVE = 32 + REFUSING_MAX + 4 * BACKLOG


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
    max_model_len: int | None = None  # positions per sequence at most (prompt and completion), below the model's
    tool_parser: str | None = None  # the tool call syntax when not the chat template's (toolcalls.FORMATS)
    reasoning_parser: str | None = None  # how reasoning is split out of chat answers (reasoning.tags_named)
    aliases: tuple[str, ...] = ()  # names served besides the model's (serve.py --served-model-name's others)
    sampling_defaults: tuple[tuple[str, float], ...] = ()  # (field, value): generation_config.json's, for requests
    # that leave the field out (serve.py --generation-config)
    pooling: str = "mean"  # how /v1/embeddings pools the final hidden states (features/embed.py POOLINGS)
    shutdown_timeout_s: float = 20.0  # grace for running requests on SIGTERM; under Kubernetes' 30 s to SIGKILL


@dataclass
class GateState:
    """What Gate reads and keeps of the server: whether requests are admitted, the requests in flight (what a
    shutdown waits for) and the responses counted by endpoint and status. The server changes the phase."""
    # "serving"; "draining" after SIGTERM/SIGINT (Gate answers 503, requests in flight may finish); "closing" once
    # those left are ended (at the grace's end or a second signal); "failed" when the engine thread died. `why` says
    # why for the last two: it is what the requests ended then are told.
    phase: str = "serving"
    why: str | None = None
    inflight: int = 0  # requests past Gate whose response is not complete
    responses: dict[tuple[str, int], int] = field(default_factory=dict)  # (endpoint, HTTP status) -> count

    def count(self, endpoint: str, status: int) -> None:
        self.responses[endpoint, status] = self.responses.get((endpoint, status), 0) + 1


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
          code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status, headers)


class Refused(Exception):
    """A request answered with an error before its handler could answer it (raised in Gate, or by its receive)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.kind, self.code, self.headers = status, kind, code, headers

    def response(self, path: str = "") -> JSONResponse:
        """The error in OpenAI's shape, or Anthropic's for its Messages routes."""
        if path.startswith("/v1/messages"):
            return JSONResponse(anthropic_error_body(self.status, str(self)), self.status, self.headers)
        return error(self.status, str(self), self.kind, None, self.code, self.headers)


def host_name(host: str) -> str:
    """The name in a Host header, lowercase: "[::1]:8000" -> "[::1]", "LocalHost:8000" -> "localhost"."""
    host = host.strip().lower()
    return host[:host.find("]") + 1] if host.startswith("[") else host.rpartition(":")[0] or host


def key_matches(authorization: str, key: str) -> bool:
    """Whether an Authorization header (decoded as Latin-1, as HTTP carries it) is "Bearer <key>", compared in
    constant time."""
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), key.encode())


def admit(scope: dict, config: ServeConfig, state: GateState) -> None:
    """Refused for a request this server does not serve, checked in this order: Host, Origin, API key, shutdown,
    Content-Type of a POST, Content-Length."""
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
                                                                                   config.api_key) \
            and not hmac.compare_digest(headers.get("x-api-key", "").encode("latin-1"), config.api_key.encode()):
        raise Refused(401, "a missing or incorrect API key; send it as the header 'Authorization: Bearer KEY' "
                      "(or Anthropic's 'x-api-key: KEY')", code="invalid_api_key",
                      headers={"WWW-Authenticate": "Bearer"})
    if state.phase != "serving" and path not in OPEN_ROUTES:  # draining, closing, or the engine failed
        raise Refused(503, state.why or "the server is shutting down", "server_error")
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
    format. The in-flight count is what a shutdown waits for. What it reads and counts is state's."""

    def __init__(self, app, config: ServeConfig, state: GateState):
        self.app, self.config, self.state = app, config, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # the lifespan
            await self.app(scope, receive, send)
            return
        state, path = self.state, scope["path"]
        # One label for all unknown paths, not one each
        endpoint = path if path in ROUTES else "/v1/models/{id}" if path.startswith("/v1/models/") else "other"
        started = False

        async def counted(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                state.count(endpoint, message["status"])
            await send(message)

        try:
            admit(scope, self.config, state)
            state.inflight += 1
            try:
                await self.app(scope, limited(receive, self.config), counted)
            finally:
                state.inflight -= 1
        except Refused as e:
            if not started:
                await e.response(path)(scope, receive, counted)
        except ClientDisconnect:  # it left while sending its body: nobody to answer
            state.count(endpoint, 499)  # nginx's "client closed request"
            log.info(f"{scope['method']} {path}: the client went away while sending its body")
        except Exception as e:
            log.error(f"{scope['method']} {path} failed: {type(e).__name__}: {e}")
            if not started:
                await error(500, f"the server failed on this request ({type(e).__name__})",
                            "server_error")(scope, receive, counted)


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
    the limits, which uvicorn answers with 400. h11 checks the size only of a head still arriving; a whole head in
    one read is measured here, and its header count."""
    error: h11.RemoteProtocolError | None = None

    def next_event(self):
        try:
            event = super().next_event()
            if isinstance(event, h11.Request):
                check_head(event)
            return event
        except h11.RemoteProtocolError as e:
            self.error = e
            raise


class HeadOverLimits(h11.RemoteProtocolError):
    """A whole request head over MAX_HEAD_BYTES or MAX_HEADERS (status hint 431), its message the answer's."""


def check_head(request: h11.Request) -> None:
    if len(request.headers) > MAX_HEADERS:
        raise HeadOverLimits(f"the request has {len(request.headers)} header fields, over the limit of {MAX_HEADERS}",
                             error_status_hint=431)
    size = len(request.method) + len(request.target) + len(b" HTTP/1.1\r\n\r\n") + \
        sum(len(name) + len(value) + 4 for name, value in request.headers)  # "name: value\r\n"
    if size > MAX_HEAD_BYTES:
        raise HeadOverLimits(f"the request line and headers are over {MAX_HEAD_BYTES} bytes", error_status_hint=431)


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
    over MAX_HEAD_BYTES or with over MAX_HEADERS fields is answered 431, however it arrives."""

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
        if isinstance(error, HeadOverLimits):
            self.answer(431, str(error))
        elif error is not None and error.error_status_hint == 431:  # a head still arriving, over h11's buffer
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

