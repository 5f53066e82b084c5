"""Weight-only quantization: Int8Linear (per-output-channel symmetric) and Int4Linear (group-wise asymmetric,
two 4-bit codes per byte), swapped in for nn.Linear.

Shape legend: N out_features, K in_features, G group size, M rows of activations (batch x tokens).
Decode reads every weight once per token, so fewer bytes per weight is faster decode; what that costs in
quality is measured (quality.py), not assumed. Each module has a native kernel path where torch has one
(qkernels.py: which kernel, and the int4 layouts they read) and a plain dequantize-then-matmul path (`dequantize()`)
that the tests hold the kernels to.
Writing a quantized checkpoint is export.py's; reading one is load.py's.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from ops import gemv
from formats.mxfp4 import MXFP4Linear
from formats.parts import Parts
from ops.qkernels import (KERNEL_DTYPE, ROW_BLOCK, int4_kernel, int4_mm, int8_kernel, layout_codes, pack_int4,
                          to_layout, unpack_int4)

GROUP_SIZES = (32, 64, 128, 256)  # what the int4 kernels (tinygemm on CUDA, int4pack on CPU) accept
DEFAULT_GROUP = 32  # on SmolLM2 (a Q4_1 GGUF, groups of 32) larger groups cost far more quality (dev/LOG.md)
MODES_HELP = f"int8, int4 (group {DEFAULT_GROUP}) or int4:GROUP with GROUP in {', '.join(map(str, GROUP_SIZES))}"
N_MULTIPLE = 16  # the CPU int4 packer works on blocks of 16 output rows
INT8_K_MULTIPLE = 16  # the CPU int8 kernel reads bf16 activations in 16-wide tiles (wrong results otherwise)


def parse_mode(mode: str) -> tuple[str, int | None]:
    """'int8' -> ('int8', None); 'int4' -> ('int4', DEFAULT_GROUP); 'int4:64' -> ('int4', 64)."""
    kind, _, group = mode.partition(":")
    if kind == "int8" and not group:
        return "int8", None
    if kind != "int4":
        raise ValueError(f"unknown quantization mode {mode!r}; allowed: {MODES_HELP}")
    if not group:
        return "int4", DEFAULT_GROUP
    if not group.isdigit() or int(group) not in GROUP_SIZES:
        raise ValueError(f"int4 group size {group!r} in {mode!r} is not one the int4 kernels can take, so "
                         f"in_features cannot be padded to it; allowed: {', '.join(map(str, GROUP_SIZES))}")
    return "int4", int(group)


def mode_name(kind: str, group: int | None) -> str:
    return "int8" if kind == "int8" else f"int4:{group}"


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def pad_columns(x: torch.Tensor, k: int) -> torch.Tensor:
    """x (M, K) with zero columns up to k; x itself when K == k (F.pad copies even when it adds nothing)."""
    return x if x.shape[-1] == k else F.pad(x, (0, k - x.shape[-1]))


# ---- the quantization math, on plain tensors (what checkpoints store and the tests check) ----

def quantize_int8(w: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> codes (N, K) int8 in [-127, 127] and scales (N,): w ~= codes * scales[:, None]."""
    scales = (w.float().abs().amax(dim=1).clamp(min=1e-8) / 127).to(scale_dtype)  # (N,)
    codes = torch.round(w.float() / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)  # (N, K)
    return codes, scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return codes.to(scales.dtype) * scales[:, None]  # (N, K)


def quantize_int4(w: torch.Tensor, group_size: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float, K a multiple of G -> codes (N, K) uint8 in [0, 15] and scales_and_zeros (K/G, N, 2), with
    w ~= (codes - 8) * scale + zero per group (gpt-fast's / tinygemm's asymmetric scheme)."""
    N, K = w.shape
    wg = w.float().view(N, K // group_size, group_size)  # (N, K/G, G)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)  # (N, K/G)
    scales = ((hi - lo).clamp(min=1e-6) / 15).to(scale_dtype)
    zeros = (lo + 8 * scales.float()).to(scale_dtype)  # the value of code 8, the group's midpoint
    # Round with the stored (possibly bf16) scale and zero so the codes fit what dequantization will use.
    s, z = scales.float()[..., None], zeros.float()[..., None]  # (N, K/G, 1)
    codes = torch.round((wg - z) / s + 8).clamp(0, 15).to(torch.uint8).view(N, K)
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()  # (K/G, N, 2)
    return codes, scales_and_zeros


def dequantize_int4(codes: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """codes (N, K) in [0, 15], scales_and_zeros (K/G, N, 2) -> (N, K) float32."""
    N, K = codes.shape
    groups = scales_and_zeros.shape[0]
    s, z = scales_and_zeros.transpose(0, 1).unbind(-1)  # (N, K/G) each
    w = codes.view(N, groups, K // groups).float()  # (N, K/G, G), the one float32 temporary: in place below
    return w.sub_(8).mul_(s.float()[..., None]).add_(z.float()[..., None]).view(N, K)


class Int8Linear(Parts, nn.Module):
    """y = x @ (codes * scales)^T with int8 codes (N, K) and one symmetric scale per output channel.
    parts: the checkpoint tensors it fuses (formats.parts.Parts), as the Linear it replaces."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype = torch.float32, device=None,
                 parts: dict[str, int] | None = None, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.parts = in_features, out_features, parts
        self.in_padded = round_up(in_features, INT8_K_MULTIPLE)  # zero columns: they add nothing
        self.register_buffer("weight", torch.zeros(out_features, self.in_padded, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.ones(out_features, dtype=dtype, device=device))
        self.bias = float_bias(out_features, dtype, device) if bias else None
        # The scales as the CPU kernel takes them (bf16), made once when they are loaded: a cast at every call
        # would be an op of its own, and one Inductor's lowering of the kernel cannot take as its input.
        self.register_buffer("kernel_scales", None, persistent=False)

    def quantize_weight(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """The buffers (weight, scales) for float weight w (N, K): this module's, or one part's (N its rows)."""
        assert w.shape[1] == self.in_features and w.shape[0] in self.row_counts(), f"{tuple(w.shape)} vs {self}"
        if self.in_padded != self.in_features:
            w = F.pad(w, (0, self.in_padded - self.in_features))
        blocks = [quantize_int8(b, self.scales.dtype) for b in w.split(ROW_BLOCK)]  # bounded temporaries
        return {"weight": torch.cat([c for c, _ in blocks]), "scales": torch.cat([s for _, s in blocks])}

    def dequantize(self) -> torch.Tensor:
        """The (N, K) weight this module multiplies by, in the scales' dtype: the reference path."""
        return dequantize_int8(self.weight, self.scales)[:, :self.in_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        if int8_kernel(x.device) == "cpu":
            scales = self.scales.to(KERNEL_DTYPE) if self.kernel_scales is None else self.kernel_scales
            x2 = pad_columns(x2, self.in_padded).to(KERNEL_DTYPE)  # (M, K padded)
            y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.weight, scales).to(x.dtype)
        elif x.device.type == "cuda":
            y = F.linear(x2, self.weight[:, :self.in_features].to(x.dtype)) * self.scales.to(x.dtype)
        else:
            y = F.linear(x2, self.dequantize().to(x.dtype))
        y = y if self.bias is None else y + self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], self.out_features)  # (..., N)

    def pack_for_kernel(self) -> None:
        """Make kernel_scales, once the scales are loaded."""
        on_cpu = int8_kernel(self.scales.device) == "cpu"
        self.kernel_scales = self.scales.to(KERNEL_DTYPE) if on_cpu else None

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.pack_for_kernel()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Int4Linear(Parts, nn.Module):
    """y = x @ W^T with W stored as 4-bit codes, two per byte, and a (scale, zero) pair per group of G inputs.
    K is padded to a multiple of G and N to a multiple of 16 (zero rows/columns) so every kernel takes them.

    `weight` holds the (N, K/2) bytes in the layout of the kernel the device uses (qkernels.py); the state
    dict always has the plain pack_int4 layout, so checkpoints do not depend on the machine that wrote them.
    A part (formats.parts.Parts) is stored as an Int4Linear of its own shape stores it: padded to 16 rows.
    act_order: column i of the codes is input in_perm[i] (GPTQ's act-order groups made contiguous at load); the
    kernel path gathers x's columns once per call, the reference path puts the weight's columns back."""
    ROW_DIMS = {"scales_and_zeros": 1}  # (K/G, N, 2)

    def __init__(self, in_features: int, out_features: int, group_size: int, device=None,
                 parts: dict[str, int] | None = None, bias: bool = False, dtype: torch.dtype = torch.float32,
                 act_order: bool = False):
        super().__init__()
        if group_size not in GROUP_SIZES:
            raise ValueError(f"int4 group size {group_size} is not supported; allowed: {GROUP_SIZES}")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.parts = parts
        self.in_padded, self.out_padded = round_up(in_features, group_size), round_up(out_features, N_MULTIPLE)
        self.kernel = None  # the layout `weight` is in: None (plain), "cpu" or "cuda"
        self.register_buffer("weight", torch.zeros(self.out_padded, self.in_padded // 2, dtype=torch.uint8,
                                                   device=device))
        self.register_buffer("scales_and_zeros", torch.zeros(self.in_padded // group_size, self.out_padded, 2,
                                                             dtype=KERNEL_DTYPE, device=device))
        self.bias = float_bias(out_features, dtype, device) if bias else None  # (N,), not padded
        # (K,), given with the codes (a meta placeholder until then: the first part to come sets it); None: no order
        perm = torch.empty(in_features, dtype=torch.int64, device="meta") if act_order else None
        self.register_buffer("in_perm", perm)

    def quantize_weight(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """The plain buffers (weight, scales_and_zeros) for float weight w (N, K): this module's, or one part's
        (N its rows)."""
        N, K = w.shape
        assert K == self.in_features and N in self.row_counts(), f"{tuple(w.shape)} vs {self}"
        assert self.in_perm is None, "an act-order module takes codes (buffers_for_codes), not a float weight"
        if (round_up(N, N_MULTIPLE), self.in_padded) != (N, K):  # F.pad copies even when it adds nothing
            w = F.pad(w, (0, self.in_padded - K, 0, round_up(N, N_MULTIPLE) - N))
        blocks = [quantize_int4(b, self.group_size, KERNEL_DTYPE) for b in w.split(ROW_BLOCK)]  # bounded temporaries
        return {"weight": torch.cat([pack_int4(c) for c, _ in blocks]),
                "scales_and_zeros": torch.cat([sz for _, sz in blocks], dim=1)}

    def buffers_for_codes(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                          perm: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The plain buffers for codes (N, K) in [0, 15] with a scale and zero (N, K/G) per group, taken as they
        are (a GGUF file's Q4_0/Q4_1 blocks, GPTQ's): no rounding of the weights, only of scale and zero to bf16.
        N: this module's rows, or one part's. perm (K,): the input of each code column (act_order modules)."""
        assert (perm is None) == (self.in_perm is None), "perm goes with an act_order module"
        N, K = codes.shape  # scales (N, K/G rounded up): a last group padded with zero inputs may be partly real
        assert K == self.in_features and N in self.row_counts() and scales.shape == (N, -(-K // self.group_size))
        pad_n, pad_groups = round_up(N, N_MULTIPLE) - N, self.in_padded // self.group_size - scales.shape[1]
        codes = F.pad(codes, (0, self.in_padded - K, 0, pad_n), value=8)  # padding: scale 0, zero 0, so 0
        scales, zeros = (F.pad(t, (0, pad_groups, 0, pad_n)) for t in (scales, zeros))
        scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).to(KERNEL_DTYPE).contiguous()
        out = {"weight": pack_int4(codes.to(torch.uint8)), "scales_and_zeros": scales_and_zeros}  # (K/G, N, 2)
        return out if perm is None else {**out, "in_perm": perm.to(torch.int64)}

    def load_part(self, i: int, tensors: dict[str, torch.Tensor]) -> None:
        """As Parts.load_part, into the plain layout (pack_for_kernel follows); scales and zeros bf16 always (a
        loader may have cast them to the model dtype)."""
        assert self.kernel is None, "parts load into the plain layout; pack_for_kernel follows"
        tensors = dict(tensors)
        perm = tensors.pop("in_perm", None)
        if perm is not None:  # one input order for every part (they share their input): the first sets it
            if self.parts is not None and not self.in_perm.is_meta and not torch.equal(perm, self.in_perm.cpu()):
                raise ValueError(f"the parts of a fused linear ({', '.join(self.parts)}) have different "
                                 "act-order input orders (g_idx), so they cannot share one input permutation")
            self.in_perm = perm
        super().load_part(i, {k: t.to(KERNEL_DTYPE) if k == "scales_and_zeros" else t for k, t in tensors.items()})

    def parts_state(self) -> list[dict[str, torch.Tensor]]:
        if self.parts is None:
            return super().parts_state()
        state = self.state_dict()
        perm = state.pop("in_perm", None)  # every part's input order: not split by rows
        out = []
        for i in range(len(self.parts)):  # each as an Int4Linear of the part's own shape stores it: 16-row blocks
            start, n = self.part_rows(i)
            rows = {k: t.narrow(self.ROW_DIMS.get(k, 0), start, n) for k, t in state.items()}
            out.append({k: t if k == "bias" else
                        F.pad(t, [0, 0] * (t.dim() - 1 - self.ROW_DIMS.get(k, 0)) + [0, -n % N_MULTIPLE]).contiguous()
                        for k, t in rows.items()} | ({} if perm is None else {"in_perm": perm.clone()}))
        return out

    def pack_for_kernel(self, kernel: str | None = None) -> None:
        """Convert the plain `weight` bytes to the layout of kernel (default: this device's, int4_kernel), if any."""
        if self.kernel is not None or self.weight.device.type == "meta":
            return
        kernel = kernel or int4_kernel(self.weight.device)
        if kernel is not None:
            self.weight = to_layout(self.weight, kernel)
        self.kernel = kernel

    def codes(self) -> torch.Tensor:
        """The (N, K) codes, padding included, read back from whichever layout `weight` is in."""
        return layout_codes(self.weight, self.kernel, (self.out_padded, self.in_padded), self.group_size)

    def dequantize(self) -> torch.Tensor:
        """The (N, K) float32 weight this module multiplies by: the reference path."""
        w = dequantize_int4(self.codes(), self.scales_and_zeros)[:self.out_features, :self.in_features]
        return w if self.in_perm is None else unpermute_columns(w, self.in_perm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        if self.kernel is None:
            y = F.linear(x2, self.dequantize().to(x.dtype))  # (M, N)
        else:
            x2 = x2 if self.in_perm is None else x2.index_select(1, self.in_perm)  # (M, K) in the codes' order
            y = int4_mm(self.kernel, pad_columns(x2, self.in_padded), self.weight, self.group_size,
                        self.scales_and_zeros)  # (M, N padded)
            if self.out_padded != self.out_features:
                y = y[:, :self.out_features]  # (M, N)
        y = y if self.bias is None else y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)  # (..., N)

    def repack(self, kernel: str | None) -> None:
        """The same codes in another kernel's layout (None: the plain one)."""
        self.weight, self.kernel = pack_int4(self.codes()), None
        if kernel is not None:
            self.pack_for_kernel(kernel)

    # The state dict holds the plain layout; loading one packs it for this device's kernel.
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight if self.kernel is None else pack_int4(self.codes())
        destination[prefix + "scales_and_zeros"] = self.scales_and_zeros
        if self.in_perm is not None:
            destination[prefix + "in_perm"] = self.in_perm
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if self.kernel is not None:  # back to a plain buffer that the incoming plain bytes can be copied into
            self.repack(None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.scales_and_zeros = self.scales_and_zeros.to(KERNEL_DTYPE)  # a loader may have cast it (exactly)
        self.pack_for_kernel()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, kernel={self.kernel}")


class Int8GroupLinear(nn.Module):
    """y = x @ W^T with W = codes * scale: int8 codes and one scale per group of 32 inputs, a GGUF Q8_0 tensor as the
    file holds it. PyTorch has no group-wise int8 kernel, so the int4 kernel runs it as two 4-bit halves: with
    hi = q >> 4 in [-8, 7] and lo = q & 15 in [0, 15], q = 16 hi + lo and w = 16d·hi + d·lo. In the int4 scheme
    w = (code - 8)·scale + zero that is code hi + 8 with scale 16d and zero 0, and code lo with scale d and zero 8d:
    exact but for d's rounding to bf16 (16d and 8d are then exact too). The halves are one Int4Linear of 2K inputs,
    [hi | lo], multiplied by [x | x]: 1.25 bytes a weight (the codes, and a bf16 scale and zero per 32 of each half)
    against 2 for the dequantized bf16 matrix. Used for a GGUF's Q8_0 head (load.py), the largest matrix of a small
    model (dev/LOG.md).
    Where torch dispatches its AVX2 kernels, the load also keeps the codes as gemv.py's bytes words, the same weight
    (scales bf16-rounded as the halves'), which compiled steps run (compiled_head): Inductor's one-row kernel over
    them is 2.3x faster there than the int4 kernel over the halves, and takes float32 activations. Each row runs
    alone, so a row's bits are a one-row step's whatever rows come with it."""

    def __init__(self, in_features: int, out_features: int, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.halves = Int4Linear(2 * in_features, out_features, 32, device)
        self.register_buffer("words", None, persistent=False)  # (N, K/32, 8) float32 bits (gemv.pack_bytes), or None
        self.register_buffer("word_scales", None, persistent=False)  # (N, K/32) float32
        self.compiled = False  # run the words (compiled_head): only where a load made them

    def load_codes(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """codes (N, K) int8, scales (N, K/32) float: w = codes * scale for each group of 32. Converted ROW_BLOCK
        rows at a time, straight to the plain int4 buffers: a large head's temporaries stay small."""
        weight, scales_and_zeros, words = [], [], []
        for c, s in zip(codes.split(ROW_BLOCK), scales.float().split(ROW_BLOCK)):
            u = c.view(torch.uint8)  # the same bits: q mod 256
            # hi = floor(q / 16) is the high nibble h read as signed, so hi + 8 = h ^ 8; lo is the low nibble
            weight.append(pack_int4(torch.cat([(u >> 4) ^ 8, u & 15], dim=1)))  # (n, 2K) codes -> (n, K) bytes
            scale, zero = torch.cat([16 * s, s], dim=1), torch.cat([torch.zeros_like(s), 8 * s], dim=1)  # (n, 2K/32)
            scales_and_zeros.append(torch.stack([scale, zero], dim=-1).transpose(0, 1).to(KERNEL_DTYPE))
            if avx2(codes.device):
                words.append(gemv.pack_bytes(c))  # (n, K/32, 8)
        weight, scales_and_zeros = torch.cat(weight), torch.cat(scales_and_zeros, dim=1)
        if words:
            self.words = torch.cat(words)
            self.word_scales = scales.to(KERNEL_DTYPE).float()  # the halves' scales: one weight, either form
        pad = self.halves.out_padded - codes.shape[0]
        if pad:  # rows of code 8 with scale and zero 0: weight 0 (F.pad copies even when it adds nothing)
            weight = F.pad(weight, (0, 0, 0, pad), value=0x88)
            scales_and_zeros = F.pad(scales_and_zeros, (0, 0, 0, pad))
        self.halves.load_state_dict({"weight": weight, "scales_and_zeros": scales_and_zeros}, assign=True)

    def dequantize(self) -> torch.Tensor:
        """The (N, K) float32 weight this module multiplies by: codes * bf16(scale), exactly."""
        w = self.halves.dequantize()  # (N, 2K): the two halves
        return w[:, :self.in_features] + w[:, self.in_features:]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.compiled:
            return self.halves(torch.cat([x, x], dim=-1))  # (..., N)
        rows = x.reshape(-1, self.in_features)  # (M, K)
        y = gemv.gemv_rows(rows.float(), self.words, self.word_scales)  # (M, N)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size=32, "
                f"words={self.words is not None}")


def unpermute_columns(w: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """w (N, K) whose column i is input perm[i] -> the (N, K) weight in input order."""
    out = torch.empty_like(w)
    out[:, perm] = w
    return out


def float_bias(n: int, dtype: torch.dtype, device) -> nn.Parameter:
    """A quantized linear's bias (Qwen2's q/k/v): kept in model precision, added after the product."""
    return nn.Parameter(torch.zeros(n, dtype=dtype, device=device), requires_grad=False)


def make_quantized_linear(kind: str, group: int | None, linear: nn.Linear, dtype: torch.dtype,
                          act_order: bool = False) -> nn.Module:
    """An empty Int8Linear / Int4Linear shaped like `linear` (its bias too, an input order with act_order), on its
    device (meta included)."""
    device, parts, bias = linear.weight.device, getattr(linear, "parts", None), linear.bias is not None
    if kind == "int8":
        return Int8Linear(linear.in_features, linear.out_features, dtype, device, parts, bias)
    return Int4Linear(linear.in_features, linear.out_features, group, device, parts, bias, dtype, act_order)


def swap_linears(model: nn.Module, mode: str, quantize_head: bool = False,
                 act_order: bool = False) -> dict[str, nn.Module]:
    """Replace nn.Linear modules (in the blocks; the LM head too with quantize_head) by empty quantized
    ones; returns {name: new module}. The weights are filled by the caller (quantize_model, load.py)."""
    kind, group = parse_mode(mode)
    dtype = model.norm.weight.dtype  # the model dtype: a float weight that is never quantized
    swapped = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and (name != "lm_head" or quantize_head):
            swapped[name] = make_quantized_linear(kind, group, module, dtype, act_order)
            model.set_submodule(name, swapped[name])
    return swapped


def avx2(device: torch.device) -> bool:
    """A CPU where torch dispatches its AVX2 kernels (read from torch, not CPUID: ATEN_CPU_CAPABILITY=avx2 runs an
    AVX-512 machine as an AVX2 one)."""
    return device.type == "cpu" and torch.backends.cpu.get_cpu_capability() == "AVX2"


def compiled_head(model: nn.Module, compiled: bool) -> None:
    """What a step runs a GGUF's Q8_0 head (Int8GroupLinear) as: compiled, its words where the load made them
    (AVX2), one Inductor kernel of their own (gemv.gemv_rows, an op of its own inside a `full` step's graph); else
    the int4 halves. Step.set_up calls it, compiled for `blocks` and `full`. Not for an eager step (also after a
    compile failed): a kernel compiled once per shape does not repay a short answer."""
    if isinstance(model.lm_head, Int8GroupLinear):
        model.lm_head.compiled = compiled and model.lm_head.words is not None


def head_is_quantized(model: nn.Module) -> bool:
    return not isinstance(model.lm_head, nn.Linear)


@torch.no_grad()
def quantize_model(model: nn.Module, mode: str, quantize_head: bool = False) -> nn.Module:
    """Swap the model's nn.Linear modules for Int8Linear / Int4Linear in place, quantizing their weights.
    With tied embeddings and quantize_head, the embedding becomes the dequantized head: one matrix, as tied."""
    if quantization_of(model) is not None:
        raise ValueError("the model is quantized already; quantize from its float weights (load with quantize='none')")
    floats = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    for name, module in swap_linears(model, mode, quantize_head).items():
        for i in range(len(module.parts or [None])):  # a fused linear part by part, exactly as loading fills it
            start, n = module.part_rows(i)
            module.load_part(i, module.quantize_weight(floats[name].weight[start:start + n]))
            if module.bias is not None:
                module.load_part(i, {"bias": floats[name].bias[start:start + n]})
        module.pack_for_kernel()
    if quantize_head and model.args.tie_embeddings:
        dtype = model.embed_tokens.weight.dtype
        model.embed_tokens.weight = nn.Parameter(model.lm_head.dequantize().to(dtype), requires_grad=False)
    return model


def dequantize_state(module: nn.Module, state: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """The (N, K) float weight that `module`'s plain buffers in state[prefix + ...] stand for."""
    if isinstance(module, Int8Linear):
        w = dequantize_int8(state[prefix + "weight"], state[prefix + "scales"])
    else:
        w = dequantize_int4(unpack_int4(state[prefix + "weight"]), state[prefix + "scales_and_zeros"])
    w = w[:module.out_features, :module.in_features]
    return w if prefix + "in_perm" not in state else unpermute_columns(w, state[prefix + "in_perm"])


def quantization_of(model: nn.Module) -> dict[str, str] | None:
    """{'quantization': 'int8' | 'int4', 'group_size': ..., 'quantize_head': 'true' | 'false'} (and 'act_order':
    'true' for act-order int4) as stored in a checkpoint's safetensors metadata, read off the model's modules; None
    for a float model."""
    block = model.layers[0].self_attn.o_proj  # every model has one (a Mixtral block has no dense MLP)
    if isinstance(block, nn.Linear):
        return None
    group = str(block.group_size) if isinstance(block, Int4Linear) else ""
    meta = {"quantization": "int8" if isinstance(block, Int8Linear) else "int4", "group_size": group,
            "quantize_head": "true" if head_is_quantized(model) else "false"}
    return meta if getattr(block, "in_perm", None) is None else {**meta, "act_order": "true"}


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights the model holds: parameters (a tied one once) and the quantized modules' buffers."""
    quantized = [b for m in model.modules() if isinstance(m, (Int8Linear, Int4Linear)) for b in m.buffers()]
    return sum(t.nbytes for t in [*model.parameters(), *quantized])


def describe(model: nn.Module) -> str:
    """'int4:32', 'int8 (+head)', 'int4:32 (+head int8:32)' or 'float': the weights a decode step reads, for
    summary lines. Blocks that mix them (a Q4_K_M GGUF, its Q6_K linears dequantized) count each linear:
    'int4:32 x6 + float x2'."""
    q = quantization_of(model)
    kinds: dict[str, int] = {}  # each block linear's kind -> how many
    for name, m in model.named_modules():
        if name.startswith("layers.") and isinstance(m, (nn.Linear, Int8Linear, Int4Linear, MXFP4Linear)):
            kind = f"int4:{m.group_size}" if isinstance(m, Int4Linear) else "int8" if isinstance(m, Int8Linear) \
                else "mxfp4" if isinstance(m, MXFP4Linear) else "float"  # gpt-oss's experts as stored
            kinds[kind] = kinds.get(kind, 0) + 1
    blocks = " + ".join(f"{k} x{n}" for k, n in sorted(kinds.items(), key=lambda kn: -kn[1])) if len(kinds) > 1 \
        else next(iter(kinds), "float")
    if isinstance(model.lm_head, Int8GroupLinear):  # a GGUF's Q8_0 head, as the file has it (load.py)
        return blocks + " (+head int8:32)"
    return blocks + (" (+head)" if q is not None and q["quantize_head"] == "true" else "")
