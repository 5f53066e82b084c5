"""MXFP4, the format gpt-oss's experts are released in (OCP microscaling): each value a 4-bit float (E2M1: a sign, two
exponent bits, one mantissa bit), two a byte (low nibble first), and a block of 32 sharing one 8-bit power-of-two
scale (exponent + 127). A checkpoint stores `*_blocks` (..., rows, G, 16) bytes and `*_scales` (..., rows, G): a
(rows, G x 32) matrix. Decoded here once, at load, into floats."""
import torch

# E2M1's 16 values by code: 0-7 positive, 8-15 their negatives
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks (..., rows, G, 16) uint8 and scales (..., rows, G) uint8 -> float32 (..., rows, G x 32): each code's value
    times 2^(scale - 127), exactly (a power of two times a value with one mantissa bit)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
                         "(blocks: (..., G, 16) bytes, scales: (..., G))")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    blocks = blocks.to(torch.uint8)
    values = torch.stack([lut[(blocks & 0x0F).int()], lut[(blocks >> 4).int()]], dim=-1)  # (..., G, 16, 2)
    values = torch.ldexp(values.flatten(-2), scales.int()[..., None] - 127)  # (..., G, 32)
    return values.flatten(-2)  # (..., rows, G x 32)
