"""A serving engine: continuous batching over a paged KV cache, with prefix caching and chunked prefill.

Every step() is one iteration, inbox -> schedule -> forward -> sample -> emit:
  1. take in new requests and aborts (submit() and abort() are thread-safe; step() runs on one thread);
  2. schedule (scheduler.Scheduler): admit waiting sequences while the running set has room and free KV blocks
     stay above a watermark, plan one decode token for every running sequence and prefill chunks under a token
     budget, and give them blocks, preempting the newest running sequence when none are left (it is recomputed
     from its tokens later);
  3. forward: the decodes as one batch (per-row positions), each prefill chunk as its own forward;
  4. sample each row whose tokens are all in with its own parameters, generator, grammar matcher and penalties;
  5. emit its text as an Event, and free a finished sequence at once, so the next step can admit a waiting one
     (continuous, iteration-level batching).

The KV memory (blocks of block_size positions, kvcache.BlockPool) and the prefix cache are scheduler.BlockManager's.
"""
import itertools
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from decode import Token, check_request, check_step, end_reason, penalty_state, sample_tokens
from grammar import Grammar, Matcher
from kvcache import BlockPool, PagedKVCache
from model import Transformer
from sample import SamplingParams
from scheduler import BlockManager, EngineConfig, Scheduler, Seq
from step import Step
from text import Completion, TextStream, finish_reason, push_token


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


@dataclass(eq=False, kw_only=True)
class Choice(Seq):
    """A sequence being served with its sampling state: the text so far, its generator, penalty state and grammar
    matcher (kept across preemption, like its tokens)."""
    id: int  # the request's
    request: Request
    text: TextStream
    generator: torch.Generator
    seen: torch.Tensor | None  # penalty state, as decode.sample_tokens keeps it
    generated: torch.Tensor | None
    matcher: Matcher | None


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
        self.blocks = BlockManager(self.pool, config.prefix_caching)
        self.scheduler = Scheduler(config, self.blocks)
        self.inbox: queue.SimpleQueue[Choice] = queue.SimpleQueue()  # submitted, from any thread
        self.aborts: queue.SimpleQueue[int] = queue.SimpleQueue()  # request ids, from any thread
        self.lock = threading.Lock()  # makes submit()'s queue-length check and its put one step
        self.wake = threading.Condition(self.lock)
        self.ids = itertools.count()
        self.finished = 0

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
            if self.queued() >= self.config.max_waiting:
                raise QueueFull(f"the queue is full ({self.config.max_waiting} waiting requests)")
            seq = Choice(tokens=list(request.prompt), n_prompt=len(request.prompt), id=next(self.ids),
                         request=request, text=text, generator=generator, seen=seen, generated=generated,
                         matcher=matcher)
            self.inbox.put(seq)
            self.wake.notify()
        return seq.id

    def abort(self, request_id: int) -> None:
        """End a request (finish_reason "abort"); its blocks are freed at the next step."""
        with self.lock:
            self.aborts.put(request_id)
            self.wake.notify()

    def queued(self) -> int:
        """Sequences submitted or preempted, not yet (re)admitted."""
        return self.inbox.qsize() + len(self.scheduler.waiting)

    def run_forever(self, stop: threading.Event) -> None:
        """The serving loop: step while there is work, else sleep until submit(), abort() or stop wakes it."""
        while not stop.is_set():
            if not self.step():
                with self.lock:
                    if self.inbox.empty() and self.aborts.empty() and not stop.is_set():
                        self.wake.wait(timeout=0.5)

    def stop_waiting(self) -> None:
        """Wake run_forever (after setting its stop event)."""
        with self.lock:
            self.wake.notify_all()

    def stats(self) -> dict:
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "blocks_total": self.config.num_blocks - 1, "blocks_used": self.blocks.in_use(),
                "blocks_cached": len(self.blocks.evictable), "requests_finished": self.finished,
                "preemptions": self.scheduler.preemptions}

    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting or not self.inbox.empty()
                    or not self.aborts.empty())

    # ---- the engine thread ----

    @torch.inference_mode()
    def step(self) -> bool:
        """One iteration: inbox -> schedule -> forward -> sample -> emit. True while work remains."""
        self._take_inbox()
        decodes, chunks = self.scheduler.schedule()
        for seq, logits in self._forward(decodes, chunks):
            self._sample(seq, logits)  # and emit its event
        return self.has_work()

    def _take_inbox(self) -> None:
        with self.lock:  # a submitted sequence is counted in the inbox or in the waiting queue, never in neither
            while not self.inbox.empty():
                self.scheduler.add(self.inbox.get())
        while not self.aborts.empty():
            request_id = self.aborts.get()
            for seq in [*self.scheduler.running, *self.scheduler.waiting]:
                if seq.id == request_id:
                    self._finish(seq, "abort")

    def _forward(self, decodes: list[Choice], chunks: list[tuple[Choice, int]]) -> list[tuple[Choice, torch.Tensor]]:
        """Run the step: the decodes as one batch (per-row positions), each prefill chunk as its own forward. Returns
        the sequences whose tokens are all computed, with their next-token logits (1, V). A forward that raises fails
        its rows (they cannot be told apart), and the engine serves on."""
        ready = []
        if decodes:
            tokens = torch.tensor([[s.tokens[-1]] for s in decodes], device=self.device)  # (B, 1)
            pos = torch.tensor([[s.n_computed] for s in decodes], device=self.device)  # (B, 1) per-row positions
            try:
                logits = self.decode_step(tokens, pos, PagedKVCache(self.pool, self._tables(decodes)))  # (B, V)
            except Exception as e:
                for seq in decodes:
                    self._fail(seq, e)
                decodes = []
            for b, seq in enumerate(decodes):
                self.blocks.computed(seq, 1)
                ready.append((seq, logits[b:b + 1]))
        for seq, n in chunks:
            start = seq.n_computed
            tokens = torch.tensor([seq.tokens[start:start + n]], device=self.device)  # (1, n)
            pos = torch.arange(start, start + n, device=self.device)
            try:
                logits = self.decode_step(tokens, pos, PagedKVCache(self.pool, self._tables([seq])))  # (1, V)
            except Exception as e:
                self._fail(seq, e)
                continue
            self.blocks.computed(seq, n)
            if seq.n_computed == len(seq.tokens):  # the prompt (or a preempted sequence's tokens) is in
                ready.append((seq, logits))
        return ready

    def _tables(self, seqs: list[Choice]) -> torch.Tensor:
        """(B, N) block tables, padded with block 0."""
        width = max(len(s.blocks) for s in seqs)
        return torch.tensor([s.blocks + [0] * (width - len(s.blocks)) for s in seqs], device=self.device)

    def _sample(self, seq: Choice, logits: torch.Tensor) -> None:
        """Draw seq's next token from (1, V) logits (as decode.generate does), stream it, maybe finish."""
        try:
            _, (token,) = sample_tokens(logits, seq.request.params, seq.generator, seq.seen, seq.generated, None,
                                        None if seq.matcher is None else [seq.matcher])
        except Exception as e:  # this request fails alone
            self._fail(seq, e)
            return
        seq.tokens.append(token.id)
        token.end = end_reason(token.id, len(seq.tokens) - seq.n_prompt, len(seq.tokens), seq.request.max_tokens,
                               self.model.args.max_seq_len, self.tokenizer.eos_ids, seq.matcher)
        piece = push_token(seq.text, token)
        reason = finish_reason(token.end, seq.text)
        if reason is None:
            self._emit(seq, piece, [token.id], None)
        else:
            self._finish(seq, reason, piece, [token.id])

    def _fail(self, seq: Choice, e: Exception) -> None:
        """End seq with finish_reason "error": one line on stderr, the error in its last event."""
        message = f"{type(e).__name__}: {e}"
        print(f"engine: request {seq.id} failed: {message}", file=sys.stderr)
        self._finish(seq, "error", error=message)

    def _finish(self, seq: Choice, reason: str, piece: str = "", token_ids: list[int] = (),
                error: str | None = None) -> None:
        self.scheduler.remove(seq)
        self.finished += 1
        self._emit(seq, piece + seq.text.flush(), list(token_ids), reason, error)

    def _emit(self, seq: Choice, text: str, token_ids: list[int], reason: str | None,
              error: str | None = None) -> None:
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
