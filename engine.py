"""A serving engine: continuous batching over a paged KV cache, with prefix caching and chunked prefill.

Every step() is one scheduler iteration:
  1. take in new requests and aborts (submit() and abort() are thread-safe; step() runs on one thread);
  2. admit waiting requests, oldest first, while the running set has room and free KV blocks stay above a
     watermark (admission control sits next to the KV accounting);
  3. plan the step's work under a token budget: one decode token for every running sequence, then prefill
     chunks for the sequences still reading their prompts (chunked prefill: a long prompt takes several steps
     instead of freezing everyone's decode for one long one);
  4. give each planned sequence the blocks its new positions need; when none are left, preempt the newest
     running sequence (its blocks are freed and it is recomputed from its tokens later) rather than fail;
  5. run the decodes as one batch (per-row positions) and each prefill chunk as its own forward;
  6. sample each finished row with its own parameters and generator, stream text, and free finished sequences
     at once, so the next step can admit a waiting one (continuous, iteration-level batching).

Blocks hold block_size positions (kvcache.BlockPool). A full block is keyed by a chained hash of its tokens and
everything before them; a later request whose prompt starts with the same tokens reuses those blocks (reference
counted; the token ids are compared too, so a hash collision cannot return wrong keys/values). Only full blocks
are shared and a sequence only writes past its shared prefix, so no shared block is ever written (copy-on-write
is never needed). Unreferenced cached blocks stay until memory is needed, then go least recently used first.
"""
import itertools
import queue
import sys
import threading
import time
import traceback
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from decode import check_request, check_step, end_reason
from grammar import Grammar, Matcher
from kvcache import BlockPool, PagedKVCache
from model import Transformer
from sample import SamplingParams, Token, penalty_state, sample_tokens
from step import Step
from text import Completion, TextStream, finish_reason, push_token


@dataclass
class EngineConfig:
    block_size: int = 16  # positions per KV block
    num_blocks: int = 512  # blocks in the pool, block 0 (padding) included
    max_running: int = 32  # sequences decoded together at most
    max_waiting: int = 256  # submit() raises QueueFull beyond this many queued requests
    token_budget: int = 256  # tokens computed per step: the decodes plus prefill chunks
    watermark: float = 0.01  # admit only while this share of the blocks would stay free
    prefix_caching: bool = True
    static_batching: bool = False  # admit only into an empty running set: the old way, for comparison


@dataclass
class Event:
    """What a request's on_event callback receives, on the engine's thread."""
    request_id: int
    text: str  # text that became final since the previous event (may be "")
    token_ids: list[int]  # tokens sampled since the previous event
    finished: bool
    finish_reason: str | None  # "stop" (a stop string), "eos", "length" (max_tokens or the context), "abort",
    # or "error" (serving this request failed; `error` says why, and the engine serves on)
    prompt_tokens: int
    completion_tokens: int  # so far
    cached_tokens: int  # prompt tokens whose keys/values came from the prefix cache
    error: str | None = None


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 16
    stop: Sequence[str] = ()
    seed: int | None = None
    on_event: Callable[[Event], None] | None = None
    grammar: Grammar | None = None  # structured output: the text follows it (a matcher per sequence)


class QueueFull(RuntimeError):
    pass


@dataclass(eq=False)
class Seq:
    """A request being served: its tokens (prompt, then generated), how many of them have keys/values in its
    blocks (n_computed), and its sampling state."""
    id: int
    request: Request
    tokens: list[int]
    text: TextStream
    generator: torch.Generator
    seen: torch.Tensor | None  # penalty state, as sample.sample_tokens keeps it
    generated: torch.Tensor | None
    matcher: Matcher | None  # where the output is in its grammar (kept across preemption, like the tokens)
    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # chained hash of each full block, in order
    n_computed: int = 0
    cached: int = 0  # prompt positions reused from the prefix cache when first admitted

    @property
    def n_prompt(self) -> int:
        return len(self.request.prompt)


class BlockManager:
    """Free blocks, reference counts and the prefix cache (hash -> block, with the block's tokens to verify)."""

    def __init__(self, num_blocks: int, prefix_caching: bool):
        self.free: deque[int] = deque(range(1, num_blocks))  # block 0 pads block tables
        self.refs = [0] * num_blocks
        self.prefix_caching = prefix_caching
        self.by_hash: dict[int, int] = {}  # chained hash -> block
        self.contents: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> (its hash, its tokens)
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, oldest use first

    def available(self) -> int:
        return len(self.free) + len(self.evictable)

    def allocate(self) -> int | None:
        if self.free:
            block = self.free.popleft()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)  # least recently used
            h, _ = self.contents.pop(block)
            del self.by_hash[h]
        else:
            return None
        self.refs[block] = 1
        return block

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.contents:
                self.evictable[block] = None  # kept for a later prefix hit until memory is needed
            else:
                self.free.append(block)

    def lookup(self, h: int, tokens: tuple[int, ...]) -> int | None:
        """The cached block for chained hash h, if its tokens are these; takes a reference."""
        block = self.by_hash.get(h)
        if block is None or self.contents[block][1] != tokens:
            return None
        if self.refs[block] == 0:
            del self.evictable[block]
        self.refs[block] += 1
        return block

    def register(self, block: int, h: int, tokens: tuple[int, ...]) -> None:
        """Offer a just-filled block to the prefix cache (a block with the same hash already there wins)."""
        if self.prefix_caching and h not in self.by_hash:
            self.by_hash[h] = block
            self.contents[block] = (h, tokens)


def chain_hash(previous: int, tokens: tuple[int, ...]) -> int:
    """A block's key: its tokens and, through `previous`, every token before them."""
    return hash((previous, tokens))


class Engine:
    def __init__(self, model: Transformer, tokenizer, config: EngineConfig = EngineConfig(),
                 step: Step | None = None):
        if config.token_budget < config.max_running:
            raise ValueError(f"token_budget ({config.token_budget}) must be >= max_running ({config.max_running}): "
                             "every running sequence decodes one token per step")
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.decode_step = check_step(step, model)  # eager, or compiled (step.Step)
        weight = model.embed_tokens.weight
        self.device = weight.device
        self.pool = BlockPool.for_model(model.args, config.num_blocks, config.block_size, weight.dtype, self.device)
        self.blocks = BlockManager(config.num_blocks, config.prefix_caching)
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []  # admission order: the last one is preempted first
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # ("submit", seq) | ("abort", id), from any thread
        self.lock = threading.Lock()  # guards ids and the queued count submit() checks
        self.wake = threading.Condition(self.lock)
        self.ids = itertools.count()
        self.queued = 0  # submitted, not yet admitted (waiting + inbox)
        self.finished = 0
        self.preemptions = 0

    # ---- the thread-safe side ----

    def submit(self, request: Request) -> int:
        """Queue a request; returns its id. ValueError for a bad request, QueueFull over max_waiting."""
        context = self.model.args.max_seq_len
        check_request(request.prompt, request.max_tokens, context)
        needed = -(-min(len(request.prompt) + request.max_tokens, context) // self.config.block_size)
        if needed > self.config.num_blocks - 1:
            raise ValueError(f"the request needs up to {needed} KV blocks; the pool has {self.config.num_blocks - 1}")
        text = TextStream(self.tokenizer, request.stop)  # checks the stop strings
        generator = torch.Generator(device=self.device)
        if request.seed is None:
            generator.seed()  # a nondeterministic seed for this generator alone
        else:
            generator.manual_seed(request.seed)
        seen, generated = penalty_state(request.params, [request.prompt], self.model)
        matcher = None if request.grammar is None else request.grammar.matcher()
        with self.lock:
            if self.queued >= self.config.max_waiting:
                raise QueueFull(f"the queue is full ({self.config.max_waiting} waiting requests)")
            self.queued += 1
            seq = Seq(next(self.ids), request, list(request.prompt), text, generator, seen, generated, matcher)
            self.inbox.put(("submit", seq))
            self.wake.notify()
        return seq.id

    def abort(self, request_id: int) -> None:
        """End a request (finish_reason "abort"); its blocks are freed at the next step."""
        with self.lock:
            self.inbox.put(("abort", request_id))
            self.wake.notify()

    def run_forever(self, stop: threading.Event) -> None:
        """The serving loop: step while there is work, else sleep until submit(), abort() or stop wakes it."""
        while not stop.is_set():
            if not self.step():
                with self.lock:
                    if self.inbox.empty() and not stop.is_set():
                        self.wake.wait(timeout=0.5)

    def stop_waiting(self) -> None:
        """Wake run_forever (after setting its stop event)."""
        with self.lock:
            self.wake.notify_all()

    def stats(self) -> dict:
        in_use = sum(1 for r in self.blocks.refs[1:] if r > 0)
        return {"running": len(self.running), "waiting": len(self.waiting), "blocks_total": self.config.num_blocks - 1,
                "blocks_used": in_use, "blocks_cached": len(self.blocks.evictable),
                "requests_finished": self.finished, "preemptions": self.preemptions}

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or not self.inbox.empty())

    # ---- the engine thread ----

    @torch.inference_mode()
    def step(self) -> bool:
        """One scheduler iteration; True while work remains."""
        self._take_inbox()
        self._admit()
        decodes, chunks = self._plan()
        if decodes:
            self._run_decodes(decodes)
        for seq, n in chunks:
            self._run_chunk(seq, n)
        return self.has_work()

    def _take_inbox(self) -> None:
        while not self.inbox.empty():
            kind, item = self.inbox.get()
            if kind == "submit":
                self.waiting.append(item)
                continue
            for seq in [*self.running, *self.waiting]:
                if seq.id == item:
                    self._finish(seq, "abort")

    def _admit(self) -> None:
        cfg = self.config
        if cfg.static_batching and self.running:
            return
        reserve = max(1, int(cfg.watermark * cfg.num_blocks))
        while self.waiting and len(self.running) < cfg.max_running:
            seq = self.waiting[0]
            self._reuse_prefix(seq)
            needed = -(-len(seq.tokens) // cfg.block_size) - len(seq.blocks)  # to hold what it has to compute
            if self.running and self.blocks.available() - needed < reserve:
                self._drop_blocks(seq)  # not admitted now: give back the prefix blocks it took
                break
            self.waiting.popleft()
            with self.lock:
                self.queued -= 1
            self.running.append(seq)

    def _reuse_prefix(self, seq: Seq) -> None:
        """Take the cached blocks matching the start of seq.tokens; at least one token is left to compute
        (its logits start the decoding)."""
        bs = self.config.block_size
        while self.config.prefix_caching and (len(seq.blocks) + 1) * bs < len(seq.tokens):
            i = len(seq.blocks)
            tokens = tuple(seq.tokens[i * bs:(i + 1) * bs])
            h = chain_hash(seq.hashes[-1] if seq.hashes else 0, tokens)
            block = self.blocks.lookup(h, tokens)
            if block is None:
                break
            seq.blocks.append(block)
            seq.hashes.append(h)
            seq.n_computed += bs
        if len(seq.tokens) == seq.n_prompt:  # first admission (not a preempted sequence's return)
            seq.cached = seq.n_computed

    def _plan(self) -> tuple[list[Seq], list[tuple[Seq, int]]]:
        """This step's work: every sequence in decode gets its token, then prefill chunks fill the budget.
        Blocks are allocated here; a sequence that cannot get one preempts the newest running sequence."""
        budget = self.config.token_budget
        decodes = [s for s in self.running if len(s.tokens) - s.n_computed == 1]
        chunks = []
        budget -= len(decodes)
        for seq in self.running:
            need = len(seq.tokens) - seq.n_computed
            if need > 1 and budget > 0:
                chunks.append((seq, min(need, budget)))
                budget -= chunks[-1][1]
        work = [(s, 1) for s in decodes] + chunks
        for seq, n in work:
            while seq in self.running and not self._grow(seq, seq.n_computed + n):
                self._preempt(self.running[-1])
        decodes = [s for s in decodes if s in self.running]
        chunks = [(s, n) for s, n in chunks if s in self.running]
        return decodes, chunks

    def _grow(self, seq: Seq, n_positions: int) -> bool:
        """Give seq blocks for positions 0..n_positions-1; False if the pool ran out."""
        while len(seq.blocks) * self.config.block_size < n_positions:
            block = self.blocks.allocate()
            if block is None:
                return False
            seq.blocks.append(block)
        return True

    def _preempt(self, seq: Seq) -> None:
        """Free seq's blocks and queue it first: it is recomputed from its tokens (prompt and generated) later."""
        self.running.remove(seq)
        self._drop_blocks(seq)
        self.waiting.appendleft(seq)
        with self.lock:
            self.queued += 1
        self.preemptions += 1

    def _drop_blocks(self, seq: Seq) -> None:
        for block in seq.blocks:
            self.blocks.release(block)
        seq.blocks, seq.hashes, seq.n_computed = [], [], 0

    def _tables(self, seqs: list[Seq]) -> torch.Tensor:
        """(B, N) block tables, padded with block 0."""
        width = max(len(s.blocks) for s in seqs)
        return torch.tensor([s.blocks + [0] * (width - len(s.blocks)) for s in seqs], device=self.device)

    def _run_decodes(self, seqs: list[Seq]) -> None:
        tokens = torch.tensor([[s.tokens[-1]] for s in seqs], device=self.device)  # (B, 1)
        pos = torch.tensor([[s.n_computed] for s in seqs], device=self.device)  # (B, 1) per-row positions
        try:
            logits = self.decode_step(tokens, pos, PagedKVCache(self.pool, self._tables(seqs)))  # (B, V)
        except Exception as e:  # the batch's rows cannot be told apart: they fail, the engine serves on
            for seq in seqs:
                self._fail(seq, e)
            return
        for b, seq in enumerate(seqs):
            self._computed(seq, 1)
            self._sample(seq, logits[b:b + 1])

    def _run_chunk(self, seq: Seq, n: int) -> None:
        start = seq.n_computed
        tokens = torch.tensor([seq.tokens[start:start + n]], device=self.device)  # (1, n)
        pos = torch.arange(start, start + n, device=self.device)
        try:
            logits = self.decode_step(tokens, pos, PagedKVCache(self.pool, self._tables([seq])))  # (1, V)
        except Exception as e:
            self._fail(seq, e)
            return
        self._computed(seq, n)
        if seq.n_computed == len(seq.tokens):  # the prompt (or a preempted sequence's tokens) is in
            self._sample(seq, logits)

    def _computed(self, seq: Seq, n: int) -> None:
        """n more positions hold keys/values: offer every block that just filled up to the prefix cache."""
        seq.n_computed += n
        bs = self.config.block_size
        while len(seq.hashes) < seq.n_computed // bs:
            i = len(seq.hashes)
            tokens = tuple(seq.tokens[i * bs:(i + 1) * bs])
            seq.hashes.append(chain_hash(seq.hashes[-1] if seq.hashes else 0, tokens))
            self.blocks.register(seq.blocks[i], seq.hashes[-1], tokens)

    def _sample(self, seq: Seq, logits: torch.Tensor) -> None:
        """Draw seq's next token from (1, V) logits (as decode.generate does), stream it, maybe finish."""
        try:
            _, (token,) = sample_tokens(logits, seq.request.params, seq.generator, seq.seen, seq.generated, None,
                                        None if seq.matcher is None else [seq.matcher],
                                        n_generated=[len(seq.tokens) - seq.n_prompt], stop_ids=self.tokenizer.eos_ids)
        except Exception as e:  # this request fails alone
            self._fail(seq, e)
            return
        seq.tokens.append(token.id)
        token.end = end_reason(token.id, len(seq.tokens) - seq.n_prompt, len(seq.tokens), seq.request.max_tokens,
                               self.model.args.max_seq_len, self.tokenizer.eos_ids, seq.matcher,
                               ignore_eos=seq.request.params.ignore_eos)
        piece = push_token(seq.text, token)
        reason = finish_reason(token.end, seq.text)
        if reason is None:
            self._emit(seq, piece, [token.id], None)
        else:
            self._finish(seq, reason, piece, [token.id])

    def _fail(self, seq: Seq, e: Exception) -> None:
        """End seq with finish_reason "error": one line on stderr, the error in its last event."""
        message = f"{type(e).__name__}: {e}"
        print(f"engine: request {seq.id} failed: {message}", file=sys.stderr)
        self._finish(seq, "error", error=message)

    def _finish(self, seq: Seq, reason: str, piece: str = "", token_ids: list[int] = (),
                error: str | None = None) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            with self.lock:
                self.queued -= 1
        self._drop_blocks(seq)
        self.finished += 1
        self._emit(seq, piece + seq.text.flush(), list(token_ids), reason, error)

    def _emit(self, seq: Seq, text: str, token_ids: list[int], reason: str | None, error: str | None = None) -> None:
        """Call the request's on_event. A callback that raises is the caller's bug: it is reported on stderr and
        its request aborted, and the engine serves on."""
        if seq.request.on_event is None:
            return
        try:
            seq.request.on_event(Event(seq.id, text, token_ids, reason is not None, reason, seq.n_prompt,
                                       len(seq.tokens) - seq.n_prompt, seq.cached, error))
        except Exception:
            traceback.print_exc()
            if reason is None:
                seq.request.on_event = None
                self.abort(seq.id)

    # ---- offline ----

    def generate(self, prompts: list[list[int]], params: SamplingParams = SamplingParams(), max_tokens: int = 16,
                 stop: Sequence[str] = (), seed: int | None = None,
                 grammar: Grammar | None = None) -> list[Completion]:
        """Serve a list of prompts to the end (all queued at once; the scheduler batches them); one Completion
        each, in order. ttft_s and total_s are measured from submission."""
        t0 = time.perf_counter()
        events: dict[int, list[Event]] = {}
        first: dict[int, float] = {}

        def collect(event: Event) -> None:
            events.setdefault(event.request_id, []).append(event)
            first.setdefault(event.request_id, time.perf_counter() - t0)

        ids = [self.submit(Request(p, params, max_tokens, stop, seed, collect, grammar)) for p in prompts]
        while not all(i in events and events[i][-1].finished for i in ids):
            self.step()
        out = []
        for i, prompt in zip(ids, prompts):
            tokens = [t for e in events[i] for t in e.token_ids]
            last = events[i][-1]
            out.append(Completion("".join(e.text for e in events[i]), tokens, last.finish_reason, len(prompt),
                                  len(prompt) - last.cached_tokens, [Token(t) for t in tokens], first[i],
                                  time.perf_counter() - t0))
        return out
