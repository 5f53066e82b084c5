"""The AVX2 words (gemv.py) of Int8GroupLinear (a Q8_0 head): exact packing, the one-row product against the plain
reference, and the module that keeps and runs them. They run on any CPU (the loader makes them where torch dispatches
AVX2; here that is forced), so CI on AVX-512 checks them too."""
import pytest
import torch
import torch.nn.functional as F

from ops import gemv
import quantize as q
from tiny_models import hf_to_ours, make_hf


def test_pack_unpack_bytes_round_trip():
    codes = torch.randint(-128, 128, (5, 96), dtype=torch.int8)
    codes[0, :64] = torch.arange(-128, 128, 4)  # both extremes, in every byte position
    words = gemv.pack_bytes(codes)
    assert words.shape == (5, 3, 8) and words.dtype == torch.float32
    assert torch.equal(gemv.unpack_bytes(words), codes)
    # byte b of word l in block j is column 32j + 8b + l, offset by 128
    assert (words.view(torch.int32)[2, 1, 3] >> 16) & 255 == codes[2, 32 + 8 * 2 + 3].item() + 128


def test_gemv_bytes_multiplies_by_the_codes_times_scales():
    """gemv_bytes multiplies by codes * scale, block by block (every code, both extremes, in every byte position):
    that matrix times x within float32 summation order."""
    torch.manual_seed(0)
    n, k = 48, 576
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    codes[0, :256] = torch.arange(-128, 128)
    scales = torch.rand(n, k // 32) * 0.02 + 1e-4
    w = codes.float() * scales.repeat_interleave(32, dim=1)  # (N, K)
    x = torch.randn(k)
    torch.testing.assert_close(gemv.gemv_bytes(x, gemv.pack_bytes(codes), scales), w @ x, rtol=1e-5, atol=1e-5)


def q8_0_module(n: int, k: int, monkeypatch, capability: str = "AVX2") -> tuple[q.Int8GroupLinear, torch.Tensor,
                                                                                torch.Tensor]:
    """An Int8GroupLinear loaded with random Q8_0 codes and scales as the loader fills it, on a CPU of `capability`."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    torch.manual_seed(0)
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    scales = torch.rand(n, k // 32) * 0.02 + 1e-4  # float16-sized, as a Q8_0 file stores them
    module = q.Int8GroupLinear(k, n)
    module.load_codes(codes, scales)
    return module, codes, scales


def test_a_q8_0_matrix_keeps_words_where_torch_dispatches_avx2(monkeypatch):
    """On AVX2 a Q8_0 matrix also keeps its codes as words, with the halves' bf16 scales: the same weight
    (dequantize()), not in a checkpoint's state dict; on AVX-512 no words, and a compiled step keeps the halves."""
    module, codes, scales = q8_0_module(40, 96, monkeypatch)
    assert torch.equal(gemv.unpack_bytes(module.words), codes)
    assert torch.equal(module.word_scales, scales.to(torch.bfloat16).float())
    assert torch.equal(codes.float() * module.word_scales.repeat_interleave(32, dim=1), module.dequantize())
    assert not {"words", "word_scales"} & module.state_dict().keys()
    other, _, _ = q8_0_module(40, 96, monkeypatch, "AVX512")
    assert other.words is None
    model = q.quantize_model(hf_to_ours(make_hf("llama-gqa")), "int4:32")
    model.lm_head = other
    q.compiled_head(model, True)
    assert not other.compiled


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_compiled_q8_0_head_matches_reference(dtype, monkeypatch):
    """Compiled (its words, one Inductor kernel a row): the output is the exact product with dequantize() to within
    float32's rounding of its terms (the halves' int4 kernel rounds activations to bf16: within 1e-2), for 1 and 7
    rows, and each row's bits are the same whatever rows come with it."""
    module, _, _ = q8_0_module(40, 96, monkeypatch)
    module.compiled = True
    for rows in (1, 7):
        x = torch.randn(rows, 96).to(dtype)
        y = module(x)
        assert y.shape == (rows, 40) and y.dtype == dtype
        exact = F.linear(x.double(), module.dequantize().double())  # (rows, 40)
        if dtype == torch.float32:
            # float32 sums of 96 terms (code + 128) * scale * x and the offset's: each rounding within 2^-24 of the
            # terms' total size; the order of the sums is the vector width's (AVX2 or AVX-512)
            size = F.linear(x.double().abs(), 256 * module.word_scales.repeat_interleave(32, dim=1).double())
            assert ((y.double() - exact).abs() <= 96 * 2.0 ** -24 * size).all()
        else:
            torch.testing.assert_close(y, exact.to(dtype))
        assert torch.equal(y[-1:], module(x[-1:]))
