"""One-row int4 products for CPUs where torch dispatches its AVX2 kernels (no AVX-512): Int4Linear's "words" layout.

There, torch's int4 kernel streams weights at about half the speed it reaches with AVX-512, and Inductor's own code
for a uint8 weight loads 8 bytes at a time through a stack buffer (a partial vector): both lose to a float32 matmul.
This layout makes every weight load a whole 256-bit vector and every activation load 8 consecutive floats, and lets
Inductor write the rest (shift, mask, convert, multiply-add), in float32: the file's weights exactly, in a float32
model's precision (README, Benchmarks). Opt-in (quantize.compiled_layouts): rows run one at a time, so that each
has a one-row step's bits, which a compiled verify graph with a symbolic token count cannot unroll.

Layout: codes (N, K) in [0, 15], K a multiple of 64, as int32 words (N, K/64, 8): nibble b of word l in super-block
j holds column 64j + 8b + l. Scales (N, K/32, 2): [scale, value of code 0] for each 32 columns.
Shape legend: N out_features, K in_features, J = K/64 super-blocks, b the nibble, l the lane.
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


def pack_words(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes in [0, 15] -> (N, K/64, 8) int32 words."""
    N, K = codes.shape
    c = codes.to(torch.int32).view(N, K // SUPER, 8, 8)  # (N, J, b, l)
    words = c[:, :, 0]
    for b in range(1, 8):
        words = words | (c[:, :, b] << (4 * b))
    return words.contiguous()  # (N, J, l)


def unpack_words(words: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_words: (N, K/64, 8) int32 -> (N, K) uint8 codes."""
    N, J, _ = words.shape
    return torch.stack([(words >> (4 * b)) & 15 for b in range(8)], dim=2).view(N, J * SUPER).to(torch.uint8)


def half_group_scales(scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """Int4Linear's (K/G, N, 2) [scale, value of code 8] -> (N, K/32, 2) float32 [scale, value of code 0]."""
    s, z = scales_and_zeros.float().transpose(0, 1).unbind(-1)  # (N, K/G) each
    s, m = (t.repeat_interleave(group_size // 32, dim=1) for t in (s, z - 8 * s))  # (N, K/32) each
    return torch.stack([s, m], dim=-1).contiguous()


def gemv(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (K,) -> (N,) float32: sum over k of x[k] * (scale * code + code-0 value), group by group."""
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
