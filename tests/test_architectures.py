"""The architectures beyond Llama/Mistral/Mixtral through the paths that load and run them: Hugging Face folders,
quantized (at load and exported), compiled decode steps, GGUF files written with llama.cpp's names, and their
config.json written back. Their parity with transformers (eager, cached, batched) is test_model.py's, over CONFIGS."""
import copy
import dataclasses
import math

import numpy as np
import pytest
import torch

from formats.gguffile import GGUF_ARCH_NAMES, GGUF_BLOCK_NAMES, GGUF_TOP_NAMES
from kvcache import KVCache
from load import load_model
from model import ModelArgs, rope_attention_factor
from quantize import quantize_model
from tiny_models import SEQ_LEN, hf_to_ours, llama_gguf_writer, make_hf

QWEN = ["qwen2", "qwen2-tied", "qwen3", "qwen3-tied"]
PHI = ["phi3-longrope", "phi3-short-window", "phi4-mini-partial"]
GEMMA = ["gemma2", "gemma2-untied-gqa1", "gemma3", "gemma3-untied-softcap"]


def tokens(seq: int = SEQ_LEN, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 160, (1, seq), generator=torch.Generator().manual_seed(seed))


def test_qwen_biases_and_norms_reach_the_model():
    """Random biases and q/k norm weights (tiny_models draws them) land in the fused rows and norms they belong to."""
    hf = make_hf("qwen2")
    ours = hf_to_ours(hf)
    attn = hf.model.layers[1].self_attn
    want = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
    assert torch.equal(ours.layers[1].self_attn.qkv_proj.bias, want) and want.abs().min() > 0
    hf3 = make_hf("qwen3")
    ours3 = hf_to_ours(hf3)
    assert torch.equal(ours3.layers[0].self_attn.k_norm.weight, hf3.model.layers[0].self_attn.k_norm.weight)
    assert ours3.layers[0].self_attn.qkv_proj.bias is None and ours.layers[0].self_attn.q_norm is None


@pytest.mark.parametrize("name", QWEN + PHI + GEMMA)
def test_folder_matches_transformers(tmp_path, name):
    hf = make_hf(name)
    hf.save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path), "cpu", torch.float32)
    toks = tokens()
    assert (model(toks, torch.arange(SEQ_LEN), all_logits=True) - hf(toks).logits).abs().max() <= 1e-4
    if model.args.sliding_window is None:  # export.py writes a config.json for a GGUF source, which has no window
        assert ModelArgs.from_hf_config(model.args.to_hf_config()) == model.args


@pytest.mark.parametrize("name", ["qwen2", "qwen3-tied", "phi4-mini-partial", "gemma2", "gemma3"])
@pytest.mark.parametrize("mode", ["int8", "int4:32"])
def test_quantized_qwen(tmp_path, name, mode):
    """Quantizing at load gives quantize_model's tensors (the biases kept in float, not padded); an exported folder
    loads back to them; the quantized logits equal a float model's holding the dequantized weights and the same
    biases, within the kernels' bf16 rounding."""
    from scripts import export

    make_hf(name).save_pretrained(tmp_path / "src")
    floats, _ = load_model(str(tmp_path / "src"), "cpu", torch.float32)
    at_load, _ = load_model(str(tmp_path / "src"), "cpu", torch.float32, quantize=mode)
    want = quantize_model(copy.deepcopy(floats), mode).state_dict()
    got = at_load.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    if name == "qwen2":
        bias = at_load.layers[0].self_attn.qkv_proj.bias
        assert bias.shape == (128,) and torch.equal(bias, floats.layers[0].self_attn.qkv_proj.bias)
    out = tmp_path / "out"
    assert export.main(["--model", str(tmp_path / "src"), "--mode", mode, "--out", str(out), "--dtype", "float32"]) == 0
    loaded = load_model(str(out), "cpu", torch.float32)[0].state_dict()
    assert loaded.keys() == got.keys() and all(torch.equal(loaded[k], got[k]) for k in got)
    with torch.no_grad():
        for module_name, module in floats.named_modules():
            if module_name.startswith("layers.") and isinstance(module, torch.nn.Linear):
                module.weight.copy_(at_load.get_submodule(module_name).dequantize())
    toks = tokens()
    ref = floats(toks, torch.arange(SEQ_LEN), all_logits=True)
    q = at_load(toks, torch.arange(SEQ_LEN), all_logits=True)
    assert (q - ref).abs().max() <= 2e-2 * ref.abs().max()


@pytest.mark.slow  # compiles
@pytest.mark.parametrize("name", ["qwen2", "qwen3", "phi4-mini-partial", "gemma2", "gemma3"])
def test_compiled_blocks_decode_matches_eager(name):
    """--compile blocks (the CPU default): the one-row Linear's multiply-and-sum with its bias, the q/k norms,
    partial rotary, Gemma's written-out attention, its pair of masks and (Gemma 3) its pair of RoPE tables."""
    from step import Step

    model = hf_to_ours(make_hf(name))
    steps = {mode: Step(model, mode) for mode in ("none", "blocks")}
    logits = {}
    for mode, step in steps.items():
        cache = KVCache.for_model(model.args, 1, 16, torch.float32, "cpu")
        out = [step(torch.tensor([[3, 1, 4]]), torch.arange(3), cache)]
        for pos in range(3, 12):
            out.append(step(torch.tensor([[pos * 7 % 160]]), torch.tensor([pos]), cache))
        logits[mode] = torch.cat(out)
    assert (logits["blocks"] - logits["none"]).abs().max() <= 1e-4


def test_phi3_checkpoint_is_stored_fused():
    """Phi-3's qkv_proj and gate_up_proj are its checkpoint's own tensors, taken as they are."""
    from formats.checkpoint import checkpoint_shapes

    ours = hf_to_ours(make_hf("phi3-longrope"))
    shapes = checkpoint_shapes(ours)
    assert shapes["layers.0.self_attn.qkv_proj.weight"] == (128, 64)
    assert shapes["layers.0.mlp.gate_up_proj.weight"] == (224, 64)
    assert not any("q_proj" in name or "gate_proj" in name for name in shapes)


def hf_rope(hf, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' (cos, sin) for positions (T,), each (T, R/2): its halves are equal (half-rotation layout)."""
    x = torch.zeros(1, len(positions), hf.config.hidden_size)
    cos, sin = hf.model.rotary_emb(x, positions[None])
    return cos[0, :, :cos.shape[-1] // 2], sin[0, :, :sin.shape[-1] // 2]


@pytest.mark.parametrize("name", ["phi3-longrope", "phi4-mini-partial"])
def test_longrope_factors_follow_the_context(name):
    """longrope's factors are chosen once for the model's context (llama.cpp's rule): a context past the original one
    gets transformers' long table (its choice for a sequence that long), one within it transformers' short table
    (its choice for a sequence within it), attention factor included."""
    hf = make_hf(name)
    ours = hf_to_ours(hf)
    original = hf.config.rope_parameters["original_max_position_embeddings"]
    long_cos, long_sin = hf_rope(hf, torch.arange(original + 40))
    assert (ours.rope_cos[:original + 40] - long_cos).abs().max() <= 1e-6
    assert (ours.rope_sin[:original + 40] - long_sin).abs().max() <= 1e-6
    with torch.device("meta"):
        short = type(ours)(dataclasses.replace(ours.args, max_seq_len=original))
    short.reset_rope("cpu")
    short_cos, short_sin = hf_rope(hf, torch.arange(original))
    assert (short.rope_cos - short_cos).abs().max() <= 1e-6 and (short.rope_sin - short_sin).abs().max() <= 1e-6
    assert (short_cos - long_cos[:original]).abs().max() > 1e-2  # the two tables differ


@pytest.mark.parametrize("window", [None, 5])
def test_written_attention_matches_reference_without_a_cap(window):
    """Gemma 2's written-out attention is plain attention when it neither caps nor rescales the scores."""
    from model import attention_mask, written_attention
    from tiny_models import reference_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 9, 16, generator=g)  # (B, H, T, D)
    k, v = torch.randn(2, 3, 20, 16, generator=g), torch.randn(2, 3, 20, 16, generator=g)  # (B, K, S, D)
    for mask in (attention_mask(torch.arange(11, 20), torch.arange(20), window),
                 attention_mask(torch.arange(11, 20).expand(2, 9), torch.arange(20), window)[:, None]):
        got = written_attention(q, k, v, mask, 16 ** -0.5, None)
        assert (got - reference_attention(q, k, v, mask)).abs().max() <= 1e-5


def test_gemma2_layer_types_checked():
    cfg = {"architectures": ["Gemma2ForCausalLM"], "vocab_size": 10, "hidden_size": 16, "num_hidden_layers": 2,
           "num_attention_heads": 2, "intermediate_size": 16, "head_dim": 8}
    args = ModelArgs.from_hf_config(cfg)
    assert (args.sliding_layers, args.attn_softcap, args.final_softcap, args.mlp_act) == ((0,), 50.0, 30.0,
                                                                                          "gelu_pytorch_tanh")
    assert args.tie_embeddings  # transformers' default for Gemma, whose hub configs leave the key out
    with pytest.raises(ValueError, match="layer_types must list sliding_attention or full_attention for each"):
        ModelArgs.from_hf_config({**cfg, "layer_types": ["full_attention"]})


GEMMA3_HUB_CONFIG = {  # a Gemma 3 config.json as the hub has them (transformers 4): no layer_types, rope keys on top,
    # no tie_word_embeddings (tied: transformers' default)
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 10, "hidden_size": 16,
    "num_hidden_layers": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
    "intermediate_size": 16, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 4,
    "sliding_window_pattern": 6, "query_pre_attn_scalar": 8, "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "hidden_activation": "gelu_pytorch_tanh"}


def test_gemma3_hub_config_reads_as_transformers_reads_it():
    """The hub's form (rope_theta, rope_local_base_freq, rope_scaling, sliding_window_pattern) gives the args of the
    form transformers 5 writes after reading it (rope_parameters per layer type, layer_types)."""
    from transformers import Gemma3TextConfig

    args = ModelArgs.from_hf_config(GEMMA3_HUB_CONFIG)
    assert (args.sliding_layers, args.rope_theta, args.rope_local_theta, args.rope_scaling) == (
        (0, 1, 2, 3, 4, 6, 7), 1000000.0, 10000.0, {"rope_type": "linear", "factor": 8.0})
    assert args.qk_norm and args.norm_plus_one and args.tie_embeddings
    assert args.attn_softcap is None and args.final_softcap is None and args.attn_scale == 8 ** -0.5
    written = Gemma3TextConfig(**{k: v for k, v in GEMMA3_HUB_CONFIG.items() if k != "architectures"}).to_dict()
    assert ModelArgs.from_hf_config({**written, "architectures": ["Gemma3ForCausalLM"]}) == args
    with pytest.raises(ValueError, match="rope type 'linear' for Gemma 3's sliding layers; supported: 'default'"):
        ModelArgs.from_hf_config({**written, "architectures": ["Gemma3ForCausalLM"], "rope_parameters": {
            **written["rope_parameters"], "sliding_attention": {"rope_type": "linear", "factor": 2.0}}})


@pytest.mark.parametrize("pattern, window, sliding", [(None, 4, (0, 1, 2, 3, 4, 6, 7)), (3, 4, (0, 1, 3, 4, 6, 7)),
                                                      ([True, False] * 4, 4, (0, 2, 4, 6)), (None, 0, None)])
def test_gemma3_gguf_layer_pattern(pattern, window, sliding):
    """llama.cpp's rule for a gemma3 file: sliding_window_pattern a flag per layer, or every n-th layer full (6
    unless set); no window (0 or absent): no layer windowed and one RoPE."""
    meta = {"general.architecture": "gemma3", "gemma3.attention.head_count": 2, "gemma3.embedding_length": 16,
            "gemma3.block_count": 8, "gemma3.feed_forward_length": 16, "gemma3.vocab_size": 10,
            "gemma3.attention.key_length": 8, "gemma3.attention.sliding_window": window,
            "gemma3.rope.freq_base": 1000000.0}
    if pattern is not None:
        meta["gemma3.attention.sliding_window_pattern"] = pattern
    args = ModelArgs.from_gguf(meta, {"token_embd.weight"})
    assert args.sliding_layers == sliding and args.sliding_window == (window or None)
    assert args.rope_local_theta == (10000.0 if window else None) and args.qk_norm and args.attn_scale == 8 ** -0.5


def test_phi3_refuses_tensor_parallel():
    from features.tp import Shard

    with pytest.raises(ValueError, match="fused qkv_proj/gate_up_proj"):
        Shard(0, 2).args(hf_to_ours(make_hf("phi3-longrope")).args)


# ---- GGUF files with llama.cpp's qwen2 / qwen3 / phi3 names ----

def write_gguf(path, hf, arch: str, linear_type: str = "F32") -> str:
    """`hf` as llama.cpp's converter writes a qwen2/qwen3/phi3 file: its tensor names (biases attn_q.bias, norms
    attn_q_norm; phi3's fused attn_qkv and ffn_up), q/k rows as they are (these architectures use half-rotation
    RoPE in llama.cpp, so no permutation), block linears in linear_type, a tied model without `output`; phi3's
    longrope as rope_factors_long/short tensors, its original context and attention factor, its rotary dims."""
    import gguf

    cfg = hf.config
    writer = llama_gguf_writer(path, cfg, arch)
    top = {v: k for k, v in GGUF_TOP_NAMES.items()}
    block = {v: k for k, v in {**GGUF_BLOCK_NAMES, **GGUF_ARCH_NAMES.get(arch, {})}.items()}
    if arch == "phi3":
        rope = cfg.rope_parameters
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        writer.add_sliding_window(cfg.sliding_window or 0)
        original = rope["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        scale = cfg.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(original)))
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight", np.array(rope[f"{kind}_factor"], dtype=np.float32))
    for name, t in hf.state_dict().items():
        name = name.removeprefix("model.")
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        parts = name.split(".")
        if parts[0] == "layers":
            gguf_name = f"blk.{parts[1]}.{block['.'.join(parts[2:-1])]}.{parts[-1]}"
        else:
            gguf_name = f"{top[parts[0]]}.{parts[-1]}"
        w = t.float().numpy()
        if w.ndim == 1 or linear_type == "F32" or not gguf_name.startswith("blk."):
            writer.add_tensor(gguf_name, np.ascontiguousarray(w, dtype=np.float32))
        else:
            raw = gguf.GGMLQuantizationType[linear_type]
            writer.add_tensor(gguf_name, gguf.quants.quantize(w, raw), raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize("name", QWEN + PHI)
def test_gguf_matches_transformers(tmp_path, name):
    hf = make_hf(name)
    arch = {"qwen2": "qwen2", "qwen3": "qwen3"}.get(name.split("-")[0], "phi3")
    model, _ = load_model(write_gguf(tmp_path / f"{name}.gguf", hf, arch), "cpu", torch.float32)
    want, got = hf_to_ours(hf).args, model.args
    if want.rope_scaling:  # GGUF holds the factors and the attention factor as float32
        scaling = dict(got.rope_scaling)
        assert scaling.pop("attention_factor") == pytest.approx(rope_attention_factor(want), rel=1e-6)
        assert scaling.keys() == want.rope_scaling.keys() and scaling["rope_type"] == "longrope"
        for key in ("short_factor", "long_factor", "factor", "original_max_position_embeddings"):
            assert scaling[key] == pytest.approx(want.rope_scaling[key], rel=1e-6)
        got = dataclasses.replace(got, rope_scaling=want.rope_scaling)
    assert got == dataclasses.replace(want, norm_eps=got.norm_eps)  # GGUF holds eps as float32
    toks = tokens()
    assert (model(toks, torch.arange(SEQ_LEN), all_logits=True) - hf(toks).logits).abs().max() <= 1e-4


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_q4_0_gguf_loads_as_int4_codes(tmp_path, arch):
    """A Q4_0 qwen file runs its linears as the file's int4 codes (the biases and norms float): its logits equal a
    float model holding the file's dequantized weights, within the int4 kernel's bf16 rounding."""
    import transformers

    from quantize import Int4Linear

    torch.manual_seed(0)
    prefix = {"qwen2": "Qwen2", "qwen3": "Qwen3"}[arch]
    cfg = getattr(transformers, prefix + "Config")(
        vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.1)
    hf = getattr(transformers, prefix + "ForCausalLM")(cfg).eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if p.dim() == 1:
                p.normal_(0.0 if pname.endswith(".bias") else 1.0, 0.1)
    native, _ = load_model(write_gguf(tmp_path / "q4.gguf", hf, arch, "Q4_0"), "cpu", torch.float32)
    assert isinstance(native.layers[0].self_attn.qkv_proj, Int4Linear)
    exact, _ = load_model(str(tmp_path / "q4.gguf"), "cpu", torch.float32, quantize="none")
    toks = tokens()
    a = native(toks, torch.arange(SEQ_LEN), all_logits=True)
    b = exact(toks, torch.arange(SEQ_LEN), all_logits=True)
    assert (a - b).abs().max() <= 2e-2 * b.abs().max()


def test_unknown_gguf_architecture_names_the_supported_ones():
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'gpt2'; supported: llama, qwen2, qwen3, phi3"):
        ModelArgs.from_gguf({"general.architecture": "gpt2"}, set())


PHI3_CONFIG = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 10, "hidden_size": 16, "num_hidden_layers": 1,
               "num_attention_heads": 2, "intermediate_size": 16, "max_position_embeddings": 64,
               "original_max_position_embeddings": 16}


def test_phi3_su_rope_and_partial_rotary_from_config_json():
    """Phi-3's first configs call longrope `su`; Phi-4-mini sets partial_rotary_factor at the top level."""
    args = ModelArgs.from_hf_config({**PHI3_CONFIG, "partial_rotary_factor": 0.5, "rope_scaling": {
        "type": "su", "short_factor": [1.0, 2.0], "long_factor": [3.0, 4.0]}})
    assert args.rope_dim == 4 and args.fused_checkpoint and args.rope_scaling == {
        "rope_type": "longrope", "short_factor": [1.0, 2.0], "long_factor": [3.0, 4.0],
        "original_max_position_embeddings": 16, "factor": 4.0}


@pytest.mark.parametrize("scaling, message", [
    ({"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 4},
     r"needs rope_scaling short_factor, a list of 4 numbers, got \[1.0, 1.0, 1.0\]"),
    ({"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1.0, 1.0, -1.0, 1.0]},
     "rope_scaling long_factor entry must be a positive number, got -1.0"),
])
def test_longrope_errors(scaling, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_hf_config({**PHI3_CONFIG, "rope_scaling": scaling})


def test_unknown_architecture_names_the_supported_ones():
    with pytest.raises(ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'; supported: .*"
                                         r"Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM, Gemma2ForCausalLM, "
                                         r"Gemma3ForCausalLM"):
        ModelArgs.from_hf_config({**PHI3_CONFIG, "architectures": ["GPT2LMHeadModel"]})


@pytest.mark.parametrize("name", ["qwen2-tied", "qwen3", "phi3-longrope", "gemma2", "gemma3"])
def test_generation_loops(name):
    """decode.generate's greedy tokens equal the uncached loop's; a speculative run with a draft of the same family
    (another seed) gives plain greedy's tokens: its k-query verifies decide as the one-query steps do."""
    import speculative
    from tiny_models import greedy_ids, greedy_uncached

    model, other = hf_to_ours(make_hf(name)), hf_to_ours(make_hf(name, seed=1))
    prompt = [5, 17, 42, 7]
    plain = greedy_ids(model, prompt, 24)
    assert plain == greedy_uncached(model, prompt, 24)
    spec = [t.id for t in speculative.generate(model, speculative.ModelDraft(other, model), prompt,
                                                max_new_tokens=24, k=3)]
    assert spec == plain


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_gguf_matches_transformers(tmp_path, arch):
    """A gemma2 / gemma3 file as llama.cpp's converter writes it: norms stored as 1 + w (q/k norms too), its own
    norm names, no `output` (always tied), soft-caps and window in the metadata; gemma2: every other layer windowed
    from the first; gemma3: every sixth layer full (llama.cpp's default pattern), the sliding layers' RoPE base
    apart (rope.freq_base_swa), linear scaling of the full layers' RoPE. The scale is the head dim's
    (query_pre_attn_scalar = head_dim, as llama.cpp assumes for all but the 27B models)."""
    import gguf
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=160, hidden_size=64, intermediate_size=112, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=24, query_pre_attn_scalar=24, sliding_window=16,
                  final_logit_softcapping=3.0, max_position_embeddings=256, rms_norm_eps=1e-5,
                  initializer_range=0.1, pad_token_id=None)
    if arch == "gemma2":
        cfg = transformers.Gemma2Config(num_hidden_layers=3, attn_logit_softcapping=2.0, **common)
        hf = transformers.Gemma2ForCausalLM(cfg).eval()
    else:
        cfg = transformers.Gemma3TextConfig(num_hidden_layers=7, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}, **common)
        hf = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:
                p.normal_(0.0, 0.1)
    writer = llama_gguf_writer(tmp_path / "g.gguf", cfg, arch)
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    else:
        writer.add_rope_freq_base_swa(50.0)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(4.0)
    top = {v: k for k, v in GGUF_TOP_NAMES.items()}
    block = {v: k for k, v in {**GGUF_BLOCK_NAMES, **GGUF_ARCH_NAMES[arch]}.items()}
    for name, t in hf.state_dict().items():
        name = name.removeprefix("model.")
        if name == "lm_head.weight":
            continue
        parts = name.split(".")
        gguf_name = (f"blk.{parts[1]}.{block['.'.join(parts[2:-1])]}.weight" if parts[0] == "layers"
                     else f"{top[parts[0]]}.weight")
        w = t.float().numpy() + (1.0 if name.endswith("norm.weight") else 0.0)  # the converter's 1 + w
        writer.add_tensor(gguf_name, np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model, _ = load_model(str(tmp_path / "g.gguf"), "cpu", torch.float32)
    sliding = (0, 2) if arch == "gemma2" else (0, 1, 2, 3, 4, 6)
    assert model.args.sliding_layers == sliding and model.args.tie_embeddings and not model.args.norm_plus_one
    toks = tokens()
    assert (model(toks, torch.arange(SEQ_LEN), all_logits=True) - hf(toks).logits).abs().max() <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2", "gemma2", "gemma3"])
def test_compiled_full_decode_matches_eager(name):
    """--compile full: the whole decode step as one graph (the bias, the written-out attention and its mask pair)."""
    import torch._dynamo

    from step import Step, eager

    model = hf_to_ours(make_hf(name))
    torch._dynamo.reset()
    compiled = Step(model, "full")
    caches = [KVCache.for_model(model.args, 1, 24, torch.float32, "cpu") for _ in range(2)]
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    a, b = eager(model, prompt, torch.arange(5), caches[0]), compiled(prompt, torch.arange(5), caches[1])
    for pos in range(5, 20):
        token = a.argmax(-1, keepdim=True)
        a, b = eager(model, token, torch.tensor([pos]), caches[0]), compiled(token, torch.tensor([pos]), caches[1])
        assert (a - b).abs().max() <= 1e-4


@pytest.mark.parametrize("name", ["qwen3moe-dense-layers", "deepseek-v3", "gpt-oss"])
def test_new_families_export_round_trip(tmp_path, name):
    """export.py's int8 folder of Qwen3-MoE, DeepSeek (latent attention, its router bias) and gpt-oss (sinks, expert
    biases) loads back to the model quantized at load, exactly."""
    from scripts import export

    make_hf(name).save_pretrained(tmp_path / "src")
    assert export.main(["--model", str(tmp_path / "src"), "--mode", "int8", "--out", str(tmp_path / "out"),
                        "--dtype", "float32"]) == 0
    at_load, _ = load_model(str(tmp_path / "src"), "cpu", torch.float32, quantize="int8")
    loaded, _ = load_model(str(tmp_path / "out"), "cpu", torch.float32)
    assert torch.equal(loaded(tokens(12), torch.arange(12), all_logits=True),
                       at_load(tokens(12), torch.arange(12), all_logits=True))
