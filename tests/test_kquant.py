"""GGUF K-quants: Q4_K blocks load as Int4Linear (group 32) codes, every other K-quant dequantized, each weight held
to gguf.quants.dequantize. Files written here with blocks packed by hand (ggml's layout; the gguf package cannot
quantize K-quants), and, where llama.cpp's llama-quantize is at hand (LLAMA_QUANTIZE, PATH, or $PEER/bin as
../shared/tools/llama_cpp_peer.sh builds it), Q4_K_S / Q4_K_M / Q5_K_M / Q6_K files it makes from a random model.

The bound for a Q4_K weight: the file's w = d·sc·q - dmin·m is our (q - 8)·s + z with s = d·sc and z = 8·d·sc -
dmin·m (float32; s exactly, z rounded once); Int4Linear keeps s and z in bf16, so |error| <= 2^-8 (|q - 8| |s| + |z|)
(+ float32 rounding), and 0 where s and z are bf16 numbers."""
import os
import shutil
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn

import quantize as q
from formats.checkpoint import checkpoint_modules
from formats.gguffile import GGUF_BLOCK_NAMES, int4_blocks, read_gguf, unpermute_qk
from load import load_model
from tiny_models import llama_gguf_writer

BF16_U = 2.0 ** -8  # bf16 unit roundoff: |bf16(x) - x| <= 2^-8 |x|
FP32_SLACK = 2.0 ** -22  # relative: (q - 8) * s + z and gguf's d·sc·q - dmin·m each round once or twice in float32
BLOCK_PARTS = {v: k for k, v in GGUF_BLOCK_NAMES.items() if v.endswith("_proj")}  # ours -> GGUF's block names
# where each type keeps its float16 super-block scales (d, and dmin where it has one), and max |product of the
# integer parts| of a weight (sub-block scale x code): random blocks get d of about 0.2 / that, weights below ~0.2
F16_FIELDS = {"Q4_K": ((0, 2), 63 * 15), "Q5_K": ((0, 2), 63 * 31), "Q6_K": ((208,), 127 * 32),
              "Q2_K": ((80, 82), 15 * 3), "Q3_K": ((108,), 32 * 4), "Q8_0": ((0,), 127)}


def llama_quantize() -> str | None:
    # PEER: the folder ../shared/tools/llama_cpp_peer.sh builds into, as that tool is run (no machine path here)
    peer = os.path.join(os.environ["PEER"], "bin", "llama-quantize") if "PEER" in os.environ else ""
    found = os.environ.get("LLAMA_QUANTIZE") or shutil.which("llama-quantize") or peer
    return found if os.path.isfile(found) else None


# ---- blocks packed by hand ----

def pack_q4_k(d, dmin, sc, m, codes) -> np.ndarray:
    """Q4_K super-blocks as ggml's quantize_row_q4_K writes them: d, dmin (n,) float16; sc, m (n, 8) in [0, 63];
    codes (n, 256) in [0, 15] -> (n, 144) bytes."""
    n = len(d)
    scales = np.zeros((n, 12), np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)  # low 6 bits of 0-3, top 2 of 4-7
    scales[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    q = codes.reshape(n, 4, 2, 32)  # (n, pairs of sub-blocks, 2, 32): the pair shares 32 bytes
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    return np.concatenate([d.astype(np.float16).view(np.uint8).reshape(n, 2),
                           dmin.astype(np.float16).view(np.uint8).reshape(n, 2), scales, qs], axis=1)


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, bytes per row) of random `kind` blocks: random bytes (every code and packed sub-block scale), with
    positive float16 super-block scales small enough that the weights stay below ~0.2."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    offsets, top = F16_FIELDS[kind]
    for at in offsets:
        d = rng.uniform(0.05, 0.2, (rows, cols // block, 1)) / top
        raw[..., at:at + 2] = d.astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def test_q4_k_layout_by_hand():
    """A Q4_K block packed by hand from known d, dmin, sc, m and codes: gguf.quants.dequantize gives d·sc·q - dmin·m,
    and int4_blocks gives those codes back with scale d·sc and zero 8·d·sc - dmin·m."""
    import gguf

    rng = np.random.default_rng(0)
    n = 6
    d, dmin = rng.uniform(1e-4, 1e-3, n).astype(np.float16), rng.uniform(1e-4, 1e-3, n).astype(np.float16)
    sc, m = rng.integers(0, 64, (n, 8), dtype=np.uint8), rng.integers(0, 64, (n, 8), dtype=np.uint8)
    codes = rng.integers(0, 16, (n, 256), dtype=np.uint8)
    data = pack_q4_k(d, dmin, sc, m, codes).reshape(2, -1)  # 2 rows of 3 super-blocks: K = 768
    s = d.astype(np.float32)[:, None] * sc  # (n, 8)
    want = (s[:, :, None] * codes.reshape(n, 8, 32) - (dmin.astype(np.float32)[:, None] * m)[:, :, None])
    assert np.array_equal(gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q4_K), want.reshape(2, 768))
    t = read_gguf_like(data, "Q4_K")
    got_codes, scales, zeros = int4_blocks(t, (2, 768))
    assert torch.equal(got_codes, torch.from_numpy(codes.reshape(2, 768)))
    assert torch.equal(scales, torch.from_numpy(s.reshape(2, 24)))
    assert torch.equal(zeros, torch.from_numpy((8 * s - dmin.astype(np.float32)[:, None] * m).reshape(2, 24)))


def read_gguf_like(data: np.ndarray, kind: str):
    """A file tensor (what read_gguf returns) holding `data`, (N, bytes per row) of `kind` blocks."""
    from formats.gguffile import GGUFTensor
    import gguf

    kind = gguf.GGMLQuantizationType[kind]
    return GGUFTensor("t", kind, tuple(gguf.quant_shape_from_byte_shape(data.shape, kind)), data)


def int4_error_bound(codes, scales, zeros):
    """Per weight (N, K): 2^-8 (|q - 8| |s| + |z|), what rounding s and z to bf16 can move (q - 8)·s + z by."""
    per_weight = lambda x: x.abs().repeat_interleave(32, dim=1)  # (N, K/32) -> (N, K)
    return BF16_U * ((codes.float() - 8).abs() * per_weight(scales) + per_weight(zeros))


def test_q4_k_codes_equal_gguf_dequantize():
    """Random Q4_K blocks through int4_blocks into an Int4Linear (the load's own path): its weight equals
    gguf.quants.dequantize within the bf16 bound, exactly where s and z are bf16 numbers; and the float32 codes,
    scales and zeros reproduce gguf's values but for float32 rounding."""
    import gguf

    data = random_blocks("Q4_K", 48, 512, np.random.default_rng(1))
    want = torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q4_K))  # (48, 512)
    codes, scales, zeros = int4_blocks(read_gguf_like(data, "Q4_K"), (48, 512))
    fp32 = ((codes.float().view(48, 16, 32) - 8) * scales[..., None] + zeros[..., None]).view(48, 512)
    assert ((fp32 - want).abs() <= FP32_SLACK * (want.abs() + zeros.abs().repeat_interleave(32, 1))).all()
    linear = q.Int4Linear(512, 48, 32)
    linear.load_part(0, linear.buffers_for_codes(codes, scales, zeros))
    linear.pack_for_kernel()
    err = (linear.dequantize() - want).abs()
    bound = int4_error_bound(codes, scales, zeros)
    assert (err <= bound + FP32_SLACK * (want.abs() + bound)).all(), (err - bound).max()
    exact = ((scales == scales.bfloat16().float()) & (zeros == zeros.bfloat16().float())).repeat_interleave(32, 1)
    assert exact.any() and (~exact).any()
    assert (err[exact] <= FP32_SLACK * want.abs()[exact]).all() and (err[~exact] > 0).any()
    print(f"\nQ4_K as int4 codes: max error / bound {(err / bound.clamp(min=1e-30)).max():.3f}")


# ---- tiny llama files: hidden 256, every K a multiple of 256 ----

def kquant_config(n_layers: int) -> SimpleNamespace:
    """What llama_gguf_writer reads of a transformers LlamaConfig (importing transformers would take seconds)."""
    return SimpleNamespace(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=n_layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           rms_norm_eps=1e-5, rope_theta=10000.0)


def write_random_blocks_gguf(path, types: dict[str, str], seed: int = 0, n_layers: int = 2) -> str:
    """A llama GGUF of random blocks: types maps a GGUF tensor name (blk.0.attn_v, output, token_embd) or a block
    name for every layer (attn_q) to its type (F32 when absent: normal, std 0.05); norms F32 ones. The q/k rows are
    random in the file's order: the load unpermutes them, and the tests compare in ours."""
    cfg = kquant_config(n_layers)
    writer = llama_gguf_writer(path, cfg)
    rng = np.random.default_rng(seed)
    kv, ffn = 2 * 64, cfg.intermediate_size
    shapes = {"attn_q": (256, 256), "attn_k": (kv, 256), "attn_v": (kv, 256), "attn_output": (256, 256),
              "ffn_gate": (ffn, 256), "ffn_up": (ffn, 256), "ffn_down": (256, ffn)}
    tensors = {"token_embd": (256, 256), "output": (256, 256)}
    tensors.update({f"blk.{i}.{n}": s for i in range(cfg.num_hidden_layers) for n, s in shapes.items()})
    import gguf

    for name, shape in tensors.items():
        kind = types.get(name, types.get(name.split(".")[-1], "F32"))
        if kind == "F32":
            writer.add_tensor(f"{name}.weight", rng.normal(0, 0.05, shape).astype(np.float32))
        else:
            writer.add_tensor(f"{name}.weight", random_blocks(kind, *shape, rng),
                              raw_dtype=gguf.GGMLQuantizationType[kind])
    for i in range(cfg.num_hidden_layers):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(256, np.float32))
    writer.add_tensor("output_norm.weight", np.ones(256, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def file_weights(path: str, args) -> dict[str, tuple[str, torch.Tensor, tuple | None]]:
    """{checkpoint linear (layers.0.self_attn.q_proj): (GGUF type, gguf.quants.dequantize's weight, (codes, scales,
    zeros) for Q4_K else None)}, q/k rows unpermuted: the reference each loaded weight is held to."""
    import gguf

    out = {}
    for t in read_gguf(path)[1]:
        parts = t.name.split(".")
        if parts[0] != "blk" or parts[2] not in GGUF_BLOCK_NAMES or not GGUF_BLOCK_NAMES[parts[2]].endswith("_proj"):
            continue
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(t.shape).astype(np.float32))
        blocks = int4_blocks(t, t.shape) if t.tensor_type.name == "Q4_K" else None
        if parts[2] in ("attn_q", "attn_k"):
            heads = args.n_heads if parts[2] == "attn_q" else args.n_kv_heads
            w = unpermute_qk(w, heads)
            blocks = blocks and tuple(unpermute_qk(x, heads) for x in blocks)
        out[f"layers.{parts[1]}.{GGUF_BLOCK_NAMES[parts[2]]}"] = (t.tensor_type.name, w, blocks)
    return out


def part_of(model, name: str) -> tuple[nn.Module, slice]:
    """(our module, its rows) of checkpoint linear `name` (layers.0.self_attn.k_proj -> qkv_proj's k rows)."""
    module_name, part = checkpoint_modules(model)[name]
    module = model.get_submodule(module_name)
    start, n = module.part_rows(part)
    return module, slice(start, start + n)


def check_weights(model, path: str) -> dict[str, int]:
    """Every block linear of `model` (a float32 default load of `path`) against gguf.quants.dequantize: a module
    whose parts are all Q4_K is an Int4Linear within the bf16 bound; any other holds the file's float32 values
    exactly; so do the embedding and head. Returns {GGUF type: block linear parts seen}."""
    import gguf

    weights, slots = file_weights(path, model.args), checkpoint_modules(model)
    module_kinds = {}  # our module -> its parts' types
    for name, (kind, _, _) in weights.items():
        module_kinds.setdefault(slots[name][0], set()).add(kind)
    seen = {}
    for name, (kind, want, blocks) in weights.items():
        module, rows = part_of(model, name)
        if module_kinds[slots[name][0]] == {"Q4_K"}:
            assert isinstance(module, q.Int4Linear) and module.group_size == 32, (name, module)
            err = (module.dequantize()[rows] - want).abs()
            bound = int4_error_bound(*blocks)
            assert (err <= bound + FP32_SLACK * (want.abs() + bound)).all(), (name, (err - bound).max())
        else:
            assert isinstance(module, nn.Linear), (name, kind, module)
            assert torch.equal(module.weight[rows], want), (name, kind)
        seen[kind] = seen.get(kind, 0) + 1
    for t in read_gguf(path)[1]:  # the embedding and head: dequantized to float32, exactly
        if t.name in ("token_embd.weight", "output.weight"):
            ours = model.embed_tokens if t.name == "token_embd.weight" else model.lm_head
            want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(t.shape).astype(np.float32)
            assert isinstance(ours, nn.Linear | nn.Embedding) and torch.equal(ours.weight, torch.from_numpy(want))
    return seen


Q4_K_M_LIKE = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q4_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
               "ffn_up": "Q4_K", "ffn_down": "Q4_K", "blk.0.attn_v": "Q6_K", "blk.0.ffn_down": "Q6_K",
               "token_embd": "Q4_K", "output": "Q6_K"}  # llama-quantize's Q4_K_M: Q6_K v/down where it adds bits


@pytest.fixture(scope="module")
def q4_k_m_like(tmp_path_factory) -> str:
    return write_random_blocks_gguf(tmp_path_factory.mktemp("kquant") / "q4_k_m_like.gguf", Q4_K_M_LIKE)


def test_q4_k_m_like_file_runs_q4_k_as_codes(q4_k_m_like):
    """Default load: layer 0's qkv_proj (a Q6_K v) and down_proj (Q6_K) dequantize, every all-Q4_K module runs as
    int4:32 codes, each weight held to gguf.quants.dequantize; the Q6_K head and Q4_K embedding are float. A bf16
    model has the same codes (scales and zeros are bf16 always); `none` dequantizes everything."""
    model, _ = load_model(q4_k_m_like, "cpu", torch.float32)
    floats = {"layers.0.self_attn.qkv_proj", "layers.0.mlp.down_proj"}
    for name, module in model.named_modules():
        if name.startswith("layers.") and name.endswith("_proj"):
            assert isinstance(module, nn.Linear if name in floats else q.Int4Linear), name
    assert isinstance(model.lm_head, nn.Linear)
    assert check_weights(model, q4_k_m_like) == {"Q4_K": 12, "Q6_K": 2}
    assert q.describe(model) == "int4:32 x6 + float x2"  # the summary line says the mix, not layer 0's o_proj
    bf16, _ = load_model(q4_k_m_like, "cpu", torch.bfloat16)
    for name, module in model.named_modules():
        if isinstance(module, q.Int4Linear):
            other = bf16.get_submodule(name).state_dict()
            assert all(torch.equal(t, other[k]) for k, t in module.state_dict().items()), name
    exact, _ = load_model(q4_k_m_like, "cpu", torch.float32, quantize="none")
    assert not any(isinstance(m, q.Int4Linear) for m in exact.modules())
    assert torch.equal(exact.embed_tokens.weight, model.embed_tokens.weight)


def test_q4_k_codes_logits_equal_dequantize_then_matmul(q4_k_m_like):
    """The int4 kernel on the Q4_K codes against a float32 model holding those codes' own dequantized weights:
    full forward over 32 random tokens, within the kernel's bf16 rounding of activations (as test_load_gguf's)."""
    import copy

    model, _ = load_model(q4_k_m_like, "cpu", torch.float32)
    ref, _ = load_model(q4_k_m_like, "cpu", torch.float32, quantize="none")
    ref = copy.deepcopy(ref)
    for name, module in model.named_modules():
        if isinstance(module, q.Int4Linear):
            ref.get_submodule(name).weight.copy_(module.dequantize())
    tokens = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))
    got = model(tokens, torch.arange(32), all_logits=True)[0]
    want = ref(tokens, torch.arange(32), all_logits=True)[0]
    rel = ((got - want).abs().max() / want.abs().max()).item()
    print(f"\nQ4_K codes vs dequantize-then-matmul: logits max |diff| / max |ref| {rel:.2e}")
    assert rel <= 1.6e-2


def test_quantize_modes_on_a_q4_k_file(q4_k_m_like):
    """--quantize int4:32 keeps the Q4_K modules' codes and quantizes the dequantized rest to int4:32; int4:64
    quantizes everything from the dequantized floats, exactly as quantize_model does on the `none` load."""
    import copy

    native, _ = load_model(q4_k_m_like, "cpu", torch.float32)
    exact, _ = load_model(q4_k_m_like, "cpu", torch.float32, quantize="none")
    for mode in ("int4:32", "int4:64"):
        model, _ = load_model(q4_k_m_like, "cpu", torch.float32, quantize=mode)
        requantized = q.quantize_model(copy.deepcopy(exact), mode).state_dict()
        for name, module in model.named_modules():
            if not (name.startswith("layers.") and name.endswith("_proj")):
                continue
            assert isinstance(module, q.Int4Linear) and module.group_size == int(mode[5:]), (mode, name)
            kept = native.get_submodule(name) if mode == "int4:32" else None
            want = kept.state_dict() if isinstance(kept, q.Int4Linear) else \
                {k.removeprefix(name + "."): t for k, t in requantized.items() if k.startswith(name + ".")}
            assert all(torch.equal(t, want[k]) for k, t in module.state_dict().items()), (mode, name)


@pytest.mark.parametrize("kind", ["Q5_K", "Q6_K", "Q2_K", "Q3_K", "Q8_0"])
def test_other_block_types_load_dequantized(tmp_path, kind):
    """A file of another K-quant (or Q8_0) block linears loads them as float32, exactly gguf.quants.dequantize's."""
    path = write_random_blocks_gguf(tmp_path / f"{kind}.gguf", {n: kind for n in BLOCK_PARTS.values()})
    model, _ = load_model(path, "cpu", torch.float32)
    assert q.quantization_of(model) is None
    assert check_weights(model, path) == {kind: 14}


# ---- files made by llama.cpp's llama-quantize ----

QUANTIZE = llama_quantize()
needs_llama_quantize = pytest.mark.skipif(QUANTIZE is None, reason="llama-quantize not found (LLAMA_QUANTIZE, PATH, "
                                                                   "$PEER/bin)")
LLAMA_TYPES = {"Q4_K_S": {"Q4_K", "Q5_K"}, "Q4_K_M": {"Q4_K", "Q6_K"}, "Q5_K_M": {"Q5_K", "Q6_K"}, "Q6_K": {"Q6_K"}}


@pytest.fixture(scope="module")
def llama_quantized(tmp_path_factory):
    """llama_quantized(ftype) -> path of an 8-layer random F32 llama GGUF quantized by llama-quantize to ftype."""
    folder = tmp_path_factory.mktemp("llama-quantize")
    source = write_random_blocks_gguf(folder / "f32.gguf", {}, seed=5, n_layers=8)
    made = {}

    def get(ftype: str) -> str:
        if ftype not in made:
            out = str(folder / f"{ftype}.gguf")
            run = subprocess.run([QUANTIZE, source, out, ftype], capture_output=True, text=True, timeout=300)
            assert run.returncode == 0, run.stderr[-2000:]
            made[ftype] = out
        return made[ftype]
    return get


@pytest.mark.slow
@needs_llama_quantize
@pytest.mark.parametrize("ftype", list(LLAMA_TYPES))
def test_llama_quantize_files(llama_quantized, ftype):
    """Every weight of a llama-quantize file held to gguf.quants.dequantize: Q4_K modules as int4:32 codes within
    the bf16 bound, the rest (Q5_K, Q6_K, and modules mixing Q4_K with them) float32, exactly."""
    path = llama_quantized(ftype)
    model, _ = load_model(path, "cpu", torch.float32)
    seen = check_weights(model, path)
    heads = {t.name: t.tensor_type.name for t in read_gguf(path)[1] if t.name in ("token_embd.weight", "output.weight")}
    print(f"\n{ftype}: block linear parts {seen}, {heads}")
    assert set(seen) == LLAMA_TYPES[ftype]
    codes = [m for m in model.modules() if isinstance(m, q.Int4Linear)]
    assert bool(codes) == ("Q4_K" in seen)
    if ftype == "Q4_K_M":  # llama.cpp's more-bits layers 0, 3, 6, 7 of 8: their qkv_proj and down_proj float
        for i in range(8):
            for name in ("self_attn.qkv_proj", "mlp.down_proj"):
                module = model.get_submodule(f"layers.{i}.{name}")
                assert isinstance(module, nn.Linear if i in (0, 3, 6, 7) else q.Int4Linear), (i, name)
        assert q.describe(model) == "int4:32 x24 + float x8"
