"""A serving engine: continuous batching over a paged KV cache, with prefix caching, chunked prefill and parallel
sampling.

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

Parallel sampling (Request.n, best_of): the prompt is prefilled once; when it is in, best_of choices fork from it,
sharing its blocks (reference counted; the prompt's last partial block is copied on a fork's first write into it),
and all draw their first token from its logits. Choice i has its own generator (seeded seed + i: choice 0 is the
request with n = 1), grammar matcher and penalty state, and is preempted and recomputed alone. Events are per choice
(Event.index); a request has ended once each of its n choices has sent finished=True. With best_of > n the events
are held, and at the end the n choices with the highest cumulative logprob go out, one event each, re-indexed.
Prompt logprobs (Request.prompt_logprobs) come from every position's logits of the prefill chunks; such a request
takes nothing from the prefix cache until they are in.
"""
import itertools
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from decode import Token, check_request, check_step, end_reason, penalty_state, sample_tokens
from grammar import Grammar, Matcher
from kvcache import BlockPool, PagedKVCache
from model import Transformer
from sample import SamplingParams
from scheduler import BlockManager, EngineConfig, Scheduler, Seq
from step import Step
from text import Completion, TextStream, check_stop, finish_reason, push_token


@dataclass
class Event:
    """What a request's on_event callback receives, on the engine's thread. Events are per choice (`index`):
    `finished` ends that choice, and the request has ended once n events with finished=True have arrived, one per
    index. With best_of > n, each of the n best choices sends one event, at the request's end."""
    request_id: int
    text: str  # text that became final since the choice's previous event (may be "")
    token_ids: list[int]  # tokens sampled since the choice's previous event
    finished: bool
    finish_reason: str | None  # "stop" (a stop string), "eos", "length" (max_tokens or the context), "abort",
    # or "error" (serving this request failed; `error` says why, and the engine serves on)
    prompt_tokens: int
    completion_tokens: int  # so far, this choice's
    cached_tokens: int  # prompt tokens whose keys/values came from the prefix cache
    error: str | None = None
    index: int = 0  # which choice, 0..n-1
    tokens: list[Token] | None = None  # with Request.logprobs: a Token (id, logprob, top N) per token_id
    # with Request.prompt_logprobs, on each choice's first event: per prompt position i, Token(prompt[i], its
    # logprob under the model's unfiltered log_softmax at i - 1, the top N there); position 0 is None
    prompt_logprobs: list[Token | None] | None = None


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 16  # may be 0 only when prompt_logprobs is not None (echo: the prefill only)
    stop: Sequence[str] = ()
    seed: int | None = None  # choice i draws from a generator seeded seed + i
    on_event: Callable[[Event], None] | None = None
    grammar: Grammar | None = None  # structured output: the text follows it (each choice has its own matcher)
    n: int = 1  # choices returned
    best_of: int | None = None  # sequences sampled (>= n, default n); the n with the highest cumulative logprob
    # of their sampled tokens are returned
    logprobs: int | None = None  # with it, Event.tokens gives a decode.Token (id, logprob, top N) per token_id
    prompt_logprobs: int | None = None  # with it, each choice's first event has Event.prompt_logprobs


class QueueFull(RuntimeError):
    pass


@dataclass(eq=False)
class Group:
    """A request being served: its choices (one sequence until the prompt is in, then best_of of them) and the
    events they have ended with. With best_of > n, every event is held and the n best choices go out at the end."""
    id: int
    request: Request
    choices: list["Choice"] = field(default_factory=list)
    prompt_logprobs: list[Token | None] | None = None  # filled in while the prompt is prefilled
    finals: list[tuple[float, Event]] = field(default_factory=list)  # (cumulative logprob, last event) per choice

    @property
    def best_of(self) -> int:
        return self.request.best_of or self.request.n

    @property
    def holds(self) -> bool:
        return self.best_of > self.request.n

    @property
    def done(self) -> bool:
        return len(self.finals) == self.best_of

    def send(self, choice: "Choice | None", event: Event) -> list[Event]:
        """The events that go out for this one (of choice; None: an index the request ended before forking): itself,
        or while held none, and with the last choice's end the n best, merged into one event each and re-indexed."""
        held = [] if choice is None else choice.held
        if self.holds:
            held.append(event)
        if event.finished:
            logprob = float("-inf") if choice is None else choice.logprob
            self.finals.append((logprob, merged(held) if self.holds else event))
        if not self.holds:
            return [event]
        if not self.done:
            return []
        best = sorted(self.finals, key=lambda f: (-f[0], f[1].index))[:self.request.n]
        return [replace(e, index=rank) for rank, (_, e) in enumerate(best)]


def merged(events: list[Event]) -> Event:
    """One choice's events as one: its whole text and tokens, its end."""
    first, last = events[0], events[-1]
    return replace(last, text="".join(e.text for e in events), token_ids=[t for e in events for t in e.token_ids],
                   tokens=None if last.tokens is None else [t for e in events for t in e.tokens],
                   prompt_logprobs=first.prompt_logprobs)


@dataclass(eq=False, kw_only=True)
class Choice(Seq):
    """One of a request's sequences with its sampling state: the text so far, its generator, penalty state and
    grammar matcher (kept across preemption, like its tokens)."""
    group: Group
    index: int
    text: TextStream
    generator: torch.Generator
    seen: torch.Tensor | None  # penalty state, as decode.sample_tokens keeps it
    generated: torch.Tensor | None
    matcher: Matcher | None
    logprob: float = 0.0  # cumulative, of the sampled tokens (ranks best_of)
    finished: bool = False
    sent: bool = False  # its first event went out (the one with the prompt's logprobs)
    held: list[Event] = field(default_factory=list)  # its events, while its group holds them


def score_prompt(out: list[Token | None], prompt: list[int], start: int, logits: torch.Tensor, top: int) -> None:
    """Fill out[i] for each prompt position i that logits (n, V), computed at positions start..start+n-1, predict:
    Token(prompt[i], its logprob under the model's log_softmax (unfiltered, no temperature), the top `top`)."""
    m = min(logits.shape[0], len(prompt) - 1 - start)  # the prompt's last position predicts no prompt token
    if m <= 0:
        return
    lp = torch.log_softmax(logits[:m].float(), dim=-1)  # (m, V)
    targets = torch.tensor(prompt[start + 1:start + 1 + m], device=lp.device)  # (m,)
    chosen = lp.gather(-1, targets[:, None])[:, 0].tolist()
    top_lp, top_ids = lp.topk(min(top, lp.shape[-1]), dim=-1)  # (m, top)
    for j in range(m):
        out[start + 1 + j] = Token(prompt[start + 1 + j], chosen[j], list(zip(top_ids[j].tolist(),
                                                                                  top_lp[j].tolist())))


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
        self.groups: dict[int, Group] = {}  # the requests taken in and not ended
        self.inbox: queue.SimpleQueue[Choice] = queue.SimpleQueue()  # submitted, from any thread
        self.aborts: queue.SimpleQueue[int] = queue.SimpleQueue()  # request ids, from any thread
        self.lock = threading.Lock()  # makes submit()'s queue-length check and its put one step
        self.wake = threading.Condition(self.lock)
        self.ids = itertools.count()
        self.finished = 0

    # ---- the thread-safe side ----

    def submit(self, request: Request) -> int:
        """Queue a request; returns its id. ValueError for a bad request, QueueFull over max_waiting."""
        self.check(request)
        group = Group(-1, request, prompt_logprobs=None if request.prompt_logprobs is None else
                      [None] * len(request.prompt))
        first = self._choice(group, 0, *penalty_state(request.params, [request.prompt], self.model))
        first.width, first.reuse = group.best_of, request.prompt_logprobs is None  # forks when its prompt is in
        group.choices.append(first)
        with self.lock:
            if self.queued() >= self.config.max_waiting:
                raise QueueFull(f"the queue is full ({self.config.max_waiting} waiting requests)")
            group.id = next(self.ids)
            self.inbox.put(first)
            self.wake.notify()
        return group.id

    def check(self, request: Request) -> None:
        """Raise a ValueError naming what the engine cannot serve in request."""
        context, cfg = self.model.args.max_seq_len, self.config
        echo = request.max_tokens == 0 and request.prompt_logprobs is not None  # the prefill only
        check_request(request.prompt, 1 if echo else request.max_tokens, context)
        needed = -(-min(len(request.prompt) + request.max_tokens, context) // cfg.block_size)
        if needed > cfg.num_blocks - 1:
            raise ValueError(f"the request needs up to {needed} KV blocks; the pool has {cfg.num_blocks - 1}")
        if request.n < 1:
            raise ValueError(f"n must be >= 1, got {request.n}")
        if request.best_of is not None and request.best_of < request.n:
            raise ValueError(f"best_of must be >= n ({request.n}), got {request.best_of}")
        if (request.best_of or request.n) > cfg.max_running:
            raise ValueError(f"best_of and n can be at most the engine's max_running ({cfg.max_running}), got "
                             f"{request.best_of or request.n}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(request, name) is not None and getattr(request, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(request, name)}")
        check_stop(request.stop)

    def abort(self, request_id: int) -> None:
        """End a request, every choice (finish_reason "abort"); its blocks are freed at the next step."""
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
        return bool(self.groups or not self.inbox.empty() or not self.aborts.empty())

    # ---- the engine thread ----

    @torch.inference_mode()
    def step(self) -> bool:
        """One iteration: inbox -> schedule -> forward -> sample -> emit. True while work remains."""
        self._take_inbox()
        decodes, chunks = self.scheduler.schedule()
        for seq, logits in self._forward(decodes, chunks):
            if seq.finished:  # its request ended in this step (a sibling's forward failed)
                continue
            # A prompt that is in starts its request's choices, which all draw their first token from its logits.
            for choice in self._fork(seq) if len(seq.tokens) == seq.n_prompt else [seq]:
                if not choice.finished:
                    self._sample(choice, logits)  # and emit
        return self.has_work()

    def _take_inbox(self) -> None:
        with self.lock:  # a submitted sequence is counted in the inbox or in the waiting queue, never in neither
            while not self.inbox.empty():
                seq = self.inbox.get()
                self.groups[seq.group.id] = seq.group
                self.scheduler.add(seq)
        while not self.aborts.empty():
            group = self.groups.get(self.aborts.get())
            if group is not None:
                self._end(group, "abort")

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
            logits = self._run_chunk(seq, n)
            if logits is not None:
                ready.append((seq, logits))
        return ready

    def _run_chunk(self, seq: Choice, n: int) -> torch.Tensor | None:
        """Compute n more of seq's tokens; the (1, V) logits after them once all its tokens are in. While the
        request's prompt logprobs are wanted, the chunk's every position's logits score the prompt."""
        group, start = seq.group, seq.n_computed
        scoring = group.prompt_logprobs is not None and len(seq.tokens) == seq.n_prompt
        tokens = torch.tensor([seq.tokens[start:start + n]], device=self.device)  # (1, n)
        pos = torch.arange(start, start + n, device=self.device)
        try:  # (1, V), or (1, n, V) when scoring
            logits = self.decode_step(tokens, pos, PagedKVCache(self.pool, self._tables([seq])), all_logits=scoring)
        except Exception as e:
            self._fail(seq, e)
            return None
        if scoring:
            score_prompt(group.prompt_logprobs, group.request.prompt, start, logits[0], group.request.prompt_logprobs)
            logits = logits[:, -1]
        self.blocks.computed(seq, n)
        return logits if seq.n_computed == len(seq.tokens) else None  # the prompt (or a preempted one's tokens)

    def _tables(self, seqs: list[Choice]) -> torch.Tensor:
        """(B, N) block tables, padded with block 0."""
        width = max(len(s.blocks) for s in seqs)
        return torch.tensor([s.blocks + [0] * (width - len(s.blocks)) for s in seqs], device=self.device)

    def _choice(self, group: Group, index: int, seen: torch.Tensor | None, generated: torch.Tensor | None) -> Choice:
        request = group.request
        generator = torch.Generator(device=self.device)
        if request.seed is None:
            generator.seed()  # a nondeterministic seed for this generator alone
        else:
            generator.manual_seed((request.seed + index) % 2 ** 64)
        return Choice(tokens=list(request.prompt), n_prompt=len(request.prompt), group=group, index=index,
                      text=TextStream(self.tokenizer, request.stop), generator=generator, seen=seen,
                      generated=generated, matcher=None if request.grammar is None else request.grammar.matcher())

    def _fork(self, first: Choice) -> list[Choice]:
        """first's prompt is in: the request's best_of choices, first and forks of it that share its blocks, each
        with its own generator, matcher and penalty state; none for an echo (max_tokens 0: the prefill only)."""
        group = first.group
        first.width, first.reuse = 1, True
        if group.request.max_tokens == 0:
            self._end(group, "length")
            return []
        for i in range(1, group.best_of):
            state = (None, None) if first.seen is None else (first.seen.clone(), first.generated.clone())
            fork = self._choice(group, i, *state)
            self.blocks.fork(first, fork)
            self.scheduler.start(fork)
            group.choices.append(fork)
        return group.choices

    def _sample(self, choice: Choice, logits: torch.Tensor) -> None:
        """Draw choice's next token from (1, V) logits (as decode.generate does), stream it, maybe finish."""
        request = choice.group.request
        logprobs = 0 if request.logprobs is None and choice.group.holds else request.logprobs  # ranking needs them
        try:
            _, (token,) = sample_tokens(logits, request.params, choice.generator, choice.seen, choice.generated,
                                        logprobs, None if choice.matcher is None else [choice.matcher])
        except Exception as e:  # this request fails alone
            self._fail(choice, e)
            return
        choice.tokens.append(token.id)
        choice.logprob += token.logprob or 0.0
        token.end = end_reason(token.id, len(choice.tokens) - choice.n_prompt, len(choice.tokens),
                               request.max_tokens, self.model.args.max_seq_len, self.tokenizer.eos_ids, choice.matcher)
        piece = push_token(choice.text, token)
        reason = finish_reason(token.end, choice.text)
        if reason is None:
            self._send(choice.group, choice, self._event(choice, piece, [token], None))
        else:
            self._finish(choice, reason, piece, [token])

    def _fail(self, choice: Choice, e: Exception) -> None:
        """End choice's request with finish_reason "error": one line on stderr, the error in the last events."""
        if choice.finished:
            return
        message = f"{type(e).__name__}: {e}"
        print(f"engine: request {choice.group.id} failed: {message}", file=sys.stderr)
        self._end(choice.group, "error", message)

    def _end(self, group: Group, reason: str, error: str | None = None) -> None:
        """End every choice of group still running, with reason."""
        for choice in group.choices:
            if not choice.finished:
                self._finish(choice, reason, error=error)
        for i in range(len(group.choices), group.best_of):  # not forked yet: they end with nothing generated
            self._send(group, None, Event(group.id, "", [], True, reason, len(group.request.prompt), 0,
                                          group.choices[0].cached, error, i,
                                          None if group.request.logprobs is None else [], group.prompt_logprobs))

    def _finish(self, choice: Choice, reason: str, piece: str = "", tokens: list[Token] = (),
                error: str | None = None) -> None:
        choice.finished = True
        self.scheduler.remove(choice)
        self._send(choice.group, choice, self._event(choice, piece + choice.text.flush(), tokens, reason, error))

    def _event(self, choice: Choice, text: str, tokens: list[Token], reason: str | None,
               error: str | None = None) -> Event:
        group, first = choice.group, not choice.sent
        choice.sent = True
        return Event(group.id, text, [t.id for t in tokens], reason is not None, reason, choice.n_prompt,
                     len(choice.tokens) - choice.n_prompt, choice.cached, error, choice.index,
                     None if group.request.logprobs is None else list(tokens),
                     group.prompt_logprobs if first else None)

    def _send(self, group: Group, choice: Choice | None, event: Event) -> None:
        """Hand event to the request's on_event (or hold it: Group.send). A callback that raises is the caller's
        bug: it is reported on stderr and its request aborted, and the engine serves on."""
        events = group.send(choice, event)
        if group.done:
            del self.groups[group.id]
            self.finished += 1
        for e in events:
            if group.request.on_event is None:
                return
            try:
                group.request.on_event(e)
            except Exception:
                traceback.print_exc()
                if not group.done:
                    group.request.on_event = None
                    self.abort(group.id)

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
