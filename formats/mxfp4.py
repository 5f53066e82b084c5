"""MXFP4, the format gpt-oss's experts are released in (OCP microscaling): each value a 4-bit float (E2M1: a sign, two
exponent bits, one mantissa bit), two a byte (low nibble first), and a block of 32 sharing one 8-bit power-of-two
scale (exponent + 127). A checkpoint stores `*_blocks` (..., rows, G, 16) bytes and `*_scales` (..., rows, G): a
(rows, G x 32) matrix. Decoded once at load into floats (dequantize), or kept as stored and decoded for each product
(MXFP4Linear): the same weight either way, so the same logits."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from formats.parts import Parts

# E2M1's 16 values by code: 0-7 positive, 8-15 their negatives
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def check(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
                         "(blocks: (..., G, 16) bytes, scales: (..., G))")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks (..., rows, G, 16) uint8 and scales (..., rows, G) uint8 -> float32 (..., rows, G x 32): each code's value
    times 2^(scale - 127), exactly (a power of two times a value with one mantissa bit)."""
    check(blocks, scales)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    blocks = blocks.to(torch.uint8)
    values = torch.stack([lut[(blocks & 0x0F).int()], lut[(blocks >> 4).int()]], dim=-1)  # (..., G, 16, 2)
    values = torch.ldexp(values.flatten(-2), scales.int()[..., None] - 127)  # (..., G, 32)
    return values.flatten(-2)  # (..., rows, G x 32)


def byte_table(dtype: torch.dtype, device=None) -> torch.Tensor:
    """(256, 2): the two values each byte holds, low nibble first, in dtype (exact: E2M1 fits any float dtype)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    byte = torch.arange(256)
    return torch.stack([lut[byte & 0x0F], lut[byte >> 4]], dim=-1).to(dtype=dtype, device=device)


def scale_table(dtype: torch.dtype, device=None) -> torch.Tensor:
    """(256,): 2^(e - 127) for each scale byte e, in dtype (exact in float32 and bfloat16: e 255 is inf in both)."""
    return torch.ldexp(torch.ones(256), torch.arange(256) - 127).to(dtype=dtype, device=device)


def pair_table(dtype: torch.dtype, device=None) -> torch.Tensor:
    """(65536,) words: entry e x 256 + b holds byte b's two weights under scale byte e, in dtype (float32 or
    bfloat16), as one int64 / int32 word: exact products (e 255, E8M0's NaN, gives inf and NaN)."""
    values = byte_table(torch.float32)[None] * scale_table(torch.float32)[:, None, None]  # (256, 256, 2)
    words = values.to(dtype).contiguous().view(torch.int64 if dtype == torch.float32 else torch.int32)
    return words.view(-1).to(device)


class MXFP4Linear(Parts, nn.Module):
    """y = x @ W^T (+ bias) with W kept as the checkpoint's MXFP4 codes: blocks (N, G, 16) and scales (N, G) bytes,
    4.25 bits a weight. Each product decodes W whole into x's dtype (one table gather: the values dequantize
    gives, exactly) and runs F.linear on it, so the output is the dequantized-once model's, bit for bit.
    The codes are uint8 Parameters: the model's weight bytes count them. `parts`: gate | up rows, as Linear's."""
    ROW_DIMS: dict[str, int] = {}

    def __init__(self, in_features: int, out_features: int, parts: dict[str, int] | None = None,
                 bias: bool = False, tables: dict | None = None):
        super().__init__()
        if in_features % 32:
            raise ValueError(f"MXFP4 needs inputs in blocks of 32; got {in_features}")
        self.in_features, self.out_features, self.parts = in_features, out_features, parts
        G = in_features // 32
        self.blocks = nn.Parameter(torch.empty(out_features, G, 16, dtype=torch.uint8, device="meta"),
                                   requires_grad=False)
        self.scales = nn.Parameter(torch.empty(out_features, G, dtype=torch.uint8, device="meta"), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, device="meta"), requires_grad=False) if bias else None
        # (dtype, device) -> pair_table; a dict the model's experts share (swap_experts): 512 KB a table
        self.tables = {} if tables is None else tables

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (N, K) weight in dtype: one gather from a table of every (scale, byte) pair's two weights, in float32
        for a float32 model, else in bfloat16 (which holds every MXFP4 weight exactly) and cast: the dequantized-once
        weight, bit for bit. On this CPU 3x faster than gathering the values and multiplying by the scales, which
        is 6x faster than indexing a (256, 2) table (dev/LOG.md)."""
        work = torch.float32 if dtype == torch.float32 else torch.bfloat16
        key = (work, self.blocks.device)
        if key not in self.tables:
            self.tables[key] = pair_table(work, self.blocks.device)
        N, G = self.scales.shape
        index = (self.scales.int() << 8).unsqueeze(-1) + self.blocks.int()  # (N, G, 16): scale x 256 + byte
        w = self.tables[key].index_select(0, index.view(-1)).view(work)  # (N x G x 32,)
        return w.view(N, G * 32).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def swap_experts(model: nn.Module) -> None:
    """Each expert's linears (model.MLP's gate_up_proj, down_proj under an `experts` list) -> MXFP4Linear, before
    their codes are read in (a meta-device model)."""
    tables: dict = {}  # one decoding table for all of them
    for name, module in list(model.named_modules()):
        if ".experts." in name and name.endswith(("gate_up_proj", "down_proj")):
            model.set_submodule(name, MXFP4Linear(module.in_features, module.out_features, module.parts,
                                                  module.bias is not None, tables))


def expert_codes(handle, key: str, pick: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's (blocks (rows, G, 16), scales (rows, G)) of a safetensors `*_blocks` key, its rows picked:
    pick ("mxfp4", expert, row offset: gate 0 / up 1 of gate_up's interleaved rows, or None for all)."""
    _, e, offset = pick
    blocks = handle.get_slice(key)[e:e + 1][0]  # (rows, G, 16)
    scales = handle.get_slice(key.removesuffix("_blocks") + "_scales")[e:e + 1][0]  # (rows, G)
    check(blocks, scales)
    if offset is not None:
        blocks, scales = blocks[offset::2].contiguous(), scales[offset::2].contiguous()
    return blocks, scales
