"""Many-row steps on CPU: the model's quantized (and bf16/fp16) linear layers as float32 (or bf16) matrices,
dequantized once.

torch's CPU int4 kernel computes each activation row on its own, so a decode step of B rows costs about B one-row
steps, and where the CPU has no bf16 units (AVX2) a bf16 matmul is a slow loop. A float32 GEMM reads each weight
once for all B rows, and held in oneDNN's packed (blocked) layout it runs a few rows 1.5-3x faster on two threads
than torch's plain float32 matmul does: from about 8 rows on it is the faster product (dev/LOG.md), at the memory
of a float32 copy of those layers. Under torch's AVX-512 kernels the int4 and int8 kernels are fast enough that a
float32 copy (4x the bytes of int4 codes) never pays through 32 rows, but where the CPU computes bf16 natively a bf16
copy does, from about 16 rows, and a prompt's prefill through it is 3.5x faster (copy_dtype). wide_model makes a
second view of the model for those steps: it shares every other tensor (the embedding, norms, RoPE tables, a float32
model's own weights) and replaces each such layer with a WideLinear. Its rows round otherwise than the kernel's (one
GEMM): close to the narrow model, not bitwise (tests/test_engine.py). auto_rows is serve.py's default: from which row
count the copy runs, if at all.
Shape legend: M rows of activations, K in_features, N out_features.
"""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import Linear, Transformer
from ops import cpu  # noqa: F401 (registers tinyllm::packed_linear)
from quantize import Int4Linear, Int8GroupLinear, Int8Linear

QUANTIZED = (Int4Linear, Int8GroupLinear, Int8Linear)
# From how many rows the copy (packed, eager) beat each kernel: SmolLM2, 2 threads (dev/LOG.md). Under torch's AVX2
# kernels (AMD Zen 3), a float32 copy:
INT4_ROWS = 8  # torch's int4 kernel, eager or `blocks` (int4 codes, a GGUF's Q8_0 head)
INT4_ROWS_FULL = 16  # ... under a `full` compiled step, whose few-row steps are faster
SLOW_ROWS = 2  # torch's int8 kernel (3.3x a float32 GEMV already at one row), and bf16 matmuls without bf16 units
# Under its AVX-512 kernels with bf16 units (AMD Zen 4) the int4 and int8 kernels beat a float32 copy through 32 rows;
# a bf16 copy (half its bytes, oneDNN's bf16 GEMM) beats them from about 16 rows, and prefills 3.5x faster:
BF16_ROWS = 16
BF16_ROWS_FULL = 24  # ... beside a `full` compiled step
MEMORY_SHARE = 4  # auto_rows makes the copy only where it takes at most a quarter of the machine's memory


class WideLinear(nn.Module):
    """y = x @ W^T with W an (N, K) matrix in `dtype` (float32, or bf16 where the CPU computes it natively), for
    activations of any float dtype (cast in and back). packed: W in oneDNN's blocked layout (an opaque tensor), whose
    small-row GEMMs run 1.5-3x faster on two threads than the plain matrix (dev/LOG.md); a compiled step reads it
    through cpu.packed_linear."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool = False,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        weight = weight.to(dtype)  # (N, K)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = packed
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(weight, None) if packed else weight)
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)  # (N,)

    def dequantize(self) -> torch.Tensor:
        """The (N, K) matrix (what DeepSeek's latent attention reads of kv_b_proj)."""
        return self.weight.to_dense() if self.packed else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.weight.dtype
        if not self.packed:
            return F.linear(x.to(dtype), self.weight, self.bias).to(x.dtype)  # (..., N)
        rows = x.reshape(-1, self.in_features).to(dtype)  # (M, K)
        y = torch.ops.tinyllm.packed_linear(rows, self.weight, self.bias)  # (M, N), eager or compiled
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)  # (..., N)


def widens(module: nn.Module) -> bool:
    """Whether a float32 copy of module pays for many rows: a quantized linear, or a bf16/fp16 one on CPU."""
    if isinstance(module, QUANTIZED):
        return True
    return isinstance(module, Linear) and module.weight.dtype in (torch.bfloat16, torch.float16) and \
        module.weight.device.type == "cpu"


def copy_dtype(model: Transformer, native_bf16: bool) -> torch.dtype:
    """The copy's dtype: bf16 where the model's activations are bf16 and the CPU computes bf16 natively (half the
    bytes of float32, through oneDNN's bf16 GEMM), else float32."""
    return torch.bfloat16 if native_bf16 and model.embed_tokens.weight.dtype == torch.bfloat16 else torch.float32


def auto_rows(model: Transformer, memory_bytes: int, mode: str, *, native_bf16: bool,
              avx512: bool) -> tuple[int | None, str]:
    """serve.py's --wide-rows auto: (rows, why), by the kernels torch dispatches on this CPU (avx512) and whether it
    computes bf16 natively. Under the AVX2 kernels: INT4_ROWS for int4 codes (INT4_ROWS_FULL beside a `full`
    compiled decode step: `mode`, step.Step's), SLOW_ROWS for int8 codes; under the AVX-512 ones, int4 and int8 codes
    from BF16_ROWS (BF16_ROWS_FULL) where the copy is bf16 (copy_dtype), else never; bf16 layers without native bf16
    from SLOW_ROWS. None on CUDA, for a float32 model, for DeepSeek (not measured), or where the copy would not fit
    its share of memory_bytes."""
    layers = [m for m in model.modules() if widens(m)]
    if model.embed_tokens.weight.device.type != "cpu" or type(model) is not Transformer:
        return None, "off: a CPU path for the dense and MoE families"
    dtype = copy_dtype(model, native_bf16)
    codes = any(isinstance(m, QUANTIZED) for m in layers)
    if (not native_bf16 and any(isinstance(m, Linear) for m in layers)) or \
            (not avx512 and any(isinstance(m, Int8Linear) for m in layers)):
        rows = SLOW_ROWS  # emulated bf16 matmuls, or the AVX2 int8 kernel
    elif codes and not avx512:
        rows = INT4_ROWS_FULL if mode == "full" else INT4_ROWS
    elif codes and dtype == torch.bfloat16:
        rows = BF16_ROWS_FULL if mode == "full" else BF16_ROWS
    elif codes:
        return None, "off: torch's AVX-512 int4/int8 kernels beat a float32 copy"
    else:
        return None, "off: no layer it pays for"
    size, name = sum(dtype.itemsize * m.in_features * m.out_features for m in layers), str(dtype).removeprefix("torch.")
    if size * MEMORY_SHARE > memory_bytes:
        return None, f"off: its {name} copy ({size / 1e9:.1f} GB) would pass 1/{MEMORY_SHARE} of memory"
    return rows, f"{rows}+ rows through a {size / 1e9:.2f} GB {name} copy"


def wide_model(model: Transformer, packed: bool = False, dtype: torch.dtype = torch.float32) -> Transformer | None:
    """A view of model for many-row steps, every widening layer (widens) as a WideLinear of its dequantized weight
    (packed: in oneDNN's layout, for eager steps); None when there is none (a float32 model already multiplies rows
    together)."""
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
        setattr(parent, attr, WideLinear(weight, getattr(old, "bias", None), packed, dtype))
    return wide
