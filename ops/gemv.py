"""The one-row product a compiled step (blocks or full) runs a GGUF's Q8_0 head (Int8GroupLinear) with where torch
dispatches its AVX2 kernels (no AVX-512): its codes as words (quantize.compiled_head), each row through one kernel of
its own (gemv_rows).

There, torch's int4 kernel (which runs the head as two 4-bit halves) streams weights at about half the speed it reaches
with AVX-512. Inductor's own code for an integer tensor (uint8, int8, int32) loads each vector through a stack buffer
(Vectorized<int>::loadu with a count copies with memcpy): a one-row product over int8 codes streams ~6x slower than
over float32 (dev/LOG.md). So the codes are packed into 32-bit words kept in a float32 tensor, the words' bits
unchanged: every weight load is a whole 256-bit float vector, reinterpreted as integers in registers (a free bitcast),
and every activation load 8 consecutive floats; Inductor writes the rest (mask, convert, multiply-add), in float32: the
weights exactly, in a float32 model's precision. The bits are not float values: a model holding them must never be
cast with .to(dtype) (the loaders build each model in its dtype).

Codes (N, K) in [-128, 127], K a multiple of 32, as words (N, K/32, 8): byte b of word l in block j holds column
32j + 8b + l, offset to [0, 255]. Scales (N, K/32).
Shape legend: N out_features, K in_features, J = K/32 blocks, b the byte, l the lane.
"""
import functools
import types
from collections.abc import Callable

import torch

BYTE_SCALE = tuple(256.0 ** -b for b in range(3)) + (1.0,)  # the activations' scale for byte b (gemv_bytes)


def pack_bytes(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) int8 codes -> (N, K/32, 8) int32 words of 4 offset bytes (code + 128), as float32 bits."""
    N, K = codes.shape
    u = (codes.to(torch.int32) + 128).view(N, K // 32, 4, 8)  # (N, J, b, l)
    words = u[:, :, 0] | (u[:, :, 1] << 8) | (u[:, :, 2] << 16) | (u[:, :, 3] << 24)
    return words.contiguous().view(torch.float32)  # (N, J, l)


def unpack_bytes(words: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_bytes: (N, K/32, 8) float32 bits -> (N, K) int8 codes."""
    N, J, _ = words.shape
    words = words.view(torch.int32)
    u = torch.stack([(words >> (8 * b)) & 255 for b in range(4)], dim=2)  # (N, J, b, l)
    return (u - 128).view(N, J * 32).to(torch.int8)


def gemv_bytes(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (K,), words (N, K/32, 8) float32 bits (pack_bytes), scales (N, K/32) float32 -> (N,) float32: sum over k of
    x[k] * code * scale, block by block. Bytes 0-2 are read in place, as (code + 128) * 256^b (a mask, no shift,
    exact in float32), against activations scaled by 256^-b (exact: powers of two); the top byte is shifted down, as
    its masked value would be negative. The offset comes off once a block: 128 * scale * (the block's sum of x)."""
    words = words.view(torch.int32)
    N, J, _ = words.shape
    xb = x.float().view(J, 4, 8) * torch.tensor(BYTE_SCALE, device=x.device)[:, None]  # (J, b, l)
    part = 0
    for b in range(4):
        u = words & (255 << (8 * b)) if b < 3 else (words >> 24) & 255  # (N, J, l)
        part = part + u.float() * xb[:, b]
    block_sums = x.float().view(J, 32).sum(-1)  # (J,)
    return (part.sum(-1) * scales).sum(-1) - 128 * (scales * block_sums).sum(-1)


@functools.cache
def compiled(fn: Callable, shapes: tuple) -> Callable:
    """fn as one Inductor kernel for these argument shapes, called eagerly (gemv_rows: also from inside a compiled
    step's graph, as an op of its own). Each shape gets a code object of its own, so Dynamo compiles each once, with
    static shapes (a symbolic kernel is ~35% slower), never hitting its recompile limit. The vector width is named so
    that Inductor's on-disk cache keeps AVX2 and AVX-512 code apart (step.vector_width). Multiplies and adds contract
    into FMAs (one rounding where there were two): the Q8_0 head's words 2.1 -> 1.9 ms a row on an AVX2 Zen 4, 2
    threads, and no further from the exact product (dev/LOG.md)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)
    options = {"cpp_wrapper": True, "cpp.simdlen": pick_vec_isa().bit_width(),
               "cpp.enable_floating_point_contract_flag": "fast"}
    return torch.compile(own, dynamic=False, fullgraph=True, options=options)


@torch.library.custom_op("tinyllm::gemv_rows", mutates_args=())
def gemv_rows(rows: torch.Tensor, words: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """rows (M, K) -> (M, N) float32: each row through gemv_bytes compiled alone (its own kernel). An op of its own
    inside a compiled step's graph, which Inductor cannot fuse into: in a whole-step graph it fused the final norm
    into the words' loop, recomputing it for every block of outputs (1.7x slower than the int4 halves)."""
    kernel = compiled(gemv_bytes, (rows.shape[1:], words.shape, scales.shape))
    return torch.stack([kernel(row, words, scales) for row in rows])  # (M, N)


@gemv_rows.register_fake
def _(rows: torch.Tensor, words: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], words.shape[0], dtype=torch.float32)  # (M, N)
