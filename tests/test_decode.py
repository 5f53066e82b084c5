"""The decode loops against simple references: cached greedy vs a plain uncached loop, the one stop/length rule,
the sampling order and penalties inside the loop, logprobs, batched prompts vs one at a time, a chat session's
reused cache vs a fresh run. The step (eager or compiled) is tested in test_step.py."""
import math

import pytest
import torch

from decode import Session, common_prefix, end_reason, generate, generate_batch, new_cache
from helpers import complete_greedy
from sample import apply_penalties, logits_to_logprobs, sample_tokens, token_counts
from params import SamplingParams
from text import complete_batch
from tiny_models import greedy_ids, greedy_uncached, last_logits

PROMPT = [5, 17, 42, 99, 3]


# ---- the plain loop: cached vs uncached, and when it ends ----

def test_greedy_matches_uncached_loop(tiny):
    assert greedy_ids(tiny, PROMPT, 40) == greedy_uncached(tiny, PROMPT, 40)


def test_last_token_says_why_generation_ended(tiny):
    tokens = list(generate(tiny, PROMPT, max_new_tokens=12))
    assert len(tokens) == 12 and [t.end for t in tokens] == [None] * 11 + ["length"]
    stop = tokens[4].id
    ended = list(generate(tiny, PROMPT, max_new_tokens=12, stop_ids=[stop]))
    assert ended[-1].id == stop and ended[-1].end == "eos" and all(t.end is None for t in ended[:-1])


def test_stops_after_stop_id(tiny):
    full = greedy_ids(tiny, PROMPT, 40)
    stop = full[10]
    got = greedy_ids(tiny, PROMPT, 40, stop_ids=[stop])
    assert got == full[: full.index(stop) + 1]


def test_stops_at_context_limit(tiny):
    context = tiny.args.max_seq_len  # 256
    prompt = list(range(1, 151)) + list(range(1, 101))  # 250 tokens
    tokens = list(generate(tiny, prompt, max_new_tokens=100))
    got = [t.id for t in tokens]
    # The last position (context - 1) can be fed, so its logits give one more token: context - len + 1.
    assert len(got) == context - len(prompt) + 1 and tokens[-1].end == "length"
    assert got == greedy_uncached(tiny, prompt, len(got))


def test_end_reason():
    assert end_reason(7, 1, 10, 5, 100, stop_ids=[7]) == "eos"  # a stop id wins, even on the last token
    assert end_reason(7, 5, 10, 5, 100, stop_ids=[7]) == "eos"
    assert end_reason(3, 4, 10, 5, 100, stop_ids=[7]) is None
    assert end_reason(3, 5, 10, 5, 100, stop_ids=[7]) == "length"  # max_new_tokens
    assert end_reason(3, 2, 100, 5, 100, stop_ids=()) is None  # token 100 can still be fed, at position 99
    assert end_reason(3, 2, 101, 5, 100, stop_ids=()) == "length"  # token 101 would need position 100: none left
    assert end_reason(7, 1, 10, 5, 100, stop_ids=[7], ignore_eos=True) is None  # ignore_eos: a stop id goes on
    assert end_reason(7, 5, 10, 5, 100, stop_ids=[7], ignore_eos=True) == "length"


def test_bad_requests(tiny):
    with pytest.raises(ValueError, match="the prompt is 256 tokens, longer than the model's context of 255"):
        list(generate(tiny, [1] * 256, max_new_tokens=10))
    with pytest.raises(ValueError, match="the prompt is empty"):
        list(generate(tiny, [], max_new_tokens=10))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        list(generate(tiny, [1, 2], max_new_tokens=0))


def test_common_prefix():
    assert common_prefix([1, 2, 3, 4], [1, 2, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([9], [1]) == 0


def test_seeded_sampling_is_reproducible(tiny):
    def run(seed):
        return greedy_ids(tiny, [1, 2, 3], 30, SamplingParams(temperature=1.0, top_p=0.9),
                          generator=torch.Generator().manual_seed(seed))
    assert run(3) == run(3)
    assert run(3) != run(4)


def test_int8_kv_cache_generation_runs_to_the_end(tiny):
    tokens = list(generate(tiny, PROMPT, max_new_tokens=20, kv_dtype="int8"))
    assert len(tokens) == 20 and tokens[-1].end == "length"
    assert new_cache(tiny, 1, 8, "int8").bytes_per_token < new_cache(tiny, 1, 8).bytes_per_token


# ---- the sampling order, penalties and logprobs, through the function the loops call ----

def test_order_penalties_temperature_top_k_top_p_min_p():
    p = torch.tensor([0.04, 0.4, 0.06, 0.3, 0.2])
    seen = torch.tensor([[False, True, False, False, False]])
    generated = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0]])  # token 1 was generated once
    params = SamplingParams(temperature=0.5, top_k=4, top_p=0.8, min_p=0.5, presence_penalty=0.5)
    _, (token,) = sample_tokens(p.log()[None], params, torch.Generator().manual_seed(0), seen, generated, logprobs=5)
    w = p * torch.tensor([1, math.exp(-0.5), 1, 1, 1])  # presence penalty: token 1's logit - 0.5; top is now 3
    w = w ** 2  # temperature 0.5 squares the odds: [.0082, .3033, .0186, .4638, .2061] normalized
    w[0] = 0  # top-k 4 drops the least likely
    w[2] = 0  # top-p 0.8: tokens 3, 1 (.7734) then 4 reach it; token 2 is dropped
    w[4] = 0  # min-p 0.5: token 4 (.2118) is under half of token 3 (.4766)
    expected = w / w.sum()  # [0, .3954, 0, .6046, 0]
    got = torch.zeros(5)
    for i, lp in token.top:
        got[i] = math.exp(lp)
    assert torch.allclose(got, expected, atol=1e-6)
    assert [i for i, _ in token.top] == [3, 1]  # only tokens with probability left, most likely first
    assert token.id in (1, 3)
    # sample_tokens updates the penalty state with the token it drew
    assert generated[0, token.id] == 2.0 if token.id == 1 else generated[0, token.id] == 1.0


def greedy_penalized_uncached(model, prompt, n, params):
    """Greedy with penalties recomputed from scratch every step, on an uncached forward."""
    seq = list(prompt)
    for _ in range(n):
        seen = token_counts([seq], model.args.vocab_size) > 0
        generated = token_counts([seq[len(prompt):]], model.args.vocab_size)
        logits = apply_penalties(last_logits(model, seq)[None], seen, generated, params)
        seq.append(logits.argmax(-1).item())
    return seq[len(prompt):]


def test_penalized_greedy_matches_uncached_reference(tiny):
    prompt = [5, 17, 42, 99, 3, 5, 5]
    params = SamplingParams(repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.4)
    got = greedy_ids(tiny, prompt, 30, params)
    assert got == greedy_penalized_uncached(tiny, prompt, 30, params)
    assert got != greedy_ids(tiny, prompt, 30)  # the penalties changed something


def test_logprobs_at_temperature_1_are_the_models_log_softmax(tiny):
    tokens = list(generate(tiny, PROMPT, max_new_tokens=20, params=SamplingParams(temperature=1.0),
                           generator=torch.Generator().manual_seed(1), logprobs=3))
    seq = list(PROMPT)
    for token in tokens:
        ref = torch.log_softmax(last_logits(tiny, seq), -1)
        assert abs(token.logprob - ref[token.id].item()) <= 1e-5
        top_lp, top_ids = ref.topk(3)
        assert [i for i, _ in token.top] == top_ids.tolist()
        assert max(abs(v - r) for (_, v), r in zip(token.top, top_lp.tolist())) <= 1e-5
        seq.append(token.id)


def test_logprobs_are_of_the_processed_distribution(tiny):
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9)
    tokens = list(generate(tiny, PROMPT, max_new_tokens=20, params=params, generator=torch.Generator().manual_seed(2),
                           logprobs=50))
    seq = list(PROMPT)
    for token in tokens:
        ref = logits_to_logprobs(last_logits(tiny, seq)[None], params)[0]
        assert abs(token.logprob - ref[token.id].item()) <= 1e-5
        kept = int((ref > float("-inf")).sum())
        assert len(token.top) == kept <= 20  # fewer than 50 alternatives: top-k/top-p removed the rest
        assert abs(sum(math.exp(v) for _, v in token.top) - 1) < 1e-5
        seq.append(token.id)


def test_greedy_logprobs_are_the_unfiltered_distribution(tiny):
    prompt = [5, 17, 42]
    (token,) = generate(tiny, prompt, max_new_tokens=1, params=SamplingParams(temperature=0.0, top_k=2), logprobs=4)
    ref = torch.log_softmax(last_logits(tiny, prompt), -1)
    assert token.id == ref.argmax().item() and abs(token.logprob - ref.max().item()) <= 1e-5
    assert len(token.top) == 4


def test_greedy_token_leads_its_alternatives_on_a_tie():
    """Greedy picks the argmax; when two logits tie exactly (common in bfloat16: 8 significant bits) the reported
    top alternative must still be the token picked, with its log-probability."""
    logits = torch.zeros(1, 49152)  # SmolLM2's vocabulary size: topk takes its vectorized path there
    logits[0, 12288] = logits[0, 24576] = 3.0
    _, (token,) = sample_tokens(logits, SamplingParams(), None, None, None, logprobs=2)
    assert token.id in (12288, 24576)
    assert token.top[0] == (token.id, token.logprob) and {i for i, _ in token.top} == {12288, 24576}


def test_no_logprobs_unless_asked(tiny):
    token = next(generate(tiny, PROMPT, max_new_tokens=3))
    assert token.logprob is None and token.top is None


# ---- logit bias, min_tokens, ignore_eos in the loop ----

def greedy_biased_uncached(model, prompt, n, bias: dict[int, float], min_tokens: int = 0, stop_ids=()):
    """Greedy on an uncached forward with the bias added and the stop ids at -inf for the first min_tokens tokens,
    ending after a stop id: the rule written out."""
    seq = list(prompt)
    for i in range(n):
        logits = last_logits(model, seq).clone()
        for token, b in bias.items():
            logits[token] += b
        if i < min_tokens:
            logits[list(stop_ids)] = float("-inf")
        seq.append(logits.argmax().item())
        if seq[-1] in stop_ids:
            break
    return seq[len(prompt):]


def test_logit_bias_bans_and_forces_in_greedy(tiny):
    plain = greedy_ids(tiny, PROMPT, 20)
    banned = plain[0]
    got = greedy_ids(tiny, PROMPT, 20, SamplingParams(logit_bias=((banned, -100),)))
    assert banned not in got and got == greedy_biased_uncached(tiny, PROMPT, 20, {banned: -100})
    assert greedy_ids(tiny, PROMPT, 20, SamplingParams(logit_bias=((7, 100),))) == [7] * 20
    mild = {plain[3]: 1.5, 11: -0.5, 140: 2.0}
    got = greedy_ids(tiny, PROMPT, 20, SamplingParams(logit_bias=tuple(mild.items())))
    assert got == greedy_biased_uncached(tiny, PROMPT, 20, mild) and got != plain


def test_logit_bias_past_the_vocabulary_is_an_error(tiny):
    with pytest.raises(ValueError, match=r"logit_bias token 160 is outside the vocabulary \(ids 0 to 159\)"):
        next(generate(tiny, PROMPT, max_new_tokens=4, params=SamplingParams(logit_bias=((160, 1.0),))))
    with pytest.raises(ValueError, match="logit_bias token 999 is outside the vocabulary"):
        next(generate_batch(tiny, [PROMPT], max_new_tokens=4, params=SamplingParams(logit_bias=((999, 1.0),))))


def test_min_tokens_delays_the_stop_ids(tiny):
    """A bias toward the stop id makes greedy emit it at once; min_tokens holds it back for that many tokens,
    then it comes (the bias still pulls), and generation ends there."""
    stop = 9
    eager = SamplingParams(logit_bias=((stop, 100),))
    assert greedy_ids(tiny, PROMPT, 20, eager, stop_ids=[stop, 3]) == [stop]
    held = SamplingParams(logit_bias=((stop, 100),), min_tokens=6)
    tokens = list(generate(tiny, PROMPT, max_new_tokens=20, params=held, stop_ids=[stop, 3], logprobs=2))
    assert [t.id for t in tokens] == greedy_biased_uncached(tiny, PROMPT, 20, {stop: 100}, 6, [stop, 3])
    assert len(tokens) == 7 and tokens[-1].id == stop and tokens[-1].end == "eos"
    assert not {t.id for t in tokens[:6]} & {stop, 3}  # every stop id held, not only the biased one
    assert all(stop not in {i for i, _ in t.top} for t in tokens[:6])  # and not reported as an alternative
    # max_new_tokens below min_tokens: it is simply length
    assert [t.end for t in generate(tiny, PROMPT, max_new_tokens=4, params=held, stop_ids=[stop])][-1] == "length"


def test_ignore_eos_runs_to_max_tokens(tiny):
    stop = 9
    params = SamplingParams(logit_bias=((stop, 100),), ignore_eos=True)
    tokens = list(generate(tiny, PROMPT, max_new_tokens=8, params=params, stop_ids=[stop]))
    assert [t.id for t in tokens] == [stop] * 8 and [t.end for t in tokens] == [None] * 7 + ["length"]
    plain = greedy_ids(tiny, PROMPT, 12)
    assert greedy_ids(tiny, PROMPT, 12, SamplingParams(ignore_eos=True), stop_ids=[plain[2]]) == plain


def test_defaults_are_bitwise_unchanged(tiny):
    """Sampled with logprobs, the new parameters at their defaults change nothing: the same tokens and the very
    same log-probabilities as with none of them given."""
    params = SamplingParams(temperature=0.9, top_k=40, repetition_penalty=1.2)
    ref = list(generate(tiny, PROMPT, max_new_tokens=16, params=params, generator=torch.Generator().manual_seed(3),
                        stop_ids=[4], logprobs=3))
    same = SamplingParams(temperature=0.9, top_k=40, repetition_penalty=1.2, logit_bias=(), min_tokens=0,
                          ignore_eos=False)
    got = list(generate(tiny, PROMPT, max_new_tokens=16, params=same, generator=torch.Generator().manual_seed(3),
                        stop_ids=[4], logprobs=3))
    assert [(t.id, t.logprob, t.top, t.end) for t in got] == [(t.id, t.logprob, t.top, t.end) for t in ref]


# ---- batched prompts vs one at a time ----

def rows_of(batch_rows) -> list[list]:
    """Each row's Tokens from generate_batch's per-step lists (None once a row ended)."""
    rows = None
    for step_rows in batch_rows:
        rows = rows or [[] for _ in step_rows]
        for b, token in enumerate(step_rows):
            if token is not None:
                rows[b].append(token)
    return rows


def test_batched_greedy_matches_one_at_a_time(tiny):
    g = torch.Generator().manual_seed(0)
    lengths = [3, 17, 9, 40, 250]  # the last one reaches the 256-token context before max_new_tokens
    prompts = [torch.randint(1, 160, (n,), generator=g).tolist() for n in lengths]
    alone = [list(generate(tiny, p, max_new_tokens=20)) for p in prompts]
    stop = alone[1][4].id  # ends row 1 early, and any other row that produces it
    alone = [list(generate(tiny, p, max_new_tokens=20, stop_ids=[stop])) for p in prompts]
    rows = rows_of(generate_batch(tiny, prompts, max_new_tokens=20, stop_ids=[stop]))
    assert [[t.id for t in r] for r in rows] == [[t.id for t in r] for r in alone]
    assert [[t.end for t in r] for r in rows] == [[t.end for t in r] for r in alone]  # and why each row ended
    assert len(alone[4]) == 256 - 250 + 1 and len(alone[1]) <= 5 and len({len(r) for r in alone}) >= 3
    assert {r[-1].end for r in alone} == {"eos", "length"}


def test_batched_penalties_and_logprobs_match_one_at_a_time(tiny):
    prompts = [[5, 5, 6], [9, 8, 7, 6, 5, 4, 3, 2, 1, 5, 5], [42] * 6]
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2)
    alone = [list(generate(tiny, p, max_new_tokens=12, params=params, logprobs=2)) for p in prompts]
    rows = rows_of(generate_batch(tiny, prompts, max_new_tokens=12, params=params, logprobs=2))
    for got, ref in zip(rows, alone):
        assert [s.id for s in got] == [s.id for s in ref]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(got, ref)) <= 1e-5


def test_batched_bias_min_tokens_ignore_eos_match_one_at_a_time(tiny):
    prompts = [[5, 5, 6], [9, 8, 7, 6, 5, 4, 3, 2, 1, 5, 5], [42] * 6]
    for params in (SamplingParams(logit_bias=((9, 12.0), (3, -100)), min_tokens=4),
                   SamplingParams(logit_bias=((9, 100),), ignore_eos=True)):
        alone = [[t.id for t in generate(tiny, p, max_new_tokens=10, params=params, stop_ids=[9])] for p in prompts]
        rows = rows_of(generate_batch(tiny, prompts, max_new_tokens=10, params=params, stop_ids=[9]))
        assert [[t.id for t in r] for r in rows] == alone
        assert all(9 in r for r in alone)  # the bias made the stop id come, min_tokens or not


def test_batch_rejects_no_prompts(tiny):
    with pytest.raises(ValueError, match="no prompts"):
        next(generate_batch(tiny, [], max_new_tokens=4))


@pytest.mark.slow
def test_batched_smollm2_matches_one_at_a_time(smollm2):
    model, tok = smollm2
    texts = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived",
             "def fibonacci(n):", "List three colors:"]
    prompts = [tok.encode(t) for t in texts]
    assert len({len(p) for p in prompts}) == 4
    batch = complete_batch(generate_batch(model, prompts, max_new_tokens=16, stop_ids=tok.eos_ids), tok,
                           [len(p) for p in prompts], stop=["\n\n"])
    for c, prompt in zip(batch, prompts):
        ref = complete_greedy(model, tok, prompt, 16, stop=["\n\n"])
        assert (c.tokens, c.text, c.finish_reason) == (ref.tokens, ref.text, ref.finish_reason)
    assert {c.finish_reason for c in batch} == {"stop", "length"}


# ---- a chat session: the cache is kept across turns ----

def test_session_prefills_only_the_new_tokens(tiny):
    session = Session(tiny)
    turn1 = [5, 17, 42, 99, 3]
    out1 = greedy_ids(tiny, turn1, 10, session=session)
    # The last generated token was never fed, so it is not in the cache.
    assert session.tokens == turn1 + out1[:-1] and session.cache.max_seq_len == 15
    turn2 = turn1 + out1 + [7, 8, 9]
    assert session.reusable(turn2) == len(turn1) + len(out1) - 1
    out2 = greedy_ids(tiny, turn2, 10, session=session)
    assert session.cache.max_seq_len == 30  # grew (doubling) to hold 18 + 10, keeping what it held
    assert out2 == greedy_ids(tiny, turn2, 10)
    # History that differs from the cache (an edited turn) reuses only the common prefix.
    turn3 = turn2[:4] + [1, 2] + turn2[6:] + out2 + [11]
    assert session.reusable(turn3) == 4
    assert greedy_ids(tiny, turn3, 10, session=session) == greedy_ids(tiny, turn3, 10)


def test_session_cache_limit(tiny):
    session = Session(tiny, max_seq_len=16)
    with pytest.raises(ValueError, match="the prompt is 20 tokens, longer than the session's limit of 15"):
        list(generate(tiny, list(range(1, 21)), max_new_tokens=4, session=session))
    tokens = list(generate(tiny, list(range(1, 11)), max_new_tokens=40, session=session))
    assert len(tokens) == 16 - 10 + 1 and tokens[-1].end == "length"


@pytest.mark.slow
def test_smollm2_chat_second_turn_matches_a_fresh_run(smollm2):
    model, tok = smollm2
    session = Session(model, max_seq_len=512)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt1 = tok.encode(tok.apply_chat_template(messages), bos=False)
    first = complete_greedy(model, tok, prompt1, 40, session=session)
    assert first.finish_reason == "eos" and first.prefilled == len(prompt1)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And of Germany?"}]
    prompt2 = tok.encode(tok.apply_chat_template(messages), bos=False)
    second = complete_greedy(model, tok, prompt2, 40, session=session)
    fresh = complete_greedy(model, tok, prompt2, 40)
    assert second.tokens == fresh.tokens and second.text == fresh.text
    # Only the new turn was prefilled: everything up to the reply's last token (EOS, never fed) was cached.
    assert second.prefilled == len(prompt2) - (len(prompt1) + len(first.tokens) - 1)
    assert second.prefilled < 20 < len(prompt2)
