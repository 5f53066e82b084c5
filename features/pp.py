"""Pipeline parallelism: each of P ranks (processes, one per device) holds a range of the model's layers, a stage.

    torchrun --nproc-per-node 2 generate.py --pipeline-parallel 2 --prompt "The capital of France is"

The first stage embeds the tokens, the last one holds the final norm and the head; between two stages only the
hidden state crosses, point to point (B x T x C values per forward), so unlike tensor parallelism's two all-reduces
per layer it tolerates a slow link (Ethernet between machines). The layers go to stages so that each stage's decode
step reads about the same weights, the head counted on the last stage (SmolLM2's 30 layers over 2 stages: 19 and
11 + the head, which weighs as much as 8 layers). Each stage's KV cache holds only its layers: a stage's model is a
Transformer whose ModelArgs has its n_layers. A rank loads the model as one process does (strictly) and keeps its
stage (split); the other layers are freed with the whole.

Every rank runs the same decode loop: the last stage broadcasts the logits, so every rank samples the same token
with the same generator (for generate.py); the serving engine runs on rank 0 alone, which gets the logits, and the
other ranks run serve_stage(), which mirrors each of the engine's forwards (PipelineStep).

A forward's rows are split into M micro-batches that flow through the stages one after another, so stage s works on
micro-batch m while stage s + 1 works on m - 1 (irecv posted ahead, isend). The stages still idle while the pipeline
fills and drains: the bubble, (P - 1) / (M + P - 1) of a forward's time for equal stages; Clock measures each
stage's busy and whole time, and report() sets the two side by side. A forward of one row (a prompt's prefill)
splits into M chunks of its tokens instead: a stage has chunk c's keys in its KV cache before chunk c + 1 reaches
it, so the chunks compute what the whole prompt does (a chunked prefill), and a long prompt's stages overlap.

With P x N processes, each stage is N tensor-parallel ranks (tp.py, over a process group of their own): rank
s * N + t holds slice t of stage s's layers, sends its (whole, all-reduced) hidden state to its counterpart
(s + 1) * N + t, and the last stage's first rank hands out the logits.
"""
import copy
import dataclasses
import os
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from config import ModelArgs
from features import tp
from kvcache import BlockPool, Int8LayerKVCache, KVCache, LayerKVCache, PagedKVCache, PagedLayer, Slots
from model import Linear, Transformer

FORWARD, STOP = 1, 0  # what rank 0's PipelineStep tells the other stages


def check_world(stages: int) -> None:
    """A ValueError unless torchrun started P x N processes for P = stages >= 2: N tensor-parallel ranks a stage."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if stages < 2:
        raise ValueError(f"--pipeline-parallel must be >= 2 (stages, one process each), got {stages}")
    if world == 1:
        raise ValueError(f"--pipeline-parallel {stages} runs one process per stage: launch it with torchrun "
                         f"--nproc-per-node {stages} (README, More than one machine)")
    if world % stages:
        raise ValueError(f"--pipeline-parallel {stages} needs a multiple of {stages} processes (P stages x N "
                         f"tensor-parallel ranks each), torchrun started {world}")


def place(whole: tp.Shard, stages: int) -> tuple["Stage", object]:
    """Where this process is, from its rank of all (tp.from_env): its Stage, and the process group of its stage's
    tensor-parallel ranks (None with one rank a stage). Ranks s*N ... s*N + N - 1 make stage s."""
    n = whole.world // stages
    stage = Stage(whole.rank // n, stages, whole.rank % n, n)
    if n == 1:
        return stage, None
    groups = [dist.new_group(list(range(s * n, (s + 1) * n))) for s in range(stages)]  # every rank makes each
    return stage, groups[stage.rank]


def layer_cost(args: ModelArgs) -> int:
    """Weights one layer's decode step reads per model dim: q, o, k, v and the MLP (the experts a token uses)."""
    experts = args.n_experts_per_token if args.n_experts else 1
    return 2 * (args.n_heads + args.n_kv_heads) * args.head_dim + 3 * (args.moe_hidden_dim or args.hidden_dim) * experts


@dataclass(frozen=True)
class Stage:
    """This process's place in the pipeline: stage `rank` of `world`, and its rank of the stage's tp_world
    tensor-parallel ranks."""
    rank: int
    world: int
    tp_rank: int = 0
    tp_world: int = 1

    def peer(self, stage: int) -> int:
        """The global rank of this process's counterpart (the same tensor-parallel rank) in another stage."""
        return stage * self.tp_world + self.tp_rank

    def shard(self) -> tp.Shard | None:
        """This process's tensor-parallel slice of every layer (tp.py), or None with one rank a stage."""
        return None if self.tp_world == 1 else tp.Shard(self.tp_rank, self.tp_world)

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.world - 1

    def counts(self, args: ModelArgs) -> list[int]:
        """Every stage's layer count: balanced so that each stage reads about the same weights a step, the last
        stage's head (its vocabulary rows x dim) counted as layers; a ValueError for fewer layers than stages."""
        if args.n_layers < self.world:
            raise ValueError(f"pipeline parallel: {args.n_layers} layers cannot be split over {self.world} stages")
        head = args.vocab_size / self.tp_world / layer_cost(args)  # the head's weights per model dim, in layers
        return tp.balanced(args.n_layers, [0.0] * (self.world - 1) + [head])

    def layers(self, args: ModelArgs, counts: list[int] | None = None) -> range:
        """This stage's layers, of counts (default: counts(args))."""
        counts = counts or self.counts(args)
        start = sum(counts[:self.rank])
        return range(start, start + counts[self.rank])

    def agreed(self, args: ModelArgs, device) -> range:
        """layers() as rank 0 counts them: a tensor-parallel rank's args are its own slice's, uneven where the
        heads fall unevenly (SmolLM2: 6 and 3 heads), and every rank must cut the model in the same places."""
        counts = torch.tensor(self.counts(args), device=device)
        if self.tp_world > 1:
            dist.broadcast(counts, src=0)
        return self.layers(args, counts.tolist())


class Received(nn.Module):
    """A later stage's embedding: none. Its input is the previous stage's hidden state (Pipeline.forward); the
    empty weight keeps the model's device and dtype where callers read them (model.embed_tokens.weight)."""

    def __init__(self, dim: int, like: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(0, dim, dtype=like.dtype, device=like.device), requires_grad=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.weight.new_empty(*tokens.shape, 0)  # (B, T, 0): Transformer.inputs' x, unused


@dataclass
class Clock:
    """A stage's time in forwards: busy computing (its layers, the head), the whole forwards (from the call until
    the logits are in), and the formula's share of it per forward's micro-batch count."""
    busy: float = 0.0
    whole: float = 0.0
    formula: float = 0.0  # sum of whole x (P - 1) / (m + P - 1)
    forwards: int = 0
    micro: dict = field(default_factory=dict)  # micro-batches -> forwards

    def add(self, busy: float, whole: float, m: int, stages: int) -> None:
        self.busy, self.whole, self.forwards = self.busy + busy, self.whole + whole, self.forwards + 1
        self.formula += whole * (stages - 1) / (m + stages - 1)
        self.micro[m] = self.micro.get(m, 0) + 1


class NoNorm(nn.Module):
    """An earlier stage's final norm: none. What would norm this stage's hidden states (features/embed.py's
    embeddings) would get the wrong ones: a ValueError says so."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("under pipeline parallel the final norm is on the last stage: embeddings are not served")


def no_head(dim: int, like: torch.Tensor) -> Linear:
    """An earlier stage's head: none, an empty Linear where callers look for one (quantize.describe)."""
    with torch.device("meta"), warnings.catch_warnings():  # nn.Linear's init warns of a no-op on an empty weight
        warnings.simplefilter("ignore", UserWarning)
        head = Linear(dim, 0)
    return head.to_empty(device=like.device).to(like.dtype)


def rows_of(layer_cache, start: int, stop: int):
    """A layer's cache seen by rows [start, stop) of its batch: views of its buffers (writes go through) or of its
    block tables; None for a cache kind it cannot slice (a rolling cache: the forward runs as one micro-batch)."""
    view = copy.copy(layer_cache)
    if isinstance(layer_cache, PagedLayer):  # its write slots from its own rows (a Slots memo is per table)
        view.tables = layer_cache.tables[start:stop]  # (b, N)
        view.where = Slots(view.tables, layer_cache.block_size)
    elif isinstance(layer_cache, (LayerKVCache, Int8LayerKVCache)):
        for name, t in vars(layer_cache).items():
            if isinstance(t, torch.Tensor):
                setattr(view, name, t[start:stop])  # (b, K, S, D) or (b, K, S, 1)
    else:
        return None
    return view


def cut(v, a: int, b: int, t: int, u: int, batched: bool):
    """A micro-batch's share of a per-token input (cos, sin or mask, or a pair of them): rows a:b of (B, 1, T, .)
    with per-row positions, else tokens t:u of (T, .), shared by the rows."""
    if isinstance(v, tuple):
        return tuple(cut(x, a, b, t, u, batched) for x in v)
    return v[a:b] if batched else v[t:u]


class Pipeline(Transformer):
    """One stage of a model: its layers, the embedding on the first stage, the norm and head on the last. Its
    forward runs the stage's part of the pipeline; the logits come back on every rank (to="all") or on rank 0."""

    def __init__(self, model: Transformer, stage: Stage, micro_batches: int = 1, to: str = "all"):
        nn.Module.__init__(self)
        if type(model) is not Transformer:  # a family's own blocks (DeepSeek) run their own inputs
            raise ValueError(f"pipeline parallel does not support {type(model).__name__} models")
        if micro_batches < 1:
            raise ValueError(f"--micro-batches must be >= 1, got {micro_batches}")
        span = stage.agreed(model.args, model.embed_tokens.weight.device)
        self.args = dataclasses.replace(model.args, n_layers=len(span))  # its KV cache holds its layers only
        self.first_layer, self.stage, self.micro_batches, self.to = span.start, stage, micro_batches, to
        like = model.embed_tokens.weight
        self.embed_tokens = model.embed_tokens if stage.first else Received(model.args.dim, like)
        self.layers = nn.ModuleList(model.layers[i] for i in span)
        self.norm = model.norm if stage.last else NoNorm()
        self.lm_head = model.lm_head if stage.last else no_head(model.args.dim, like)
        for name, buffer in model.named_buffers(recurse=False):  # RoPE's tables
            self.register_buffer(name, buffer, persistent=False)
        self.clock = Clock()

    def parts(self, tokens: torch.Tensor, input_pos: torch.Tensor, cache) -> list[tuple[int, int, int, int]]:
        """The micro-batches, (first row, stop row, first token, stop token) each: up to micro_batches of the rows;
        one row's tokens in as many chunks (a prompt's prefill, positions shared by the batch: each stage has a
        chunk's keys in its cache before the next chunk reaches it); one part when the cache cannot be cut."""
        (B, T), m = tokens.shape, self.micro_batches
        sliceable = cache is not None and all(rows_of(c, 0, 1) is not None for c in cache.layers[:1])
        if B > 1 and (sliceable or cache is None):
            return [(a, b, 0, T) for a, b in tp.spans(B, min(m, B))]
        if T > 1 and sliceable and input_pos.dim() == 1:
            return [(0, B, a, b) for a, b in tp.spans(T, min(m, T))]
        return [(0, B, 0, T)]

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, cache: KVCache | None = None,
                all_logits: bool = False, steps: bool = False) -> torch.Tensor:
        """Transformer.forward's logits (B, T or 1, V), computed by the stages in turn, micro-batch by
        micro-batch; empty, (B, T or 1, 0), on a rank that does not receive them (to=0)."""
        began = time.perf_counter()
        x, cos, sin, mask = self.inputs(tokens, input_pos, cache)
        B, T = tokens.shape
        parts, batched = self.parts(tokens, input_pos, cache), input_pos.dim() == 2
        first, last = self.stage.first, self.stage.last
        by_rows = len(parts) > 1 and parts[0][3] == T  # else by tokens (or one part)
        like = self.embed_tokens.weight
        inbox = [] if first else [torch.empty(b - a, u - t, self.args.dim, dtype=like.dtype, device=like.device)
                                   for a, b, t, u in parts]  # (b, t, C) each
        posted = [dist.irecv(t, src=self.stage.peer(self.stage.rank - 1)) for t in inbox]
        sent, outs, busy = [], [], 0.0
        for m, (a, b, t, u) in enumerate(parts):
            if first:
                h = x[a:b, t:u]  # (b, t, C)
            else:
                posted[m].wait()
                h = inbox[m]
            t0 = time.perf_counter()
            pos = input_pos[a:b] if batched else input_pos[t:u]
            c, s, k = (cut(v, a, b, t, u, batched) for v in (cos, sin, mask))
            for i, layer in enumerate(self.layers):
                layer_cache = None if cache is None else cache.layers[i]
                layer_cache = rows_of(layer_cache, a, b) if by_rows else layer_cache
                h = layer(h, pos, c, s, k, layer_cache, steps)
            if not last:
                h = h.contiguous()
                sent.append((dist.isend(h, dst=self.stage.peer(self.stage.rank + 1)), h))  # h kept until sent
            elif all_logits or u == T:  # a chunk of tokens before the last gives its logits only when all are asked
                outs.append(self.head(h, all_logits))  # (b, t or 1, V)
            busy += time.perf_counter() - t0
        for work, _ in sent:
            work.wait()
        logits = self.logits(outs, B, T if all_logits else 1, like.device, 0 if by_rows else 1)
        self.clock.add(busy, time.perf_counter() - began, len(parts), self.stage.world)
        return logits

    def logits(self, outs: list[torch.Tensor], B: int, T: int, device, dim: int) -> torch.Tensor:
        """The last stage's logits (B, T, V), its parts' put together along dim (rows or tokens), on every rank
        (broadcast by its first tensor-parallel rank), or on rank 0 only (to=0; the others' empty)."""
        src, me = (self.stage.world - 1) * self.stage.tp_world, dist.get_rank()
        if self.stage.last:
            logits = torch.cat(outs, dim=dim)  # (B, T, V)
        elif self.to == "all" or me == 0:
            logits = torch.empty(B, T, self.args.vocab_size, dtype=torch.float32, device=device)
        else:
            return torch.empty(B, T, 0, device=device)
        if self.to == "all":
            dist.broadcast(logits, src=src)
            return logits
        if me == src:
            dist.send(logits, dst=0)
        elif me == 0:
            dist.recv(logits, src=src)
            return logits
        return logits[..., :0]

    def report(self) -> str:
        """Every stage's busy share of its forwards' time against the formula's, gathered (a collective: every
        rank calls it); rank 0 prints it."""
        clocks = [None] * dist.get_world_size()  # every rank of every stage
        dist.all_gather_object(clocks, self.clock)
        whole = sum(c.whole for c in clocks)
        if not whole:
            return "pipeline: no forwards"
        idle = [1 - c.busy / c.whole for c in clocks]
        micro = ", ".join(f"{n} x {m}" for m, n in sorted(clocks[0].micro.items()))
        return (f"pipeline x{self.stage.world}: bubble {100 * sum(c.whole - c.busy for c in clocks) / whole:.1f}% "
                f"measured (stages idle {' | '.join(f'{100 * x:.0f}%' for x in idle)}) vs "
                f"{100 * sum(c.formula for c in clocks) / whole:.1f}% by (P-1)/(M+P-1) | forwards x micro-batches: "
                f"{micro}")


def split(model: Transformer, stage: Stage, micro_batches: int = 1, to: str = "all") -> Pipeline:
    """This rank's stage of a loaded model (with tp_world > 1, loaded as stage.shard()); the other layers are
    dropped with the model."""
    return Pipeline(model, stage, micro_batches, to)


def layer_ranges(pipe: Pipeline) -> str:
    """Every stage's layers, e.g. `layers 0-18 | 19-29` (a collective: every rank calls it)."""
    n = pipe.stage.tp_world  # a stage's ranks hold the same layers
    firsts, counts = tp.each_rank(pipe.first_layer)[::n], tp.each_rank(pipe.args.n_layers)[::n]
    return "layers " + " | ".join(f"{a}-{a + c - 1}" for a, c in zip(firsts, counts))


def summary(pipe: Pipeline) -> str:
    """The summary line's part, e.g. ` | pipeline parallel x2 (layers 0-18 | 19-29; 2 micro-batches)` (a
    collective: every rank calls it)."""
    m, n = pipe.micro_batches, pipe.stage.tp_world
    tensor = f" x tensor parallel x{n}" if n > 1 else ""
    return (f" | pipeline parallel x{pipe.stage.world}{tensor} ({layer_ranges(pipe)}; {m} micro-batch"
            f"{'es' if m > 1 else ''})")


class PipelineStep:
    """The engine's step on rank 0 (the first stage): before each forward, it tells the other stages its shapes,
    positions, block tables and the pool's block copies since the last one (serve_stage runs the same forward on
    theirs); the logits come back to it alone."""

    def __init__(self, step):
        self.step, self.model, self.mode, self.cuda_graphs = step, step.model, step.mode, False
        self.copies: list[tuple[int, int]] = []

    def watch(self, pool: BlockPool) -> None:
        """Note the engine's block copies (copy-on-write of a shared block), for the other stages' pools."""
        copy_block = pool.copy_block

        def copy_and_tell(src: int, dst: int) -> None:
            copy_block(src, dst)
            self.copies.append((src, dst))

        pool.copy_block = copy_and_tell

    def __call__(self, tokens: torch.Tensor, input_pos: torch.Tensor, cache: PagedKVCache, all_logits: bool = False,
                 prefill: bool = False) -> torch.Tensor:
        B, T = tokens.shape
        device = tokens.device
        header = [FORWARD, B, T, cache.tables.shape[1], input_pos.dim(), all_logits, prefill, len(self.copies)]
        dist.broadcast(torch.tensor(header, device=device), src=0)
        for t in (tokens, input_pos, cache.tables):  # tokens: for the first stage's other tensor-parallel ranks
            dist.broadcast(t.to(torch.int64).contiguous(), src=0)
        if self.copies:
            dist.broadcast(torch.tensor(self.copies, device=device), src=0)  # (n, 2)
            self.copies = []
        return self.step(tokens, input_pos, cache, all_logits, prefill)

    def stop(self) -> None:
        """Tell the other stages to return from serve_stage."""
        dist.broadcast(torch.tensor([STOP] + [0] * 7, device=self.model.embed_tokens.weight.device), src=0)


def serve_stage(step, pool: BlockPool) -> None:
    """A later stage's loop under serve.py: run each forward rank 0's engine runs (PipelineStep), on this stage's
    layers and pool, until it says stop."""
    device = step.model.embed_tokens.weight.device
    while True:
        header = torch.empty(8, dtype=torch.int64, device=device)
        dist.broadcast(header, src=0)
        op, B, T, N, dims, all_logits, prefill, n_copies = header.tolist()
        if op == STOP:
            return
        tokens = torch.empty(B, T, dtype=torch.int64, device=device)
        input_pos = torch.empty((B, T) if dims == 2 else (T,), dtype=torch.int64, device=device)
        tables = torch.empty(B, N, dtype=torch.int64, device=device)
        for t in (tokens, input_pos, tables):
            dist.broadcast(t, src=0)
        if n_copies:
            copies = torch.empty(n_copies, 2, dtype=torch.int64, device=device)
            dist.broadcast(copies, src=0)
            for src, dst in copies.tolist():
                pool.copy_block(src, dst)
        step(tokens, input_pos, PagedKVCache(pool, tables), all_logits=bool(all_logits), prefill=bool(prefill))
