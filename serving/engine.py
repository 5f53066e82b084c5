"""A serving engine: continuous batching over a paged KV cache, with prefix caching, chunked prefill and parallel
sampling.

Every step() is one iteration, inbox -> schedule -> forward -> sample -> emit:
  1. take in new requests and aborts (submit() and abort() are thread-safe; step() runs on one thread);
  2. schedule (scheduler.Scheduler): admit waiting sequences while the running set has room and free KV blocks
     stay above a watermark, plan one decode token for every running sequence and prefill chunks under a token
     budget, and give them blocks, preempting the newest running sequence when none are left (it is recomputed
     from its tokens later);
  3. forward: the decodes as one batch (per-row positions), each prefill chunk as its own forward (with every
     position's logits while a request's prompt logprobs are wanted);
  4. sample (choices.Outputs) each row whose tokens are all in, with its own parameters, generator, grammar matcher
     and penalties; a prompt that is in first forks into its request's choices (n, best_of); a sequence that
     finishes frees its blocks at once, so the next step can admit a waiting one (continuous, iteration-level
     batching);
  5. emit: hand the step's Events (text, tokens, logprobs) to the requests' callbacks, then on_step_events.
Work that uses the model outside the KV cache (an embedding's forward) is a job (run_job): the step runs the oldest
one first, on this thread, so no two threads ever run the model at once.

The KV memory (blocks of block_size positions, kvcache.BlockPool) and the prefix cache are scheduler.BlockManager's;
a request's choices, their sampling state and the events they send are choices.py's; Request and Event are
contract.py's. A request with prompt logprobs takes nothing from the prefix cache until they are in.
"""
import itertools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from decode import check_request, check_step
from features.constraint import Grammar
from kvcache import BlockPool, PagedKVCache
from model import Transformer
from ops.cpu import native_bf16
from ops.wide import WideLinear, copy_dtype, wide_model
from params import SamplingParams, Token
from serving.choices import Choice, Outputs, score_prompt
from serving.contract import Event, Request
from serving.scheduler import BlockManager, EngineConfig, Scheduler
from features.sinks import SinkKVCache, SinkWindow
from step import Step
from text import Completion, check_stop

__all__ = ["Engine", "EngineConfig", "Event", "QueueFull", "Request"]


class QueueFull(RuntimeError):
    pass


def bucket(n: int, cap: int) -> int:
    """The padded size of n rows (or blocks): the next power of two, at most cap (itself a bucket); n <= cap."""
    return min(1 << (n - 1).bit_length(), cap)


def check(request: Request, context: int, cfg: EngineConfig) -> None:
    """Raise a ValueError naming what an engine with config cfg, for a model of this context, cannot serve."""
    echo = request.max_new_tokens == 0 and request.prompt_logprobs is not None  # the prefill only
    limit = cfg.max_len(context)  # past the context through a rolling cache
    check_request(request.prompt, 1 if echo else request.max_new_tokens, limit)
    needed = -(-min(len(request.prompt) + request.max_new_tokens, limit, cfg.cache_window or limit) // cfg.block_size)
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


class Engine:
    def __init__(self, model: Transformer, tokenizer, config: EngineConfig = EngineConfig(),
                 step: Step | None = None):
        if config.prefill_chunk is not None and config.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {config.prefill_chunk}")
        if config.wide_rows is not None and config.wide_rows < 1:
            raise ValueError(f"wide_rows must be >= 1, got {config.wide_rows}")
        if config.token_budget < config.max_running:
            raise ValueError(f"token_budget ({config.token_budget}) must be >= max_running ({config.max_running}): "
                             "every running sequence decodes one token per step")
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.window = None if config.cache_window is None else SinkWindow(config.sink_tokens, config.cache_window)
        if self.window is not None:
            self.window.check(model.args.max_seq_len)
            if config.prefix_caching:
                raise ValueError("cache_window (--cache-window) needs prefix caching off: a rolling cache rewrites "
                                 "its blocks")
        self.decode_step = check_step(step, model)  # eager, or compiled (step.Step)
        weight = model.embed_tokens.weight
        self.device = weight.device
        self.wide_step = self._wide_step(config.wide_rows)  # the forwards of many rows, or None
        self.buckets = self.decode_step.cuda_graphs if config.bucket_batches is None else config.bucket_batches
        # A compiled step sees its decode batches' sizes as symbolic (one graph for one row, one for the rest)
        self.dynamic = self.buckets or self.decode_step.mode != "none"
        self.max_width = -(-model.args.max_seq_len // config.block_size)  # blocks a sequence holds at most
        self.pool = BlockPool.for_model(model.args, config.num_blocks, config.block_size, weight.dtype, self.device)
        self.blocks = BlockManager(self.pool, config.prefix_caching, config.cache_window, config.sink_tokens)
        self.scheduler = Scheduler(config, self.blocks)
        self.inbox: queue.SimpleQueue[Choice] = queue.SimpleQueue()  # submitted, from any thread
        self.aborts: queue.SimpleQueue[int] = queue.SimpleQueue()  # request ids, from any thread
        self.jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()  # see run_job
        self.lock = threading.Lock()  # makes submit()'s queue-length check and its put one step
        self.wake = threading.Condition(self.lock)
        self.ids = itertools.count()
        self.outputs = Outputs(model, tokenizer, self.scheduler)  # the requests taken in, not ended
        # Called on this thread once a step's events are handed out (after emit): a server wakes its event loop
        # there once for all of them, not once an event.
        self.on_step_events: Callable[[], None] | None = None

    def _wide_step(self, wide_rows: int | None) -> Step | None:
        """A Step over ops.wide's float32 (or bf16: copy_dtype) view of the model, in oneDNN's packed layout where
        torch has it, for forwards of at least wide_rows rows (tokens): its decode steps compiled as one graph beside a
        `full` narrow step (warm_up compiles it; its linears through cpu.packed_linear), else eager (eager over packed
        weights was faster than a compiled step over plain ones: dev/LOG.md). None when not asked for or nothing
        widens."""
        if wide_rows is None:
            return None
        if self.device.type != "cpu" or self.decode_step.deterministic:
            raise ValueError("wide_rows (--wide-rows) is a CPU path for the default (not --deterministic) forwards")
        dtype = copy_dtype(self.model, native_bf16(self.device) is not None)
        wide = wide_model(self.model, packed=torch.backends.mkldnn.is_available(), dtype=dtype)
        if wide is None:
            return None
        packed = all(m.packed for m in wide.modules() if isinstance(m, WideLinear))
        return Step(wide, "full" if self.decode_step.mode == "full" and packed else "none")

    def _step_for(self, rows: int) -> Step:
        """The step that computes a forward of this many rows (decode rows, or a chunk's tokens)."""
        wide = self.wide_step is not None and rows >= self.config.wide_rows
        return self.wide_step if wide else self.decode_step

    # ---- the thread-safe side ----

    def submit(self, request: Request) -> int:
        """Queue a request; returns its id. ValueError for a bad request, QueueFull over max_waiting."""
        check(request, self.model.args.max_seq_len, self.config)
        first = self.outputs.first(request)
        with self.lock:
            if self.queued() >= self.config.max_waiting:
                raise QueueFull(f"the queue is full ({self.config.max_waiting} waiting requests)")
            first.group.id = next(self.ids)
            self.inbox.put(first)
            self.wake.notify()
        return first.group.id

    def abort(self, request_id: int) -> None:
        """End a request, every choice (finish_reason "abort"); its blocks are freed at the next step."""
        with self.lock:
            self.aborts.put(request_id)
            self.wake.notify()

    def run_job(self, fn: Callable[[], Any]) -> Future:
        """Run fn() on the engine's thread at the start of a step, one job a step (so a long run of jobs delays
        each step's decodes by one job's time, not all of theirs); its result or exception comes in the Future. A
        job cancelled before it starts is skipped."""
        future = Future()
        with self.lock:
            self.jobs.put((fn, future))
            self.wake.notify()
        return future

    def fail_jobs(self, why: str) -> None:
        """End every job not yet run with RuntimeError(why): the engine stops, or died."""
        while not self.jobs.empty():
            _, future = self.jobs.get()
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError(why))

    def queued(self) -> int:
        """Sequences submitted or preempted, not yet (re)admitted."""
        return self.inbox.qsize() + len(self.scheduler.waiting)

    def run_forever(self, stop: threading.Event) -> None:
        """The serving loop: step while there is work, else sleep until submit(), abort() or stop wakes it."""
        while not stop.is_set():
            if not self.step():
                with self.lock:
                    if self.inbox.empty() and self.aborts.empty() and self.jobs.empty() and not stop.is_set():
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

    @property
    def finished(self) -> int:
        """Requests ended."""
        return self.outputs.finished

    def has_work(self) -> bool:
        return bool(self.outputs.groups or not self.inbox.empty() or not self.aborts.empty() or not self.jobs.empty())

    # ---- the engine thread ----

    @torch.inference_mode()
    def step(self) -> bool:
        """One iteration: (a job) -> inbox -> schedule -> forward -> sample -> emit. True while work remains."""
        self._run_job()
        self._take_inbox()
        decodes, chunks = self.scheduler.schedule()
        for seq, logits in self._forward(decodes, chunks):
            self.outputs.sample(seq, logits)
        for request_id in self.outputs.emit():  # a callback raised: its request is aborted, the engine serves on
            self.abort(request_id)
        if self.on_step_events is not None:
            self.on_step_events()
        return self.has_work()

    def _run_job(self) -> None:
        if self.jobs.empty():
            return
        fn, future = self.jobs.get()
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn())
            except Exception as e:  # the job's own failure, for its caller; the engine serves on
                future.set_exception(e)

    def _take_inbox(self) -> None:
        with self.lock:  # a submitted sequence is counted in the inbox or in the waiting queue, never in neither
            while not self.inbox.empty():
                seq = self.inbox.get()
                self.outputs.groups[seq.group.id] = seq.group
                self.scheduler.add(seq)
        while not self.aborts.empty():
            group = self.outputs.groups.get(self.aborts.get())
            if group is not None:
                self.outputs.end(group, "abort")

    def _forward(self, decodes: list[Choice], chunks: list[tuple[Choice, int]]) -> list[tuple[Choice, torch.Tensor]]:
        """Run the step: the decodes as one batch (per-row positions), each prefill chunk as its own forward. Returns
        the sequences whose tokens are all computed, with their next-token logits (1, V). A forward that raises fails
        its rows (they cannot be told apart), and the engine serves on."""
        ready = []
        if decodes:
            try:
                logits = self._decode([([s.tokens[-1]], [s.n_computed], s.blocks) for s in decodes])  # (B, V)
            except Exception as e:
                for seq in decodes:
                    self.outputs.fail(seq, e)
                decodes = []
            for b, seq in enumerate(decodes):
                self.blocks.computed(seq, 1)
                ready.append((seq, logits[b:b + 1]))
        for seq, n in chunks:
            logits = None if seq.finished else self._run_chunk(seq, n)  # (a failed decode ends its siblings)
            if logits is not None:
                ready.append((seq, logits))
        return ready

    def _decode(self, rows: list[tuple[list[int], list[int], list[int]]]) -> torch.Tensor:
        """One decode forward of rows (token, position, block table) -> their logits (B, V)."""
        n, width = len(rows), max(len(r[2]) for r in rows)
        if self.dynamic and self.window is None:  # (a rolling cache's width is bounded by its window already)
            width = max(width, 2)  # >= 2, which Dynamo keeps symbolic (below)
            if self.buckets:
                width = bucket(width, self.max_width)
        if self.buckets:  # padding rows: token 0 at position 0 in block 0, the pool's never-read pad block
            rows = rows + [([0], [0], [])] * (bucket(n, self.config.max_running) - n)
        tokens = torch.tensor([r[0] for r in rows], device=self.device)  # (B, 1)
        pos = torch.tensor([r[1] for r in rows], device=self.device)  # (B, 1) per-row positions
        if len(rows) == 1:  # one row: positions shared by the batch, (T,), the model's cheaper path
            pos = pos[0]  # (1,)
        tables = self._tables([r[2] for r in rows], width)  # (B, N)
        if self.dynamic:  # symbolic sizes from the first compile: one graph for one row and one for the rest,
            for t, dim in ((tokens, 0), (pos, 0), (tables, 0), (tables, 1)):  # not a recompile for each size
                torch._dynamo.maybe_mark_dynamic(t, dim)  # that changes (a size of 1 is specialized anyway)
        logits = self._step_for(n)(tokens, pos, self._cache(tables))  # (B, V)
        if self.decode_step.cuda_graphs:
            logits = logits[:n].clone()  # the next replay reuses this output buffer
        return logits

    @torch.inference_mode()
    def warm_up(self) -> list[int]:
        """Compile (capture) the decode step's graphs before the first request, so that none waits for one: one row,
        then more, each at two block-table widths and row counts, after which Dynamo keeps the sizes that changed
        symbolic; with buckets, every power of two up to max_running; a compiled wide step's graph at wide_rows and
        one more. Every row writes token 0 at position 0 of the pad block, which no sequence reads. Returns the row
        counts run."""
        if not self.dynamic:
            return []
        cap = self.config.max_running
        shapes = [(1, 2), (1, 3), (min(2, cap), 2), (min(3, cap), 3)]  # (rows, blocks)
        if self.buckets:
            shapes += [(bucket(n, cap), 2) for n in range(1, cap + 1)]
        wide = self.config.wide_rows
        if self.wide_step is not None and self.wide_step.mode != "none" and wide <= cap:  # the wide step's graph
            shapes += [(wide, 2), (min(wide + 1, cap), 3)]
        for rows, width in shapes:
            self._decode([([0], [0], [0] * width)] * rows)
        return sorted({rows for rows, _ in shapes})

    def _run_chunk(self, seq: Choice, n: int) -> torch.Tensor | None:
        """Compute n more of seq's tokens; the (1, V) logits after them once all its tokens are in. While the
        request's prompt logprobs are wanted, the chunk's every position's logits score the prompt."""
        group, start = seq.group, seq.n_computed
        scoring = group.prompt_logprobs is not None and len(seq.tokens) == seq.n_prompt
        tokens = torch.tensor([seq.tokens[start:start + n]], device=self.device)  # (1, n)
        pos = torch.arange(start, start + n, device=self.device)
        try:  # (1, V), or (1, n, V) when scoring
            logits = self._step_for(n)(tokens, pos, self._cache(self._tables([seq.blocks], len(seq.blocks))),
                                       all_logits=scoring, prefill=True)
        except Exception as e:
            self.outputs.fail(seq, e)
            return None
        if scoring:
            score_prompt(group.prompt_logprobs, group.request.prompt, start, logits[0], group.request.prompt_logprobs)
            logits = logits[:, -1]
        self.blocks.computed(seq, n)
        return logits if seq.n_computed == len(seq.tokens) else None  # the prompt (or a preempted one's tokens)

    def _tables(self, tables: list[list[int]], width: int) -> torch.Tensor:
        """The rows' block tables as one (B, width) tensor, padded with block 0."""
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], device=self.device)

    def _cache(self, tables: torch.Tensor) -> PagedKVCache:
        """The pool as rows with these block tables (B, N) see it."""
        if self.window is not None:  # a rolling cache over the rows' blocks (sinks.py)
            return SinkKVCache.paged(self.model, self.pool, tables, self.window)
        return PagedKVCache(self.pool, tables)

    # ---- offline ----

    def generate(self, prompts: list[list[int]], params: SamplingParams = SamplingParams(), max_new_tokens: int = 16,
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

        ids = [self.submit(Request(p, params, max_new_tokens, stop, seed, collect, grammar)) for p in prompts]
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
