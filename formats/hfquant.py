"""GPTQ and AWQ checkpoints (config.json `quantization_config.quant_method` "gptq" / "awq"): their int32-packed
4-bit codes read as Int4Linear takes them, without re-rounding. Which tensor goes where is load.py's.

Shape legend: N out_features, K in_features, G the checkpoint's group size, G' Int4Linear's (one of
quantize.GROUP_SIZES dividing G: a group's scale and zero repeat over its G/G' sub-groups, exactly).
Both formats dequantize as w = (q - z) * s with q, z in [0, 15] and a float16 scale s per group; in Int4Linear's
w = (q - 8) * scale + zero that is scale s, zero (8 - z) * s (both rounded to bf16: the only rounding).
- GPTQ (AutoGPTQ, gptqmodel, transformers): qweight (K/8, N) packs 8 inputs of a column, input 8i + j in bits
  4j..4j+3; qzeros (K/G, N/8) packs 8 columns the same way; scales (K/G, N); g_idx (K,) the group of each input.
  The "gptq" (v1) checkpoint format stores z - 1, "gptq_v2" z itself. With act-order (desc_act) the groups are
  sets of inputs taken in order of decreasing Hessian diagonal: sorted by g_idx they are contiguous again, and
  Int4Linear's in_perm gathers the inputs in that order.
- AWQ (AutoAWQ's "gemm" version): qweight (K, N/8) packs 8 columns of an input, column 8i + ORDER[j] in bits 4j..;
  qzeros (K/G, N/8) the same; scales (K/G, N); no g_idx, no offset on z.
"""
from dataclasses import dataclass

import torch

from quantize import GROUP_SIZES

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column held in nibble j of AutoAWQ's gemm packing
PACKED = ("qweight", "qzeros", "scales", "g_idx")  # a packed linear's tensors (AWQ has no g_idx)


@dataclass(frozen=True)
class PackedFormat:
    method: str  # "gptq" or "awq"
    group: int  # the checkpoint's group size, K itself for GPTQ's per-channel -1 (resolved per linear)
    zero_offset: int  # added to a stored zero: 1 for GPTQ v1 checkpoints
    act_order: bool  # GPTQ desc_act: g_idx is not k // G

    def int4_group(self, in_features: list[int]) -> int:
        """G' for the whole model: the largest Int4Linear group size dividing the checkpoint's group (per-channel:
        every linear's in_features), a refusal if none does."""
        fits = [g for g in GROUP_SIZES if all((k if self.group == -1 else self.group) % g == 0 for k in in_features)]
        if not fits:
            raise ValueError(f"{self.method} group size {self.group} is not a multiple of any int4 kernel group size "
                             f"{GROUP_SIZES}, so its codes cannot load without re-rounding")
        return max(fits)


def packed_format(config: dict, source: str) -> PackedFormat | None:
    """The format of a config.json's quantization_config, None if it has none; a ValueError naming what cannot be
    loaded without re-rounding (other bit widths, AWQ's gemv layout, ...)."""
    q = config.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method == "mxfp4":  # gpt-oss's experts: decoded to floats as they are read (hffolder.gpt_oss_names)
        return None
    if method not in ("gptq", "awq"):
        raise ValueError(f"{source}: quantization_config.quant_method {method!r} is not supported; allowed: gptq, "
                         "awq (4-bit), or a folder export.py wrote")
    bits = q.get("bits", q.get("w_bit"))
    group = q.get("group_size", q.get("q_group_size"))
    if bits != 4:
        raise ValueError(f"{source}: {method} with {bits}-bit codes; only 4-bit codes load (Int4Linear)")
    if isinstance(group, bool) or not isinstance(group, int) or not (group > 0 or group == -1 and method == "gptq"):
        raise ValueError(f"{source}: {method} group_size {group!r} must be a positive integer (GPTQ: or -1)")
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm" or q.get("zero_point", True) is not True:
            raise ValueError(f"{source}: AWQ version {version!r} zero_point {q.get('zero_point')!r}; only the gemm "
                             "layout with zero points loads")
        return PackedFormat("awq", group, 0, False)
    fmt = q.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"{source}: GPTQ checkpoint_format {fmt!r}; allowed: gptq, gptq_v2")
    return PackedFormat("gptq", group, 1 if fmt == "gptq" else 0, bool(q.get("desc_act", False)))


def float_shapes(found: dict[str, tuple], fmt: PackedFormat) -> dict[str, tuple]:
    """The checkpoint's tensors as a float checkpoint names them: X.qweight (+ qzeros, scales, g_idx) -> X.weight
    (N, K); every other tensor (norms, the embedding, a float head, biases) as it is."""
    shapes = {}
    for name, shape in found.items():
        prefix, _, key = name.rpartition(".")
        if key == "qweight":
            shapes[prefix + ".weight"] = (shape[1], shape[0] * 8) if fmt.method == "gptq" else (shape[1] * 8, shape[0])
        elif key not in PACKED:
            shapes[name] = shape
    return shapes


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 (R, C) with 8 nibbles each, the lowest first -> (R, 8C) codes: element (r, 8c + j) is nibble j."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)  # (8,)
    return ((packed[:, :, None] >> shifts) & 15).reshape(packed.shape[0], -1).to(torch.uint8)  # (R, C, 8) -> (R, 8C)


def unpack_awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's (R, N/8) int32 -> (R, N) codes in column order (undoing AWQ_ORDER)."""
    nibbles = unpack_rows(packed).view(packed.shape[0], -1, 8)  # (R, N/8, 8): nibble j is column 8i + ORDER[j]
    out = torch.empty_like(nibbles)
    out[:, :, list(AWQ_ORDER)] = nibbles
    return out.view(packed.shape[0], -1)


def int4_blocks(tensors: dict[str, torch.Tensor], fmt: PackedFormat, name: str, sub: int):
    """One packed linear's tensors (qweight, qzeros, scales[, g_idx]) -> (codes (N, K), scales (N, K/G'), zeros
    (N, K/G'), perm (K,) or None) for Int4Linear.buffers_for_codes with G' = sub: code column i is input perm[i]."""
    if fmt.method == "gptq":
        codes = unpack_rows(tensors["qweight"].t().contiguous())  # (N, K): the checkpoint's (K/8, N), transposed
        zeros = unpack_rows(tensors["qzeros"]).int() + fmt.zero_offset  # (K/G, N)
    else:
        codes = unpack_awq_columns(tensors["qweight"]).t()  # (N, K)
        zeros = unpack_awq_columns(tensors["qzeros"]).int()  # (K/G, N)
    N, K = codes.shape
    scales = tensors["scales"].float()  # (K/G, N)
    groups = scales.shape[0]
    if zeros.shape != (groups, N) or K % groups or scales.shape[1] != N:
        raise ValueError(f"{name}: qzeros {tuple(zeros.shape)} and scales {tuple(scales.shape)} do not fit qweight's "
                         f"{N} x {K} weight")
    group = K // groups
    perm = torch.arange(K) if fmt.act_order else None
    g_idx = tensors.get("g_idx")
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(K) // group):
        if not fmt.act_order:
            raise ValueError(f"{name}: g_idx reorders the inputs but quantization_config has no desc_act: true")
        perm = torch.sort(g_idx.long(), stable=True).indices  # (K,): inputs grouped, in their order within a group
        if not torch.equal(g_idx.long()[perm], torch.arange(K) // group):
            raise ValueError(f"{name}: g_idx does not give each of the {groups} groups {group} inputs")
        codes = codes[:, perm]
    sub_scales = scales.t().repeat_interleave(group // sub, dim=1)  # (N, K/G')
    sub_zeros = (8 - zeros.t().float()).repeat_interleave(group // sub, dim=1) * sub_scales
    return codes, sub_scales, sub_zeros, perm
