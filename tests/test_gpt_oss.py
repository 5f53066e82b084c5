"""gpt-oss beyond the logits tests every tiny config gets in test_model.py (one forward, token by token, chunked,
batched, against transformers): its checkpoint layout, the sinks against a direct computation, quantized experts
with their biases, the paged engine, speculative decoding and what is refused; the harmony chat template rendered
as transformers renders it (the template as released, from llama.cpp's sources: found as test_convert.py finds
the converter, else those tests skip) and its answers split into reasoning and content."""
import pytest
import torch

from config import ModelArgs
from helpers import ToyTokenizer
from load import load_model
from model import attention_mask, written_attention
from serving.engine import Engine, EngineConfig
from tiny_models import (SEQ_LEN, compiled_against_eager, dense_twin, greedy_ids, greedy_uncached, harmony_template,
                         hf_to_ours, make_hf, write_harmony_tokenizer, write_mxfp4_pair)

PROMPT = [5, 17, 42, 99, 3, 64, 8]


@pytest.fixture(scope="module")
def hf():
    return make_hf("gpt-oss")


def tokens(seq: int = SEQ_LEN) -> torch.Tensor:
    return torch.randint(0, 160, (1, seq), generator=torch.Generator().manual_seed(1))


def test_folder_matches_transformers(hf, tmp_path):
    """The stacked, transposed, column-interleaved experts and their biases, the router and the sinks load to
    transformers' logits and greedy tokens."""
    hf.save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path), "cpu", torch.float32)
    assert (model(tokens(), torch.arange(SEQ_LEN), all_logits=True) - hf(tokens()).logits).abs().max() <= 1e-4
    out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert greedy_ids(model, PROMPT, 12) == out[0, len(PROMPT):].tolist() == greedy_uncached(model, PROMPT, 12)
    assert model.args.sliding_layers == (0, 2) and model.args.swiglu_limit == 1.5


@pytest.mark.parametrize("window", [None, 5])
def test_sinks_against_a_direct_computation(window):
    """Each head's sink logit joins the softmax as a column and its share is dropped: the rows sum to less than 1;
    a sink of -inf is plain attention."""
    from tiny_models import reference_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 6, 9, 16, generator=g), torch.randn(2, 3, 20, 16, generator=g), \
        torch.randn(2, 3, 20, 16, generator=g)  # (B, H, T, D), (B, K, S, D) x 2
    sinks = torch.randn(6, generator=g)
    mask = attention_mask(torch.arange(11, 20), torch.arange(20), window)
    kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # (B, H, S, D)
    scores = (q @ kr.transpose(-2, -1) / 4).masked_fill(~mask, float("-inf"))  # (B, H, T, S)
    with_sink = torch.cat([scores, sinks.view(1, 6, 1, 1).expand(2, 6, 9, 1)], dim=-1).softmax(-1)[..., :20]
    got = written_attention(q, k, v, mask, 16 ** -0.5, None, sinks)
    assert (got - with_sink @ vr).abs().max() <= 1e-5
    plain = written_attention(q, k, v, mask, 16 ** -0.5, None, torch.full((6,), float("-inf")))
    assert (plain - reference_attention(q, k, v, mask)).abs().max() <= 1e-5


@pytest.mark.parametrize("mode", ["int8", "int4:32"])
def test_quantized_experts_keep_their_biases(hf, tmp_path, mode, monkeypatch):
    """Every linear quantized at load, its bias kept in float; with the dequantize path the logits equal a float
    model's holding the dequantized weights."""
    import quantize

    monkeypatch.setattr(quantize, "int8_kernel", lambda device: None)
    monkeypatch.setattr(quantize, "int4_kernel", lambda device: None)
    hf.save_pretrained(tmp_path)
    floats, _ = load_model(str(tmp_path), "cpu", torch.float32)
    q, _ = load_model(str(tmp_path), "cpu", torch.float32, quantize=mode)
    expert = q.layers[1].mlp.experts[2].gate_up_proj
    assert torch.equal(expert.bias, floats.layers[1].mlp.experts[2].gate_up_proj.bias)
    for name, module in floats.named_modules():
        if name.startswith("layers.") and isinstance(module, torch.nn.Linear):
            module.weight.copy_(q.get_submodule(name).dequantize())
    want = floats(tokens(24), torch.arange(24), all_logits=True)
    assert (q(tokens(24), torch.arange(24), all_logits=True) - want).abs().max() <= 1e-5


def test_paged_engine_and_speculative_match_greedy(hf):
    import speculative
    from speculative import PromptLookupDraft

    ours = hf_to_ours(hf)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 160, (n,), generator=g).tolist() for n in (3, 17, 9)]
    expected = [greedy_ids(ours, p, 24) for p in prompts]
    engine = Engine(ours, ToyTokenizer(), EngineConfig(block_size=4, num_blocks=100, max_running=4, token_budget=24))
    assert [c.tokens for c in engine.generate(prompts, max_new_tokens=24)] == expected
    got = [t.id for t in speculative.generate(ours, PromptLookupDraft(), prompts[1], max_new_tokens=24, k=4)]
    assert got == expected[1]


def test_config_and_refusals(tmp_path):
    from features import tp

    cfg = {"architectures": ["GptOssForCausalLM"], "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 2,
           "num_attention_heads": 2, "intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
           "attention_bias": True, "head_dim": 4}
    args = ModelArgs.from_hf_config(cfg)
    assert (args.sliding_layers, args.swiglu_limit, args.attn_sinks, args.o_bias, args.n_experts) == (
        (0,), 7.0, True, True, 4)
    with pytest.raises(ValueError, match="unsupported config.json swiglu_alpha 1.5; supported: 1.702"):
        ModelArgs.from_hf_config({**cfg, "swiglu_alpha": 1.5})
    make_hf("gpt-oss").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="^tensor parallel does not split gpt-oss's experts"):
        load_model(str(tmp_path), "cpu", torch.float32, shard=tp.Shard(0, 2))


def test_gguf_metadata():
    """A gpt-oss file as llama.cpp's converter writes it and llama.cpp reads it: every other layer windowed from the
    first, the SwiGLU clamped at 7, biases and sinks; YaRN as transformers' gpt-oss (untruncated)."""
    meta = {"general.architecture": "gpt-oss", "gpt-oss.block_count": 3, "gpt-oss.embedding_length": 64,
            "gpt-oss.feed_forward_length": 48, "gpt-oss.attention.head_count": 4, "gpt-oss.attention.head_count_kv": 2,
            "gpt-oss.vocab_size": 160, "gpt-oss.expert_count": 8, "gpt-oss.expert_used_count": 2,
            "gpt-oss.attention.key_length": 16, "gpt-oss.attention.sliding_window": 16,
            "gpt-oss.rope.scaling.type": "yarn", "gpt-oss.rope.scaling.factor": 8.0,
            "gpt-oss.rope.scaling.original_context_length": 32}
    args = ModelArgs.from_gguf(meta, {"output.weight"})
    assert (args.sliding_layers, args.sliding_window, args.swiglu_limit, args.attn_sinks, args.qkv_bias,
            args.o_bias, args.moe_bias) == ((0, 2), 16, 7.0, True, True, True, True)
    assert args.rope_scaling["truncate"] is False and args.rope_scaling["factor"] == 8.0


def test_mxfp4_decodes_as_transformers():
    """An MXFP4 matrix (codes two a byte, a power-of-two scale per 32) decodes to transformers' dequantization
    bitwise (its convert_moe_packed_tensors, which also transposes to its float layout)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from formats import mxfp4

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 140, (3, 10, 4), generator=g, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # (E, G x 32, rows)
    assert torch.equal(mxfp4.dequantize(blocks, scales).transpose(1, 2), want)


def test_mxfp4_linear_decodes_every_byte_and_scale():
    """MXFP4Linear's weight (decoded for each product from its pair table) equals dequantize's float32 one for every
    code byte under every scale but 255 (E8M0's NaN), cast to float32, bfloat16 and float16 alike."""
    from formats.mxfp4 import MXFP4Linear, dequantize

    blocks = torch.arange(256, dtype=torch.uint8).view(16, 16)[None].expand(255, 16, 16).contiguous()  # (N, G, 16)
    scales = torch.arange(255, dtype=torch.uint8)[:, None].expand(255, 16).contiguous()  # (N, G)
    linear = MXFP4Linear(16 * 32, 255)
    linear.blocks, linear.scales = torch.nn.Parameter(blocks, False), torch.nn.Parameter(scales, False)
    want = dequantize(blocks, scales)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(linear.dequantize(dtype), want.to(dtype)), dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_folder_runs_as_stored_or_dequantized(tmp_path, dtype):
    """A folder whose experts are MXFP4 blocks and scales (as gpt-oss is released, quant_method mxfp4) loads as its
    codes (MXFP4Linear, decoded for each product) by default and as floats with --quantize none: both give the logits
    of a float folder holding transformers' dequantization of them, bit for bit, in float32 and bfloat16, cached
    decode steps too; the codes take 4.25 bits a weight."""
    from formats.mxfp4 import MXFP4Linear
    from quantize import describe, weight_bytes

    hf = make_hf("gpt-oss", intermediate_size=64)  # MXFP4 blocks of 32 along F and C
    write_mxfp4_pair(hf, tmp_path, {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]})
    floats, _ = load_model(str(tmp_path / "float"), "cpu", dtype)
    stored, _ = load_model(str(tmp_path / "mxfp4"), "cpu", dtype)
    decoded, _ = load_model(str(tmp_path / "mxfp4"), "cpu", dtype, quantize="none")
    experts = [m for m in stored.modules() if isinstance(m, MXFP4Linear)]
    assert describe(stored) == "mxfp4 x48 + float x6" and describe(decoded) == "float"  # the summary line's
    assert len(experts) == 2 * 3 * 8 and not any(isinstance(m, MXFP4Linear) for m in decoded.modules())
    want = floats(tokens(24), torch.arange(24), all_logits=True)
    for model in (stored, decoded):
        assert torch.equal(model(tokens(24), torch.arange(24), all_logits=True), want)
    assert greedy_ids(stored, PROMPT, 8) == greedy_ids(floats, PROMPT, 8)
    weights = sum(m.in_features * m.out_features for m in experts)
    assert sum(m.blocks.nbytes + m.scales.nbytes for m in experts) * 8 == weights * 4.25
    saved = weights * dtype.itemsize - weights * 17 // 32  # the expert matrices' bytes less their codes'
    assert weight_bytes(decoded) - weight_bytes(stored) == saved


HARMONY = harmony_template()
needs_template = pytest.mark.skipif(HARMONY is None, reason="gpt-oss's template not found (LLAMA_CPP_CONVERT, or "
                                    "$PEER's llama.cpp sources)")
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {
        "type": "string", "enum": ["C", "F"]}}, "required": ["city"]}}}]
CONVERSATIONS = [
    ([{"role": "user", "content": "Hi there"}], None, {}),
    ([{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello"}], None,
     {"reasoning_effort": "high"}),
    ([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "thinking": "Easy."},
      {"role": "user", "content": "And 3+3?"}], None, {}),
    ([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "thinking": "Call the tool.", "tool_calls": [{"type": "function", "function": {
          "name": "get_weather", "arguments": {"city": "Paris"}}}]},
      {"role": "tool", "content": "{\"temp\": 21}"}], WEATHER, {}),
]


@needs_template
@pytest.mark.parametrize("case", range(len(CONVERSATIONS)))
def test_harmony_template_renders_as_transformers(tmp_path, case):
    """System, developer, reasoning effort, an earlier answer with its thinking (dropped), tools, a call and its
    result: the same text as transformers' apply_chat_template, and the same ids."""
    from transformers import AutoTokenizer

    from tokenizer import load_tokenizer

    write_harmony_tokenizer(tmp_path, HARMONY)
    messages, tools, variables = CONVERSATIONS[case]
    ours, theirs = load_tokenizer(str(tmp_path)), AutoTokenizer.from_pretrained(str(tmp_path))
    text = ours.apply_chat_template(messages, tools=tools, variables=variables)
    assert text == theirs.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                              **variables)
    assert text.endswith("<|start|>assistant") and "<|start|>system<|message|>" in text
    assert ours.encode_chat(messages, tools=tools, variables=variables) == \
        theirs.encode(text, add_special_tokens=False)


@needs_template
def test_a_harmony_answer_is_read_as_reasoning_then_content(tmp_path):
    """The template's model: --reasoning-parser auto picks harmony; a chat answer streamed token by token (special
    tokens whole, as the detokenizer gives them) carries the analysis as reasoning_content and the final as content,
    and the next turn renders the answer alone."""
    from features.reasoning import HARMONY as HARMONY_TAGS, Reader, ReasoningParser, tags_named
    from tokenizer import load_tokenizer

    write_harmony_tokenizer(tmp_path, HARMONY)
    tok = load_tokenizer(str(tmp_path))
    assert tags_named("auto", tok.chat_template) == HARMONY_TAGS
    output = "<|channel|>analysis<|message|>The user greets.<|end|><|start|>assistant<|channel|>final<|message|>Hi!"
    ids = tok.encode(output, bos=False)
    reader, stream = Reader(ReasoningParser(HARMONY_TAGS)), tok.stream()
    deltas = [d for i in ids for d in reader.feed(stream.push(i))] + reader.feed(stream.flush(), final=True)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user greets."
    assert "".join(d.get("content", "") for d in deltas) == "Hi!"
    assert reader.message() == {"role": "assistant", "content": "Hi!", "reasoning_content": "The user greets."}
    turn = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": reader.content}]
    assert tok.apply_chat_template(turn).endswith("<|start|>assistant<|channel|>final<|message|>Hi!<|end|>"
                                                  "<|start|>assistant")


@pytest.mark.slow
def test_compiled_sinks_equal_eager_and_moe_is_refused(hf):
    """--compile blocks and full run the learned sinks (written_attention's extra column, the windows) as eager
    does, within 1e-5, on a dense twin of the tiny model; the MoE model itself is refused in one line."""
    from step import Step

    model = hf_to_ours(hf)
    twin = dense_twin(model)
    assert twin.args.attn_sinks and twin.args.sliding_layers
    assert max(compiled_against_eager(twin, [7, 8, 9], 12).values()) <= 1e-5
    for mode in ("blocks", "full"):
        with pytest.raises(ValueError, match="^--compile does not support mixture-of-experts models"):
            Step(model, mode)


def test_published_shape_in_the_kv_table(capsys):
    """bench.py's gpt-oss-20b: 20.9 B parameters as published; its KV cache 24 layers x 8 kv heads x (64 + 64) x 2
    bytes a token, and half of it per 32k sequence (plus 128 tokens of each sliding layer) where windows are kept to
    their length."""
    from scripts import bench

    shape = bench.SHAPES["gpt-oss-20b"]
    assert round(bench.param_count(shape) / 1e9, 1) == 20.9
    assert bench.main(["--kv-table", "--context", "32768"]) == 0
    out = capsys.readouterr().out.splitlines()[2:]
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:6]] for r in out}
    token = 24 * 8 * 128 * 2
    windowed = 12 * 8 * 128 * 2 * (32768 + 128)
    assert rows["gpt-oss-20b"] == ["GQA, half sliding (128)", f"{token / 1024:g}", f"{token * 32768 / 2**30:.3g}",
                                   f"{windowed / 2**30:.3g}"]
    assert rows["llama-3-8b"][2] == rows["llama-3-8b"][3] == "4"  # no windows: the same


def test_a_harmony_gguf_vocabulary_ends_at_return_and_call():
    """A GGUF's turn ends (<|end|> among them) are ends of the output, but with harmony's <|return|> and <|call|>
    in the vocabulary <|end|> ends a message, not the answer: the output ends at those two (llama.cpp's rule)."""
    from helpers import toy_bpe

    specials = ("<|start|>", "<|channel|>", "<|message|>", "<|return|>", "<|call|>")
    for eos in (107, 0):  # <|return|>, as the converter writes gpt-oss's eos; <|end|>, dropped all the same
        tok = toy_bpe(specials, eos_token_id=eos)
        assert sorted(tok.backend.id_to_token(i) for i in tok.eos_ids) == ["<|call|>", "<|return|>"]
    plain = toy_bpe(specials[:3])  # no harmony ends: <|end|> (id 0, the file's eos) ends the output
    assert plain.eos_ids == [0]
