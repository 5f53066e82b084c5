"""Tensor parallelism: each of N ranks (processes, one per device) holds a 1/N slice of every block's weights.

    torchrun --nproc-per-node 2 generate.py --prompt "The capital of France is" --temperature 0

Each block is split Megatron-style. q/k/v and the MLP's gate/up projections are split by output rows
(column-parallel): rank r computes its own heads and its own slice of the MLP's hidden units, with no
communication. o_proj and down_proj are split by input columns (row-parallel): each rank's product is a partial
sum of the full output, so one all-reduce after the attention and one after the MLP make every rank's hidden
state whole again. A Mixtral expert is split exactly like the dense MLP (its names end in gate_proj/up_proj/
down_proj); the router is replicated, so every rank picks the same experts, and the weighted sum of the experts'
partial sums is the partial sum of the weighted sum: the one all-reduce after the MLP still suffices.
Two all-reduces of B x T x C values per block, so tensor parallelism belongs inside a node.

A rank's shard is just a smaller model: ModelArgs with H/N query heads, K/N kv heads (or one replicated kv head
when K < N) and hidden_dim/N, so its KV cache holds only its own kv heads. Embedding, norms and the LM head are
replicated: every rank computes the same logits and, with the same seed, samples the same tokens.
NCCL on CUDA, gloo on CPU; torchrun's RANK / WORLD_SIZE / LOCAL_RANK say who is who.
"""
import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from config import ModelArgs

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split dim 0 (output rows)
ROW_PARALLEL = ("o_proj", "down_proj")  # split dim 1 (input columns); their outputs are all-reduced


@dataclass(frozen=True)
class Shard:
    """This process's place in a tensor-parallel group: rank of world."""
    rank: int
    world: int

    def args(self, full: ModelArgs) -> ModelArgs:
        """The ModelArgs of this rank's shard (a ValueError when the model cannot be split `world` ways)."""
        H, K, F, w = full.n_heads, full.n_kv_heads, full.hidden_dim, self.world
        if H % w:
            raise ValueError(f"tensor parallel: {H} attention heads do not divide over {w} ranks")
        if K % w and w % K:
            raise ValueError(f"tensor parallel: {K} kv heads can be neither split nor replicated over {w} ranks "
                             "(one must divide the other)")
        if F % w:
            raise ValueError(f"tensor parallel: the MLP width {F} does not divide over {w} ranks")
        if full.fused_checkpoint:  # its rows are not slices of one tensor per part
            raise ValueError("tensor parallel cannot split a checkpoint with fused qkv_proj/gate_up_proj (Phi-3)")
        return dataclasses.replace(full, n_heads=H // w, n_kv_heads=max(K // w, 1), hidden_dim=F // w,
                                   head_dim=full.head_dim)

    def region(self, name: str, full: ModelArgs) -> tuple[int, int, int] | None:
        """(dim, start, stop) of this rank's slice of the full tensor `name`, or None if it is replicated."""
        module = name.split(".")[-2] if name.startswith("layers.") else ""
        D, local = full.head_dim, self.args(full)
        if module == "q_proj" or module == "o_proj":
            rows = local.n_heads * D
            return (0 if module == "q_proj" else 1, self.rank * rows, (self.rank + 1) * rows)
        if module in ("k_proj", "v_proj"):
            if full.n_kv_heads >= self.world:  # split: K/world heads each
                first = self.rank * local.n_kv_heads
            else:  # replicated: this rank's query heads all belong to kv head rank*K//world (world/K ranks share it)
                first = self.rank * full.n_kv_heads // self.world
            return (0, first * D, (first + local.n_kv_heads) * D)
        if module in ("gate_proj", "up_proj", "down_proj"):
            cols = local.hidden_dim
            return (0 if module != "down_proj" else 1, self.rank * cols, (self.rank + 1) * cols)
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

    def read(self, name: str, tensor_slice, full: ModelArgs) -> torch.Tensor:
        """This rank's slice read from a safetensors slice handle: only those bytes leave the file."""
        region = self.region(name, full)
        if region is None:
            return tensor_slice[:]
        dim, start, stop = region
        return tensor_slice[start:stop] if dim == 0 else tensor_slice[:, start:stop]


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the ranks: the partial products of a row-parallel layer. A functional collective, so
    torch.compile traces it into the graph."""
    import torch.distributed._functional_collectives as funcol

    return funcol.all_reduce(x, "sum", dist.group.WORLD)


def install(model) -> None:
    """Make each block all-reduce its attention and MLP outputs (the row-parallel layers' partial sums)."""
    for layer in model.layers:
        layer.all_reduce = all_reduce


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
