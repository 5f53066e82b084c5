"""Qwen3-MoE on the Mixtral machinery, beyond the logits tests every tiny config gets in test_model.py: both
checkpoint layouts against transformers, its routing (norm_topk_prob), its dense layers, its config.json and GGUF
metadata, quantized experts, the int8 cache and the engine. The converter's GGUF is test_convert.py's."""
import pytest
import torch
from safetensors.torch import load_file

from config import ModelArgs
from helpers import ToyTokenizer
from kvcache import KVCache
from load import load_model
from model import MLP, MoE
from serving.engine import Engine, EngineConfig
from tiny_models import SEQ_LEN, greedy_ids, greedy_uncached, hf_to_ours, make_hf

PROMPT = [5, 17, 42, 99, 3, 64, 8]
CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 4,
          "num_attention_heads": 2, "intermediate_size": 16, "moe_intermediate_size": 4, "num_experts": 4,
          "num_experts_per_tok": 2}


def tokens(seq: int = SEQ_LEN) -> torch.Tensor:
    return torch.randint(0, 160, (1, seq), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", ["qwen3moe-8x2", "qwen3moe-dense-layers"])
@pytest.mark.parametrize("original", [True, False])
def test_folder_layouts_match_transformers(tmp_path, name, original):
    """save_pretrained's per-expert names (mlp.experts.E.gate_proj) and transformers 5's stacked experts load to
    transformers' logits and greedy tokens; the config.json written back reads as the same args."""
    hf = make_hf(name)
    hf.save_pretrained(tmp_path, save_original_format=original)
    stacked = "model.layers.1.mlp.experts.gate_up_proj" in load_file(tmp_path / "model.safetensors")
    assert stacked != original
    model, _ = load_model(str(tmp_path), "cpu", torch.float32)
    toks = tokens()
    assert (model(toks, torch.arange(SEQ_LEN), all_logits=True) - hf(toks).logits).abs().max() <= 1e-4
    out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert greedy_ids(model, PROMPT, 12) == out[0, len(PROMPT):].tolist()
    assert ModelArgs.from_hf_config(model.args.to_hf_config()) == model.args


def test_dense_layers_and_routing():
    """decoder_sparse_step 2 makes layer 0 dense, mlp_only_layers layer 2; experts are moe_intermediate_size wide;
    without norm_topk_prob the top-k softmax weights are not rescaled (they sum to less than 1)."""
    ours = hf_to_ours(make_hf("qwen3moe-dense-layers"))
    kinds = [type(layer.mlp) for layer in ours.layers]
    assert kinds == [MLP, MoE, MLP]
    assert ours.layers[0].mlp.down_proj.in_features == 112
    assert ours.layers[1].mlp.experts[5].down_proj.in_features == 32
    gate = ours.layers[1].mlp.gate
    weights, ids = gate(torch.randn(5, 64, generator=torch.Generator().manual_seed(0)))
    assert ids.shape == (5, 3) and (weights.sum(-1) < 1 - 1e-3).all()
    probs = torch.softmax(torch.randn(5, 64, generator=torch.Generator().manual_seed(0)) @ gate.weight.T, -1)
    assert torch.allclose(weights, probs.gather(1, ids), atol=1e-6)


def test_config():
    """The hub's num_experts or transformers 5's num_local_experts; dense layers both ways; bad values named."""
    args = ModelArgs.from_hf_config({**CONFIG, "decoder_sparse_step": 2, "mlp_only_layers": [2]})
    assert (args.n_experts, args.moe_hidden_dim, args.dense_layers, args.moe_renormalize) == (4, 4, (0, 2), False)
    written = {k: v for k, v in CONFIG.items() if k != "num_experts"}
    assert ModelArgs.from_hf_config({**written, "num_local_experts": 4, "norm_topk_prob": True}).n_experts == 4
    with pytest.raises(ValueError, match="config.json mlp_only_layers must list layer numbers below 4, got"):
        ModelArgs.from_hf_config({**CONFIG, "mlp_only_layers": [4]})
    with pytest.raises(ValueError, match="config.json moe_intermediate_size must be a positive integer"):
        ModelArgs.from_hf_config({**CONFIG, "moe_intermediate_size": None})


def test_gguf_metadata():
    """A qwen3moe file as llama.cpp reads it: experts of expert_feed_forward_length, every layer sparse, the top-k
    renormalized, q/k norms."""
    meta = {"general.architecture": "qwen3moe", "qwen3moe.attention.head_count": 2, "qwen3moe.embedding_length": 8,
            "qwen3moe.block_count": 2, "qwen3moe.feed_forward_length": 16, "qwen3moe.vocab_size": 10,
            "qwen3moe.expert_count": 4, "qwen3moe.expert_used_count": 2, "qwen3moe.expert_feed_forward_length": 4}
    args = ModelArgs.from_gguf(meta, {"output.weight"})
    assert (args.n_experts, args.moe_hidden_dim, args.dense_layers, args.moe_renormalize, args.qk_norm) == (
        4, 4, (), True, True)
    with pytest.raises(ValueError, match="qwen3moe.expert_feed_forward_length must be a positive integer"):
        ModelArgs.from_gguf({k: v for k, v in meta.items() if "expert_feed" not in k}, {"output.weight"})


@pytest.mark.parametrize("mode", ["int8", "int4:32"])
def test_quantized_experts(tmp_path, mode, monkeypatch):
    """Every expert and the dense MLP quantized at load (the router kept in float); with the dequantize-then-matmul
    path the logits equal a float model's holding the dequantized weights."""
    import quantize

    monkeypatch.setattr(quantize, "int8_kernel", lambda device: None)
    monkeypatch.setattr(quantize, "int4_kernel", lambda device: None)
    hf = make_hf("qwen3moe-dense-layers")
    hf.save_pretrained(tmp_path)
    floats, _ = load_model(str(tmp_path), "cpu", torch.float32)
    q, _ = load_model(str(tmp_path), "cpu", torch.float32, quantize=mode)
    assert type(q.layers[1].mlp.experts[0].down_proj).__name__ == ("Int8Linear" if mode == "int8" else "Int4Linear")
    assert type(q.layers[1].mlp.gate).__name__ == "Router"
    for name, module in floats.named_modules():
        if name.startswith("layers.") and isinstance(module, torch.nn.Linear):
            module.weight.copy_(q.get_submodule(name).dequantize())
    toks = tokens()
    ref = floats(toks, torch.arange(SEQ_LEN), all_logits=True)
    assert (q(toks, torch.arange(SEQ_LEN), all_logits=True) - ref).abs().max() <= 1e-5


def test_int8_cache_and_paged_engine_match_greedy():
    ours = hf_to_ours(make_hf("qwen3moe-8x2"))
    cache = KVCache.for_model(ours.args, 1, 32, torch.float32, "cpu", kv_dtype="int8")
    full = ours(tokens(24), torch.arange(24), all_logits=True)
    assert (ours(tokens(24), torch.arange(24), cache, all_logits=True) - full).abs().max() <= 0.1 * full.abs().max()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 160, (n,), generator=g).tolist() for n in (3, 17, 9)]
    expected = [greedy_ids(ours, p, 8) for p in prompts]
    assert expected[0] == greedy_uncached(ours, prompts[0], 8)
    engine = Engine(ours, ToyTokenizer(), EngineConfig(block_size=4, num_blocks=100, max_running=4, token_budget=24))
    assert [c.tokens for c in engine.generate(prompts, max_new_tokens=8)] == expected


def test_tensor_parallel_refused_in_one_line(tmp_path):
    from features import tp

    make_hf("qwen3moe-8x2").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="^tensor parallel does not split Qwen3-MoE's experts"):
        load_model(str(tmp_path), "cpu", torch.float32, shard=tp.Shard(0, 2))


def test_compile_refused_in_one_line():
    """Qwen3-MoE's experts, as Mixtral's: a graph cannot pick an expert module by a computed index."""
    from step import Step

    model = hf_to_ours(make_hf("qwen3moe-8x2"))
    for mode in ("blocks", "full"):
        with pytest.raises(ValueError, match="^--compile does not support mixture-of-experts models"):
            Step(model, mode)
