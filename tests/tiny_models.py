"""Tiny random Hugging Face models (no download) shared by the tests, the simple references the fast paths are
checked against (plain attention, an uncached greedy loop), the greedy token ids of decode.generate, and tiny llama
GGUF files written from a random transformers model."""
import math

import numpy as np
import torch

from decode import generate
from formats.gguffile import GGUF_BLOCK_NAMES, GGUF_TOP_NAMES
from formats.hffolder import select, tensor_names
from formats.checkpoint import load_state
from model import ModelArgs, Transformer
from models.families import build_model
from params import SamplingParams

SEQ_LEN = 80  # longer than the Mistral sliding window and than llama3's original context below

MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=24,
           v_head_dim=20, moe_intermediate_size=32)
CONFIGS = {
    # GQA 4:2 with an explicit head_dim (H * D != hidden size)
    "llama-gqa": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24)),
    "llama3-rope": ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "llama-linear-rope": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "mistral-window": ("mistral", dict(sliding_window=16)),
    # Mixtral: several expert counts and top-k, GQA, the sliding window set and unset
    "mixtral-8x2": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2)),
    "mixtral-4x1-window": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=1, num_key_value_heads=1,
                                           sliding_window=16)),
    "mixtral-6x3-window": ("mixtral", dict(num_local_experts=6, num_experts_per_tok=3, head_dim=24,
                                           sliding_window=24)),
    # Qwen2 (q/k/v biases), untied and tied; Qwen3 (q/k norms) with an explicit head_dim, and tied
    "qwen2": ("qwen2", dict()),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "qwen3": ("qwen3", dict(head_dim=24)),
    "qwen3-tied": ("qwen3", dict(head_dim=16, tie_word_embeddings=True)),
    # Qwen3-MoE: Qwen3's q/k norms with experts narrower than the dense width; top-k renormalized, then not, with
    # dense layers both ways transformers picks them (decoder_sparse_step 2: layer 0; mlp_only_layers: layer 2)
    "qwen3moe-8x2": ("qwen3moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, head_dim=24,
                                      norm_topk_prob=True)),
    "qwen3moe-dense-layers": ("qwen3moe", dict(num_hidden_layers=3, num_experts=6, num_experts_per_tok=3,
                                               moe_intermediate_size=32, norm_topk_prob=False, decoder_sparse_step=2,
                                               mlp_only_layers=[2])),
    # DeepSeek: multi-head latent attention (a 32-wide latent, 16 rotary dims, nope 24, values 20; as many kv heads as
    # heads, which transformers' MLA expects) with dense first layers and shared experts. V3: q_lora, sigmoid routing
    # within the best 2 of 4 groups with a correction bias, renormalized and scaled, YaRN with its mscales; then
    # without rope_interleave. V2-Lite's shape: no q_lora, softmax greedy; V2's group-limited greedy with q_lora.
    "deepseek-v3": ("deepseek_v3", dict(num_hidden_layers=3, **MLA, q_lora_rank=48, n_routed_experts=8,
                                        num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
                                        n_shared_experts=1, routed_scaling_factor=2.5, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.707, "mscale_all_dim": 1.0, "rope_theta": 10000.0})),
    "deepseek-v3-half-rope": ("deepseek_v3", dict(**MLA, q_lora_rank=48, n_routed_experts=4, num_experts_per_tok=3,
                                                  n_group=1, topk_group=1, first_k_dense_replace=0,
                                                  n_shared_experts=2, rope_interleave=False)),
    "deepseek-v2-lite": ("deepseek_v2", dict(num_hidden_layers=3, **MLA, q_lora_rank=None, n_routed_experts=8,
                                             num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=2)),
    "deepseek-v2-group": ("deepseek_v2", dict(**MLA, q_lora_rank=48, n_routed_experts=8, num_experts_per_tok=3,
                                              topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                              first_k_dense_replace=0, n_shared_experts=1,
                                              routed_scaling_factor=1.5)),
    # gpt-oss: sinks, biases everywhere, the clamped SwiGLU (a low limit, so the clamps bite), every other layer
    # windowed (a window of 16), YaRN untruncated; GQA 4:2
    "gpt-oss": ("gpt_oss", dict(num_hidden_layers=3, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                                intermediate_size=48, sliding_window=16, swiglu_limit=1.5, rope_parameters={
        "rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 32, "rope_theta": 10000.0})),
    # Phi-3: fused qkv_proj / gate_up_proj in the checkpoint; longrope past the original context (the long factors
    # and attention factor sqrt(1 + ln 16 / ln 16)) and within it (short factors), with a window; Phi-4-mini's
    # partial rotary (12 of 16 dims, GQA) with tied embeddings
    "phi3-longrope": ("phi3", dict(original_max_position_embeddings=16, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0 + i / 10 for i in range(8)],
        "long_factor": [1.5 + i for i in range(8)]})),
    "phi3-short-window": ("phi3", dict(max_position_embeddings=256, original_max_position_embeddings=256,
                                       sliding_window=16, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0 + i / 5 for i in range(8)], "long_factor": [9.0] * 8})),
    "phi4-mini-partial": ("phi3", dict(partial_rotary_factor=0.75, tie_word_embeddings=True,
                                       original_max_position_embeddings=32, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.1] * 6, "long_factor": [1.0 + i for i in range(6)]})),
    # Gemma 2: GeGLU, (1 + w) norms, scaled embeddings, sandwich norms, soft-capped attention and logits (caps
    # low enough to bite on these scores), alternating windowed/full layers, query_pre_attn_scalar != head_dim;
    # then untied, one kv head, its own layer_types and the default caps
    "gemma2": ("gemma2", dict(num_hidden_layers=3, head_dim=16, sliding_window=16, query_pre_attn_scalar=24,
                              attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "gemma2-untied-gqa1": ("gemma2", dict(head_dim=24, num_key_value_heads=1, sliding_window=24,
                                          tie_word_embeddings=False,
                                          layer_types=["full_attention", "sliding_attention"])),
    # Gemma 3: Gemma 2's layout with (1 + w) q/k norms, no soft-caps, a sliding pattern of 3 here (2 windowed, 1
    # full), the full layers' RoPE base and linear scaling apart from the sliding layers' base (far apart, so a
    # swapped table shows); then untied, one kv head, a final soft-cap and the default bases (1e6, 1e4)
    "gemma3": ("gemma3", dict(num_hidden_layers=4, head_dim=16, sliding_window=16, query_pre_attn_scalar=24,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                           "sliding_attention"],
                              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                  "rope_theta": 1000.0},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}})),
    "gemma3-untied-softcap": ("gemma3", dict(head_dim=24, num_key_value_heads=1, sliding_window=24,
                                             tie_word_embeddings=False, final_logit_softcapping=3.0,
                                             layer_types=["sliding_attention", "full_attention"])),
}
# families whose biases and norms are drawn at random
RANDOM_VECTORS = ("qwen2", "qwen3", "qwen3moe", "phi3", "gemma2", "gemma3", "deepseek_v2", "deepseek_v3", "gpt_oss")


def make_hf(name: str, seed: int = 0, **overrides):
    """A random fp32 transformers model for CONFIGS[name], with config fields `overrides` on top."""
    import transformers

    family, extra = CONFIGS[name]
    prefix = {"llama": "Llama", "mistral": "Mistral", "mixtral": "Mixtral", "qwen2": "Qwen2", "qwen3": "Qwen3",
              "qwen3moe": "Qwen3Moe", "deepseek_v2": "DeepseekV2", "deepseek_v3": "DeepseekV3", "gpt_oss": "GptOss",
              "phi3": "Phi3", "gemma2": "Gemma2", "gemma3": "Gemma3Text"}[family]
    config_cls = getattr(transformers, prefix + "Config")  # Gemma3Config is the multimodal model's
    model_cls = getattr(transformers, prefix.removesuffix("Text") + "ForCausalLM")
    kw = dict(vocab_size=160, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
              pad_token_id=None,  # Phi-3's default (32000) is past the tiny vocabulary
              initializer_range=0.1)  # larger than the default so logits are O(1) and differences show
    kw.update(extra)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kw)).eval()
    if family in RANDOM_VECTORS:  # transformers initializes them to 0 and 1, which would hide a swapped or lost one
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 1 or name.endswith("_bias"):  # gpt-oss's stacked expert biases (E, F) too
                    mean = 0.0 if name.endswith(".bias") or family.startswith("gemma") else 1.0  # Gemma: w - 1
                    p.normal_(mean, 0.1)  # a bias, or a norm's weight
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's router bias (a buffer): choices move
                    b.normal_(0.0, 0.1)
    return model


def hf_to_ours(hf) -> Transformer:
    """Copy a transformers model's weights into ours (strict). Mixtral's stacked experts (transformers 5 holds
    them as (E, rows, columns) tensors) are named per expert as load.py names them."""
    cfg = hf.config.to_dict()
    cfg["architectures"] = [type(hf).__name__]
    with torch.device("meta"):
        model = build_model(ModelArgs.from_hf_config(cfg))
    state = {}
    for key, t in hf.state_dict().items():
        for name, _, pick in tensor_names(key, tuple(t.shape), model.args.attn_sinks):
            if name == "lm_head.weight" and model.args.tie_embeddings:
                continue  # the embedding, as save_pretrained leaves it out of a checkpoint
            state[name] = select(t, pick).clone()  # not hf's memory
    return load_state(model, state)


def reference_attention(q, k, v, mask):
    """Plain softmax(q k^T / sqrt(D)) v with GQA by repetition: the definition SDPA is checked against."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (B, H, S, D)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, S)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v  # (B, H, T, D)


def last_logits(model: Transformer, seq: list[int]) -> torch.Tensor:
    """(V,) next-token logits of `seq` from one uncached forward: the simple path."""
    return model(torch.tensor([seq]), torch.arange(len(seq)))[0, -1]


def greedy_uncached(model: Transformer, prompt: list[int], n: int) -> list[int]:
    """The simplest possible decoder: rerun the whole sequence for every new token."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(last_logits(model, seq).argmax().item())
    return seq[len(prompt):]


def greedy_ids(model: Transformer, prompt: list[int], n: int, params: SamplingParams = SamplingParams(),
               **kw) -> list[int]:
    """The token ids of decode.generate (greedy by default); kw as generate takes them (stop_ids, step, ...)."""
    return [t.id for t in generate(model, prompt, max_new_tokens=n, params=params, **kw)]


# ---- writing tiny GGUF files (as llama.cpp's converter does) ----

def llama_cpp_permute(w, n_heads: int):
    """llama.cpp's converter for q/k rows (RoPE pairs (i, i + D/2) -> (2i, 2i + 1)); gguffile.unpermute_qk undoes it.
    w: a numpy (rows, columns) array."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def llama_gguf_writer(path, cfg, arch: str = "llama"):
    """A gguf.GGUFWriter for a file of llama.cpp architecture `arch` (llama, qwen2, qwen3) with the metadata of
    transformers config `cfg` (and, for a Mixtral config, its expert counts); the caller adds the tensors and
    writes the file."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    if getattr(cfg, "head_dim", None) and cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads:
        writer.add_key_length(cfg.head_dim)  # as llama.cpp's converter writes a config's own head_dim
        writer.add_value_length(cfg.head_dim)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)  # Gemma 3's sliding layers have their own: the caller writes it
    writer.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or rope["rope_theta"]))
    writer.add_vocab_size(cfg.vocab_size)
    if getattr(cfg, "num_local_experts", None):
        writer.add_expert_count(cfg.num_local_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
    return writer


def make_hf_llama(tied: bool, seed: int = 0):
    """A random fp32 LlamaForCausalLM: K of every linear a multiple of 32 (intermediate 128), as Q4 blocks need."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rms_norm_eps=1e-5, initializer_range=0.1, tie_word_embeddings=tied)
    return LlamaForCausalLM(config).eval()


def write_llama_gguf(path, hf, linear_type: str, types: dict[str, str] | None = None) -> str:
    """Write `hf` as a llama GGUF: block linears (attn_q/k/v/output, ffn_gate/up/down) in `linear_type` (F32,
    Q4_0, Q4_1, Q8_0; `types` overrides it per GGUF block name, and sets token_embd's and output's, F32 by default),
    everything else F32; a tied model has no `output` tensor, as llama.cpp writes it."""
    import gguf

    cfg = hf.config
    writer = llama_gguf_writer(path, cfg)

    ours = {v: k for k, v in GGUF_TOP_NAMES.items()}
    block = {v: k for k, v in GGUF_BLOCK_NAMES.items()}
    for name, t in hf.state_dict().items():
        name = name.removeprefix("model.")
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = t.float().numpy()
        parts = name.split(".")
        if parts[0] == "layers":
            kind = block[".".join(parts[2:-1])]
            gguf_name = f"blk.{parts[1]}.{kind}.weight"
            if kind in ("attn_q", "attn_k"):
                w = llama_cpp_permute(w, cfg.num_attention_heads if kind == "attn_q" else cfg.num_key_value_heads)
            qtype = None if w.ndim == 1 else (types or {}).get(kind, linear_type)
        else:
            gguf_name = f"{ours[parts[0]]}.weight"
            qtype = None if w.ndim == 1 else (types or {}).get(ours[parts[0]])
        if qtype in (None, "F32"):
            writer.add_tensor(gguf_name, np.ascontiguousarray(w, dtype=np.float32))
        else:
            raw = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(gguf_name, gguf.quants.quantize(w, raw), raw_dtype=raw)  # (N, bytes per row)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def write_mxfp4_pair(hf, root, quantization: dict) -> None:
    """gpt-oss as released, beside its floats: root/mxfp4 holds the experts as random MXFP4 blocks and scales
    (*_blocks, *_scales; config.json's quantization_config), root/float the same model with transformers'
    dequantization of them."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf.save_pretrained(root / "float")
    state = load_file(root / "float" / "model.safetensors")
    packed, g = dict(state), torch.Generator().manual_seed(0)
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        E, cols, rows = state[key].shape  # stored (E, in, out); the blocks are (E, out, in / 32, 16)
        blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(120, 126, (E, rows, cols // 32), generator=g, dtype=torch.uint8)
        del packed[key]
        packed[key + "_blocks"], packed[key + "_scales"] = blocks, scales
        state[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).contiguous()
    save_file(state, root / "float" / "model.safetensors", metadata={"format": "pt"})
    (root / "mxfp4").mkdir()
    save_file(packed, root / "mxfp4" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((root / "float" / "config.json").read_text())
    (root / "mxfp4" / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))


def harmony_template() -> str | None:
    """gpt-oss's chat template as released (llama.cpp keeps a copy among its sources' templates), found as
    test_convert.py finds the converter: LLAMA_CPP_CONVERT's tree or $PEER's llama.cpp sources; None without."""
    import glob
    import os

    roots = [os.path.dirname(os.environ.get("LLAMA_CPP_CONVERT", ""))]
    roots += sorted(glob.glob(os.path.join(os.environ["PEER"], "src", "*", "vendor", "llama.cpp"))) \
        if "PEER" in os.environ else []
    for root in roots:
        path = os.path.join(root, "models", "templates", "openai-gpt-oss-120b.jinja")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return f.read()
    return None


HARMONY_TOKENS = ("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|channel|>", "<|message|>", "<|end|>",
                  "<|return|>", "<|call|>", "<|constrain|>")


def write_harmony_tokenizer(folder, template: str) -> None:
    """A byte-level BPE tokenizer with no merges (a token a byte) and gpt-oss's harmony special tokens after the 256
    bytes, its chat template `template`: a folder both transformers and tokenizer.py read."""
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in HARMONY_TOKENS])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>", "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>", "chat_template": template}))


def dense_twin(model: Transformer, seed: int = 0) -> Transformer:
    """A random model of `model`'s family with every MoE layer a dense MLP (n_experts None): its attention (MLA,
    learned sinks) as the family has it, in a model --compile takes."""
    import dataclasses

    from models.families import build_model

    args = dataclasses.replace(model.args, n_experts=None, dense_layers=(), n_shared_experts=0)
    torch.manual_seed(seed)
    twin = build_model(args).eval().requires_grad_(False)
    for p in twin.parameters():
        p.data.normal_(0, 0.05)
    twin.reset_rope("cpu")
    return twin


def compiled_against_eager(model: Transformer, prompt: list[int], n: int) -> dict[str, float]:
    """{mode: the largest logit difference of n greedy cached steps (after the prompt's prefill) run by a compiled
    Step against an eager one}, for modes blocks and full."""
    import torch._dynamo

    from kvcache import KVCache
    from step import Step

    def steps(step: Step) -> torch.Tensor:
        cache = KVCache.for_model(model.args, 1, len(prompt) + n, torch.float32, "cpu")
        logits = step(torch.tensor([prompt]), torch.arange(len(prompt)), cache)
        out = [logits]
        for pos in range(len(prompt), len(prompt) + n):
            logits = step(logits.argmax(-1, keepdim=True), torch.tensor([pos]), cache)
            out.append(logits)
        return torch.stack(out)

    torch._dynamo.reset()
    eager = steps(Step(model))
    return {mode: (steps(Step(model, mode)) - eager).abs().max().item() for mode in ("blocks", "full")}
