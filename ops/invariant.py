"""Batch-invariant ops: what the deterministic mode (--deterministic, step.Step) runs. Under `BatchInvariant()` a
token's logits are bitwise the same whatever else is in its forward: the other rows of a decode batch, the other
tokens of its prefill chunk, and how many keys the cache holds past its own.

Without it they are not: a matmul's blocking, and so its rounding, depends on its row count (a one-row step is
MKL's GEMV, more rows oneDNN's or MKL's GEMM, each blocked by the shape), and attention reduces over however many
cache slots its batch pads to. Here every op whose reduction order could depend on the rest of the batch is
swapped, while the mode is on, for one that calls the library with one fixed shape only:
- float linear layers (F.linear): the rows in tiles of ROWS, the last padded with zeros, one call per tile (a
  row's result does not depend on the other rows of a tile of fixed shape, nor on its place in it);
  the CPU int8 and int4 kernels (quantize.py) compute each row alone already, and are left as they are (both
  properties are checked in tests/test_deterministic.py);
- batched matmuls (attention's): tiles of TILE_ROWS x BLOCK times BLOCK x BLOCK in one torch.bmm, the tiles' partial
  products over the reduced dim summed in order, so a key past a query's own (its probability masked to 0) adds
  an exact zero;
- softmax: the max, exp, and a sum in order (cumsum), over the last dim padded with -inf to a multiple of BLOCK;
- F.scaled_dot_product_attention: written out with those, as ops.cpu.decode_attention computes it (float32, scores
  / sqrt(D)), so a query gets the same bits whether a decode step, a verify or a long prefill chunk computes it.
Row-wise ops (RMSNorm, the activations, RoPE, the embedding) compute each row alone already.

The guarantee is per machine, torch build and thread count: other kernels (other CPUs' vector widths) round
differently.

Shape legend: M rows, K reduced dim, N columns, n batched matmuls, mt/kt/nt tiles along M/K/N.
"""
import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

ROWS = 16  # rows per linear-layer call: a one-row decode step pays a 16-row GEMM
TILE_ROWS = 32  # rows per tile of a batched matmul (attention): fewer, larger tiles for prefill's many queries
BLOCK = 64  # keys (and reduced-dim elements) per attention tile; a multiple of every CPU's float vector width


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) as a new tensor of rows padded to a multiple of ROWS. Always a copy (F.pad copies even when it adds
    nothing): a fresh allocation, so every tile starts on the same alignment."""
    return F.pad(x, (0, 0, 0, -x.shape[0] % ROWS))


def tiled_rows(fn, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """fn(x, *args) for x (..., K) computed ROWS rows at a time: fn takes rows (ROWS, K) and returns (ROWS, N)."""
    x2 = x.reshape(-1, x.shape[-1])  # (M, K)
    y = torch.cat([fn(tile, *args, **kwargs) for tile in pad_rows(x2).split(ROWS)])  # (M padded, N)
    return y[:x2.shape[0]].view(*x.shape[:-1], y.shape[-1])  # (..., N)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (..., M, K) @ b (..., K, N), batch dims broadcast: one torch.bmm over tiles (TILE_ROWS, BLOCK) x
    (BLOCK, BLOCK), then the kt partial products of each output tile summed in order."""
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    (M, K), N = a.shape[-2:], b.shape[-1]
    a = F.pad(a, (0, -K % BLOCK, 0, -M % TILE_ROWS)).expand(*batch, -1, -1)  # (..., Mp, Kp), zeros add nothing
    b = F.pad(b, (0, -N % BLOCK, 0, -K % BLOCK)).expand(*batch, -1, -1)  # (..., Kp, Np)
    (Mp, Kp), Np = a.shape[-2:], b.shape[-1]
    mt, kt, nt = Mp // TILE_ROWS, Kp // BLOCK, Np // BLOCK
    a = a.reshape(-1, mt, TILE_ROWS, kt, BLOCK).transpose(2, 3)  # (n, mt, kt, TILE_ROWS, BLOCK)
    b = b.reshape(-1, kt, BLOCK, nt, BLOCK).transpose(2, 3)  # (n, kt, nt, BLOCK, BLOCK)
    n = a.shape[0]
    tiles_a = a[:, :, :, None].expand(n, mt, kt, nt, TILE_ROWS, BLOCK).reshape(-1, TILE_ROWS, BLOCK)
    tiles_b = b[:, None].expand(n, mt, kt, nt, BLOCK, BLOCK).reshape(-1, BLOCK, BLOCK)
    parts = torch.bmm(tiles_a, tiles_b).view(n, mt, kt, nt, TILE_ROWS, BLOCK)  # each tile's product
    y = parts[:, :, 0] if kt == 1 else parts.cumsum(2)[:, :, -1]  # summed in order (cumsum: sequential)
    y = y.transpose(2, 3).reshape(n, Mp, Np)[:, :M, :N]  # (n, mt, nt, TILE_ROWS, BLOCK) -> (n, M, N)
    return y.reshape(*batch, M, N).contiguous()  # callers view it


def softmax(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """softmax over the last dim, its sum taken in order (cumsum): keys past the row's last one (-inf) add exact
    zeros. The row is padded to a multiple of BLOCK, so exp's vectorized loop takes every element (its scalar tail,
    which rounds differently, takes none)."""
    assert dim in (-1, x.dim() - 1), f"dim {dim} vs the last of {x.dim()}"
    x = x if dtype is None else x.to(dtype)
    S = x.shape[-1]
    padded = F.pad(x, (0, -S % BLOCK), value=float("-inf"))  # (..., S padded)
    e = torch.exp(padded - padded.amax(-1, keepdim=True))
    return (e / e.cumsum(-1)[..., -1:])[..., :S].contiguous()  # cumsum: a sequential sum (in double on CPU)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False) -> torch.Tensor:
    """F.scaled_dot_product_attention as ops.cpu.decode_attention computes it, with the ops above: q (B, H, T, D),
    k and v (B, K, S, D), attn_mask (T, S) or (B, 1, T, S), True where a query attends."""
    assert dropout_p == 0.0 and not is_causal and scale is None, "the model calls SDPA with a mask and no scale"
    B, H, T, D = q.shape
    K, S = k.shape[1], k.shape[2]
    G = H // K  # query heads per kv head
    qg = q.float().reshape(B, K, G * T, D)  # (B, K, G*T, D): a kv head's queries as rows
    scores = (matmul(qg, k.float().transpose(-2, -1)) / math.sqrt(D)).view(B, K, G, T, S)  # (B, K, G, T, S)
    if attn_mask is not None:  # (T, S) or (B, 1, T, S) -> broadcast over K and G
        scores = torch.where(attn_mask.unsqueeze(-3), scores, float("-inf"))
    p = softmax(scores, dim=-1).view(B, K, G * T, S)  # (B, K, G*T, S)
    return matmul(p, v.float()).view(B, H, T, D).to(q.dtype)  # (B, H, T, D)


def row_op(op):
    """A kernel taking rows (M, K) first, tiled."""
    return lambda x, *args, **kwargs: tiled_rows(op, x, *args, **kwargs)


def swaps() -> dict:
    """The functions BatchInvariant replaces, each with its batch-invariant version."""
    table = {F.linear: row_op(F.linear), F.scaled_dot_product_attention: attention,
             torch.softmax: softmax, torch.Tensor.softmax: softmax,
             F.softmax: lambda x, dim=None, _stacklevel=3, dtype=None: softmax(x, dim, dtype)}
    for name in ("bmm", "matmul", "__matmul__"):
        table[getattr(torch.Tensor, name)] = matmul
    table[torch.bmm] = table[torch.matmul] = matmul
    return table


class BatchInvariant(TorchFunctionMode):
    """While entered, the swaps' functions run batch-invariant; oneDNN stays on, so the backend of a tile's matmul
    does not depend on a flag that something else (step.gemv_backend) may have set."""

    def __init__(self):
        super().__init__()
        self.table = swaps()

    def __enter__(self):
        self.mkldnn = torch.backends.mkldnn.enabled
        torch.backends.mkldnn.enabled = True
        return super().__enter__()

    def __exit__(self, *exc):
        torch.backends.mkldnn.enabled = self.mkldnn
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # The mode is off inside this call, so the swaps call the originals.
        return self.table.get(func, func)(*args, **(kwargs or {}))
