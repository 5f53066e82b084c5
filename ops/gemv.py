"""One-row int4 and int8 products for CPUs where torch dispatches its AVX2 kernels (no AVX-512): Int4Linear's
"words" layout and Int8GroupLinear's (a GGUF Q8_0 head's) words.

There, torch's int4 kernel streams weights at about half the speed it reaches with AVX-512. Inductor's own code for
an integer tensor (uint8, int8, int32) loads each vector through a stack buffer (Vectorized<int>::loadu with a count
copies with memcpy): a one-row product over int8 codes streams ~6x slower than over float32 (README, Benchmarks). So
the codes are packed into 32-bit words kept in a float32 tensor, the words' bits unchanged: every weight load is a
whole 256-bit float vector, reinterpreted as integers in registers (a free bitcast), and every activation load 8
consecutive floats; Inductor writes the rest (mask, convert, multiply-add), in float32: the weights exactly, in a
float32 model's precision. The bits are not float values: a model holding them must never be cast with .to(dtype)
(the loaders build each model in its dtype).

Int4 (Int4Linear, opt-in: quantize.compiled_layouts): rows run one at a time, so that each has a one-row step's
bits, which a compiled verify graph with a symbolic token count cannot unroll. Codes (N, K) in [0, 15], K a multiple
of 64, as words (N, K/64, 8): nibble b of word l in super-block j holds column 64j + 8b + l. Scales (N, K/32, 2):
[scale, value of code 0] for each 32 columns.
Int8 (Int8GroupLinear's compiled form, quantize.compiled_head): codes (N, K) in [-128, 127], K a multiple of 32, as
words (N, K/32, 8): byte b of word l in block j holds column 32j + 8b + l, offset to [0, 255]. Scales (N, K/32).
Shape legend: N out_features, K in_features, J = K/64 super-blocks (int4) or K/32 blocks (int8), b the nibble or
byte, l the lane.
"""
import functools
import types
from collections.abc import Callable

import torch

SUPER = 64  # columns a super-block of 8 words holds; K must be a multiple
# Nibble b (< 7) is read in place as code * 16^b (a mask, no shift); the activations are scaled by 16^-b to match,
# which is exact (powers of two, and code * 16^b has 4 significant bits). The top nibble is shifted down instead, as
# its masked value would be negative.
NIBBLE_SCALE = tuple(16.0 ** -b for b in range(7)) + (1.0,)
BYTE_SCALE = tuple(256.0 ** -b for b in range(3)) + (1.0,)  # the same for the bytes of gemv_bytes' words


def pack_words(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes in [0, 15] -> (N, K/64, 8) int32 words, as float32 bits."""
    N, K = codes.shape
    c = codes.to(torch.int32).view(N, K // SUPER, 8, 8)  # (N, J, b, l)
    words = c[:, :, 0]
    for b in range(1, 8):
        words = words | (c[:, :, b] << (4 * b))
    return words.contiguous().view(torch.float32)  # (N, J, l)


def unpack_words(words: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_words: (N, K/64, 8) float32 bits -> (N, K) uint8 codes."""
    N, J, _ = words.shape
    words = words.view(torch.int32)
    return torch.stack([(words >> (4 * b)) & 15 for b in range(8)], dim=2).view(N, J * SUPER).to(torch.uint8)


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


def half_group_scales(scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """Int4Linear's (K/G, N, 2) [scale, value of code 8] -> (N, K/32, 2) float32 [scale, value of code 0]."""
    s, z = scales_and_zeros.float().transpose(0, 1).unbind(-1)  # (N, K/G) each
    s, m = (t.repeat_interleave(group_size // 32, dim=1) for t in (s, z - 8 * s))  # (N, K/32) each
    return torch.stack([s, m], dim=-1).contiguous()


def gemv(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (K,), words (N, K/64, 8) float32 bits -> (N,) float32: sum over k of x[k] * (scale * code + code-0 value),
    group by group."""
    words = words.view(torch.int32)
    N, J, _ = words.shape
    xb = x.float().view(J, 8, 8) * torch.tensor(NIBBLE_SCALE, device=x.device)[:, None]  # (J, b, l)
    s = scales.view(N, J, 2, 2)  # (N, J, half, [scale, code-0 value])
    acc = 0
    for h in range(2):  # the two 32-column groups of a super-block: nibbles 0-3 and 4-7
        part = 0
        for b in range(4 * h, 4 * h + 4):
            code = words & (15 << (4 * b)) if b < 7 else (words >> 28) & 15  # (N, J, l)
            part = part + code.float() * xb[:, b]
        acc = acc + part * s[:, :, h, 0, None]  # (N, J, l)
    group_sums = x.float().view(J, 2, 32).sum(-1)  # (J, half)
    return acc.sum((1, 2)) + (s[..., 1] * group_sums).sum((1, 2))


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
    """fn as one Inductor kernel for these argument shapes, for eager callers (a compiled step traces fn into its own
    graph). Each shape gets a code object of its own, so Dynamo compiles each once, with static shapes (a symbolic
    kernel is ~35% slower), never hitting its recompile limit. The vector width is named so that Inductor's on-disk
    cache keeps AVX2 and AVX-512 code apart (step.vector_width)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)
    options = {"cpp_wrapper": True, "cpp.simdlen": pick_vec_isa().bit_width()}
    return torch.compile(own, dynamic=False, fullgraph=True, options=options)


def run(fn: Callable, *args: torch.Tensor) -> torch.Tensor:
    """fn (gemv), compiled: inside a graph being compiled, as ops of that graph; else as its own kernel."""
    if torch.compiler.is_compiling():
        return fn(*args)
    return compiled(fn, tuple(a.shape for a in args))(*args)
