"""The AVX2 "words" layouts (gemv.py) of Int4Linear and of Int8GroupLinear (a Q8_0 head): exact packing, the one-row
products against the plain reference, and a whole model decoding in them as in the plain layout. They run on any CPU
(compiled_layouts and the loader choose them where torch dispatches AVX2; here they are forced), so CI on AVX-512
checks them too."""
import pytest
import torch
import torch.nn.functional as F

from ops import gemv
from ops import qkernels
import quantize as q
from test_quantize import quantized_linear
from tiny_models import hf_to_ours, make_hf


def test_pack_unpack_words_round_trip():
    codes = torch.randint(0, 16, (5, 192), dtype=torch.uint8)
    words = gemv.pack_words(codes)
    assert words.shape == (5, 3, 8) and words.dtype == torch.float32  # the words' bits, as float32 (gemv.py)
    assert torch.equal(gemv.unpack_words(words), codes)
    # nibble b of word l in super-block j is column 64j + 8b + l
    assert (words.view(torch.int32)[2, 1, 3] >> 20) & 15 == codes[2, 64 + 8 * 5 + 3]


@pytest.mark.parametrize("n, k", [(64, 64), (128, 576), (192, 1536), (48, 128)])
def test_codes_read_back_from_torchs_cpu_layout(n, k):
    """layout_codes reads torch's CPU int4 layout back: through int4pack_order (read off the packer) where the rows
    are a multiple of 64, through the kernel's own product elsewhere; the codes packed, either way."""
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    weight, _ = qkernels.to_layout(qkernels.pack_int4(codes), "cpu", None, 32)
    assert torch.equal(qkernels.layout_codes(weight, "cpu", (n, k), 32), codes)


def test_pack_unpack_bytes_round_trip():
    codes = torch.randint(-128, 128, (5, 96), dtype=torch.int8)
    codes[0, :64] = torch.arange(-128, 128, 4)  # both extremes, in every byte position
    words = gemv.pack_bytes(codes)
    assert words.shape == (5, 3, 8) and words.dtype == torch.float32
    assert torch.equal(gemv.unpack_bytes(words), codes)
    # byte b of word l in block j is column 32j + 8b + l, offset by 128
    assert (words.view(torch.int32)[2, 1, 3] >> 16) & 255 == codes[2, 32 + 8 * 2 + 3].item() + 128


@pytest.mark.parametrize("group", q.GROUP_SIZES)
def test_gemv_multiplies_by_the_plain_weight(group):
    """gemv multiplies by the plain layout's weight, (code - 8) * scale + zero: that matrix
    times x within float32 summation order (every code, both extremes, in every nibble position)."""
    torch.manual_seed(0)
    n, k = 48, 512
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    codes[0, :64] = torch.arange(64) % 16
    scales_and_zeros = (torch.randn(k // group, n, 2) * 0.1).to(torch.bfloat16)
    w = q.dequantize_int4(codes, scales_and_zeros)  # (N, K)
    words, scales = gemv.pack_words(codes), gemv.half_group_scales(scales_and_zeros, group)
    x = torch.randn(k)
    torch.testing.assert_close(gemv.gemv(x, words, scales), w @ x, rtol=1e-5, atol=1e-5)


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


@pytest.mark.slow
def test_compiled_gemv_equals_eager():
    """Inductor's kernel for gemv (what an eager step calls) computes what the ops compute."""
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (96, 576), dtype=torch.uint8)
    sz = (torch.randn(576 // 32, 96, 2) * 0.1).to(torch.bfloat16)
    words, scales = gemv.pack_words(codes), gemv.half_group_scales(sz, 32)
    x = torch.randn(576)
    torch.testing.assert_close(gemv.run(gemv.gemv, x, words, scales), gemv.gemv(x, words, scales),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("n, k", [(64, 64), (40, 128), (17, 576)])
@pytest.mark.parametrize("rows", [1, 5, 20])
def test_int4_linear_in_words_layout_matches_reference(n, k, rows):
    """Int4Linear in the words layout: the same codes read back, a state dict in the plain layout, and outputs
    equal to F.linear with dequantize() for one row and several (gemv, row by row), and each row's bits are the same
    whatever rows it comes with."""
    linear, module = quantized_linear("int4:32", n, k)
    module.repack("words")
    assert module.kernel == "words"
    plain = module.quantize_weight(linear.weight)["weight"]
    assert torch.equal(module.state_dict()["weight"], plain)
    x = torch.randn(rows, k)
    torch.testing.assert_close(module(x), F.linear(x, module.dequantize()), rtol=1e-5, atol=1e-5)
    assert torch.equal(module(x)[-1:], module(x[-1:]))


def test_compiled_layouts_picks_words_where_torch_dispatches_avx2(monkeypatch):
    """compiled_layouts: the words layout on AVX2 (where the inputs are a multiple of 64), torch's
    kernel on AVX-512."""
    for capability, want in (("AVX2", {"words", "cpu"}), ("AVX512", {"cpu"})):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda capability=capability: capability)
        model = q.quantize_model(hf_to_ours(make_hf("llama-gqa")), "int4:32")
        q.compiled_layouts(model)
        # head_dim 24: o_proj's 96 inputs are not a multiple of 64, so it keeps torch's kernel
        assert {m.kernel for m in model.modules() if isinstance(m, q.Int4Linear)} == want, capability
        q.compiled_layouts(model, compiled=False)  # an eager step, or one whose compile failed: torch's kernel
        assert {m.kernel for m in model.modules() if isinstance(m, q.Int4Linear)} == {"cpu"}, capability


@pytest.mark.slow
def test_model_decodes_in_words_layout_as_in_plain_layout():
    """A whole int4 model, its logits for a prefill and one-token decode steps, in the words layout against the plain
    layout (dequantize-then-matmul, float32 throughout): the same weights, the same logits within float32 rounding."""
    from kvcache import KVCache

    hf = make_hf("llama-gqa")
    logits = {}
    for layout in ("words", None):
        model = q.quantize_model(hf_to_ours(hf), "int4:32")
        for m in model.modules():
            if isinstance(m, q.Int4Linear):
                m.repack(layout if m.in_padded % 64 == 0 else None)
        cache = KVCache.for_model(model.args, 1, 16, torch.float32, "cpu")
        tokens = torch.tensor([[1, 5, 9, 3]])
        out = [model(tokens, torch.arange(4), cache)[:, -1]]
        for pos in range(4, 7):
            out.append(model(tokens[:, :1] + pos, torch.tensor([pos]), cache)[:, -1])
        logits[layout] = torch.stack(out)
    torch.testing.assert_close(logits["words"], logits[None], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("rows", [1, 20])
def test_act_order_module_in_words_layout_matches_reference(rows):
    """A GPTQ act-order module (its codes' columns in in_perm's input order) gathers x the same way in the words
    layout as in torch's kernel: outputs equal F.linear with dequantize()."""
    torch.manual_seed(0)
    n, k = 48, 128
    module = q.Int4Linear(k, n, 32, act_order=True)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales, zeros = torch.rand(n, k // 32) * 0.1, torch.randn(n, k // 32) * 0.1
    module.load_state_dict(module.buffers_for_codes(codes, scales, zeros, torch.randperm(k)), assign=True)
    module.repack("words")
    x = torch.randn(rows, k)
    torch.testing.assert_close(module(x), F.linear(x, module.dequantize()), rtol=1e-5, atol=1e-5)


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
