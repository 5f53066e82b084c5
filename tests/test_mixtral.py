"""Mixtral (sparse mixture of experts) beyond the logits tests every tiny config gets in test_model.py: the three
checkpoint layouts (per-expert and stacked safetensors, GGUF) against transformers, strict loading, what a decode
step reads, quantized experts, the int8 cache, the engine, speculative decoding, --compile and tensor parallelism."""
import copy
import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from safetensors.torch import load_file, save_file

import quantize as q
from step import Step
from serving.engine import Engine, EngineConfig
from helpers import ToyTokenizer
from kvcache import KVCache
from formats.gguffile import GGUF_BLOCK_NAMES, GGUF_TOP_NAMES
from load import load_model
from model import ModelArgs, MoE, Router
from tiny_models import SEQ_LEN, greedy_ids, hf_to_ours, llama_cpp_permute, llama_gguf_writer, make_hf

PROMPT = [5, 17, 42, 99, 3, 64, 8]


@pytest.fixture(scope="module")
def hf():
    """8 experts, 2 per token, GQA 4:2, no sliding window."""
    return make_hf("mixtral-8x2")


@pytest.fixture(scope="module")
def ours(hf):
    return hf_to_ours(hf)


def tokens(seq: int = SEQ_LEN, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 160, (1, seq), generator=torch.Generator().manual_seed(seed))


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


# ---- loading ----

@pytest.mark.parametrize("layout", ["per-expert", "stacked"])
def test_hf_folder_layouts_match_transformers(hf, tmp_path, layout):
    """save_pretrained writes Mixtral's original per-expert names (block_sparse_moe.experts.N.w1/w2/w3) by default
    and transformers 5's stacked experts (mlp.experts.gate_up_proj (E, 2F, C)) with save_original_format=False."""
    hf.save_pretrained(tmp_path, save_original_format=layout == "per-expert")
    keys = load_file(tmp_path / "model.safetensors").keys()
    stacked = "model.layers.0.mlp.experts.gate_up_proj" in keys
    assert stacked == (layout == "stacked")
    assert stacked or "model.layers.0.block_sparse_moe.experts.7.w3.weight" in keys
    model, _ = load_model(str(tmp_path), "cpu", torch.float32)
    toks = tokens()
    assert (model(toks, torch.arange(SEQ_LEN), all_logits=True) - hf(toks).logits).abs().max() <= 1e-4
    assert greedy_ids(model, PROMPT, 16) == hf_greedy(hf, PROMPT, 16)


def test_strict_loading_names_the_missing_expert(hf, tmp_path):
    hf.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.block_sparse_moe.experts.5.w2.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors \['layers.1.mlp.experts.5.down_proj.weight'\]"):
        load_model(str(tmp_path), "cpu", torch.float32)


def test_config_errors():
    cfg = {"architectures": ["MixtralForCausalLM"], "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
           "num_attention_heads": 2, "intermediate_size": 16, "num_local_experts": 4}
    assert ModelArgs.from_hf_config({**cfg, "num_experts_per_tok": 3}).n_experts_per_token == 3
    with pytest.raises(ValueError, match="5 experts per token is not within 1..4 experts"):
        ModelArgs.from_hf_config({**cfg, "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match="unsupported architecture 'Qwen2MoeForCausalLM'"):
        ModelArgs.from_hf_config({**cfg, "architectures": ["Qwen2MoeForCausalLM"]})


def write_mixtral_gguf(path, hf, linear_type: str = "F32", drop: str | None = None, per_expert: bool = False) -> str:
    """`hf` as llama.cpp writes a Mixtral: llama architecture with expert_count / expert_used_count, the router as
    ffn_gate_inp (F32) and each layer's experts stacked as ffn_{gate,up,down}_exps (E, rows, columns); the
    attention and expert linears in linear_type; `drop` leaves that tensor out. per_expert: the older files' one
    tensor per expert, `blk.N.ffn_{gate,up,down}.E.weight`."""
    import gguf

    cfg = hf.config
    writer = llama_gguf_writer(path, cfg)
    top, block = {v: k for k, v in GGUF_TOP_NAMES.items()}, {v: k for k, v in GGUF_BLOCK_NAMES.items()}
    F = cfg.intermediate_size
    tensors = {}
    for name, t in hf.state_dict().items():
        w = t.float().numpy()
        parts = name.removeprefix("model.").split(".")
        if parts[0] != "layers":
            tensors[f"{top[parts[0]]}.weight"] = w
        elif parts[-1] == "gate_up_proj":  # (E, 2F, C): rows gate | up
            tensors[f"blk.{parts[1]}.ffn_gate_exps.weight"] = w[:, :F]
            tensors[f"blk.{parts[1]}.ffn_up_exps.weight"] = w[:, F:]
        elif parts[-1] == "down_proj" and parts[-2] == "experts":
            tensors[f"blk.{parts[1]}.ffn_down_exps.weight"] = w
        else:
            kind = block[".".join(parts[2:-1])]
            if kind in ("attn_q", "attn_k"):
                w = llama_cpp_permute(w, cfg.num_attention_heads if kind == "attn_q" else cfg.num_key_value_heads)
            tensors[f"blk.{parts[1]}.{kind}.weight"] = w
    if per_expert:
        for name in [n for n in tensors if "_exps" in n]:
            stacked = tensors.pop(name)
            tensors.update({name.replace("_exps", f".{e}"): stacked[e] for e in range(len(stacked))})
    for name, w in tensors.items():
        if name == drop:
            continue
        if ("_exps" in name or ".attn_" in name) and linear_type != "F32":
            raw = gguf.GGMLQuantizationType[linear_type]
            writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(w), raw), raw_dtype=raw)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize("per_expert", [False, True])
def test_gguf_same_weights_same_tokens(hf, ours, tmp_path, per_expert):
    path = write_mixtral_gguf(tmp_path / "mixtral.gguf", hf, per_expert=per_expert)
    model, _ = load_model(path, "cpu", torch.float32)
    assert (model.args.n_experts, model.args.n_experts_per_token) == (8, 2)
    toks = tokens()
    assert (model(toks, torch.arange(SEQ_LEN), all_logits=True) - hf(toks).logits).abs().max() <= 1e-4
    assert greedy_ids(model, PROMPT, 24) == greedy_ids(ours, PROMPT, 24) == hf_greedy(hf, PROMPT, 24)


def test_gguf_missing_expert_tensor(hf, tmp_path):
    path = write_mixtral_gguf(tmp_path / "mixtral.gguf", hf, drop="blk.1.ffn_up_exps.weight")
    with pytest.raises(ValueError, match=r"missing tensors \['layers.1.mlp.experts.0.up_proj.weight', "):
        load_model(path, "cpu", torch.float32)


def test_gguf_q4_0_experts_load_as_their_codes(tmp_path):
    """Q4_0 linears, stacked experts included (widths multiples of 32), load natively as int4:32 codes, equal to
    the file's own dequantization within bf16's rounding of the scales; the router stays a float Router."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    hf = MixtralForCausalLM(MixtralConfig(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                          max_position_embeddings=256, initializer_range=0.1)).eval()
    path = write_mixtral_gguf(tmp_path / "q4.gguf", hf, linear_type="Q4_0")
    floats, _ = load_model(path, "cpu", torch.float32, quantize="none")
    native, _ = load_model(path, "cpu", torch.float32)
    assert q.quantization_of(native) == {"quantization": "int4", "group_size": "32", "quantize_head": "false"}
    router = native.layers[0].mlp.gate
    assert isinstance(router, Router) and torch.equal(router.weight, floats.layers[0].mlp.gate.weight)
    for e in range(4):
        for name in ("gate_up_proj", "down_proj"):
            module = native.layers[0].mlp.experts[e].get_submodule(name)
            w = floats.layers[0].mlp.experts[e].get_submodule(name).weight
            assert isinstance(module, q.Int4Linear)
            assert (module.dequantize() - w).abs().max() <= 2 ** -7 * w.abs().max()
    toks = tokens(seq=12)
    a, b = floats(toks, torch.arange(12), all_logits=True), native(toks, torch.arange(12), all_logits=True)
    assert ((b - a).abs().max() / a.abs().max()).item() < 0.05  # the kernel's bf16 activations


# ---- what a decode step reads ----

def test_batch1_decode_runs_only_the_selected_experts(ours):
    """One decode step calls exactly the k experts the router picked in each layer, so it reads k of E experts'
    weight bytes; a prefill runs each expert that received a token once."""
    calls, picked = [], []
    hooks = []
    for i, layer in enumerate(ours.layers):
        hooks.append(layer.mlp.gate.register_forward_hook(lambda m, inp, out, i=i: picked.append((i, out[1]))))
        for e, expert in enumerate(layer.mlp.experts):
            hooks.append(expert.register_forward_hook(lambda m, inp, out, i=i, e=e: calls.append((i, e))))
    try:
        cache = KVCache.for_model(ours.args, 1, 32, torch.float32, "cpu")
        ours(torch.tensor([PROMPT]), torch.arange(len(PROMPT)), cache)
        assert sorted(calls) == sorted(set(calls))  # prefill: each expert at most once per layer, for all its tokens
        calls.clear(), picked.clear()
        ours(torch.tensor([[7]]), torch.tensor([len(PROMPT)]), cache)
    finally:
        for h in hooks:
            h.remove()
    k, E = ours.args.n_experts_per_token, ours.args.n_experts
    assert len(picked) == ours.args.n_layers
    assert sorted(calls) == sorted((i, e) for i, ids in picked for e in ids[0].tolist())
    expert_bytes = q.weight_bytes(ours.layers[0].mlp.experts[0])
    read = sum(q.weight_bytes(ours.layers[i].mlp.experts[e]) for i, e in calls)
    assert read == ours.args.n_layers * k * expert_bytes
    assert read * E == ours.args.n_layers * k * sum(q.weight_bytes(ex) for ex in ours.layers[0].mlp.experts)


def test_decode_path_equals_grouped_path(ours):
    """The one-token path (the k selected experts) against the grouped path on the same rows."""
    moe = ours.layers[0].mlp
    x = torch.randn(5, 1, ours.args.dim, generator=torch.Generator().manual_seed(0))
    grouped = moe(x.view(1, 5, -1))  # M = 5: grouped by expert
    one_by_one = torch.cat([moe(x[i:i + 1]) for i in range(5)], dim=1)  # M = 1 each
    assert (grouped - one_by_one).abs().max() <= 1e-6


# ---- quantized experts ----

@pytest.mark.parametrize("mode", ["int8", "int4:32"])
def test_quantized_experts_equal_their_dequantize_reference(ours, mode, monkeypatch):
    """quantize_model quantizes every expert linear and leaves the router in model precision; with the
    dequantize-then-matmul path the model equals a float copy holding each linear's dequantize() weights."""
    monkeypatch.setattr(q, "int8_kernel", lambda device: None)
    monkeypatch.setattr(q, "int4_kernel", lambda device: None)
    quantized = q.quantize_model(copy.deepcopy(ours), mode)
    reference = copy.deepcopy(ours)
    for (name, m), (_, ref) in zip(quantized.named_modules(), reference.named_modules()):
        if isinstance(ref, nn.Linear) and name != "lm_head":  # attention and every expert's linears
            assert isinstance(m, (q.Int8Linear, q.Int4Linear)), name
            ref.weight.copy_(m.dequantize())
        if isinstance(m, Router):
            assert torch.equal(m.weight, ref.weight) and m.weight.dtype == torch.float32
    toks = tokens(seq=24)
    got = quantized(toks, torch.arange(24), all_logits=True)
    assert (got - reference(toks, torch.arange(24), all_logits=True)).abs().max() <= 1e-5
    assert q.describe(quantized) == mode


@pytest.mark.parametrize("mode", ["int8", "int4:32"])
def test_quantized_kernels_close_to_float(ours, mode):
    quantized = q.quantize_model(copy.deepcopy(ours), mode)
    assert q.weight_bytes(quantized) < q.weight_bytes(ours) * (0.5 if mode == "int8" else 0.4)
    toks = tokens(seq=12)
    a, b = ours(toks, torch.arange(12), all_logits=True), quantized(toks, torch.arange(12), all_logits=True)
    assert ((b - a).abs().max() / a.abs().max()).item() < (0.05 if mode == "int8" else 0.5)


def test_export_round_trip(hf, ours, tmp_path):
    """A quantized Mixtral written by export.save_quantized loads back with the same modules and logits."""
    from scripts.export import save_quantized

    quantized = q.quantize_model(copy.deepcopy(ours), "int8")
    hf_dir = tmp_path / "src"
    hf.save_pretrained(hf_dir)  # the source folder whose config.json export copies
    save_quantized(quantized, str(hf_dir), str(tmp_path / "out"))
    loaded, _ = load_model(str(tmp_path / "out"), "cpu", torch.float32)
    toks = tokens(seq=12)
    assert torch.equal(loaded(toks, torch.arange(12)), quantized(toks, torch.arange(12)))


# ---- caches, engine, speculative, compile ----

def test_int8_cache_and_paged_engine_match_greedy(ours):
    """The int8 KV cache gives close logits; the engine (paged cache, continuous batching, chunked prefill: rows
    of several sequences grouped by expert) gives decode.generate's tokens."""
    toks = tokens(seq=24)
    full = ours(toks, torch.arange(24), all_logits=True)
    cache = KVCache.for_model(ours.args, 1, 24, torch.float32, "cpu", kv_dtype="int8")
    assert (ours(toks, torch.arange(24), cache, all_logits=True) - full).abs().max() <= 0.1 * full.abs().max()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 160, (n,), generator=g).tolist() for n in (3, 17, 40, 9, 33)]
    expected = [greedy_ids(ours, p, 12) for p in prompts]
    engine = Engine(ours, ToyTokenizer(), EngineConfig(block_size=4, num_blocks=200, max_running=8, token_budget=24))
    assert [c.tokens for c in engine.generate(prompts, max_new_tokens=12)] == expected


def test_speculative_greedy_matches_plain_greedy(ours):
    import speculative
    from speculative import ModelDraft, PromptLookupDraft

    want = greedy_ids(ours, PROMPT, 32)
    drafts = {"dense-draft": ModelDraft(hf_to_ours(make_hf("llama-gqa")), ours),
              "moe-draft": ModelDraft(hf_to_ours(make_hf("mixtral-8x2", seed=1)), ours),
              "lookup": PromptLookupDraft()}
    for name, draft in drafts.items():
        assert [t.id for t in speculative.generate(ours, draft, PROMPT, max_new_tokens=32, k=4)] == want, name


def test_compile_refused_in_one_line(ours):
    with pytest.raises(ValueError, match=r"^--compile does not support mixture-of-experts models \(Mixtral\)"):
        Step(ours, "full")


# ---- tensor parallel ----

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    from features import tp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, _ = load_model(model_dir, "cpu", torch.float32, shard=tp.Shard(rank, world))
        tp.install(model)
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT]), torch.arange(len(PROMPT)), all_logits=True)[0]
            ids = greedy_ids(model, PROMPT, 12)
        shape = tuple(model.layers[0].mlp.experts[3].down_proj.weight.shape)
        torch.save({"logits": logits, "tokens": ids, "shape": shape}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["per-expert", "stacked"])
def test_tensor_parallel_splits_each_expert(hf, ours, tmp_path, layout):
    """2 ranks: each holds half of every expert's width (column-parallel gate/up, row-parallel down) and the whole
    router; the logits and tokens are one process's."""
    hf.save_pretrained(tmp_path / "model", save_original_format=layout == "per-expert")
    mp.spawn(run_rank, args=(2, free_port(), str(tmp_path / "model"), str(tmp_path)), nprocs=2)
    logits = ours(torch.tensor([PROMPT]), torch.arange(len(PROMPT)), all_logits=True)[0]
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert (got["logits"] - logits).abs().max() <= 1e-4
        assert got["tokens"] == greedy_ids(ours, PROMPT, 12)
        assert got["shape"] == (64, 112 // 2)


def test_moe_module_types(ours):
    assert all(isinstance(layer.mlp, MoE) for layer in ours.layers)
    assert len(ours.layers[0].mlp.experts) == 8
