"""Checkpoint loading: Hugging Face folders (single and sharded safetensors), strictness, quantized checkpoints,
the real GGUF against transformers, and the peak memory of loading (float and quantize-at-load)."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from cli import pick_dtype
from helpers import PEAK_RSS, run_py
from formats.gguffile import unpermute_qk
from formats.hffolder import read_quantization
from load import load_model
from tiny_models import SEQ_LEN, greedy_ids, make_hf


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


def test_final_check_names_what_was_not_filled(single_file, monkeypatch):
    """Strict loading's last check, against a loader that skips a tensor or fills one twice: the error names it."""
    from formats import checkpoint

    folder, _ = single_file
    put = checkpoint.Filler.put
    monkeypatch.setattr(checkpoint.Filler, "put", lambda self, name, t: name == "norm.weight" or put(self, name, t))
    with pytest.raises(ValueError, match=r"missing \['norm.weight'\], still on the meta device \['norm.weight'\]"):
        load_model(str(folder), "cpu", torch.float32)
    monkeypatch.setattr(checkpoint.Filler, "put", lambda self, name, t: [put(self, name, t) for _ in range(2)])
    with pytest.raises(ValueError, match=r"tensor lm_head.weight filled twice"):  # the file's first
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
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
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


def test_read_quantization(tmp_path):
    """The mode a quantized checkpoint records in its safetensors metadata; None for a float checkpoint."""
    meta = {"quantization": "int4", "group_size": "64", "quantize_head": "true"}
    save_file({"x": torch.zeros(2)}, tmp_path / "q.safetensors", metadata={"format": "pt", **meta})
    save_file({"x": torch.zeros(2)}, tmp_path / "f.safetensors", metadata={"format": "pt"})
    assert read_quantization(str(tmp_path / "q.safetensors")) == meta
    assert read_quantization(str(tmp_path / "f.safetensors")) is None


@pytest.mark.slow
def test_loading_with_a_mismatched_mode(smollm2_int4_dir):
    with pytest.raises(ValueError, match="quantized as int4:64 with the head; requested int8"):
        load_model(smollm2_int4_dir, "cpu", torch.float32, quantize="int8")


# --- the real model: SmolLM2-135M-Instruct Q4_1 GGUF, ours vs transformers' GGUF loader ---

@pytest.fixture(scope="module")
def smollm2_hf(smollm2_gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(smollm2_gguf)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return hf, AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2_hf, smollm2):
    (hf, hf_tok), (ours, _) = smollm2_hf, smollm2
    text = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
            "combined movable metal type with an oil-based ink, a wooden screw press and a hand mould, "
            "and in a few decades printed books spread across Europe.")
    ids = torch.tensor([hf_tok.encode(text)[:32]])
    assert ids.shape[1] == 32
    ref = hf(ids).logits
    assert (ours(ids, torch.arange(32), all_logits=True) - ref).abs().max() <= 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("prompt", ["The capital of France is", "def fibonacci(n):",
                                    "Once upon a time, in a small village,"])
def test_smollm2_greedy_matches_transformers(smollm2_hf, smollm2, prompt):
    (hf, hf_tok), (ours, _) = smollm2_hf, smollm2
    ids = hf_tok.encode(prompt)
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                      min_new_tokens=32)[0, len(ids):].tolist()
    assert greedy_ids(ours, ids, 32) == ref


def load_peak_rss(path: str, dtype: str, quantize: str | None = None) -> tuple[float, float, float]:
    """(peak RSS growth, weight bytes, parameter bytes) of load_model(path, 'cpu', dtype, quantize=quantize) in a
    fresh process ("none": a GGUF's quantized blocks dequantized to dtype). Parameter bytes count a tied head
    once; weight bytes count a quantized module's buffers too."""
    code = ("import sys, torch, gguf, numpy\n"
            "from load import load_model\n"
            "from quantize import weight_bytes\n"
            f"{PEAK_RSS}\n"
            "base = peak_rss()\n"
            "quantize = (sys.argv[3:] or [None])[0]\n"
            "model, _ = load_model(sys.argv[1], 'cpu', getattr(torch, sys.argv[2]), quantize=quantize)\n"
            "print(peak_rss() - base, weight_bytes(model), sum(p.nbytes for p in model.parameters()))\n")
    result = run_py("-c", code, path, dtype, *([quantize] if quantize else []))
    assert result.returncode == 0, result.stderr
    growth, weights, params = result.stdout.split()
    return float(growth), float(weights), float(params)


@pytest.mark.slow
def test_smollm2_load_memory(smollm2_gguf):
    """Loading must not need more than ~2x the final weight bytes of RAM (peak RSS growth)."""
    growth, _, params = load_peak_rss(smollm2_gguf, "float32", "none")
    ratio = growth / params
    assert ratio <= 2.0, f"peak RSS grew by {ratio:.2f}x the weight bytes"


@pytest.mark.slow
def test_int4_load_peak_memory_below_float(smollm2_gguf):
    """Quantize-at-load never holds the float model: the int4 load's peak must undercut the float load's by most
    of the weight bytes it saves (~146 MB on SmolLM2 in bf16). Both in the dtype `auto` picks on this CPU (bf16
    where it is native, else float32: an emulated bf16 load is many times slower and says nothing more)."""
    dtype = str(pick_dtype("auto", torch.device("cpu"))[0]).removeprefix("torch.")
    float_peak, float_weights, _ = load_peak_rss(smollm2_gguf, dtype, "none")
    # int4:64, not the file's own int4:32 (which loads its codes as they are): every block is dequantized and
    # requantized, one tensor at a time
    int4_peak, int4_weights, _ = load_peak_rss(smollm2_gguf, dtype, "int4:64")
    assert int4_peak < float_peak - 0.6 * (float_weights - int4_weights), (dtype, int4_peak / 1e6, float_peak / 1e6)


@pytest.mark.parametrize("mode", [None, "int8", "int4:32"])
def test_fused_projections_split_and_join_back(mode):
    """A fused model's state under the checkpoint's names (q/k/v, gate/up apart; an int4 part padded to 16 rows
    on its own, here 20 rows -> 32) joins back to the same tensors, and the fused forward equals one built from
    separate q/k/v and gate/up products."""
    import torch.nn.functional as F

    from formats.checkpoint import checkpoint_state, load_state
    from model import ModelArgs, Transformer
    from quantize import quantize_model, swap_linears

    torch.manual_seed(0)
    args = ModelArgs(vocab_size=64, dim=64, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=20, hidden_dim=96)
    model = Transformer(args).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    if mode is not None:
        model = quantize_model(model, mode)
    state = checkpoint_state(model)
    names = {k.rsplit(".", 2)[-2] for k in state if k.startswith("layers.0.")}
    assert {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"} <= names and "qkv_proj" not in names
    if mode == "int4:32":
        assert state["layers.0.self_attn.k_proj.weight"].shape == (32, 32)  # 20 rows padded to 32, K/2 = 32
    with torch.device("meta"):
        empty = Transformer(args)
    if mode is not None:
        swap_linears(empty, mode)
    joined = load_state(empty, state).state_dict()  # each part into its rows of the fused modules
    own = model.state_dict()
    assert joined.keys() == own.keys()
    assert all(torch.equal(joined[k], own[k]) for k in joined)
    if mode is None:  # fused matmuls against the parts' own ones
        x = torch.randn(1, 3, 64)
        attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
        q, k, v = (F.linear(x, state[f"layers.0.self_attn.{n}_proj.weight"]) for n in "qkv")
        assert torch.allclose(attn.qkv_proj(x), torch.cat([q, k, v], -1), atol=1e-6)
        gate, up = (F.linear(x, state[f"layers.0.mlp.{n}_proj.weight"]) for n in ("gate", "up"))
        want = F.linear(F.silu(gate) * up, state["layers.0.mlp.down_proj.weight"])
        assert torch.allclose(mlp(x), want, atol=1e-6)


@pytest.mark.parametrize("mode", ["int8", "int4:32"])
def test_fused_rows_not_a_multiple_of_16(tmp_path, mode):
    """qkv_proj of 66 + 22 + 22 = 110 rows (an Int4Linear pads them to 112, each part on its own to 80, 32, 32) and a
    150-row head: quantizing at load gives exactly quantize_model's tensors, and an exported folder loads back to
    them."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    from scripts import export
    from quantize import quantize_model

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=150, hidden_size=66, intermediate_size=72, num_hidden_layers=1,
                                 num_attention_heads=3, num_key_value_heads=1, head_dim=22,
                                 initializer_range=0.1)).save_pretrained(tmp_path / "src")
    floats, _ = load_model(str(tmp_path / "src"), "cpu", torch.float32)
    at_load, _ = load_model(str(tmp_path / "src"), "cpu", torch.float32, quantize=mode, quantize_head=True)
    want = quantize_model(copy.deepcopy(floats), mode, quantize_head=True).state_dict()
    got = at_load.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    out = tmp_path / "out"
    assert export.main(["--model", str(tmp_path / "src"), "--mode", mode, "--quantize-head", "--out", str(out),
                        "--dtype", "float32"]) == 0
    loaded = load_model(str(out), "cpu", torch.float32)[0].state_dict()
    assert loaded.keys() == got.keys() and all(torch.equal(loaded[k], got[k]) for k in got)


# --- corrupt folders and files: one ValueError naming the problem, found before any weight is read ---

class WeightRead(BaseException):
    """Not an Exception: the loader's `except Exception` that names a tensor it cannot read must not catch it."""


def forbid_weight_reads(monkeypatch) -> None:
    """Reading any weight fails the test: the error must come from the checks that run before."""
    from formats import gguffile
    from formats import hffolder

    def read(*args, **kwargs):
        raise WeightRead("a weight was read before the error was found")

    monkeypatch.setattr(hffolder, "read_tensor", read)
    monkeypatch.setattr(gguffile, "dequantize", read)


@pytest.fixture()
def no_weight_reads(monkeypatch):
    forbid_weight_reads(monkeypatch)


@pytest.mark.parametrize("text, message", [
    ("[1, 2]", "config.json must hold a JSON object, not a list"),
    ("{oops", "config.json is not valid JSON"),
    (b"\xff\xfe{}", "config.json is not UTF-8 text"),
    (json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 160, "hidden_size": 64,
                 "num_hidden_layers": 2, "num_attention_heads": 7, "num_key_value_heads": 3, "head_dim": 24,
                 "intermediate_size": 112}), "7 attention heads are not a multiple of 3 key/value heads"),
    # no head_dim and a hidden size 4 heads do not divide: head dim 66 // 4 = 16, which the weights contradict
    (json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 160, "hidden_size": 66,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "intermediate_size": 112}), r"tensor embed_tokens.weight has shape \(160, 64\), expected \(160, 66\)"),
])
def test_corrupt_config_json(single_file, no_weight_reads, text, message):
    folder, _ = single_file
    (folder / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=message):
        load_model(str(folder), "cpu", torch.float32)


@pytest.mark.parametrize("dtype, stored", [(torch.int32, "I32"), (torch.bool, "BOOL"), (torch.uint8, "U8")])
def test_float_weight_stored_as_integers(single_file, no_weight_reads, dtype, stored):
    folder, state = single_file
    state["model.layers.0.mlp.down_proj.weight"] = torch.ones(64, 112, dtype=dtype)
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ValueError, match=f"tensor layers.0.mlp.down_proj.weight is stored as {stored}, expected F64"):
        load_model(str(folder), "cpu", torch.float32)


def test_quantized_codes_of_the_wrong_dtype(tiny_dir, tmp_path, monkeypatch):
    from scripts import export
    from safetensors import safe_open

    out = tmp_path / "int8"
    assert export.main(["--model", tiny_dir, "--mode", "int8", "--out", str(out), "--dtype", "float32"]) == 0
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        meta = f.metadata()
    state = load_file(out / "model.safetensors")
    state["layers.1.self_attn.v_proj.weight"] = state["layers.1.self_attn.v_proj.weight"].float()
    save_file(state, out / "model.safetensors", metadata=meta)
    forbid_weight_reads(monkeypatch)
    with pytest.raises(ValueError, match="layers.1.self_attn.v_proj.weight is stored as F32, expected I8"):
        load_model(str(out), "cpu", torch.float32)


@pytest.mark.parametrize("index, message", [
    ("[]", "must hold a JSON object, not a list"),
    ("{}", "has no weight_map object"),
    ('{"weight_map": {"model.norm.weight": 3}}', "has no weight_map object"),
])
def test_corrupt_index(single_file, index, message):
    folder, _ = single_file
    (folder / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ValueError, match=message):
        load_model(str(folder), "cpu", torch.float32)


@pytest.mark.parametrize("cut", [0, 7, -1])
def test_truncated_or_empty_safetensors(single_file, cut):
    folder, _ = single_file
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:cut])
    with pytest.raises(ValueError, match="cannot read safetensors file"):
        load_model(str(folder), "cpu", torch.float32)


GGUF_META = {"general.architecture": "llama", "llama.attention.head_count": 4, "llama.embedding_length": 64,
             "llama.block_count": 2, "llama.feed_forward_length": 128, "llama.vocab_size": 160}


@pytest.mark.parametrize("edit, message", [
    ({"llama.block_count": None}, "GGUF metadata has no llama.block_count"),
    ({"llama.vocab_size": None}, "GGUF metadata has no llama.vocab_size"),
    ({"llama.attention.head_count": 0}, "llama.attention.head_count must be a positive integer, got 0"),
    ({"llama.attention.head_count_kv": 3}, "4 attention heads are not a multiple of 3 key/value heads"),
    ({"llama.embedding_length": 72, "llama.attention.head_count": 8}, "head dim 9 is odd"),
    ({"llama.rope.freq_base": -1.0}, "llama.rope.freq_base must be a positive number"),
    ({"llama.rope.scaling.type": "linear"}, "llama.rope.scaling.factor must be a positive number, got None"),
    ({"llama.expert_count": 2, "llama.expert_used_count": 3}, "3 experts per token is not within 1..2"),
])
def test_gguf_metadata_errors(edit, message):
    from config import ModelArgs

    meta = {k: v for k, v in {**GGUF_META, **edit}.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_gguf(meta, [])


def test_gguf_tensor_of_a_type_that_cannot_be_dequantized(tmp_path):
    """An I8 matrix (no GGUF converter writes one): named, instead of gguf's NotImplementedError."""
    import numpy as np

    from formats.gguffile import GGUF_BLOCK_NAMES, GGUF_TOP_NAMES
    from tiny_models import llama_gguf_writer

    hf = make_hf("llama-gqa")
    writer = llama_gguf_writer(tmp_path / "i8.gguf", hf.config)
    writer.add_key_length(hf.config.head_dim)
    writer.add_value_length(hf.config.head_dim)
    top, block = {v: k for k, v in GGUF_TOP_NAMES.items()}, {v: k for k, v in GGUF_BLOCK_NAMES.items()}
    for name, t in hf.state_dict().items():
        parts = name.removeprefix("model.").split(".")
        gguf_name = f"blk.{parts[1]}.{block['.'.join(parts[2:-1])]}.weight" if parts[0] == "layers" else \
            f"{top[parts[0]]}.weight"
        w = t.numpy()
        writer.add_tensor(gguf_name, w.astype(np.int8) if gguf_name == "blk.1.ffn_up.weight" else w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"cannot dequantize GGUF tensor 'layers.1.mlp.up_proj.weight' \(I8\)"):
        load_model(str(tmp_path / "i8.gguf"), "cpu", torch.float32)


def test_gguf_bad_alignment(tmp_path):
    import gguf

    from formats.gguffile import read_gguf

    writer = gguf.GGUFWriter(str(tmp_path / "a.gguf"), "llama")
    writer.add_uint32("general.alignment", 0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match="general.alignment must be a positive integer, got 0"):
        read_gguf(str(tmp_path / "a.gguf"))
