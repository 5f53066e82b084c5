"""Quantization: exact packing, every kernel path against its dequantize-then-matmul reference, the int8 KV
cache, quality on the real model, and quantized checkpoints (save, load, round trip, bad input)."""
import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import quantize as q
from generate import generate
from kvcache import KVCache
from load import load_model
from tiny_models import PEAK_RSS, hf_to_ours, make_hf
from tokenizer import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [(64, 64), (40, 72), (17, 33), (96, 160)]  # (N, K): odd ones take the padding path


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def quantized_linear(mode: str, n: int, k: int, dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    linear = torch.nn.Linear(k, n, bias=False).to(dtype)
    module = q.make_quantized_linear(*q.parse_mode(mode), linear, dtype)
    module.load_state_dict(module.quantize_weight(linear.weight))
    return linear, module


def test_pack_unpack_round_trip_exact():
    codes = torch.randint(0, 16, (37, 64), dtype=torch.uint8)
    packed = q.pack_int4(codes)
    assert packed.shape == (37, 32) and packed.dtype == torch.uint8
    assert torch.equal(q.unpack_int4(packed), codes)
    assert torch.equal(q.pack_int4(q.unpack_int4(packed)), packed)


@pytest.mark.parametrize("n, k", SHAPES)
def test_kernel_layout_round_trips_to_plain_codes(n, k):
    """The kernel's own packed layout reads back to exactly the codes quantize_weight produced."""
    linear, module = quantized_linear("int4:32", n, k)
    plain = module.quantize_weight(linear.weight)["weight"]
    assert module.kernel == q.int4_kernel(torch.device("cpu"))
    assert torch.equal(q.pack_int4(module.codes()), plain)
    assert torch.equal(module.state_dict()["weight"], plain)  # checkpoints get the plain layout


@pytest.mark.parametrize("group", q.GROUP_SIZES)
def test_int4_quantization_error_within_half_a_step(group):
    torch.manual_seed(0)
    w = torch.randn(48, 512)
    codes, sz = q.quantize_int4(w, group, torch.bfloat16)
    step = sz[..., 0].float().t().repeat_interleave(group, dim=1)  # (N, K)
    assert codes.max() <= 15
    assert ((q.dequantize_int4(codes, sz) - w).abs() <= step * 0.5 + 1e-2 * step + 1e-6).all()


def test_int8_quantization_error_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(48, 100)
    codes, scales = q.quantize_int8(w, torch.float32)
    assert codes.abs().max() <= 127
    assert ((q.dequantize_int8(codes, scales) - w).abs() <= scales[:, None] * 0.5 + 1e-6).all()


@pytest.mark.parametrize("mode", ["int8", "int4:32", "int4:64", "int4:128", "int4:256"])
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_dequantize_then_matmul(mode, n, k, dtype):
    """The native kernel path (bf16 activations on CPU) equals F.linear with dequantize() within bf16 rounding."""
    linear, module = quantized_linear(mode, n, k, dtype)
    x = torch.randn(3, 5, k, dtype=dtype)
    y = module(x)
    assert y.shape == (3, 5, n) and y.dtype == dtype
    reference = F.linear(x.float(), module.dequantize().float())
    assert rel_err(y, reference) < 1e-2
    # and the quantized weight is close to the float one (a wrong scale or nibble order would not be)
    tolerance = 0.01 if mode == "int8" else 0.1
    assert rel_err(module.dequantize(), linear.weight) < tolerance


@pytest.mark.parametrize("mode", ["int8", "int4:64"])
@pytest.mark.parametrize("n, k", SHAPES)
def test_reference_path_matches_dequantize(mode, n, k, monkeypatch):
    """With no kernel (e.g. an old torch or another device) forward is exactly F.linear with dequantize()."""
    monkeypatch.setattr(q, "int8_kernel", lambda device: None)
    monkeypatch.setattr(q, "int4_kernel", lambda device: None)
    _, module = quantized_linear(mode, n, k)
    assert getattr(module, "kernel", None) is None
    x = torch.randn(4, k)
    torch.testing.assert_close(module(x), F.linear(x, module.dequantize()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode, message", [
    ("fp8", "unknown quantization mode 'fp8'"),
    ("int8:64", "unknown quantization mode 'int8:64'"),
    ("int4:48", "group size '48'"),
    ("int4:abc", "group size 'abc'"),
    ("int4:0", "group size '0'"),
])
def test_bad_modes(mode, message):
    with pytest.raises(ValueError, match=message):
        q.parse_mode(mode)


def test_parse_mode():
    assert q.parse_mode("int8") == ("int8", None)
    assert q.parse_mode("int4") == ("int4", q.DEFAULT_GROUP)
    assert q.parse_mode("int4:256") == ("int4", 256)


# ---- the int8 KV cache ----

def test_int8_kv_cache_update_and_bytes():
    B, K, S, D, L = 2, 3, 16, 64, 4
    fp = KVCache(L, B, K, S, D, torch.float32, "cpu")
    q8 = KVCache(L, B, K, S, D, torch.float32, "cpu", kv_dtype="int8")
    assert fp.bytes_per_token == 2 * L * K * D * 4
    assert q8.bytes_per_token == 2 * L * K * (D + 4)  # int8 values plus a float32 scale per token and head
    assert q8.nbytes == q8.bytes_per_token * B * S
    torch.manual_seed(0)
    k, v = torch.randn(B, K, 5, D), torch.randn(B, K, 5, D)
    pos = torch.arange(3, 8)
    k_all, v_all = q8.layers[0].update(pos, k, v)
    assert k_all.shape == (B, K, S, D) and k_all.dtype == torch.float32
    step = k.abs().amax(-1, keepdim=True) / 127  # half a step is the most rounding can move a value
    assert ((k_all[:, :, 3:8] - k).abs() <= step * 0.5 + 1e-6).all()
    assert (v_all[:, :, 3:8] - v).abs().max() < 0.02
    # per-row positions (B, T) write the same values as shared positions
    per_row = KVCache(L, B, K, S, D, torch.float32, "cpu", kv_dtype="int8")
    k_rows, _ = per_row.layers[0].update(pos.expand(B, -1), k, v)
    assert torch.equal(k_rows, k_all)
    q8.reset()
    assert all(t.abs().sum() == 0 for layer in q8.layers for t in layer.buffers())
    with pytest.raises(ValueError, match="unknown KV cache dtype 'fp8'"):
        KVCache(L, B, K, S, D, torch.float32, "cpu", kv_dtype="fp8")


def test_int8_kv_cache_decode_close_to_float_cache():
    model = hf_to_ours(make_hf("llama-gqa"))
    tokens = torch.randint(0, model.args.vocab_size, (1, 24))
    out = {}
    for kv in ("model", "int8"):
        cache = KVCache.for_model(model.args, 1, 24, torch.float32, "cpu", kv_dtype=kv)
        logits = [model(tokens[:, :16], torch.arange(16), cache)]
        for t in range(16, 24):
            logits.append(model(tokens[:, t:t + 1], torch.tensor([t]), cache))
        out[kv] = torch.cat(logits, dim=1)
    assert rel_err(out["int8"], out["model"]) < 0.02


# ---- whole models ----

@pytest.mark.parametrize("mode", ["int8", "int4:32"])
@pytest.mark.parametrize("head", [False, True])
def test_quantize_model_swaps_linears(mode, head):
    model = hf_to_ours(make_hf("llama-tied")).eval()
    ref = copy.deepcopy(model)
    quantized = q.quantize_model(model, mode, quantize_head=head)
    linears = [n for n, m in quantized.named_modules() if isinstance(m, torch.nn.Linear)]
    assert linears == ([] if head else ["lm_head"])
    meta = q.quantization_of(quantized)
    assert meta["quantization"] == mode.split(":")[0] and meta["quantize_head"] == str(head).lower()
    assert q.weight_bytes(quantized) < q.weight_bytes(ref) * (0.5 if mode == "int8" else 0.4)
    tokens = torch.randint(0, model.args.vocab_size, (1, 12))
    with torch.no_grad():
        a, b = ref(tokens, torch.arange(12), all_logits=True), quantized(tokens, torch.arange(12), all_logits=True)
    assert rel_err(b, a) < (0.05 if mode == "int8" else 0.5)  # random weights: int4 is coarse; broken packing is ~1


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_gguf):
    """SmolLM2 in float32, the eval text's tokens and the reference log-probs (loaded once)."""
    model, path = load_model(smollm2_gguf, "cpu", torch.float32)
    tokens = q.load_eval_tokens(load_tokenizer(path))
    return model, tokens, q.teacher_forced_logprobs(model, tokens)


@pytest.mark.parametrize("mode, kv, min_top1, max_kl", [
    # The GGUF reference is itself Q4_1 (group 32): int4 g32 lands on the same grid, almost lossless.
    ("int4:32", "model", 0.90, 0.01),
    # int8 per channel re-rounds that grid: measured top-1 0.978, KL 0.0023 (the issue asked 0.99; see README)
    ("int8", "model", 0.97, 0.005),
    (None, "int8", 0.98, 0.002),
])
def test_quality_on_smollm2(smollm2_reference, mode, kv, min_top1, max_kl):
    model, tokens, ref = smollm2_reference
    test_model = model if mode is None else q.quantize_model(copy.deepcopy(model), mode)
    row = q.compare(ref, q.teacher_forced_logprobs(test_model, tokens, kv), tokens)
    assert len(tokens) > 1000
    assert row["top1"] >= min_top1 and row["kl"] <= max_kl, row


def load_peak_rss(path: str, *load_args: str) -> tuple[float, float]:
    """(peak RSS growth, weight bytes) of load_model(path, 'cpu', bf16, *load_args) in a fresh process."""
    code = ("import sys, torch, gguf, numpy\n"
            "from load import load_model\n"
            "from quantize import weight_bytes\n"
            f"{PEAK_RSS}\n"
            "base = peak_rss()\n"
            "model, _ = load_model(sys.argv[1], 'cpu', torch.bfloat16, quantize=(sys.argv[2:] or [None])[0])\n"
            "print(peak_rss() - base, weight_bytes(model))\n")
    out = subprocess.run([sys.executable, "-c", code, path, *load_args], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    growth, weights = out.stdout.split()
    return float(growth), float(weights)


def test_int4_load_peak_memory_below_bf16(smollm2_gguf):
    """Quantize-at-load never holds the float model: the int4 load's peak must undercut the bf16 load's by
    most of the weight bytes it saves (~146 MB on SmolLM2)."""
    bf16_peak, bf16_weights = load_peak_rss(smollm2_gguf)
    int4_peak, int4_weights = load_peak_rss(smollm2_gguf, "int4")
    assert int4_peak < bf16_peak - 0.6 * (bf16_weights - int4_weights), (int4_peak / 1e6, bf16_peak / 1e6)


# ---- quantized checkpoints ----

def run_py(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture(scope="module")
def saved_int4(smollm2_gguf, tmp_path_factory):
    """quantize.py --mode int4:64 --quantize-head --out DIR on the GGUF (bf16 scales and embedding)."""
    out = tmp_path_factory.mktemp("int4") / "ckpt"
    result = run_py("quantize.py", "--model", smollm2_gguf, "--mode", "int4:64", "--quantize-head", "--out", str(out))
    assert result.returncode == 0, result.stderr
    return out


def test_saved_checkpoint_size_and_metadata(saved_int4, smollm2_reference):
    model, _, _ = smollm2_reference
    bf16_bytes = sum(p.numel() for p in model.parameters()) * 2  # the same model as a bf16 checkpoint
    folder_bytes = sum(f.stat().st_size for f in saved_int4.iterdir())
    assert folder_bytes < 0.4 * bf16_bytes, (folder_bytes, bf16_bytes)
    assert q.read_quantization(str(saved_int4 / "model.safetensors")) == {
        "quantization": "int4", "group_size": "64", "quantize_head": "true"}
    assert sorted(p.name for p in saved_int4.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def test_saved_tokenizer_matches_gguf(saved_int4, smollm2_gguf):
    ours, theirs = load_tokenizer(str(saved_int4)), load_tokenizer(smollm2_gguf)
    for text in ["Hello world", "  two  spaces\nand 12345 digits", "<|im_start|>user\nhi<|im_end|>", "héllo ✓"]:
        assert ours.encode(text) == theirs.encode(text)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages)
    assert (ours.bos_id, ours.eos_ids, ours.add_bos) == (theirs.bos_id, theirs.eos_ids, theirs.add_bos)


def test_saved_checkpoint_round_trip_is_token_identical(saved_int4, smollm2_gguf):
    loaded, _ = load_model(str(saved_int4), "cpu", torch.bfloat16)
    at_load, _ = load_model(smollm2_gguf, "cpu", torch.bfloat16, quantize="int4:64", quantize_head=True)
    saved_state = loaded.state_dict()
    for name, tensor in at_load.state_dict().items():
        assert torch.equal(saved_state[name], tensor), name
    tok = load_tokenizer(str(saved_int4))
    prompt = tok.encode("The capital of France is")
    a = list(generate(loaded, prompt, 24))
    b = list(generate(at_load, prompt, 24))
    assert a == b


def test_loading_with_a_mismatched_mode(saved_int4):
    with pytest.raises(ValueError, match="quantized as int4:64 with the head; requested int8"):
        load_model(str(saved_int4), "cpu", torch.float32, quantize="int8")
    result = run_py("generate.py", "--model", str(saved_int4), "--quantize", "int4:32", "--prompt", "hi")
    assert_one_line_error(result, "quantized as int4:64", "requested int4:32")


def test_cli_bad_modes_are_one_line_errors(tmp_path):
    assert_one_line_error(run_py("generate.py", "--quantize", "int3", "--prompt", "hi"),
                          "unknown quantization mode 'int3'")
    assert_one_line_error(run_py("generate.py", "--quantize", "int4:48", "--prompt", "hi"), "group size '48'")
    (tmp_path / "notes.txt").write_text("mine")
    assert_one_line_error(run_py("quantize.py", "--mode", "int8", "--out", str(tmp_path)),
                          "is not empty and is not a previous quantize.py output")
    assert (tmp_path / "notes.txt").read_text() == "mine"
