"""The rotation frequencies of RoPE as each checkpoint family scales them (linear, llama3, longrope, yarn) and the
factor some of them multiply cos and sin by: model.Transformer builds its cos/sin tables from these."""
import math

import torch

from config import ModelArgs


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Per-pair rotation frequencies (R/2,) for the R = rope_dim rotated dims, with the checkpoint's rope scaling."""
    d = args.rope_dim
    exponents = torch.arange(0, d, 2, dtype=torch.int64).float() / d  # (R/2,)
    scaling = args.rope_scaling or {}
    if scaling.get("rope_type") == "longrope":
        # Phi-3: per-frequency divisors, the long ones for a context past the original one. The choice is made once
        # for the model's context (llama.cpp's rule), so every cached key keeps its rotation; transformers picks per
        # forward, by its last position, so it uses the short ones on shorter sequences of a long-context model.
        long = args.max_seq_len > scaling["original_max_position_embeddings"]
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * args.rope_theta ** exponents)
    inv_freq = 1.0 / (args.rope_theta ** exponents)
    if scaling.get("rope_type") == "yarn":
        return yarn_inv_freq(inv_freq, args.rope_theta, d, scaling)
    if scaling.get("rope_type") == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif scaling.get("rope_type") == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between.
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    if args.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(args.rope_freq_factors, dtype=torch.float32)
    return inv_freq


def yarn_inv_freq(inv_freq: torch.Tensor, theta: float, d: int, scaling: dict) -> torch.Tensor:
    """YaRN (DeepSeek, Qwen, gpt-oss): frequencies that turn fewer than beta_slow times over the original context are
    divided by `factor`, those turning more than beta_fast times kept, a linear ramp between (transformers' rule)."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def dim_of(turns: float) -> float:  # the rotated dim whose frequency turns `turns` times over the original context
        return d * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)  # (R/2,)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context extended `factor` times: 0.1 mscale ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(args: ModelArgs) -> float:
    """What longrope and yarn multiply cos and sin by (transformers' attention_scaling), from the checkpoint's context
    extension `factor` (config.py: max_position_embeddings / original); 1 for every other rope type."""
    scaling = args.rope_scaling or {}
    if scaling.get("rope_type") == "yarn":
        factor, mscale, all_dims = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
        default = yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dims) if mscale and all_dims else \
            yarn_mscale(factor)
        return scaling.get("attention_factor") or default
    if scaling.get("rope_type") != "longrope":
        return 1.0
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or args.max_seq_len / original
    default = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return scaling.get("attention_factor") or default
