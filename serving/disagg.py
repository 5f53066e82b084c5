"""Disaggregated prefill/decode: a prefill worker computes prompts' KV blocks and ships them to a decode worker,
which admits each request straight into decode, so that a long prompt never stalls the running streams' tokens.

    python serve.py --role decode  --kv-address 127.0.0.1:8001 --port 8000   # the HTTP front and the decodes
    python serve.py --role prefill --kv-address 127.0.0.1:8001               # dials the decode worker (any number)

The decode worker (DecodeEngine, an Engine) owns the HTTP API, sampling and the running streams. A new request takes
its own prefix-cache hits first, reserves blocks for the rest of its prompt and asks a prefill worker (the one with
the least work queued) for the keys/values of prompt[start:], start being what it already holds. The prefill worker
(PrefillWorker) reuses its own prefix cache, reserves blocks for the whole prompt (a prompt waits while others hold
them), computes the rest in chunks of --token-budget tokens, one chunk of each started prompt in turn (a short
prompt waits a chunk of a long one, not all of it), and sends each chunk's full blocks while the next chunk computes
(a writer thread); the last, partial block goes at the end with the logits after the prompt's last token. The
decode worker writes the blocks into the ones it reserved (a reader thread), registers them in its prefix cache,
admits the request into the running set and samples its first token from those logits, on its own thread with the
request's sampler, seed and grammar (forking n/best_of), so every sampling option works as co-located. The logits
are exact: a prompt's chunks run as prefill forwards, which compute the same however a prompt is split (step.Step),
so they are the co-located engine's bit for bit. A prompt with one token left after the decode worker's prefix hits
computes it there (a decode step, as co-located); requests with prompt logprobs (echo) and sequences preempted after
admission are prefilled on the decode worker.

Transport: one TCP connection per prefill worker, messages of a JSON head (4-byte length first) and raw bytes. Not
torch.distributed: a gloo or NCCL group is one fate, where a rank that dies leaves the others' point-to-point
calls hanging until the group's timeout and the group unusable (every rank must re-rendezvous, and a replacement
cannot join a running group). Here a connection that ends, errs or is silent for --kv-timeout seconds (both sides
send a heartbeat each second) fails only the requests it was prefilling, with an error naming the worker; the decode
worker serves on, answers 503 while no prefill worker is connected, and a restarted worker dials in again. The cost:
KV crosses host memory (no GPU-to-GPU copy on CUDA). The first message checks that both sides run the same weights
(a fingerprint of the arguments, tensor names, shapes and dtypes and the embedding's sum), dtype and block layout,
and the same --api-key when the decode worker has one.
"""
import hashlib
import hmac
import json
import queue
import socket
import struct
import sys
import threading
from collections import deque
from dataclasses import dataclass, field

import torch

from kvcache import BlockPool, PagedKVCache
from model import Transformer
from serving.choices import Choice
from serving.contract import Request, Unavailable
from serving.engine import Engine, EngineConfig
from serving.scheduler import BlockManager, Scheduler, Seq
from step import Step

VERSION = 1
HEAD = struct.Struct("!I")  # the JSON head's length
MAX_HEAD = 64 << 20  # a head carries a prompt's token ids at most
HEARTBEAT_S = 1.0


# ---- the wire ----

def send(sock: socket.socket, head: dict, payload: torch.Tensor | None = None) -> None:
    """One message: the head (with the payload's byte count) and the payload's raw bytes."""
    data = json.dumps({**head, "bytes": 0 if payload is None else payload.numel()}).encode()
    sock.sendall(HEAD.pack(len(data)) + data)
    if payload is not None and payload.numel():
        sock.sendall(memoryview(payload.numpy()))


def recv_into(sock: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        view = view[n:]


def receive(sock: socket.socket, limit: int = 0) -> tuple[dict, torch.Tensor | None]:
    """The next message: its head and payload (uint8, or None; a payload over `limit` bytes ends the connection
    before anything is allocated for it)."""
    size = bytearray(HEAD.size)
    recv_into(sock, memoryview(size))
    (n,) = HEAD.unpack(size)
    if n > MAX_HEAD:
        raise ConnectionError(f"a message head of {n} bytes (at most {MAX_HEAD})")
    data = bytearray(n)
    recv_into(sock, memoryview(data))
    head = json.loads(data)
    if not isinstance(head, dict) or not isinstance(head.get("bytes"), int) or not 0 <= head["bytes"] <= limit:
        raise ConnectionError(f"a malformed message head, or a payload over {limit} bytes")
    payload = None
    if head["bytes"]:
        payload = torch.empty(head["bytes"], dtype=torch.uint8)
        recv_into(sock, memoryview(payload.numpy()))
    return head, payload


def parse_address(address: str) -> tuple[str, int]:
    """'HOST:PORT' -> (host, port); a ValueError naming the value otherwise."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--kv-address must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


# ---- what both sides agree on: the weights, and the blocks' bytes ----

def fingerprint(model: Transformer) -> str:
    """Who computes keys/values as this model does: its arguments, every tensor's name, shape and dtype (a quantized
    model has other tensors), and the embedding's sum (other weights of the same shapes)."""
    h = hashlib.sha256(repr(model.args).encode())
    for name, t in model.state_dict().items():
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    h.update(repr(float(model.embed_tokens.weight.double().sum())).encode())
    return h.hexdigest()


def layout(pool: BlockPool, vocab: int) -> dict:
    """A pool's block layout (what a block's bytes mean) and the logits' width."""
    return {"layers": len(pool.k), "block_size": pool.block_size, "dtype": str(pool.k[0].dtype),
            "k": list(pool.k[0].shape[1:]), "v": list(pool.v[0].shape[1:]), "vocab": vocab}


def pack(pool: BlockPool, ids: list[int]) -> torch.Tensor:
    """Blocks ids' keys/values as bytes: every layer's keys, then every layer's values, (n, K, bs, D) each."""
    index = torch.tensor(ids, device=pool.k[0].device)
    return torch.cat([t.index_select(0, index).reshape(-1).view(torch.uint8) for t in (*pool.k, *pool.v)]).cpu()


def unpack(pool: BlockPool, ids: list[int], data: torch.Tensor) -> None:
    """pack's bytes into blocks ids of pool."""
    index, offset = torch.tensor(ids, device=pool.k[0].device), 0
    for t in (*pool.k, *pool.v):
        shape = (len(ids), *t.shape[1:])  # (n, K, bs, D)
        n = t[0].nbytes * len(ids)
        if n:
            t.index_copy_(0, index, data[offset:offset + n].view(t.dtype).view(shape).to(t.device))
        offset += n
    assert offset == data.numel(), f"{data.numel()} bytes for {len(ids)} blocks of {offset // len(ids)}"


def block_bytes(pool: BlockPool) -> int:
    return sum(t[0].nbytes for t in (*pool.k, *pool.v))


def hello(model: Transformer, pool: BlockPool, key: str | None) -> dict:
    return {"type": "hello", "version": VERSION, "fingerprint": fingerprint(model),
            "layout": layout(pool, model.args.vocab_size),
            "key": key}


def mismatch(mine: dict, theirs: dict, key: str | None) -> str | None:
    """Why a prefill worker's hello is refused, or None."""
    if theirs.get("version") != VERSION:
        return f"protocol version {theirs.get('version')} (this decode worker speaks {VERSION})"
    if key is not None and not hmac.compare_digest(str(theirs.get("key")).encode(), key.encode()):
        return "a wrong or missing --api-key"
    if theirs.get("fingerprint") != mine["fingerprint"]:
        return "other weights (the model, --quantize and --dtype must match the decode worker's)"
    if theirs.get("layout") != mine["layout"]:
        return f"another KV block layout {theirs.get('layout')} (this decode worker's: {mine['layout']})"
    return None


# ---- the decode worker ----

@dataclass(eq=False)
class Transfer:
    """A prompt's keys/values on their way from a prefill worker into blocks this decode worker reserved."""
    id: int
    seq: Choice
    peer: "Peer"
    blocks: list[int]  # the pool blocks they go into, in order
    start: int  # positions the decode worker held already (a multiple of the block size)
    end: int  # positions shipped up to: the whole prompt
    received: int = 0  # blocks written
    cached: int = 0  # positions the prefill worker took from its own prefix cache
    error: str | None = None
    logits: torch.Tensor | None = None  # (1, V) after the prompt's last token: the first token is drawn from them


@dataclass(eq=False)
class Peer:
    """One connected prefill worker: its socket, what it is prefilling, and the messages queued for it."""
    sock: socket.socket
    name: str
    outbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    transfers: dict[int, Transfer] = field(default_factory=dict)
    alive: bool = True

    def load(self) -> int:
        return sum(t.end - t.start for t in self.transfers.values())


class KVLink:
    """The decode worker's side of the wire: it listens for prefill workers, asks them for prompts, and writes what
    they send into the pool (on a reader thread per worker, under `lock`, never into a block whose transfer ended)."""

    def __init__(self, pool: BlockPool, mine: dict, address: str, key: str | None, timeout: float, notify):
        self.pool, self.mine, self.key, self.timeout, self.notify = pool, mine, key, timeout, notify
        self.block_bytes = block_bytes(pool)
        # the most one message carries: every block of the pool, or the logits (as float64 at most)
        self.limit = max(pool.num_blocks * self.block_bytes, mine["layout"]["vocab"] * 8)
        self.lock = threading.Lock()
        self.peers: list[Peer] = []
        self.settled: deque[Transfer] = deque()  # arrived whole, or failed: for the engine thread
        self.ids = iter(range(1 << 62))
        self.bytes_received = 0
        try:
            self.listener = socket.create_server(parse_address(address), backlog=16)
        except OSError as e:
            raise ValueError(f"cannot listen for prefill workers on {address}: {e.strerror or e}") from None
        self.address = "%s:%d" % self.listener.getsockname()[:2]
        threading.Thread(target=self._accept, name="kv-accept", daemon=True).start()

    def close(self) -> None:
        self.listener.close()
        with self.lock:
            for peer in self.peers:
                peer.sock.close()

    def connected(self) -> int:
        return len(self.peers)

    def start(self, seq: Choice) -> Transfer | None:
        """Ask the least busy prefill worker for seq's prompt past seq.n_computed; None when none is connected."""
        with self.lock:
            if not self.peers:
                return None
            peer = min(self.peers, key=Peer.load)
            first = seq.n_computed // self.pool.block_size
            t = Transfer(next(self.ids), seq, peer, seq.blocks[first:], seq.n_computed, len(seq.tokens))
            peer.transfers[t.id] = t
        peer.outbox.put(({"type": "prefill", "id": t.id, "tokens": list(seq.tokens), "start": t.start}, None))
        return t

    def cancel(self, t: Transfer) -> None:
        """End t before it arrives (its request ended): nothing more is written into its blocks after this returns."""
        with self.lock:
            if t.peer.transfers.pop(t.id, None) is not None:
                t.peer.outbox.put(({"type": "cancel", "id": t.id}, None))

    def take_settled(self) -> list[Transfer]:
        with self.lock:
            out, self.settled = list(self.settled), deque()
        return out

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self.listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(sock, "%s:%d" % addr[:2]), name="kv-peer", daemon=True).start()

    def _serve(self, sock: socket.socket, name: str) -> None:
        """A prefill worker's connection: the hello, then its messages until it ends (which fails its transfers)."""
        sock.settimeout(self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = Peer(sock, name)
        try:
            head, _ = receive(sock)
            why = mismatch(self.mine, head, self.key)
            if why:
                print(f"disagg: refused the prefill worker at {name}: {why}", file=sys.stderr)
                send(sock, {"type": "refused", "why": why})
                return sock.close()
            with self.lock:  # before the welcome: a worker that has it is counted
                self.peers.append(peer)
            send(sock, {"type": "welcome"})
            print(f"disagg: prefill worker {name} connected", file=sys.stderr)
            threading.Thread(target=write, args=(peer, self.timeout), name="kv-writer", daemon=True).start()
            while True:
                self._handle(peer, *receive(sock, self.limit))
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:  # died, hung, or garbled
            self._lost(peer, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)

    def _handle(self, peer: Peer, head: dict, payload: torch.Tensor | None) -> None:
        kind = head["type"]
        if kind == "ping":
            return
        with self.lock:
            t = peer.transfers.get(head["id"])
            if t is None:  # cancelled meanwhile: its blocks may be someone else's now
                return
            if kind == "blocks":
                first, n = head["first"], head["count"]
                if not (first == t.received and first + n <= len(t.blocks) and payload is not None and
                        payload.numel() == n * self.block_bytes):
                    raise ConnectionError(f"blocks {first}+{n} of {len(t.blocks)}, after {t.received}")
                unpack(self.pool, t.blocks[first:first + n], payload)
                t.received += n
                self.bytes_received += payload.numel()
                return
            if kind == "done" and t.received != -(-(t.end - t.start) // self.pool.block_size):
                t.error = f"the prefill worker {peer.name} sent {t.received} of the prompt's blocks"
            elif kind == "done":
                t.cached, t.logits = int(head["cached"]), self._logits(head, payload)
            else:
                t.error = f"the prefill worker {peer.name} failed: {head.get('why', kind)}"
            del peer.transfers[t.id]
            self.settled.append(t)
        self.notify()

    def _logits(self, head: dict, payload: torch.Tensor | None) -> torch.Tensor:
        dtype, vocab = getattr(torch, head["dtype"]), self.mine["layout"]["vocab"]
        if not (isinstance(dtype, torch.dtype) and payload is not None and payload.numel() == vocab * dtype.itemsize):
            raise ConnectionError(f"logits of {None if payload is None else payload.numel()} bytes")
        return payload.view(dtype).view(1, vocab).to(self.pool.k[0].device)

    def _lost(self, peer: Peer, why: str) -> None:
        """peer is gone: its transfers fail, the rest of the engine serves on."""
        peer.sock.close()
        with self.lock:
            peer.alive = False
            if peer in self.peers:
                self.peers.remove(peer)
                print(f"disagg: prefill worker {peer.name} lost ({why}); {len(peer.transfers)} requests fail",
                      file=sys.stderr)
            for t in peer.transfers.values():
                t.error = f"the prefill worker {peer.name} was lost mid-transfer ({why})"
                self.settled.append(t)
            peer.transfers.clear()
        peer.outbox.put(None)  # ends its writer
        self.notify()


def write(peer, timeout: float) -> None:
    """A connection's writer thread: its outbox's messages in order, a heartbeat when idle; ends at None or an error
    (the reader then finds the connection dead). An item is (head, payload), or a callable that makes one (or does
    its work and returns None) here, off the thread that queued it."""
    interval = min(HEARTBEAT_S, timeout / 4)
    while True:
        try:
            item = peer.outbox.get(timeout=interval)
        except queue.Empty:
            item = ({"type": "ping"}, None)
        if item is None:
            return
        try:
            item = item() if callable(item) else item
            if item is not None:
                send(peer.sock, *item)
        except OSError:
            peer.alive = False
            peer.sock.close()
            return


class RemoteScheduler(Scheduler):
    """The decode worker's scheduler: a new sequence reserves blocks (pending), its prompt is prefilled elsewhere
    (flying), then waits for a running slot (arrived) and runs as a decode of its last prompt token. Prompt logprobs,
    preempted sequences and a prompt of one token left go the co-located way (Scheduler's waiting queue)."""

    def __init__(self, config: EngineConfig, blocks: BlockManager, link: KVLink):
        super().__init__(config, blocks)
        self.link = link
        self.pending: deque[Seq] = deque()  # waiting for blocks
        self.flying: dict[Seq, Transfer] = {}
        self.arrived: deque[Transfer] = deque()  # the whole prompt in its blocks, waiting for a running slot

    def add(self, seq: Seq) -> None:
        if seq.reuse and len(seq.tokens) == seq.n_prompt:
            self.pending.append(seq)
        else:
            super().add(seq)

    def schedule(self) -> tuple[list[Seq], list[tuple[Seq, int]]]:
        self._reserve()
        return super().schedule()

    def admit_arrived(self) -> list[Transfer]:
        """The arrived transfers that now run (oldest first, while the running set has room)."""
        admitted = []
        while self.arrived and self.admit_computed(self.arrived[0].seq):
            admitted.append(self.arrived.popleft())
        return admitted

    def _reserve(self) -> None:
        """Give pending sequences their prefix hits and blocks for the rest, oldest first, while free blocks stay
        above the watermark (as admission does), and send them to a prefill worker."""
        cfg = self.config
        reserve = max(1, int(cfg.watermark * cfg.num_blocks))
        while self.pending:
            seq = self.pending[0]
            self.blocks.reuse_prefix(seq)
            needed = -(-len(seq.tokens) // cfg.block_size) - len(seq.blocks)
            if (self.running or self.flying or self.arrived) and self.blocks.available() - needed < reserve:
                self.blocks.drop(seq)  # retried next step
                return
            self.pending.popleft()
            remote = seq.n_computed < len(seq.tokens) - 1 and self.blocks.grow(seq, len(seq.tokens))
            t = self.link.start(seq) if remote else None
            if t is None:  # one token left (a decode step, as co-located), or no prefill worker since submit()
                self.blocks.drop(seq)
                super().add(seq)
            else:
                self.flying[seq] = t

    def arrive(self, t: Transfer) -> None:
        """t's keys/values are all in: its blocks join the prefix cache and it waits for a running slot."""
        seq = t.seq
        del self.flying[seq]
        self.blocks.computed(seq, t.end - t.start)
        seq.cached = max(t.start, t.cached)  # prefix hits on either side
        self.arrived.append(t)

    def remove(self, seq: Seq) -> None:
        if seq in self.pending:
            self.pending.remove(seq)
        self.arrived = deque(t for t in self.arrived if t.seq is not seq)
        t = self.flying.pop(seq, None)
        if t is not None:
            self.link.cancel(t)  # before its blocks are freed
        super().remove(seq)


class DecodeEngine(Engine):
    """An Engine whose prompts are prefilled by prefill workers that dial `address` (KVLink); 503 (Unavailable)
    while none is connected."""

    def __init__(self, model: Transformer, tokenizer, config: EngineConfig = EngineConfig(), step: Step | None = None,
                 address: str = "127.0.0.1:0", key: str | None = None, timeout: float = 30.0):
        if config.cache_window is not None:
            raise ValueError("--role decode needs the whole-context KV cache: --cache-window rewrites its blocks")
        super().__init__(model, tokenizer, config, step)
        self.link = KVLink(self.pool, hello(model, self.pool, None), address, key, timeout, self._notify)
        self.scheduler = RemoteScheduler(config, self.blocks, self.link)
        self.outputs.scheduler = self.scheduler

    def _notify(self) -> None:
        with self.lock:
            self.wake.notify()

    def submit(self, request: Request) -> int:
        if request.prompt_logprobs is None and not self.link.connected():
            raise Unavailable(f"no prefill worker is connected to this decode worker (it listens on "
                              f"{self.link.address}: serve.py --role prefill --kv-address {self.link.address})")
        return super().submit(request)

    @torch.inference_mode()
    def step(self) -> bool:
        """Settle the transfers that ended (admit or fail their requests), then Engine.step; while nothing but
        transfers is left, wait for one (not a busy loop that would take the reader threads' time)."""
        for t in self.link.take_settled():
            if t.error is None:
                self.scheduler.arrive(t)
            else:
                self.outputs.fail(t.seq, ConnectionError(t.error))
        for t in self.scheduler.admit_arrived():
            self.outputs.sample(t.seq, t.logits)  # its first token (forks for n/best_of), as a co-located prefill's
        busy = super().step()
        s = self.scheduler
        if busy and not (s.running or s.waiting or s.arrived):
            with self.lock:
                if self.inbox.empty() and self.aborts.empty() and self.jobs.empty() and not self.link.settled:
                    self.wake.wait(timeout=0.5)
        return busy

    def stats(self) -> dict:
        return {**super().stats(), "prefill_workers": self.link.connected(), "transfers": len(self.scheduler.flying),
                "kv_bytes_received": self.link.bytes_received}

    def close(self) -> None:
        self.link.close()


# ---- the prefill worker ----

class PrefillWorker:
    """Computes prompts' keys/values for the decode worker it dials, in chunks of config.token_budget tokens, one
    chunk of each prompt in turn, with a prefix cache of its own; a writer thread sends each chunk's blocks while the
    next chunk computes."""

    def __init__(self, model: Transformer, config: EngineConfig = EngineConfig(), step: Step | None = None,
                 key: str | None = None, timeout: float = 30.0):
        self.model, self.config, self.key, self.timeout = model, config, key, timeout
        self.step = step or Step(model)
        weight = model.embed_tokens.weight
        self.device = weight.device
        self.pool = BlockPool.for_model(model.args, config.num_blocks, config.block_size, weight.dtype, self.device)
        self.blocks = BlockManager(self.pool, config.prefix_caching)
        self.released: queue.SimpleQueue[Seq] = queue.SimpleQueue()  # sent: their blocks may go (main thread)
        self.held: set[Seq] = set()  # prompts whose blocks are computed or being sent
        self.prefilled = 0  # prompts sent whole

    def run(self, address: str, stop: threading.Event, retry_s: float = 1.0) -> None:
        """Dial the decode worker at address and serve it; after a lost connection (or before it listens), dial
        again every retry_s seconds, until stop is set. A refusal (other weights, a wrong key) is a ValueError."""
        host, port = parse_address(address)
        while not stop.is_set():
            try:
                sock = socket.create_connection((host, port), timeout=self.timeout)
            except OSError:
                stop.wait(retry_s)
                continue
            self.serve(sock, stop)
            stop.wait(retry_s)

    def serve(self, sock: socket.socket, stop: threading.Event) -> None:
        """One connection: the hello, then prompts until the connection or `stop` ends."""
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self.timeout)
        try:
            send(sock, hello(self.model, self.pool, self.key))
            head, _ = receive(sock)
        except (OSError, ValueError) as e:
            print(f"disagg: the decode worker did not answer: {e}", file=sys.stderr)
            return sock.close()
        if head.get("type") != "welcome":
            sock.close()
            raise ValueError(f"the decode worker refused this prefill worker: {head.get('why')}")
        peer, jobs, cancelled = Peer(sock, "decode"), queue.SimpleQueue(), set()
        writer = threading.Thread(target=write, args=(peer, self.timeout), name="kv-writer", daemon=True)
        writer.start()
        threading.Thread(target=read_jobs, args=(peer, jobs, cancelled), name="kv-reader", daemon=True).start()
        self._loop(peer, jobs, cancelled, stop)
        peer.outbox.put(None)
        writer.join()
        sock.close()
        for seq in list(self.held):  # what was still being sent
            self.released.put(seq)
        self._release()

    def _loop(self, peer: Peer, jobs: queue.SimpleQueue, cancelled: set, stop: threading.Event) -> None:
        """Prompts in order of arrival, each started once its blocks fit (waiting), then one chunk of each started one
        in turn (active), so a short prompt waits one chunk of a long one, not all of it."""
        waiting: deque[dict] = deque()
        active: deque[Job] = deque()
        while not stop.is_set() and peer.alive:
            self._release()
            try:
                head = jobs.get_nowait() if active or waiting else jobs.get(timeout=0.2)
            except queue.Empty:
                head = False
            if head is None:  # the connection ended
                return
            if head:
                waiting.append(head)
            self._start(waiting, active, peer, cancelled)
            if active:
                if self.advance(active[0], peer, cancelled):
                    active.popleft()
                else:
                    active.rotate(-1)
            elif waiting:  # blocks still being sent come back soon
                stop.wait(0.005)

    def _start(self, waiting: deque, active: deque, peer: Peer, cancelled: set) -> None:
        """Start waiting prompts, oldest first, while the pool has blocks for the whole of each; refuse one (an
        error message) that cannot be served, or that needs more blocks than the pool has when no other holds any."""
        while waiting:
            head = waiting.popleft()
            if head["id"] in cancelled:
                cancelled.discard(head["id"])
                continue
            why = self._check(head["tokens"], head["start"])
            if why is None:
                seq = Seq(tokens=list(head["tokens"]), n_prompt=len(head["tokens"]))
                self.blocks.reuse_prefix(seq)
                if self.blocks.grow(seq, len(seq.tokens)):
                    self.held.add(seq)
                    base = head["start"] // self.config.block_size
                    active.append(Job(head["id"], seq, base, base, seq.n_computed))
                    continue
                self.blocks.drop(seq)
                if self.held:  # others hold blocks: later
                    waiting.appendleft(head)
                    return
                why = "the prompt needs more KV blocks than the prefill worker's pool (its --num-blocks) holds"
            peer.outbox.put(({"type": "error", "id": head["id"], "why": why}, None))

    def _release(self) -> None:
        while not self.released.empty():
            seq = self.released.get()
            if seq in self.held:
                self.held.remove(seq)
                self.blocks.drop(seq)

    @torch.inference_mode()
    def advance(self, job: "Job", peer: Peer, cancelled: set) -> bool:
        """Send job's full blocks and compute its next chunk; after the last, the rest and "done". True when the job
        is over (its blocks released once sent)."""
        seq, bs = job.seq, self.config.block_size
        if job.id not in cancelled and peer.alive:  # (its blocks were all given when it started)
            job.sent = self._send(peer, job.id, seq, job.sent, seq.n_computed // bs, job.base)
            n = min(self.config.token_budget, len(seq.tokens) - seq.n_computed)
            pos = torch.arange(seq.n_computed, seq.n_computed + n, device=self.device)
            table = torch.tensor([seq.blocks], device=self.device)  # (1, N)
            logits = self.step(torch.tensor([seq.tokens[seq.n_computed:seq.n_computed + n]], device=self.device),
                               pos, PagedKVCache(self.pool, table), prefill=True)  # (1, V)
            self.blocks.computed(seq, n)
            if seq.n_computed < len(seq.tokens):
                return False
            self._send(peer, job.id, seq, job.sent, -(-len(seq.tokens) // bs), job.base)
            peer.outbox.put(({"type": "done", "id": job.id, "cached": job.cached, "dtype": str(logits.dtype)[6:]},
                             logits.reshape(-1).view(torch.uint8).cpu()))
            self.prefilled += 1
        cancelled.discard(job.id)
        peer.outbox.put(lambda: self.released.put(seq))  # after its blocks went out
        return True

    def _check(self, tokens, start) -> str | None:
        """Why a job cannot be served (a decode worker's bug or another model), or None."""
        if not isinstance(tokens, list) or not tokens or len(tokens) > self.model.args.max_seq_len:
            return f"a prompt of 1 to {self.model.args.max_seq_len} tokens is needed"
        if not all(isinstance(t, int) and 0 <= t < self.model.args.vocab_size for t in tokens):
            return f"token ids must be in [0, {self.model.args.vocab_size})"
        if not isinstance(start, int) or start % self.config.block_size or not 0 <= start < len(tokens):
            return f"start {start!r} is not a block boundary within the prompt"
        return None

    def _send(self, peer: Peer, id: int, seq: Seq, first: int, end: int, base: int) -> int:
        """Queue blocks first..end-1 of seq for the writer, numbered from block `base` (the job's start), which
        packs them from the pool (they are held until seq is released); returns the next block to send."""
        if end > first:
            ids = seq.blocks[first:end]
            peer.outbox.put(lambda: ({"type": "blocks", "id": id, "first": first - base, "count": len(ids)},
                                     pack(self.pool, ids)))
        return max(first, end)


@dataclass(eq=False)
class Job:
    """A prompt a prefill worker is computing: its blocks are sent from `base` (the decode worker's hits) on."""
    id: int
    seq: Seq
    base: int
    sent: int  # the next block to send
    cached: int  # positions from this worker's prefix cache


def read_jobs(peer: Peer, jobs: queue.SimpleQueue, cancelled: set) -> None:
    """A prefill worker's reader thread: prompts into jobs, cancels into cancelled; None into jobs at the end."""
    try:
        while True:
            head, _ = receive(peer.sock)
            if head["type"] == "prefill":
                jobs.put(head)
            elif head["type"] == "cancel":
                cancelled.add(head["id"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"disagg: the decode worker's connection ended: {e}", file=sys.stderr)
    peer.alive = False
    jobs.put(None)
