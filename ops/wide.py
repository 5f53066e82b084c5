"""Many-row steps on CPU: the model's quantized (and bf16/fp16) linear layers as float32 matrices, dequantized once.

torch's CPU int4 kernel computes each activation row on its own, so a decode step of B rows costs about B one-row
steps, and where the CPU has no bf16 units (AVX2) a bf16 matmul is a slow loop. A float32 GEMM reads each weight
once for all B rows: from about 8 rows on it is the faster product (dev/LOG.md), at the memory of a float32 copy
of those layers. wide_model makes a second view of the model for those steps: it shares every other tensor (the
embedding, norms, RoPE tables, a float32 model's own weights) and replaces each such layer with a WideLinear.
Its rows round otherwise than the kernel's (float32 activations, one GEMM): close to the narrow model, not
bitwise (tests/test_engine.py).
Shape legend: M rows of activations, K in_features, N out_features.
"""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import Linear, Transformer
from quantize import Int4Linear, Int8GroupLinear, Int8Linear

QUANTIZED = (Int4Linear, Int8GroupLinear, Int8Linear)
WIDE_ROWS = 8  # the row count from which the float32 GEMM beat the int4 kernel (SmolLM2's layers, Zen 3 AVX2)


class WideLinear(nn.Module):
    """y = x @ W^T with W a float32 (N, K) matrix, for activations of any float dtype (cast in and back)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight.float(), requires_grad=False)  # (N, K)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)  # (N,)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight, self.bias).to(x.dtype)  # (..., N)


def widens(module: nn.Module) -> bool:
    """Whether a float32 copy of module pays for many rows: a quantized linear, or a bf16/fp16 one on CPU."""
    if isinstance(module, QUANTIZED):
        return True
    return isinstance(module, Linear) and module.weight.dtype in (torch.bfloat16, torch.float16) and \
        module.weight.device.type == "cpu"


def wide_model(model: Transformer) -> Transformer | None:
    """A view of model for many-row steps, every widening layer (widens) as a WideLinear of its dequantized weight;
    None when there is none (a float32 model already multiplies rows together)."""
    targets = {name for name, m in model.named_modules() if widens(m)}
    if not targets:
        return None
    # share every tensor but those the replaced layers hold: deepcopy's memo hands back the originals
    memo = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    wide = copy.deepcopy(model, memo)
    for name in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = wide.get_submodule(parent_name)
        old = model.get_submodule(name)
        weight = old.dequantize() if isinstance(old, QUANTIZED) else old.weight  # (N, K)
        setattr(parent, attr, WideLinear(weight, getattr(old, "bias", None)))
    return wide
