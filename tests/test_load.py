"""Checkpoint loading: Hugging Face folders (single and sharded safetensors), strictness, and the real GGUF."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from load import load_model, unpermute_qk
from tiny_models import PEAK_RSS, SEQ_LEN, make_hf

torch.set_grad_enabled(False)


def save_hf(name: str, folder, **kw):
    hf = make_hf(name)
    hf.save_pretrained(folder, **kw)
    return hf


@pytest.mark.parametrize("name", ["llama-gqa", "llama-tied", "mistral-window"])
def test_sharded_folder_matches_transformers(tmp_path, name):
    hf = save_hf(name, tmp_path, max_shard_size="40KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    model, path = load_model(str(tmp_path), "cpu", torch.float32)
    assert path == str(tmp_path)
    toks = torch.randint(0, 160, (1, SEQ_LEN))
    assert (model(toks, torch.arange(SEQ_LEN), all_logits=True) - hf(toks).logits).abs().max() <= 1e-4
    if model.args.tie_embeddings:
        assert model.lm_head.weight is model.embed_tokens.weight


def test_dtype_and_rope_device(tmp_path):
    save_hf("llama-gqa", tmp_path)
    model, _ = load_model(str(tmp_path), "cpu", torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rope_cos.dtype == torch.float32 and model.rope_cos.device.type == "cpu"
    assert model(torch.tensor([[1, 2, 3]]), torch.arange(3)).isfinite().all()


@pytest.fixture()
def single_file(tmp_path):
    """A one-file folder and its state dict, to be edited by the strictness tests."""
    save_hf("llama-gqa", tmp_path)
    return tmp_path, load_file(tmp_path / "model.safetensors")


def test_missing_tensor(single_file):
    folder, state = single_file
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors \['layers.1.mlp.up_proj.weight'\]"):
        load_model(str(folder), "cpu", torch.float32)


def test_unexpected_tensor(single_file):
    folder, state = single_file
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(96)
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"unexpected tensors \['layers.0.self_attn.q_proj.bias'\]"):
        load_model(str(folder), "cpu", torch.float32)


def test_wrong_shape(single_file):
    folder, state = single_file
    state["model.norm.weight"] = torch.ones(63)
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"tensor norm.weight has shape \(63,\), expected \(64,\)"):
        load_model(str(folder), "cpu", torch.float32)


def test_truncated_safetensors(single_file):
    folder, _ = single_file
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cannot read safetensors file"):
        load_model(str(folder), "cpu", torch.float32)


def test_missing_shard(tmp_path):
    save_hf("llama-gqa", tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    os.remove(tmp_path / sorted(set(index["weight_map"].values()))[-1])
    with pytest.raises(FileNotFoundError, match="listed in the index is missing"):
        load_model(str(tmp_path), "cpu", torch.float32)


def test_unsupported_architecture(single_file):
    folder, _ = single_file
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["Qwen2ForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'Qwen2ForCausalLM'"):
        load_model(str(folder), "cpu", torch.float32)


def test_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "nope" / "model.gguf"), "cpu", torch.float32)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tmp_path), "cpu", torch.float32)


def test_hub_id_unreachable(monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(*args, **kwargs):
        raise LocalEntryNotFoundError("cannot reach the hub\nsecond line")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(FileNotFoundError, match=r"could not be fetched from the Hugging Face hub .*cannot reach"):
        load_model("some-org/some-model", "cpu", torch.float32)


def test_unpermute_inverts_llama_cpp_permute():
    """llama.cpp's converter: reshape(n_head, 2, D/2, C).swapaxes(1, 2); we must undo exactly that."""
    w = torch.randn(3 * 8, 5)  # 3 heads of D = 8
    permuted = w.reshape(3, 2, 4, 5).transpose(1, 2).reshape(24, 5)
    assert torch.equal(unpermute_qk(permuted, 3), w)


# --- the real model: SmolLM2-135M-Instruct Q4_1 GGUF, ours vs transformers' GGUF loader ---

@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(smollm2_gguf)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    ours, _ = load_model(smollm2_gguf, "cpu", torch.float32)
    return hf, hf_tok, ours


def test_smollm2_logits_match_transformers(smollm2):
    hf, hf_tok, ours = smollm2
    text = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
            "combined movable metal type with an oil-based ink, a wooden screw press and a hand mould, "
            "and in a few decades printed books spread across Europe.")
    ids = torch.tensor([hf_tok.encode(text)[:32]])
    assert ids.shape[1] == 32
    ref = hf(ids).logits
    assert (ours(ids, torch.arange(32), all_logits=True) - ref).abs().max() <= 1e-3


@pytest.mark.parametrize("prompt", ["The capital of France is", "def fibonacci(n):",
                                    "Once upon a time, in a small village,"])
def test_smollm2_greedy_matches_transformers(smollm2, prompt):
    from generate import generate

    hf, hf_tok, ours = smollm2
    ids = hf_tok.encode(prompt)
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                      min_new_tokens=32)[0, len(ids):].tolist()
    assert list(generate(ours, ids, 32, temperature=0.0)) == ref


def test_smollm2_load_memory(smollm2_gguf):
    """Loading must not need more than ~2x the final weight bytes of RAM (peak RSS growth)."""
    code = (
        "import sys, torch, gguf, numpy\n"
        "from load import load_model\n"
        f"{PEAK_RSS}\n"
        "base = peak_rss()\n"
        "model, _ = load_model(sys.argv[1], 'cpu', torch.float32)\n"
        "weights = sum(p.nbytes for p in model.parameters())\n"  # parameters() counts the tied head once
        "print((peak_rss() - base) / weights)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code, smollm2_gguf], cwd=root, capture_output=True, text=True,
                         check=True)
    ratio = float(out.stdout.strip())
    assert ratio <= 2.0, f"peak RSS grew by {ratio:.2f}x the weight bytes"
