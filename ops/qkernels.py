"""The native kernels quantize.py's modules run (which one a device gets) and the int4 weight layouts they read.

An Int4Linear keeps its codes in one of three layouts, named by its `kernel`: None, the plain one checkpoints store
(pack_int4: two codes a byte); "cpu", torch's int4pack_mm_for_cpu's; "cuda", tinygemm's (sm80+). to_layout and
layout_codes convert between the plain bytes and the others; int4_mm multiplies through a layout's kernel.
Shape legend: N out_features (padded to 16), K in_features (padded to G), G group size, M rows of activations.
"""
import functools

import torch

# The CPU kernels are vectorized for bfloat16 only (float32 takes a scalar loop, slower than a float32 matmul),
# so on CPU they run with bf16 activations whatever the model dtype (then faster than a float32 matmul at any
# row count, prefill included); int4 scales and zeros are bf16 always, as in gpt-fast.
KERNEL_DTYPE = torch.bfloat16
ROW_BLOCK = 4096  # rows converted at a time: a large embedding's float32/int32 temporaries would set the peak memory
PROBE_ROWS = 64  # rows of the probes that read torch's CPU int4 layout back (int4pack_order)
# the int4 kernel of each layout Int4Linear.kernel names (None where this torch lacks it)
INT4_MM = {"cpu": getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None),
           "cuda": getattr(torch.ops.aten, "_weight_int4pack_mm", None)}


def int4_kernel(device: torch.device) -> str | None:
    """'cpu' (int4pack_mm_for_cpu), 'cuda' (tinygemm, sm80+) or None (dequantize-then-matmul)."""
    if device.type == "cpu" and INT4_MM["cpu"] is not None:
        return "cpu"
    if device.type == "cuda" and INT4_MM["cuda"] is not None and torch.cuda.get_device_capability(device)[0] >= 8:
        return "cuda"
    return None


def int8_kernel(device: torch.device) -> str | None:
    """'cpu' (_weight_int8pack_mm) or None: on CUDA the matmul with an int8 -> dtype cast in front (gpt-fast's
    formulation, which torch.compile fuses) is the fast path."""
    return "cpu" if device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int8pack_mm") else None


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) uint8 codes in [0, 15] -> (N, K/2) bytes: even k in the low nibble, odd k in the high one."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: (N, K/2) bytes -> (N, K) codes."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).view(packed.shape[0], -1)  # (N, K/2, 2) -> (N, K)


def cuda_inner_k_tiles(k: int) -> int:
    return 8 if k % 128 == 0 else 4 if k % 64 == 0 else 2  # K is a multiple of G >= 32


def to_layout(plain: torch.Tensor, kernel: str) -> torch.Tensor:
    """Plain bytes (N, K/2) -> the weight in `kernel`'s layout."""
    if kernel == "cpu":  # it packs each block of 16 rows on its own, so blocks of rows keep int32 copies small
        return torch.cat([torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(rows).to(torch.int32), 1)
                          for rows in plain.split(ROW_BLOCK)])
    assert kernel == "cuda", kernel
    codes = unpack_int4(plain)  # (N, K)
    high_first = (codes[:, 0::2] << 4) | codes[:, 1::2]  # the CUDA packer wants even k in the high nibble
    return torch.ops.aten._convert_weight_to_int4pack(high_first, cuda_inner_k_tiles(codes.shape[1]))


@functools.cache
def int4pack_order(k: int) -> torch.Tensor:
    """Where torch's CPU packer puts the codes of a block of PROBE_ROWS rows of k codes: for each nibble of the packed
    block (low nibble first), the index row * k + column of the code it holds. Read off the packer itself: probes
    whose codes spell their own index, 4 bits each, packed, then read back nibble by nibble. That the packer moves
    codes without reading them and packs each block of PROBE_ROWS rows alike (it works on blocks of 16-64 rows) is
    what tests/test_quantize.py checks: the codes packed come back."""
    index = torch.arange(PROBE_ROWS * k, dtype=torch.int32).view(PROBE_ROWS, k)
    order = torch.zeros(PROBE_ROWS * k, dtype=torch.int64)
    for shift in range(0, (PROBE_ROWS * k - 1).bit_length(), 4):
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu((index >> shift) & 15, 1)  # (64, k/2) bytes
        order |= torch.stack([packed & 15, packed >> 4], dim=-1).flatten().long() << shift
    return order


def layout_codes(weight: torch.Tensor, kernel: str | None, shape: tuple[int, int], group_size: int) -> torch.Tensor:
    """The (N, K) codes (shape: padded) read back from `weight` in `kernel`'s layout."""
    if kernel is None:
        return unpack_int4(weight)
    N, K = shape
    if kernel == "cpu" and N % PROBE_ROWS == 0:
        nibbles = torch.stack([weight & 15, weight >> 4], dim=-1).view(N // PROBE_ROWS, PROBE_ROWS * K)
        codes = torch.empty_like(nibbles)
        codes[:, int4pack_order(K)] = nibbles  # (N/64, 64 K): each block's codes, row-major
        return codes.view(N, K)
    # The kernel reads its own layout: with scale 1 and zero 8 it computes identity @ (codes - 8 + 8)^T,
    # exactly (small integers, one non-zero product per sum, all exact in bf16). K rows: seconds for a large matrix.
    eye = torch.eye(K, dtype=KERNEL_DTYPE, device=weight.device)  # (K, K)
    unit = torch.tensor([1.0, 8.0], dtype=KERNEL_DTYPE, device=weight.device)
    unit = unit.expand(K // group_size, N, 2).contiguous()  # (K/G, N, 2)
    return int4_mm(kernel, eye, weight, group_size, unit).t().round().to(torch.uint8)  # (K, N) -> (N, K)


def int4_mm(kernel: str, x2: torch.Tensor, weight: torch.Tensor, group_size: int,
            scales: torch.Tensor) -> torch.Tensor:
    """x2 (M, K) -> (M, N) through the kernel of `weight`'s layout, with scales_and_zeros (K/G, N, 2)."""
    # tinygemm (CUDA) takes bf16 only, the CPU kernel is fast in bf16 only: cast around them. A bf16 decode
    # step calls this 120 times (SmolLM2), so the casts that would do nothing are not called at all.
    mm = INT4_MM[kernel]
    if x2.dtype == KERNEL_DTYPE:
        return mm(x2.contiguous(), weight, group_size, scales)
    return mm(x2.to(KERNEL_DTYPE).contiguous(), weight, group_size, scales).to(x2.dtype)
