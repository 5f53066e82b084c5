"""Quantization: exact packing, every kernel path against its dequantize-then-matmul reference, and whole models
with their linear layers swapped. (Quality on the real model: test_quality.py; checkpoints: test_export.py.)"""
import copy

import pytest
import torch
import torch.nn.functional as F

from ops import qkernels
import quantize as q
from tiny_models import hf_to_ours, make_hf

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
    packed = qkernels.pack_int4(codes)
    assert packed.shape == (37, 32) and packed.dtype == torch.uint8
    assert torch.equal(qkernels.unpack_int4(packed), codes)
    assert torch.equal(qkernels.pack_int4(qkernels.unpack_int4(packed)), packed)


@pytest.mark.parametrize("n, k", SHAPES)
def test_kernel_layout_round_trips_to_plain_codes(n, k):
    """The kernel's own packed layout reads back to exactly the codes quantize_weight produced."""
    linear, module = quantized_linear("int4:32", n, k)
    plain = module.quantize_weight(linear.weight)["weight"]
    assert module.kernel == qkernels.int4_kernel(torch.device("cpu"))
    assert torch.equal(qkernels.pack_int4(module.codes()), plain)
    assert torch.equal(module.state_dict()["weight"], plain)  # checkpoints get the plain layout


@pytest.mark.parametrize("n, k", [(64, 64), (128, 576), (192, 1536), (48, 128)])
def test_codes_read_back_from_torchs_cpu_layout(n, k):
    """layout_codes reads torch's CPU int4 layout back: through int4pack_order (read off the packer) where the rows
    are a multiple of 64, through the kernel's own product elsewhere; the codes packed, either way."""
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    weight = qkernels.to_layout(qkernels.pack_int4(codes), "cpu")
    assert torch.equal(qkernels.layout_codes(weight, "cpu", (n, k), 32), codes)


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


@pytest.mark.parametrize("n, k", [(64, 32), (50, 96), (200, 576)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_int8_runs_exactly_as_two_int4_halves(n, k, dtype):
    """Int8GroupLinear (a GGUF Q8_0 matrix, run by the int4 kernel as q = 16 hi + lo): the weight it multiplies by is
    exactly codes * bf16(scale) for every code in [-128, 127], and its output equals F.linear with that weight
    within the kernel's bf16 rounding, for 1 and 7 rows (out_features padded to 16 where needed)."""
    torch.manual_seed(0)
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    codes[0, :32] = torch.arange(-128, 128, 8, dtype=torch.int8)  # both extremes and every high nibble
    codes[1, :32] = torch.arange(-16, 16, dtype=torch.int8)  # every low nibble, on both sides of 0
    scales = torch.rand(n, k // 32) * 0.02 + 1e-4  # float16-sized, as a Q8_0 file stores them
    module = q.Int8GroupLinear(k, n)
    module.load_codes(codes, scales)
    exact = codes.float() * scales.to(torch.bfloat16).float().repeat_interleave(32, dim=1)  # (N, K)
    assert torch.equal(module.dequantize(), exact)
    for rows in (1, 7):
        x = torch.randn(rows, k, dtype=dtype)
        y = module(x)
        assert y.shape == (rows, n) and y.dtype == dtype
        assert rel_err(y, F.linear(x.float(), exact)) < 1e-2


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
