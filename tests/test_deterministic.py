"""The deterministic mode (--deterministic: step.Step over invariant.py's batch-invariant ops). A request's logprobs
are bitwise the same served alone, among 15 concurrent random requests, with its prefill chunked and after a
prefix-cache hit, and the default mode differs in each (so each check can fail). Beneath that: each op is close to
the plain one and invariant to what the rest of its batch holds; whole-forward logits are equal for every chunking
and cache length; the flags."""
import copy
import dataclasses
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import generate
from ops import invariant
from decode import new_cache
from serving.engine import Engine, EngineConfig, Request
from helpers import ToyTokenizer
from ops.cpu import decode_attention, native_bf16
from quantize import make_quantized_linear, parse_mode
from params import SamplingParams
from step import Step
from tiny_models import reference_attention


def rows_around(x: torch.Tensor, before: int, after: int, seed: int) -> torch.Tensor:
    """x (1, K) with `before` random rows above it and `after` below (scaled, so the other rows differ in size)."""
    g = torch.Generator().manual_seed(seed)
    above, below = (torch.randn(n, x.shape[1], generator=g) * 10 for n in (before, after))
    return torch.cat([above.to(x.dtype), x, below.to(x.dtype)])


PLACES = [(0, 0), (3, 1), (15, 0), (16, 4), (21, 30), (0, 47)]  # rows before and after the row followed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_do_not_depend_on_the_other_rows(dtype):
    torch.manual_seed(0)
    w, b = torch.randn(96, 80).to(dtype), torch.randn(96).to(dtype)
    x = torch.randn(1, 80).to(dtype)
    with invariant.BatchInvariant():
        alone = F.linear(x, w, b)
        for i, (before, after) in enumerate(PLACES + [(p, 40) for p in range(invariant.ROWS)]):  # every place
            assert torch.equal(F.linear(rows_around(x, before, after, i), w, b)[before], alone[0])
    torch.testing.assert_close(alone, F.linear(x, w, b), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-3)


@pytest.mark.parametrize("mode", ["int8", "int4:32", "int4:64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_kernels_compute_each_row_alone(mode, dtype):
    """The int8 and int4 CPU kernels are left untiled (invariant.py): this is why that is right."""
    torch.manual_seed(0)
    plain = nn.Linear(128, 96, bias=False)
    kind, group = parse_mode(mode)
    layer = make_quantized_linear(kind, group, plain, torch.float32)
    layer.load_state_dict(layer.quantize_weight(plain.weight.detach()), strict=False)
    layer.pack_for_kernel()
    x = torch.randn(1, 128).to(dtype)
    with invariant.BatchInvariant():
        alone = layer(x)
        for i, (before, after) in enumerate(PLACES):
            assert torch.equal(layer(rows_around(x, before, after, i))[before], alone[0])


def test_matmul_is_invariant_to_rows_columns_and_zero_tails():
    torch.manual_seed(0)
    a, b = torch.randn(2, 3, 40, 100), torch.randn(2, 1, 100, 70)  # batch dims broadcast
    y = invariant.matmul(a, b)
    torch.testing.assert_close(y, a @ b, rtol=1e-5, atol=1e-4)
    one = invariant.matmul(a[:, :, 5:6], b)  # a row alone
    assert torch.equal(one[:, :, 0], y[:, :, 5])
    for before in range(invariant.TILE_ROWS + 1):  # every place in a tile
        more_rows = torch.cat([torch.randn(2, 3, before, 100), a[:, :, 5:6], torch.randn(2, 3, 9, 100)], dim=2)
        assert torch.equal(invariant.matmul(more_rows, b)[:, :, before], y[:, :, 5])
    more_columns = torch.cat([torch.randn(2, 1, 100, 5), b, torch.randn(2, 1, 100, 200)], dim=3)
    assert torch.equal(invariant.matmul(a, more_columns)[..., 5:75], y)
    # a longer reduced dim whose extra a-entries are zero (probabilities of masked keys) and b-rows anything
    longer_a = torch.cat([a, torch.zeros(2, 3, 40, 150)], dim=3)
    longer_b = torch.cat([b, torch.randn(2, 1, 150, 70)], dim=2)
    assert torch.equal(invariant.matmul(longer_a, longer_b), y)


def test_softmax_is_invariant_to_masked_tails():
    torch.manual_seed(0)
    x = torch.randn(4, 7, 90)
    p = invariant.softmax(x, dim=-1)
    torch.testing.assert_close(p, torch.softmax(x, dim=-1), rtol=1e-5, atol=1e-7)
    longer = torch.cat([x, torch.full((4, 7, 300), float("-inf"))], dim=-1)
    assert torch.equal(invariant.softmax(longer, dim=-1)[..., :90], p)
    assert torch.equal(invariant.softmax(torch.cat([torch.randn(5, 7, 90), x]), dim=-1)[5:], p)


def test_attention_is_sdpa_and_every_path_gives_a_query_the_same_bits():
    """invariant.attention against the plain definition, and a query's output bitwise the same whether SDPA (long
    prefill chunks) or ops.cpu.decode_attention (decode steps, short chunks) computes it under the mode."""
    torch.manual_seed(0)
    B, H, K, T, S, D = 2, 6, 2, 20, 50, 16
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, K, S, D), torch.randn(B, K, S, D)
    mask = torch.arange(S)[None, :] <= torch.arange(S - T, S)[:, None]  # (T, S): causal at positions S-T..S-1
    y = invariant.attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(y, reference_attention(q, k, v, mask), rtol=1e-5, atol=1e-5)
    with invariant.BatchInvariant():
        assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), y)
        for t in (0, 7, T - 1):  # one query, as a decode step computes it, with the cache padded further
            padded_k, padded_v = (torch.cat([x, torch.randn(B, K, 30, D)], dim=2) for x in (k, v))
            one = decode_attention(q[:, :, t:t + 1], padded_k, padded_v, F.pad(mask[t:t + 1], (0, 30)))
            assert torch.equal(one[:, :, 0], y[:, :, t])


def chunked_logits(model, step: Step, tokens: list[int], chunk: int, cache_len: int) -> torch.Tensor:
    """Every position's logits (T, V), the prompt fed `chunk` tokens at a time into a cache of cache_len slots."""
    cache, out = new_cache(model, 1, cache_len), []
    for start in range(0, len(tokens), chunk):
        piece = torch.tensor([tokens[start:start + chunk]])
        out.append(step(piece, torch.arange(start, start + piece.shape[1]), cache, all_logits=True)[0])
    return torch.cat(out)


@torch.inference_mode()
def test_logits_are_equal_for_every_chunking_and_cache_length(tiny):
    tokens = torch.randint(1, 160, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    det = Step(tiny, deterministic=True)
    whole = chunked_logits(tiny, det, tokens, 40, 40)
    for chunk, cache_len in ((1, 40), (7, 100), (17, 256), (32, 70)):
        assert torch.equal(chunked_logits(tiny, det, tokens, chunk, cache_len), whole), (chunk, cache_len)
    plain = chunked_logits(tiny, Step(tiny), tokens, 40, 40)
    torch.testing.assert_close(whole, plain, rtol=1e-4, atol=1e-4)  # still the model
    assert not torch.equal(chunked_logits(tiny, Step(tiny), tokens, 1, 40), plain)  # the default's are not equal


def random_prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 60, (n,), generator=g).tolist()
    return [torch.randint(1, 160, (length,), generator=g).tolist() for length in lengths]


def served_logprobs(engine: Engine, prompts: list[list[int]], max_new_tokens: int) -> list[list[tuple]]:
    """Greedy (temperature 0) through the engine, all submitted at once: per prompt, each token's (id, logprob,
    top 5)."""
    tokens: dict[int, list] = {}
    ids = [engine.submit(Request(p, SamplingParams(temperature=0.0), max_new_tokens, logprobs=5,
                                 on_event=lambda e: tokens.setdefault(e.request_id, []).extend(e.tokens)))
           for p in prompts]
    while engine.has_work():
        engine.step()
    return [[(t.id, t.logprob, tuple(t.top)) for t in tokens[i]] for i in ids]


ROOMY = EngineConfig(block_size=4, num_blocks=400, max_running=16, token_budget=512)


def scenarios(model, deterministic: bool, target: list[int], max_new_tokens: int, warm: list[int]) -> dict:
    """The target's logprobs served alone, among 15 random requests, in prefill chunks of 7 tokens, and after a
    request sharing all but its last 5 tokens left them in the prefix cache."""
    def engine(config: EngineConfig = ROOMY) -> Engine:
        return Engine(model, ToyTokenizer(), config, Step(model, deterministic=deterministic))

    cached = engine()
    served_logprobs(cached, [warm], 1)
    return {"alone": served_logprobs(engine(), [target], max_new_tokens)[0],
            "15 concurrent": served_logprobs(engine(), [target, *random_prompts(15, 1)], max_new_tokens)[0],
            "chunked prefill": served_logprobs(engine(EngineConfig(block_size=4, num_blocks=400, max_running=4,
                                                                   token_budget=7)), [target], max_new_tokens)[0],
            "prefix-cache hit": served_logprobs(cached, [target], max_new_tokens)[0]}


def test_served_logprobs_are_bitwise_equal_only_when_deterministic(tiny):
    target = random_prompts(1, 0)[0] + list(range(1, 41))  # 40-odd tokens
    warm = target[:-5] + [7, 8, 9]
    det = scenarios(tiny, True, target, 12, warm)
    default = scenarios(tiny, False, target, 12, warm)
    for name in ("15 concurrent", "chunked prefill", "prefix-cache hit"):
        assert det[name] == det["alone"], name
    # The default mode rounds a batch's rows and a chunked prompt otherwise; a prefix-cache hit's last tokens go
    # through SDPA as the whole prefill's do (ops/cpu.py), equal here, though SDPA's rows are not invariant in general.
    for name in ("15 concurrent", "chunked prefill"):
        assert default[name] != default["alone"], f"the default mode gave equal logprobs for {name}"


@pytest.mark.slow
@pytest.mark.parametrize("quantize", [None, "none"])
def test_smollm2_served_logprobs_are_bitwise_equal(smollm2_gguf, smollm2_tokenizer, quantize):
    """SmolLM2 in bf16 with the GGUF's int4 linears (as serve.py loads it by default) and dequantized to bf16
    weights, where the default's one-row steps (MKL) and batches (oneDNN) differ on a CPU with native bf16 (on an
    AVX2 one, AMD Zen 3, they gave equal logprobs). Through serve.py's flag."""
    from load import load_model
    from serve import make_engine, parse_args

    model, _ = load_model(smollm2_gguf, "cpu", torch.bfloat16, quantize=quantize)
    target = smollm2_tokenizer.encode("The three primary colours are red, yellow and blue; mixing two of them")
    warm = target[:-5] + smollm2_tokenizer.encode(" gives")
    det = scenarios(model, True, target, 6, warm)
    for name in ("15 concurrent", "chunked prefill", "prefix-cache hit"):
        assert det[name] == det["alone"], name
    engine = make_engine(parse_args(["--deterministic"]), model, smollm2_tokenizer)
    assert engine.decode_step.deterministic
    assert served_logprobs(engine, [target], 6)[0] == det["alone"]
    if quantize == "none" and native_bf16(torch.device("cpu")):  # emulated bf16 (AVX2) happens to be row-invariant
        default = scenarios(model, False, target, 6, warm)
        assert default["15 concurrent"] != default["alone"] and default["chunked prefill"] != default["alone"]


def test_deterministic_runs_eagerly_and_not_for_mixtral(tiny, cli_error):
    assert Step(tiny, "auto", deterministic=True).mode == "none"
    with pytest.raises(ValueError, match="--deterministic runs eagerly; it cannot take --compile blocks"):
        Step(tiny, "blocks", deterministic=True)
    moe = copy.copy(tiny)  # only its args change: Mixtral's expert count
    moe.args = dataclasses.replace(tiny.args, n_experts=4)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        Step(moe, deterministic=True)
    assert "--deterministic runs eagerly; it cannot take --compile full" in cli_error(
        generate.main, ["--prompt", "hi", "--deterministic", "--compile", "full"])


def test_the_command_line_flag(capsys, tiny_text_dir):
    run = ["--model", tiny_text_dir, "--prompt", "hi", "--max-new-tokens", "4", "--temperature", "0",
           "--dtype", "float32", "--logprobs", "2", "--json"]
    assert generate.main([*run, "--deterministic"]) == 0
    out, err = capsys.readouterr()
    assert "| eager, deterministic |" in err.splitlines()[-1]
    assert generate.main([*run, "--compile", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert json.loads(out)["tokens"] == plain["tokens"]  # the same model: its logprobs differ only by rounding
