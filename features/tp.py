"""Tensor parallelism: each of N ranks (processes, one per device) holds a 1/N slice of the model's weights.

    torchrun --nproc-per-node 2 generate.py --prompt "The capital of France is" --temperature 0

Each block is split Megatron-style. q/k/v and the MLP's gate/up projections are split by output rows
(column-parallel): rank r computes its own heads and its own slice of the MLP's hidden units, with no
communication. o_proj and down_proj are split by input columns (row-parallel): each rank's product is a partial
sum of the full output, so one all-reduce after the attention and one after the MLP make every rank's hidden
state whole again. A Mixtral expert is split exactly like the dense MLP (its names end in gate_proj/up_proj/
down_proj); the router is replicated, so every rank picks the same experts, and the weighted sum of the experts'
partial sums is the partial sum of the weighted sum: the one all-reduce after the MLP still suffices.
Two all-reduces of B x T x C values per block, so tensor parallelism belongs inside a node.

The vocabulary is split too (Megatron's vocab-parallel embedding): rank r holds rows [r·ceil(V/N), ...) of the
embedding and of the LM head. A token outside a rank's rows looks up zeros there and the all-reduce adds the one
rank's row to zeros, exactly; each rank's head computes its rows' logits and an all-gather puts them side by side,
so every rank has the same logits and, with the same seed, samples the same tokens. On a small model the embedding
and head are most of the bytes (SmolLM2-135M: 148 of 215 MB in float32), so without this a rank would hold far
more than 1/N.

A rank's shard is a smaller model: ModelArgs with its query heads, kv heads (or one replicated kv head when K < N)
and MLP units, so its KV cache holds only its own kv heads. Heads go to ranks in whole kv-head groups, as evenly as
they go (SmolLM2's 3 groups of 3 heads over 2 ranks: 6 and 3), the MLP in groups of 32 units (GROUP), more of them
to a rank with fewer heads, so that the ranks' weights (and decode steps) come out even. Quantized codes are sliced
as they are, never dequantized: rows freely, and the columns of o_proj / down_proj at group boundaries, which the
splits above respect where they can (one head of dim 16 a rank cannot: a ValueError names the shapes). NCCL on
CUDA, gloo on CPU; torchrun's RANK / WORLD_SIZE / LOCAL_RANK say who is who.
"""
import dataclasses
import functools
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from config import ModelArgs
from model import Linear, Transformer

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split dim 0 (output rows)
ROW_PARALLEL = ("o_proj", "down_proj")  # split dim 1 (input columns); their outputs are all-reduced
VOCAB_PARALLEL = ("embed_tokens", "lm_head")  # split dim 0 (vocabulary rows)
GROUP = 32  # a GGUF's quantization group (Q4_0/Q4_1/Q4_K run as int4:32, Q8_0): a cut of columns falls between two


def spans(n: int, world: int) -> list[tuple[int, int]]:
    """n units over `world` ranks as evenly as they go (the first n % world ranks one more): [(start, stop), ...]."""
    base, extra = divmod(n, world)
    starts = [r * base + min(r, extra) for r in range(world + 1)]
    return list(zip(starts, starts[1:]))


def balanced(units: int, extra: list[float]) -> list[int]:
    """units over len(extra) ranks so that extra[r] + units_r come out as even as they go: the ideal shares rounded
    down, the largest remainders (the first rank on a tie) one more; spans() where a rank would get none."""
    w = len(extra)
    ideal = [(units + sum(extra)) / w - e for e in extra]
    counts = [math.floor(x) for x in ideal]
    if min(counts) < 1 or sum(counts) > units:
        return [stop - start for start, stop in spans(units, w)]
    for r in sorted(range(w), key=lambda r: (counts[r] - ideal[r], r))[:units - sum(counts)]:
        counts[r] += 1
    assert sum(counts) == units, f"{counts} vs {units}"
    return counts


@dataclass(frozen=True)
class Shard:
    """This process's place in a tensor-parallel group: rank of world."""
    rank: int
    world: int

    def heads(self, full: ModelArgs) -> tuple[int, int, int, int]:
        """(first query head, query heads, first kv head, kv heads) of this rank: whole kv-head groups when
        K >= world, else one kv head shared by world/K ranks (a ValueError when neither can be)."""
        H, K, w = full.n_heads, full.n_kv_heads, self.world
        if K >= w:
            first, stop = spans(K, w)[self.rank]
            return first * (H // K), (stop - first) * (H // K), first, stop - first
        if w % K:
            raise ValueError(f"tensor parallel: {K} kv heads can be neither split nor replicated over {w} ranks "
                             f"(fewer kv heads than ranks must divide them)")
        if H % w:
            raise ValueError(f"tensor parallel: {H} attention heads do not divide over {w} ranks (with {K} kv "
                             "heads, fewer than the ranks, each rank takes an equal share of a group)")
        return self.rank * (H // w), H // w, self.rank * K // w, 1

    def mlp(self, full: ModelArgs) -> tuple[int, int]:
        """[start, stop) of this rank's MLP units, whole groups of GROUP where there are enough of them. Where the
        heads fall unevenly, a rank with fewer takes more units, so that every rank holds about the same weights
        (SmolLM2 on 2 ranks: 6 heads and 672 units, 3 heads and 864)."""
        width, w = full.hidden_dim, self.world
        if width < w:
            raise ValueError(f"tensor parallel: the MLP width {width} cannot be split over {w} ranks")
        unit = GROUP if width % GROUP == 0 and width // GROUP >= w else 1
        # weights per model dim: q, o (H*D each), k, v (K*D each); gate, up, down of every expert per MLP unit
        attention = [2 * (nq + nk) * full.head_dim for _, nq, _, nk in (Shard(r, w).heads(full) for r in range(w))]
        per_unit = 3 * (full.n_experts or 1) * unit
        counts = balanced(width // unit, [a / per_unit for a in attention])
        start = sum(counts[:self.rank]) * unit
        return start, start + counts[self.rank] * unit

    def vocab(self, full: ModelArgs) -> tuple[int, int]:
        """[start, stop) of this rank's vocabulary rows: ceil(V/world) each, the last rank the rest."""
        chunk = -(-full.vocab_size // self.world)
        start, stop = self.rank * chunk, min(full.vocab_size, (self.rank + 1) * chunk)
        if start >= stop:
            raise ValueError(f"tensor parallel: a vocabulary of {full.vocab_size} cannot be split over "
                             f"{self.world} ranks")
        return start, stop

    def args(self, full: ModelArgs) -> ModelArgs:
        """The ModelArgs of this rank's shard (a ValueError when the model cannot be split `world` ways); its
        vocab_size stays the model's (the logits are gathered whole), its embedding and head rows are vocab()."""
        if full.fused_checkpoint:  # its rows are not slices of one tensor per part
            raise ValueError("tensor parallel cannot split a checkpoint with fused qkv_proj/gate_up_proj (Phi-3)")
        _, n_heads, _, n_kv_heads = self.heads(full)
        start, stop = self.mlp(full)
        self.vocab(full)
        return dataclasses.replace(full, n_heads=n_heads, n_kv_heads=n_kv_heads, hidden_dim=stop - start,
                                   head_dim=full.head_dim)

    def model(self, full: ModelArgs) -> Transformer:
        """This rank's model on the meta device, for a loader to fill: args()'s blocks and vocab()'s rows of the
        embedding (VocabShardEmbedding) and the head."""
        local, (start, stop) = self.args(full), self.vocab(full)
        with torch.device("meta"):
            model = Transformer(local)
            model.embed_tokens = VocabShardEmbedding(start, stop, full.dim)
            model.lm_head = Linear(full.dim, stop - start)
        if full.tie_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        return model

    def region(self, name: str, full: ModelArgs) -> tuple[int, int, int] | None:
        """(dim, start, stop) of this rank's slice of the full tensor `name`, or None if it is replicated."""
        module = name.split(".")[-2] if name.startswith("layers.") else name.split(".")[0]
        D, (q0, nq, k0, nk) = full.head_dim, self.heads(full)
        if module in ("q_proj", "o_proj"):
            return (0 if module == "q_proj" else 1, q0 * D, (q0 + nq) * D)
        if module in ("k_proj", "v_proj"):
            return (0, k0 * D, (k0 + nk) * D)
        if module in ("gate_proj", "up_proj", "down_proj"):
            return (0 if module != "down_proj" else 1, *self.mlp(full))
        if module in VOCAB_PARALLEL:
            return (0, *self.vocab(full))
        return None

    def local_shape(self, name: str, shape: tuple[int, ...], full: ModelArgs) -> tuple[int, ...]:
        region = self.region(name, full)
        if region is None:
            return tuple(shape)
        dim, start, stop = region
        return tuple(stop - start if i == dim else n for i, n in enumerate(shape))

    def take(self, name: str, t: torch.Tensor, full: ModelArgs) -> torch.Tensor:
        """This rank's slice of the full tensor t (a copy, so the full one can be freed)."""
        region = self.region(name, full)
        if region is None:
            return t
        dim, start, stop = region
        return t.narrow(dim, start, stop - start).clone()

    def check_group_cut(self, name: str, shape: tuple[int, ...], full: ModelArgs, group: int = GROUP) -> None:
        """A ValueError, naming the shapes, when this rank's columns of `name` (shape: the full tensor's) would cut
        a quantization group of `group` columns: the codes could not be sliced as they are."""
        region = self.region(name, full)
        if region is None or region[0] == 0 or (region[1] % group == 0 and region[2] % group == 0):
            return
        raise ValueError(f"tensor parallel: {name} {tuple(shape)} holds quantized codes in groups of {group} "
                         f"columns, and rank {self.rank} of {self.world} takes columns {region[1]}:{region[2]}, "
                         f"which cuts a group (head dim {full.head_dim}, MLP width {full.hidden_dim}); load it "
                         "dequantized (--quantize none) or on another number of ranks")

    def take_codes(self, name: str, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   full: ModelArgs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's slice of a linear's codes (N, K) and per-group scales and zeros (N, K/G), as they are: rows,
        or columns at group boundaries (check_group_cut)."""
        region = self.region(name, full)
        if region is None:
            return codes, scales, zeros
        dim, start, stop = region
        if dim == 0:
            return tuple(t[start:stop].clone() for t in (codes, scales, zeros))
        group = codes.shape[1] // scales.shape[1]  # (N, K/G)
        self.check_group_cut(name, tuple(codes.shape), full, group)
        return codes[:, start:stop].clone(), *(t[:, start // group:stop // group].clone() for t in (scales, zeros))

    def read(self, name: str, tensor_slice, full: ModelArgs) -> torch.Tensor:
        """This rank's slice read from a safetensors slice handle: only those bytes leave the file."""
        region = self.region(name, full)
        if region is None:
            return tensor_slice[:]
        dim, start, stop = region
        return tensor_slice[start:stop] if dim == 0 else tensor_slice[:, start:stop]


class VocabShardEmbedding(nn.Embedding):
    """Rows [start, stop) of the embedding. A token outside them looks up zeros here; the all-reduce (install)
    adds the one rank's row to the others' zeros, which is that row exactly."""

    def __init__(self, start: int, stop: int, dim: int):
        super().__init__(stop - start, dim, _weight=torch.empty(stop - start, dim))  # _weight: no init on meta
        self.start = start
        self.all_reduce = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start  # (B, T)
        inside = (local >= 0) & (local < self.num_embeddings)
        x = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)  # (B, T, C)
        x = x.masked_fill(~inside[..., None], 0)
        return x if self.all_reduce is None else self.all_reduce(x)


def all_reduce(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum x over the ranks (of group, default all): the partial products of a row-parallel layer. A functional
    collective, so torch.compile traces it into the graph."""
    import torch.distributed._functional_collectives as funcol

    return funcol.all_reduce(x, "sum", group or dist.group.WORLD)


def gather_vocab(x: torch.Tensor, vocab: int, world: int, group=None) -> torch.Tensor:
    """Each rank's logits (..., rows) side by side: (..., vocab). Every rank sends ceil(vocab/world) columns (the
    last rank's padded), so one all-gather of equal parts does."""
    import torch.distributed._functional_collectives as funcol

    chunk = -(-vocab // world)
    rows = F.pad(x, (0, chunk - x.shape[-1])).reshape(-1, chunk)  # (M, chunk)
    parts = funcol.all_gather_single(rows.contiguous(), 0, group or dist.group.WORLD)  # (world * M, chunk)
    whole = parts.view(world, -1, chunk).transpose(0, 1).reshape(*x.shape[:-1], world * chunk)  # (..., world*chunk)
    return whole[..., :vocab]


def install(model: Transformer, group=None) -> None:
    """Make each block all-reduce its attention and MLP outputs (the row-parallel layers' partial sums), the
    embedding its rows, and the head gather every rank's logits; over the ranks of group (default all: a pipeline
    stage's are its own, features/pp.py)."""
    reduce = all_reduce if group is None else functools.partial(all_reduce, group=group)
    for layer in model.layers:
        layer.all_reduce = reduce
    model.embed_tokens.all_reduce = reduce
    vocab, world = model.args.vocab_size, dist.get_world_size(group)
    model.lm_head.register_forward_hook(lambda module, inputs, out: gather_vocab(out, vocab, world, group))


def each_rank(value: int) -> list[int]:
    """value from every rank, in rank order: what rank 0 reports for all (weight bytes)."""
    out = [0] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def launched() -> bool:
    """Whether torchrun started this process as one of several ranks."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def from_env() -> Shard | None:
    """Under torchrun with WORLD_SIZE > 1: join the process group (NCCL if CUDA is there, else gloo) and
    return this process's Shard; otherwise None."""
    if not launched():
        return None
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return Shard(dist.get_rank(), dist.get_world_size())


def device_for(shard: Shard, device: torch.device) -> torch.device:
    """One GPU per rank (LOCAL_RANK) on CUDA; CPU ranks share the CPU."""
    if device.type == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def same_seed(seed: int, device: torch.device) -> int:
    """Rank 0's seed on every rank: identical logits and an identical generator give identical samples."""
    t = torch.tensor([seed % 2**63], dtype=torch.int64, device=device)
    dist.broadcast(t, src=0)
    return int(t.item())
