"""The model's hyper-parameters (ModelArgs) and their mappings: from a Hugging Face config.json, from GGUF metadata,
and back to a config.json (export.py writes one for a GGUF source). Every value is checked under the file's own name,
so a bad checkpoint fails here, before any weight is read.
"""
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM",
                 "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM")
DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# those whose sliding_window applies
WINDOWED = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", "GptOssForCausalLM", *GEMMA)
# llama.cpp's general.architecture
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen3moe", "deepseek2", "gpt-oss")
GPT_OSS_GGUF = dict(qkv_bias=True, o_bias=True, attn_sinks=True, moe_bias=True, swiglu_limit=7.0)  # its fixed fields
# Each rope type and the rope_scaling keys its frequencies need (rope_inv_freq).
ROPE_PARAMS = {"default": (), "linear": ("factor",),
               "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
               "longrope": ("original_max_position_embeddings",),  # and its short_factor, long_factor lists
               "yarn": ("factor", "original_max_position_embeddings")}


def positive_int(value, what: str) -> int:
    """value if it is an integer >= 1 (JSON's true is not one), else a ValueError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


def positive_number(value, what: str) -> float:
    """value if it is a finite number > 0, else a ValueError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{what} must be a positive number, got {value!r}")
    return value


def gemma_args(cfg: dict, n_layers: int, gemma3: bool) -> dict:
    """The ModelArgs fields a Gemma 2 or 3 config.json sets. layer_types unset: every `sliding_window_pattern`-th
    layer full, the others windowed (transformers' default: 2 for Gemma 2, 6 for Gemma 3). Gemma 3 adds q/k norms and
    drops the soft-caps unless its config sets them."""
    pattern = cfg.get("sliding_window_pattern", 6) if gemma3 else 2
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % positive_int(pattern, "config.json sliding_window_pattern") == 0
        else "sliding_attention" for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"config.json layer_types must list sliding_attention or full_attention for each of the "
                         f"{n_layers} layers, got {types!r}")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("unsupported config: use_bidirectional_attention must be false (a causal language model)")

    def number(key: str, default: float | None) -> float | None:
        value = cfg.get(key, default)
        return None if value is None else positive_number(value, f"config.json {key}")

    return dict(norm_plus_one=True, embed_scale=True, sandwich_norms=True,
                sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
                attn_scale=number("query_pre_attn_scalar", 256) ** -0.5,
                attn_softcap=number("attn_logit_softcapping", None if gemma3 else 50.0),
                final_softcap=number("final_logit_softcapping", None if gemma3 else 30.0))


def qwen3_moe_args(cfg: dict, n_layers: int) -> dict:
    """Qwen3-MoE's expert width and routing, and its dense layers as transformers picks them: those listed in
    mlp_only_layers, and those whose number + 1 is not a multiple of decoder_sparse_step."""
    width, step = cfg.get("moe_intermediate_size"), cfg.get("decoder_sparse_step") or 1
    only, renormalize = cfg.get("mlp_only_layers") or [], cfg.get("norm_topk_prob", False)
    if not isinstance(only, list) or not all(isinstance(i, int) and 0 <= i < n_layers for i in only):
        raise ValueError(f"config.json mlp_only_layers must list layer numbers below {n_layers}, got {only!r}")
    if not isinstance(renormalize, bool):
        raise ValueError(f"config.json norm_topk_prob must be true or false, got {renormalize!r}")
    step = positive_int(step, "config.json decoder_sparse_step")
    dense = tuple(i for i in range(n_layers) if i in only or (i + 1) % step)
    return dict(moe_hidden_dim=positive_int(width, "config.json moe_intermediate_size"), moe_renormalize=renormalize,
                dense_layers=dense)


def family_args(cfg: dict, arch: str, size: Callable) -> dict:
    """The ModelArgs fields a mixture of experts, DeepSeek or gpt-oss config.json sets beyond the Llama keys
    from_hf_config reads (those it names, such as head_dim, it takes from here first)."""
    n_layers = size("num_hidden_layers")
    if arch == "MixtralForCausalLM":
        return dict(n_experts=size("num_local_experts", 8), n_experts_per_token=size("num_experts_per_tok", 2))
    if arch == "Qwen3MoeForCausalLM":  # the hub's configs say num_experts, transformers 5 writes num_local_experts
        return dict(qwen3_moe_args(cfg, n_layers), n_experts=size("num_local_experts", cfg.get("num_experts")),
                    n_experts_per_token=size("num_experts_per_tok", 2))
    if arch == "GptOssForCausalLM":  # its experts are MLPs of intermediate_size, routed as Mixtral's
        return dict(gpt_oss_args(cfg, n_layers), n_experts=size("num_local_experts"),
                    n_experts_per_token=size("num_experts_per_tok"))
    return deepseek_args(cfg, arch, n_layers) if arch in DEEPSEEK else {}


def deepseek_args(cfg: dict, arch: str, n_layers: int) -> dict:
    """The ModelArgs fields of a DeepSeek-V2/V3 config.json: multi-head latent attention (head_dim is a query's and
    key's nope + rope dims) and the MoE: experts after the first first_k_dense_replace layers, shared experts, V2's
    softmax router (greedy, or group_limited_greedy) or V3's sigmoid one (noaux_tc: grouped, corrected, renormalized
    with norm_topk_prob), the weights scaled by routed_scaling_factor."""
    def size(key: str, default: int | None = None) -> int | None:
        value = cfg.get(key, default)
        return None if value is None else positive_int(value, f"config.json {key}")

    v3, experts = arch == "DeepseekV3ForCausalLM", size("n_routed_experts")
    method = "noaux_tc" if v3 else cfg.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ValueError(f"unsupported config.json topk_method {method!r}; supported: 'greedy', 'group_limited_greedy'")
    grouped = method != "greedy"
    rope, nope = size("qk_rope_head_dim", 64), cfg.get("qk_nope_head_dim", 128)
    if isinstance(nope, bool) or not isinstance(nope, int) or nope < 0:
        raise ValueError(f"config.json qk_nope_head_dim must be a non-negative integer, got {nope!r}")
    return dict(
        n_kv_heads=size("num_attention_heads"),  # MLA has no kv heads: its one latent serves every head
        kv_lora_rank=size("kv_lora_rank", 512), q_lora_rank=size("q_lora_rank"), head_dim=nope + rope, rope_dim=rope,
        v_head_dim=size("v_head_dim", 128), rope_interleaved=cfg.get("rope_interleave", True) is not False,
        n_experts=experts, n_experts_per_token=size("num_experts_per_tok", 1) if experts else 2,
        moe_hidden_dim=size("moe_intermediate_size", 1407) if experts else None,
        n_shared_experts=cfg.get("n_shared_experts") or 0,
        dense_layers=tuple(range(min(cfg.get("first_k_dense_replace") or 0, n_layers))) if experts else (),
        moe_renormalize=v3 and cfg.get("norm_topk_prob", True) is True, router_scoring="sigmoid" if v3 else "softmax",
        n_group=size("n_group", 1) if grouped else 1, topk_group=size("topk_group", 1) if grouped else 1,
        routed_scaling=positive_number(cfg.get("routed_scaling_factor", 1.0), "config.json routed_scaling_factor"))


def gguf_family_args(meta: dict, arch: str, size: Callable, number: Callable, windowed: bool) -> dict:
    """The ModelArgs fields of a qwen3moe, deepseek2 or gpt-oss file beyond the Llama keys from_gguf reads (those it
    names, such as head_dim, it takes from here first), as llama.cpp reads them."""
    if arch == "qwen3moe":  # every layer sparse, experts of expert_feed_forward_length, the top-k renormalized
        return dict(moe_hidden_dim=size("expert_feed_forward_length"))
    if arch == "gpt-oss":  # every other layer windowed, from the first; the SwiGLU clamped at 7
        return dict(GPT_OSS_GGUF, sliding_layers=tuple(range(0, size("block_count"), 2)) if windowed else None)
    return deepseek_gguf_args(meta, size, number, size("attention.head_count")) if arch == "deepseek2" else {}


def deepseek_gguf_args(meta: dict, size: Callable, number: Callable, n_heads: int) -> dict:
    """A deepseek2 file's ModelArgs fields as llama.cpp reads them: the MLA dims (key_length_mla = nope + rope,
    value_length_mla), its experts and router (softmax unless expert_gating_func is 2, sigmoid), rotary pairs
    interleaved (llama.cpp's NORM rope, the weights as transformers holds them)."""
    experts = meta.get("deepseek2.expert_count", 0) != 0
    gating = meta.get("deepseek2.expert_gating_func", 1)
    if gating not in (1, 2):
        raise ValueError(f"unsupported GGUF deepseek2.expert_gating_func {gating!r}; supported: 1 (softmax), "
                         "2 (sigmoid)")
    return dict(
        n_kv_heads=n_heads, head_dim=size("attention.key_length_mla"), rope_dim=size("rope.dimension_count"),
        v_head_dim=size("attention.value_length_mla"), kv_lora_rank=size("attention.kv_lora_rank"),
        q_lora_rank=size("attention.q_lora_rank") if "deepseek2.attention.q_lora_rank" in meta else None,
        rope_interleaved=True, moe_hidden_dim=size("expert_feed_forward_length") if experts else None,
        n_shared_experts=meta.get("deepseek2.expert_shared_count", 0) if experts else 0,
        dense_layers=tuple(range(meta.get("deepseek2.leading_dense_block_count", 0))) if experts else (),
        routed_scaling=number("expert_weights_scale", 1.0), moe_renormalize=meta.get("deepseek2.expert_weights_norm",
                                                                                     False) is True,
        router_scoring="sigmoid" if gating == 2 else "softmax", n_group=size("expert_group_count", 1),
        topk_group=size("expert_group_used_count", 1))


def gpt_oss_args(cfg: dict, n_layers: int) -> dict:
    """gpt-oss: biases on q/k/v/o, on the router and on every expert; learned attention sinks; the clamped SwiGLU
    (swiglu_limit; its alpha 1.702 is the only one published); layer_types' sliding layers (every other one, from
    the first, unless listed)."""
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"config.json layer_types must list sliding_attention or full_attention for each of the "
                         f"{n_layers} layers, got {types!r}")
    if cfg.get("swiglu_alpha", 1.702) != 1.702:
        raise ValueError(f"unsupported config.json swiglu_alpha {cfg['swiglu_alpha']!r}; supported: 1.702")
    return dict(qkv_bias=True, o_bias=True, attn_sinks=True, moe_bias=True,
                swiglu_limit=positive_number(cfg.get("swiglu_limit", 7.0), "config.json swiglu_limit"),
                sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"))


def gemma3_rope(cfg: dict, rope: dict) -> tuple[dict, float]:
    """Gemma 3's two RoPEs: the full-attention layers' parameters (transformers 5's rope_parameters.full_attention,
    or the top-level rope_theta and rope_scaling) and the sliding layers' base (rope_parameters.sliding_attention's
    rope_theta, or rope_local_base_freq), which they use unscaled."""
    if "full_attention" in rope or "sliding_attention" in rope:
        full, local = dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
    else:
        full, local = dict(rope), {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    full.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"unsupported rope type {local['rope_type']!r} for Gemma 3's sliding layers; supported: "
                         "'default'")
    return full, positive_number(local.get("rope_theta", 10000.0), "config.json rope_local_base_freq")


def hf_rope(cfg: dict, arch: str, max_positions: int) -> tuple[float, dict | None, float, float | None]:
    """A config.json's RoPE: (theta, scaling or None, partial rotary factor, Gemma 3's local theta or None).
    transformers >= 5 writes `rope_parameters` (with rope_theta inside); older ones `rope_scaling` + `rope_theta`."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"config.json rope_scaling must be an object, got {rope!r}")
    rope, local_theta = gemma3_rope(cfg, rope) if arch == "Gemma3ForCausalLM" else (dict(rope), None)
    rope_theta = positive_number(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)), "config.json rope_theta")
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    rope_type = "longrope" if rope_type == "su" else rope_type  # Phi-3's first configs
    partial = positive_number(rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)),
                              "config.json partial_rotary_factor")
    if rope_type == "longrope" and cfg.get("original_max_position_embeddings") is not None:  # Phi-3 keeps it here
        rope.setdefault("original_max_position_embeddings", cfg["original_max_position_embeddings"])
    if rope_type == "longrope" and "original_max_position_embeddings" in rope:
        # the checkpoint's context extension, which sets the attention factor whatever context the model runs in
        original = positive_int(rope["original_max_position_embeddings"],
                                "config.json original_max_position_embeddings")
        rope.setdefault("factor", max_positions / original)
    return rope_theta, None if rope_type == "default" else {"rope_type": rope_type, **rope}, partial, local_theta


def gguf_rope_scaling(meta: dict, arch: str, size: Callable, number: Callable,
                      longrope: dict[str, list[float]] | None) -> dict | None:
    """A GGUF file's RoPE scaling (None, linear, or Phi-3's longrope as llama.cpp's converter writes it: the factors
    as tensors, the context they extend in the metadata), as ModelArgs.rope_scaling holds it."""
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type == "yarn" and arch == "deepseek2":
        # as llama.cpp reads deepseek2: cos and sin unscaled (mscale as mscale_all_dim, the published models'), the
        # softmax scale by mscale_all_dim, which the file keeps as yarn_log_multiplier = 0.1 x mscale_all_dim
        return {"rope_type": "yarn", "factor": number("rope.scaling.factor", None),
                "original_max_position_embeddings": size("rope.scaling.original_context_length"),
                "beta_fast": number("rope.scaling.yarn_beta_fast", 32.0),
                "beta_slow": number("rope.scaling.yarn_beta_slow", 1.0), "attention_factor": 1.0,
                "mscale_all_dim": meta.get(f"{arch}.rope.scaling.yarn_log_multiplier", 0.0) / 0.1}
    if scaling_type == "yarn" and arch == "gpt-oss":  # transformers' gpt-oss: its correction range untruncated
        return {"rope_type": "yarn", "factor": number("rope.scaling.factor", None), "truncate": False,
                "original_max_position_embeddings": size("rope.scaling.original_context_length"),
                "beta_fast": number("rope.scaling.yarn_beta_fast", 32.0),
                "beta_slow": number("rope.scaling.yarn_beta_slow", 1.0)}
    if scaling_type not in ("none", "linear"):
        raise ValueError(f"unsupported GGUF rope scaling {scaling_type!r}; supported: 'none', 'linear' (and 'yarn' "
                         "for deepseek2 and gpt-oss)")
    rope_scaling = None
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": number("rope.scaling.factor", None)}
    if longrope:
        original = size("rope.scaling.original_context_length")
        rope_scaling = {"rope_type": "longrope", **longrope, "original_max_position_embeddings": original,
                        "factor": size("context_length", 4096) / original}
        if f"{arch}.rope.scaling.attn_factor" in meta:
            rope_scaling["attention_factor"] = number("rope.scaling.attn_factor", None)
    return rope_scaling


def gemma_gguf_args(meta: dict, arch: str, n_layers: int, dim_per_head: int, head_dim: int | None) -> dict:
    """The ModelArgs fields of a gemma2 / gemma3 GGUF as llama.cpp reads it: its converter stored the norms as 1 + w
    (so they scale by the weight as stored); no query_pre_attn_scalar in the file: llama.cpp takes n_embd / n_head for
    the 46-layer Gemma 2 27B and the 62-layer Gemma 3 27B, the head dim for the others. gemma2: soft-caps (50, 30
    unless the file says) and every other layer windowed, from the first. gemma3: no attention soft-cap, a final
    one only if the file says; layers windowed by sliding_window_pattern (a flag per layer, or every n-th full,
    6 unless the file says), none without a window; the sliding layers' RoPE base rope.freq_base_swa (10000)."""
    def number(key: str, default: float | None) -> float | None:
        value = meta.get(f"{arch}.{key}", default)
        return None if value is None else positive_number(value, f"GGUF metadata {arch}.{key}")

    big = n_layers == (46 if arch == "gemma2" else 62)  # the 27B models
    fields = dict(mlp_act="gelu_pytorch_tanh", embed_scale=True, sandwich_norms=True,
                  attn_scale=(dim_per_head if big else head_dim or dim_per_head) ** -0.5)
    if arch == "gemma2":
        return dict(fields, sliding_layers=tuple(range(0, n_layers, 2)),
                    attn_softcap=number("attn_logit_softcapping", 50.0),
                    final_softcap=number("final_logit_softcapping", 30.0))
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        if len(pattern) != n_layers:
            raise ValueError(f"GGUF metadata {arch}.attention.sliding_window_pattern lists {len(pattern)} layers, "
                             f"expected {n_layers}")
        sliding = tuple(i for i, flag in enumerate(pattern) if flag)
    else:
        n = positive_int(pattern, f"GGUF metadata {arch}.attention.sliding_window_pattern")
        sliding = tuple(i for i in range(n_layers) if i % n < n - 1)
    windowed = bool(meta.get(f"{arch}.attention.sliding_window"))
    return dict(fields, final_softcap=number("final_logit_softcapping", None),
                sliding_layers=sliding if windowed else None,
                rope_local_theta=number("rope.freq_base_swa", 10000.0) if windowed else None)


@dataclass
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    hidden_dim: int  # width of the SwiGLU MLP (Mixtral: of each expert)
    n_kv_heads: int | None = None  # None: same as n_heads (no GQA)
    head_dim: int | None = None  # None: dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear" | "llama3", ...} as in HF config.json
    rope_freq_factors: tuple[float, ...] | None = None  # GGUF `rope_freqs`: inv_freq is divided by these
    max_seq_len: int = 4096  # the model's context length
    sliding_window: int | None = None  # Mistral: a query sees only the last `sliding_window` keys
    tie_embeddings: bool = False
    n_experts: int | None = None  # Mixtral: a sparse mixture of SwiGLU experts per layer; None: one dense MLP
    n_experts_per_token: int = 2  # Mixtral: experts each token is routed to (top-k)
    moe_hidden_dim: int | None = None  # Qwen3-MoE: each expert's width (moe_intermediate_size); None: hidden_dim
    moe_renormalize: bool = True  # the top-k routing weights rescaled to sum to 1 (Qwen3-MoE's norm_topk_prob)
    dense_layers: tuple[int, ...] = ()  # Qwen3-MoE, DeepSeek: layers with one dense MLP of hidden_dim
    # DeepSeek-V2/V3: multi-head latent attention (MLA) and its router
    kv_lora_rank: int | None = None  # MLA: keys and values come from a latent this wide, which is what is cached
    q_lora_rank: int | None = None  # MLA: queries through a low-rank bottleneck this wide; None: one q_proj
    v_head_dim: int | None = None  # MLA: a head's value width (head_dim: a query's and key's nope + rope dims)
    rope_interleaved: bool = False  # DeepSeek: rotated dims pair (2i, 2i + 1), as the model rotates them
    n_shared_experts: int = 0  # DeepSeek: experts every token runs through, one MLP of n x moe_hidden_dim
    router_scoring: str = "softmax"  # DeepSeek-V3: "sigmoid", experts chosen with a learned correction bias
    n_group: int = 1  # DeepSeek: experts in n_group groups; a token's experts come from its best topk_group groups
    topk_group: int = 1
    routed_scaling: float = 1.0  # DeepSeek: the routing weights multiplied by this
    # gpt-oss
    o_bias: bool = False  # o_proj has a bias
    attn_sinks: bool = False  # a learned logit per head joins each softmax (model.Sinks)
    moe_bias: bool = False  # the router and each expert's linears have biases
    swiglu_limit: float | None = None  # the experts' clamped SwiGLU: gate <= limit, |up| <= limit
    qkv_bias: bool = False  # Qwen2: q_proj, k_proj and v_proj have biases
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    fused_checkpoint: bool = False  # Phi-3: the checkpoint stores qkv_proj and gate_up_proj fused, as we run them
    rope_dim: int | None = None  # dims of each head RoPE rotates, the first ones (Phi-4-mini: 3/4); None: head_dim
    # Gemma 2
    mlp_act: str = "silu"  # the MLP's gate activation: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    norm_plus_one: bool = False  # RMSNorm weights stored as w - 1: the norm scales by (1 + w)
    embed_scale: bool = False  # embeddings multiplied by sqrt(dim)
    sandwich_norms: bool = False  # pre- and post-norms around attention and around the MLP
    sliding_layers: tuple[int, ...] | None = None  # the layers sliding_window applies to; None: all of them
    attn_scale: float | None = None  # the scores' scale (query_pre_attn_scalar ** -0.5); None: 1 / sqrt(head_dim)
    attn_softcap: float | None = None  # attention scores soft-capped: c * tanh(s / c)
    final_softcap: float | None = None  # logits soft-capped likewise
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base, unscaled; None: as the others

    def __post_init__(self):
        """The checks every source (config.json, GGUF metadata) needs: what would otherwise fail later, inside
        the forward or the RoPE tables. The loaders check each value's type first, under the file's own names."""
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads  # rounded down, as transformers does (the weights' shapes tell)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.n_heads} attention heads are not a multiple of {self.n_kv_heads} "
                             "key/value heads")
        if self.rope_dim is None:
            self.rope_dim = self.head_dim
        if self.head_dim % 2:
            raise ValueError(f"head dim {self.head_dim} is odd; rotary embeddings rotate pairs of dimensions")
        if self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim:
            raise ValueError(f"{self.rope_dim} rotary dims of head dim {self.head_dim}: rotary embeddings rotate "
                             "pairs of a head's dimensions")
        scaling = self.rope_scaling or {}
        rope_type = scaling.get("rope_type", "default")
        if not isinstance(rope_type, str) or rope_type not in ROPE_PARAMS:
            raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(ROPE_PARAMS)}")
        missing = [key for key in ROPE_PARAMS[rope_type] if key not in scaling]
        if missing:
            raise ValueError(f"rope type {rope_type!r} needs rope_scaling {', '.join(missing)}")
        for key in ROPE_PARAMS[rope_type]:
            positive_number(scaling[key], f"rope_scaling {key}")
        for key in ("short_factor", "long_factor") if rope_type == "longrope" else ():
            factors = scaling.get(key)
            if not isinstance(factors, (list, tuple)) or len(factors) != self.rope_dim // 2:
                raise ValueError(f"rope type 'longrope' needs rope_scaling {key}, a list of {self.rope_dim // 2} "
                                 f"numbers, got {factors!r}")
            for x in factors:
                positive_number(x, f"rope_scaling {key} entry")
        if rope_type == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
            raise ValueError(f"rope_scaling high_freq_factor {scaling['high_freq_factor']} must be greater than "
                             f"low_freq_factor {scaling['low_freq_factor']} (llama3 rope divides by their difference)")
        if self.n_experts is not None and (self.n_experts % self.n_group or not 1 <= self.topk_group <= self.n_group):
            raise ValueError(f"{self.n_experts} experts in {self.n_group} groups, the best {self.topk_group} of them: "
                             "n_group must divide the experts and topk_group be within 1..n_group")
        if any(not 0 <= i < self.n_layers for i in self.dense_layers):
            raise ValueError(f"dense layers {self.dense_layers} are not all within 0..{self.n_layers - 1}")
        if self.n_experts is not None and not 1 <= self.n_experts_per_token <= self.n_experts:
            raise ValueError(f"{self.n_experts_per_token} experts per token is not within 1..{self.n_experts} experts")

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArgs":
        """Fill from a Hugging Face config.json (one of ARCHITECTURES).
        A missing key or a value of the wrong type is a ValueError naming the key."""
        if not isinstance(cfg, dict):
            raise ValueError(f"config.json must hold a JSON object, not a {type(cfg).__name__}")
        archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
        if not isinstance(archs, list):
            raise ValueError(f"config.json architectures must be a list, got {archs!r}")
        if archs[0] not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {archs[0]!r}; supported: {', '.join(ARCHITECTURES)}")
        gemma = archs[0] in GEMMA
        act_key = "hidden_activation" if gemma else "hidden_act"  # Gemma's hidden_act is not the one it uses
        act = cfg.get(act_key) or ("gelu_pytorch_tanh" if gemma else "silu")
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported {act_key} {act!r}; supported: 'silu', 'gelu_pytorch_tanh'")
        if cfg.get("attention_bias") and archs[0] != "GptOssForCausalLM" or cfg.get("mlp_bias"):  # Qwen2's need no key
            raise ValueError("unsupported config: attention_bias/mlp_bias must be false")
        if cfg.get("use_sliding_window"):  # Qwen: a window on the layers past max_window_layers only
            raise ValueError("unsupported config: use_sliding_window must be false")
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                               "intermediate_size") if cfg.get(k) is None]
        if missing:
            raise ValueError(f"config.json has no {', '.join(missing)}")

        def size(key: str, default: int | None = None) -> int | None:
            value = cfg.get(key)
            value = default if value is None else value  # unset or null: the default (None: not used)
            return None if value is None else positive_int(value, f"config.json {key}")

        rope_theta, rope_scaling, partial, local_theta = hf_rope(cfg, archs[0], size("max_position_embeddings", 4096))
        head_dim = size("head_dim") or size("hidden_size") // size("num_attention_heads")
        tie = cfg.get("tie_word_embeddings", gemma)  # transformers' default: Gemma's configs leave it out, tied
        if not isinstance(tie, bool):
            raise ValueError(f"config.json tie_word_embeddings must be true or false, got {tie!r}")
        family = family_args(cfg, archs[0], size)
        return cls(
            vocab_size=size("vocab_size"),
            dim=size("hidden_size"),
            n_layers=size("num_hidden_layers"),
            n_heads=size("num_attention_heads"),
            hidden_dim=size("intermediate_size"),
            n_kv_heads=family.pop("n_kv_heads", size("num_key_value_heads")),
            head_dim=family.pop("head_dim", size("head_dim")),  # DeepSeek's config head_dim is its rope dims
            norm_eps=positive_number(cfg.get("rms_norm_eps", 1e-6), "config.json rms_norm_eps"),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_seq_len=size("max_position_embeddings", 4096),
            # Qwen's config.json sets sliding_window but uses it only with use_sliding_window
            sliding_window=size("sliding_window") if archs[0] in WINDOWED else None,
            tie_embeddings=tie,
            n_experts=family.pop("n_experts", None),
            n_experts_per_token=family.pop("n_experts_per_token", 2),
            qkv_bias=family.pop("qkv_bias", archs[0] == "Qwen2ForCausalLM"),
            qk_norm=archs[0] in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM"),  # Gemma 3's: 1 + w
            fused_checkpoint=archs[0] == "Phi3ForCausalLM",
            rope_dim=family.pop("rope_dim", None if partial == 1 else int(head_dim * partial)),  # rounded down
            **(gemma_args(cfg, size("num_hidden_layers"), archs[0] == "Gemma3ForCausalLM") if gemma else {}),
            mlp_act=act, rope_local_theta=local_theta, **family,
        )

    @classmethod
    def from_gguf(cls, meta: dict, tensor_names: Collection[str],
                  longrope: dict[str, list[float]] | None = None) -> "ModelArgs":
        """Fill from GGUF metadata (one of GGUF_ARCHITECTURES; keys under its name, `qwen2.block_count`) and the
        file's tensor names; a missing or mistyped key is a ValueError naming it. rope_freq_factors (a Llama 3.1
        file's `rope_freqs` tensor) is the loader's; longrope: a Phi-3 file's rope_factors_{long,short} tensors, as
        {"long_factor": [...], "short_factor": [...]}."""
        arch = meta.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")
        missing = [k for k in ("attention.head_count", "embedding_length", "block_count", "feed_forward_length")
                   if f"{arch}.{k}" not in meta]
        if f"{arch}.vocab_size" not in meta and "tokenizer.ggml.tokens" not in meta:
            missing.append("vocab_size")
        if missing:
            raise ValueError(f"GGUF metadata has no {', '.join(f'{arch}.{k}' for k in missing)}")

        def size(key: str, default: int | None = None) -> int:
            return positive_int(meta.get(f"{arch}.{key}", default), f"GGUF metadata {arch}.{key}")

        def number(key: str, default: float) -> float:
            return positive_number(meta.get(f"{arch}.{key}", default), f"GGUF metadata {arch}.{key}")

        rope_scaling = gguf_rope_scaling(meta, arch, size, number, longrope)
        head_dim = size("attention.key_length") if f"{arch}.attention.key_length" in meta else None
        window = meta.get(f"{arch}.attention.sliding_window") or (4096 if arch == "gemma2" else 0)  # 0: none
        n_heads = size("attention.head_count")
        n_experts = size("expert_count") if meta.get(f"{arch}.expert_count", 0) != 0 else None  # Mixtral: > 0
        family = gguf_family_args(meta, arch, size, number, bool(window))
        args = cls(
            vocab_size=size("vocab_size", len(meta.get("tokenizer.ggml.tokens", ()))),
            dim=size("embedding_length"),
            n_layers=size("block_count"),
            n_heads=n_heads,
            hidden_dim=size("feed_forward_length"),
            n_kv_heads=family.pop("n_kv_heads", None) or size("attention.head_count_kv", n_heads),
            head_dim=family.pop("head_dim", head_dim),  # deepseek2's key_length is its cached latent's width
            norm_eps=number("attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=number("rope.freq_base", 10000.0),
            rope_scaling=rope_scaling,
            max_seq_len=size("context_length", 4096),
            tie_embeddings="output.weight" not in tensor_names,  # llama.cpp drops the head of tied models
            n_experts=n_experts,
            n_experts_per_token=size("expert_used_count", 2) if n_experts else 2,
            qkv_bias=family.pop("qkv_bias", arch == "qwen2"),
            qk_norm=arch in ("qwen3", "gemma3", "qwen3moe"),
            moe_hidden_dim=family.pop("moe_hidden_dim", None),
            fused_checkpoint=arch == "phi3",  # attn_qkv, and ffn_up holding gate | up
            sliding_window=positive_int(window, f"GGUF metadata {arch}.attention.sliding_window") if window else None,
            rope_dim=family.pop("rope_dim", None) or (  # Phi-4-mini's partial rotary
                size("rope.dimension_count") if arch == "phi3" and f"{arch}.rope.dimension_count" in meta else None),
            **(gemma_gguf_args(meta, arch, size("block_count"), size("embedding_length") // n_heads, head_dim)
               if arch in ("gemma2", "gemma3") else {}),
            **family,
        )
        if meta.get(f"{arch}.rope.dimension_count", args.rope_dim) != args.rope_dim:
            raise ValueError("unsupported GGUF: partial rotary embeddings (rope.dimension_count != head dim)")
        return args

    def to_hf_config(self) -> dict:
        """A Hugging Face config.json (LlamaForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
        Qwen3MoeForCausalLM or Phi3ForCausalLM) that from_hf_config reads back as these args (export.py writes it for a
        GGUF source)."""
        if self.rope_freq_factors is not None:
            raise ValueError("this GGUF file has per-frequency rope factors (rope_freqs), which a config.json "
                             "cannot express; save from the Hugging Face checkpoint instead")
        if self.sliding_window is not None or self.sandwich_norms:
            raise ValueError("sliding-window and Gemma models are saved from their Hugging Face folder, not from GGUF")
        moe = self.n_experts is not None
        model_type = ("qwen3_moe" if moe and self.qk_norm else "mixtral" if moe else
                      "qwen2" if self.qkv_bias else "qwen3" if self.qk_norm else
                      "phi3" if self.fused_checkpoint else "llama")
        arch = ARCHITECTURES[("llama", "mistral", "mixtral", "qwen2", "qwen3", "phi3", "", "", "qwen3_moe")
                             .index(model_type)]
        cfg = {
            "architectures": [arch],
            "model_type": model_type, "vocab_size": self.vocab_size,
            "hidden_size": self.dim, "num_hidden_layers": self.n_layers, "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads, "head_dim": self.head_dim, "intermediate_size": self.hidden_dim,
            "hidden_act": "silu", "rms_norm_eps": self.norm_eps, "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_seq_len, "tie_word_embeddings": self.tie_embeddings,
            "attention_bias": False, "mlp_bias": False,
        }
        if self.rope_scaling:
            cfg["rope_scaling"] = dict(self.rope_scaling)
        if self.rope_dim != self.head_dim:
            cfg["partial_rotary_factor"] = self.rope_dim / self.head_dim
        if model_type == "mixtral":
            cfg.update(num_local_experts=self.n_experts, num_experts_per_tok=self.n_experts_per_token)
        elif moe:
            cfg.update(num_experts=self.n_experts, num_experts_per_tok=self.n_experts_per_token,
                       moe_intermediate_size=self.moe_hidden_dim, norm_topk_prob=self.moe_renormalize,
                       mlp_only_layers=list(self.dense_layers))
        return cfg
