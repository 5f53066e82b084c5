"""Tiny random Hugging Face models (no download) shared by the tests, a plain reference attention, and a
peak-memory probe for test subprocesses."""
import math

import torch

from model import ModelArgs, Transformer

SEQ_LEN = 80  # longer than the Mistral sliding window and than llama3's original context below

CONFIGS = {
    # GQA 4:2 with an explicit head_dim (H * D != hidden size)
    "llama-gqa": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24)),
    "llama3-rope": ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "llama-linear-rope": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "mistral-window": ("mistral", dict(sliding_window=16)),
}


def make_hf(name: str, seed: int = 0):
    """A random fp32 transformers model for CONFIGS[name]."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    family, extra = CONFIGS[name]
    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if family == "llama" else (MistralConfig, MistralForCausalLM)
    kw = dict(vocab_size=160, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
              initializer_range=0.1)  # larger than the default so logits are O(1) and differences show
    kw.update(extra)
    torch.manual_seed(seed)
    return model_cls(config_cls(**kw)).eval()


def hf_to_ours(hf) -> Transformer:
    """Copy a transformers model's weights into ours (strict)."""
    cfg = hf.config.to_dict()
    cfg["architectures"] = [type(hf).__name__]
    model = Transformer(ModelArgs.from_hf_config(cfg)).eval()
    state = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    model.load_state_dict(state, strict=True)
    return model


def reference_attention(q, k, v, mask):
    """Plain softmax(q k^T / sqrt(D)) v with GQA by repetition: the definition SDPA is checked against."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (B, H, S, D)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, S)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v  # (B, H, T, D)


# Source of peak_rss(), the process's peak RSS in bytes, for test subprocesses to exec. Not getrusage's
# ru_maxrss: Linux carries that across exec, so a child of the (large) pytest process starts at its peak.
PEAK_RSS = ("def peak_rss():\n"
            "    with open('/proc/self/status') as f:\n"
            "        return next(int(l.split()[1]) * 1024 for l in f if l.startswith('VmHWM:'))")
