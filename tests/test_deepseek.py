"""DeepSeek-V2/V3 beyond the logits tests every tiny config gets in test_model.py (there: the plain path, one forward,
token by token, chunked, batched): the absorbed decode path against the plain one and transformers, the latent
cache's bytes, its router, YaRN, both checkpoint layouts, quantization, the paged engine and what is refused."""
import pytest
import torch
from safetensors.torch import load_file

from config import ModelArgs
from helpers import ToyTokenizer
from kvcache import BlockPool, KVCache
from load import load_model
from models.deepseek import DeepseekMoE, DeepseekRouter, LatentAttention
from model import MLP
from serving.engine import Engine, EngineConfig
from tiny_models import (SEQ_LEN, compiled_against_eager, dense_twin, greedy_ids, greedy_uncached, hf_to_ours,
                         make_hf)

PROMPT = [5, 17, 42, 99, 3, 64, 8]
NAMES = ["deepseek-v3", "deepseek-v3-half-rope", "deepseek-v2-lite", "deepseek-v2-group"]


@pytest.fixture(scope="module", params=NAMES)
def pair(request):
    hf = make_hf(request.param)
    return hf, hf_to_ours(hf)


def tokens(batch: int = 1, seq: int = SEQ_LEN) -> torch.Tensor:
    return torch.randint(0, 160, (batch, seq), generator=torch.Generator().manual_seed(1))


def set_absorb(model, absorb: bool | None) -> None:
    for layer in model.layers:
        layer.self_attn.absorb = absorb


def decode(model, toks: torch.Tensor, prefill: int, absorb: bool | None) -> torch.Tensor:
    """Prefill, then one token a step (steps=True, as the decode loops call it); all logits (B, T, V)."""
    set_absorb(model, absorb)
    try:
        cache = KVCache.for_model(model.args, toks.shape[0], SEQ_LEN + 8, torch.float32, "cpu")
        out = [model(toks[:, :prefill], torch.arange(prefill), cache, all_logits=True)]
        for i in range(prefill, toks.shape[1]):
            out.append(model(toks[:, i:i + 1], torch.tensor([i]), cache, steps=True))
        return torch.cat(out, dim=1)
    finally:
        set_absorb(model, None)


def test_absorbed_decode_equals_plain_and_transformers(pair):
    """The up-projections folded into the query and the output: the same logits as up-projecting every cached latent
    (1e-5), and as transformers (1e-4); a prefill through the absorbed path too."""
    hf, ours = pair
    toks = tokens(batch=2)
    plain, absorbed = decode(ours, toks, 9, absorb=False), decode(ours, toks, 9, absorb=True)
    assert (absorbed - plain).abs().max() <= 1e-5
    assert (absorbed - hf(toks).logits).abs().max() <= 1e-4
    set_absorb(ours, True)
    try:
        whole = ours(toks, torch.arange(SEQ_LEN), all_logits=True)
    finally:
        set_absorb(ours, None)
    assert (whole - plain).abs().max() <= 1e-5


@pytest.mark.parametrize("dtype, size", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_latent_cache_bytes_per_token(pair, dtype, size):
    """What is cached per token is the latent: (kv_lora_rank + qk_rope_head_dim) x layers x the dtype's bytes, in the
    static cache's allocated buffers and in the paged pool's."""
    _, ours = pair
    a = ours.args
    want = (a.kv_lora_rank + a.rope_dim) * a.n_layers * size
    cache = KVCache.for_model(a, 2, 64, dtype, "cpu")
    assert cache.bytes_per_token == want == sum(t.nbytes for layer in cache.layers for t in layer.buffers()) // 128
    assert cache.layers[0].k.shape == (2, 1, 64, a.kv_lora_rank + a.rope_dim) and cache.layers[0].v.numel() == 0
    assert BlockPool.for_model(a, 10, 4, dtype, "cpu").bytes_per_token == want
    full = 2 * a.n_heads * (a.head_dim + a.v_head_dim) / 2 * a.n_layers * size  # keys and values of every head
    assert want < full / 4


def test_folder_layouts_match_transformers(tmp_path):
    """save_pretrained's per-expert names and transformers 5's stacked experts; the greedy tokens are transformers'."""
    hf = make_hf("deepseek-v3")
    for original in (True, False):
        folder = tmp_path / str(original)
        hf.save_pretrained(folder, save_original_format=original)
        assert ("model.layers.1.mlp.experts.gate_up_proj" in load_file(folder / "model.safetensors")) != original
        model, _ = load_model(str(folder), "cpu", torch.float32)
        assert (model(tokens(), torch.arange(SEQ_LEN), all_logits=True) - hf(tokens()).logits).abs().max() <= 1e-4
    out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert greedy_ids(model, PROMPT, 12) == out[0, len(PROMPT):].tolist() == greedy_uncached(model, PROMPT, 12)


def test_modules_and_router():
    """Dense first layers, shared experts, V3's grouped routing: every token's experts lie within its topk_group
    groups best by their top-2 sum of bias-corrected scores, weighted by the renormalized, scaled scores."""
    ours = hf_to_ours(make_hf("deepseek-v3"))
    assert [type(layer.mlp) for layer in ours.layers] == [MLP, DeepseekMoE, DeepseekMoE]
    assert isinstance(ours.layers[0].self_attn, LatentAttention)
    assert ours.layers[1].mlp.shared_experts.down_proj.in_features == 32
    gate: DeepseekRouter = ours.layers[1].mlp.gate
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(0))
    weights, ids = gate(x)
    scores = torch.sigmoid(x @ gate.weight.T)  # (M, E)
    choice = (scores + gate.e_score_correction_bias).view(50, 4, 2)  # (M, G, E/G)
    best = choice.sum(-1).topk(2, dim=-1)[1]  # each group's top-2 sum: both of its two experts
    assert all(set((ids[m] // 2).tolist()) <= set(best[m].tolist()) for m in range(50))
    picked = scores.gather(1, ids)
    assert torch.allclose(weights, picked / picked.sum(-1, keepdim=True) * 2.5, atol=1e-6)


def test_yarn_tables_and_scale():
    """YaRN's frequencies and attention factor are transformers' (cos/sin tables), and its softmax scale takes
    mscale(mscale_all_dim) twice."""
    from transformers.modeling_rope_utils import yarn_apply_mscale

    hf = make_hf("deepseek-v3")
    ours = hf_to_ours(hf)
    positions = torch.arange(200)
    cos, sin = hf.model.rotary_emb(torch.zeros(1, 200, 64), positions[None])
    assert (ours.rope_cos[:200] - cos[0, :, :8]).abs().max() <= 1e-6
    assert (ours.rope_sin[:200] - sin[0, :, :8]).abs().max() <= 1e-6
    assert abs(ours.rope_cos[:200].abs().max() - 1) > 0.01  # the attention factor is not 1 (here 0.96)
    want = yarn_apply_mscale(hf.config.rope_parameters, 40 ** -0.5)
    assert ours.layers[0].self_attn.scale == pytest.approx(want, rel=1e-7) and want != 40 ** -0.5


@pytest.mark.parametrize("mode", ["int8", "int4:32"])
def test_quantized(tmp_path, mode, monkeypatch):
    """Every linear but the router quantized at load (kv_b_proj too: the absorbed path uses it dequantized); with the
    dequantize-then-matmul path (no kernel's bf16 rounding) the absorbed decode equals the plain one."""
    import quantize

    monkeypatch.setattr(quantize, "int8_kernel", lambda device: None)
    monkeypatch.setattr(quantize, "int4_kernel", lambda device: None)
    make_hf("deepseek-v2-lite").save_pretrained(tmp_path)
    q, _ = load_model(str(tmp_path), "cpu", torch.float32, quantize=mode)
    assert type(q.layers[1].self_attn.kv_b_proj).__name__ == ("Int8Linear" if mode == "int8" else "Int4Linear")
    toks = tokens(seq=24)
    plain, absorbed = decode(q, toks, 5, absorb=False), decode(q, toks, 5, absorb=True)
    assert (absorbed - plain).abs().max() <= 1e-5


def test_int8_latent_cache():
    """The int8 cache holds the latent as int8 codes and one float32 scale per token (the empty value has none); the
    logits through it stay close to the float cache's, on the absorbed path too."""
    ours = hf_to_ours(make_hf("deepseek-v3"))
    a = ours.args
    cache = KVCache.for_model(a, 1, 32, torch.float32, "cpu", kv_dtype="int8")
    assert cache.bytes_per_token == (a.kv_lora_rank + a.rope_dim + 4) * a.n_layers
    toks = tokens(seq=24)
    full = ours(toks, torch.arange(24), all_logits=True)
    for absorb in (False, True):
        set_absorb(ours, absorb)
        try:
            cache = KVCache.for_model(a, 1, 32, torch.float32, "cpu", kv_dtype="int8")
            out = [ours(toks[:, :8], torch.arange(8), cache, all_logits=True)]
            out += [ours(toks[:, i:i + 1], torch.tensor([i]), cache, steps=True) for i in range(8, 24)]
        finally:
            set_absorb(ours, None)
        assert (torch.cat(out, dim=1) - full).abs().max() <= 0.05 * full.abs().max()


def test_speculative_greedy_matches_plain_greedy():
    import speculative
    from speculative import ModelDraft, PromptLookupDraft

    ours = hf_to_ours(make_hf("deepseek-v3"))
    want = greedy_ids(ours, PROMPT, 24)
    for draft in (ModelDraft(hf_to_ours(make_hf("deepseek-v2-lite", seed=1)), ours), PromptLookupDraft()):
        assert [t.id for t in speculative.generate(ours, draft, PROMPT, max_new_tokens=24, k=4)] == want


def test_paged_engine_matches_greedy():
    """The engine's paged pool holds the latent (a one-head key, an empty value); its tokens are plain greedy's."""
    ours = hf_to_ours(make_hf("deepseek-v2-group"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 160, (n,), generator=g).tolist() for n in (3, 17, 9)]
    expected = [greedy_ids(ours, p, 8) for p in prompts]
    engine = Engine(ours, ToyTokenizer(), EngineConfig(block_size=4, num_blocks=100, max_running=4, token_budget=24))
    assert [c.tokens for c in engine.generate(prompts, max_new_tokens=8)] == expected


def test_refusals(tmp_path):
    from features import tp

    make_hf("deepseek-v2-lite").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="^tensor parallel does not split DeepSeek's latent attention"):
        load_model(str(tmp_path), "cpu", torch.float32, shard=tp.Shard(0, 2))


def test_config():
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 2,
           "num_attention_heads": 2, "intermediate_size": 16, "kv_lora_rank": 4, "qk_rope_head_dim": 4,
           "qk_nope_head_dim": 2, "v_head_dim": 2, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2,
           "topk_group": 1, "moe_intermediate_size": 4, "first_k_dense_replace": 1}
    args = ModelArgs.from_hf_config(cfg)
    assert (args.head_dim, args.rope_dim, args.dense_layers, args.router_scoring, args.n_group) == (
        6, 4, (0,), "sigmoid", 2)
    with pytest.raises(ValueError, match="4 experts in 3 groups"):
        ModelArgs.from_hf_config({**cfg, "n_group": 3})
    with pytest.raises(ValueError, match="unsupported config.json topk_method 'x'"):
        ModelArgs.from_hf_config({**cfg, "architectures": ["DeepseekV2ForCausalLM"], "topk_method": "x"})


def test_sinks_refused_in_one_line():
    from features.sinks import SinkKVCache, SinkWindow

    ours = hf_to_ours(make_hf("deepseek-v2-lite"))
    with pytest.raises(ValueError, match="^attention sinks .* do not take latent attention"):
        SinkKVCache.for_model(ours, 1, SinkWindow(4, 16))


def test_gguf_kv_b_joined_back():
    """llama.cpp's converter splits kv_b_proj per head into attn_k_b (transposed) and attn_v_b; join_kv_b undoes it."""
    from gguf import GGMLQuantizationType

    from formats.gguffile import GGUFTensor, join_kv_b

    H, N, Dv, R = 4, 24, 20, 32
    kv_b = torch.randn(H * (N + Dv), R)
    k_b, v_b = kv_b.view(H, N + Dv, R).split([N, Dv], dim=1)  # as convert_hf_to_gguf.py's DeepseekV2Model
    k_b = k_b.transpose(1, 2).contiguous().numpy()
    f32 = GGMLQuantizationType.F32
    name = "layers.0.self_attn.{}.weight"
    tensors = {name.format("k_b_proj"): GGUFTensor("k", f32, k_b.shape, k_b),
               name.format("v_b_proj"): GGUFTensor("v", f32, tuple(v_b.shape), v_b.contiguous().numpy())}
    shapes = {k: t.shape for k, t in tensors.items()}
    join_kv_b(tensors, shapes)
    assert list(tensors) == [name.format("kv_b_proj")] and shapes[name.format("kv_b_proj")] == (H * (N + Dv), R)
    assert torch.equal(torch.from_numpy(tensors[name.format("kv_b_proj")].data), kv_b)


def test_gguf_metadata():
    """A deepseek2 file as llama.cpp's converter writes one (key_length is the cached latent's width, the MLA dims
    under *_mla) and as llama.cpp reads it: softmax unless expert_gating_func is 2; YaRN's mscale_all_dim from
    yarn_log_multiplier, cos and sin unscaled."""
    meta = {"general.architecture": "deepseek2", "deepseek2.block_count": 3, "deepseek2.embedding_length": 64,
            "deepseek2.feed_forward_length": 112, "deepseek2.attention.head_count": 4, "deepseek2.vocab_size": 160,
            "deepseek2.attention.head_count_kv": 1, "deepseek2.expert_count": 8, "deepseek2.expert_used_count": 2,
            "deepseek2.expert_group_count": 4, "deepseek2.expert_group_used_count": 2, "deepseek2.attention.key_length":
            48, "deepseek2.leading_dense_block_count": 1, "deepseek2.attention.q_lora_rank": 48,
            "deepseek2.attention.kv_lora_rank": 32, "deepseek2.attention.key_length_mla": 40,
            "deepseek2.attention.value_length_mla": 20, "deepseek2.expert_feed_forward_length": 32,
            "deepseek2.expert_shared_count": 1, "deepseek2.expert_weights_scale": 2.5,
            "deepseek2.expert_weights_norm": True, "deepseek2.rope.dimension_count": 16,
            "deepseek2.expert_gating_func": 2, "deepseek2.rope.scaling.type": "yarn", "deepseek2.rope.scaling.factor":
            4.0, "deepseek2.rope.scaling.original_context_length": 64, "deepseek2.rope.scaling.yarn_log_multiplier":
            0.0707}
    args = ModelArgs.from_gguf(meta, {"output.weight"})
    assert (args.head_dim, args.rope_dim, args.v_head_dim, args.kv_lora_rank, args.q_lora_rank, args.n_kv_heads) == (
        40, 16, 20, 32, 48, 4)
    assert (args.router_scoring, args.n_group, args.topk_group, args.routed_scaling, args.moe_renormalize,
            args.dense_layers, args.n_shared_experts, args.moe_hidden_dim) == ("sigmoid", 4, 2, 2.5, True, (0,), 1, 32)
    assert args.rope_scaling["mscale_all_dim"] == pytest.approx(0.707) and args.rope_scaling["attention_factor"] == 1
    with pytest.raises(ValueError, match="unsupported GGUF deepseek2.expert_gating_func 3"):
        ModelArgs.from_gguf({**meta, "deepseek2.expert_gating_func": 3}, {"output.weight"})


@pytest.mark.slow
def test_compiled_latent_attention_equals_eager_and_moe_is_refused():
    """--compile blocks and full run the latent attention (the absorbed decode path) as eager does, within 1e-5, on
    a dense twin of the tiny model; the MoE model itself is refused in one line (as Mixtral is: a graph cannot pick
    an expert module by a computed index)."""
    from step import Step

    model = hf_to_ours(make_hf("deepseek-v3"))
    assert max(compiled_against_eager(dense_twin(model), [7, 8, 9], 12).values()) <= 1e-5
    for mode in ("blocks", "full"):
        with pytest.raises(ValueError, match="^--compile does not support mixture-of-experts models"):
            Step(model, mode)
