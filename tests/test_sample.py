"""Sampling: hand-computed top-k/top-p examples, greedy, parameter checks, and draws against the distribution."""
import pytest
import torch

from params import SamplingParams, check_logit_bias, check_sampling
from sample import (apply_logit_bias, apply_penalties, hold_stop_ids, logits_to_probs, sample, sampled_logprobs,
                    token_counts)

PROBS = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
LOGITS = PROBS.log()


def t1(**kw) -> SamplingParams:
    """Sampling at temperature 1 with the given filters."""
    return SamplingParams(temperature=1.0, **kw)


def test_temperature_zero_is_argmax():
    logits = torch.randn(5, 50)
    assert torch.equal(sample(logits, SamplingParams()), logits.argmax(-1))


def test_temperature_scales_logits():
    assert torch.allclose(logits_to_probs(LOGITS, SamplingParams(temperature=2.0)), torch.softmax(LOGITS / 2.0, -1))
    assert torch.allclose(logits_to_probs(LOGITS, t1()), PROBS)


def test_top_k():
    assert torch.allclose(logits_to_probs(LOGITS, t1(top_k=2)), torch.tensor([[0, 0.5 / 0.8, 0, 0.3 / 0.8]]))
    assert torch.allclose(logits_to_probs(LOGITS, t1(top_k=10)), PROBS)  # k >= V keeps everything


@pytest.mark.parametrize("top_p, expected", [
    (0.4, [0, 1.0, 0, 0]),  # the most likely token alone already covers 0.4
    (0.7, [0, 0.5 / 0.8, 0, 0.3 / 0.8]),  # 0.5 < 0.7, so the next token (0.3) joins
    (0.8, [0, 0.5 / 0.8, 0, 0.3 / 0.8]),  # 0.5 + 0.3 reaches 0.8 exactly: nothing more
    (0.9, [0, 0.5 / 0.95, 0.15 / 0.95, 0.3 / 0.95]),
    (1.0, [0.05, 0.5, 0.15, 0.3]),
])
def test_top_p(top_p, expected):
    assert torch.allclose(logits_to_probs(LOGITS, t1(top_p=top_p)), torch.tensor([expected]), atol=1e-6)


def test_order_temperature_then_top_k_then_top_p():
    # T=0.5 sharpens to [.0061, .6944, .0625, .25]/..., top-k 3 drops the smallest, top-p 0.75 keeps two.
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=0.5, top_k=3, top_p=0.75))
    sharp = torch.softmax(LOGITS / 0.5, -1)[0]
    assert torch.allclose(probs[0], torch.tensor([0, sharp[1], 0, sharp[3]]) / (sharp[1] + sharp[3]))


def test_seeded_draws_are_reproducible_and_follow_the_distribution():
    logits = LOGITS.expand(20000, 4)
    a = sample(logits, t1(), torch.Generator().manual_seed(7))
    b = sample(logits, t1(), torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    freq = torch.bincount(a, minlength=4) / 20000
    assert (freq - PROBS[0]).abs().max() < 0.015


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(temperature=float("nan")), "temperature must be >= 0"),
    (dict(temperature=float("inf")), "temperature must be >= 0 and finite"),
    (dict(top_k=-1), "top_k must be >= 0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
])
def test_invalid_parameters(kwargs, message):
    params = dict(temperature=1.0, top_k=0, top_p=1.0) | kwargs
    with pytest.raises(ValueError, match=message):
        check_sampling(**params)


# Generation controls: min-p and penalties, each against a hand-computed example, and the order of all steps.

def test_min_p():
    # min-p keeps tokens at least min_p times as likely as the most likely one (0.5 here), then renormalizes.
    assert torch.allclose(logits_to_probs(LOGITS, t1(min_p=0.25)), torch.tensor([[0, 0.5, 0.15, 0.3]]) / 0.95)
    assert torch.allclose(logits_to_probs(LOGITS, t1(min_p=0.5)), torch.tensor([[0, 0.5, 0, 0.3]]) / 0.8)
    assert torch.allclose(logits_to_probs(LOGITS, t1(min_p=1.0)), torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    assert torch.allclose(logits_to_probs(LOGITS, t1(min_p=0.0)), PROBS)


def test_min_p_is_relative_to_the_tempered_distribution():
    # At T=0.5 the odds square: 0.15 vs 0.5 becomes 0.09 of the top, under min_p 0.2; 0.3 becomes 0.36, kept.
    sharp = torch.softmax(LOGITS / 0.5, -1)[0]
    expected = torch.tensor([0, sharp[1], 0, sharp[3]]) / (sharp[1] + sharp[3])
    assert torch.allclose(logits_to_probs(LOGITS, SamplingParams(temperature=0.5, min_p=0.2))[0], expected)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5]])
    seen = torch.tensor([[True, True, False, False]])
    got = apply_penalties(logits, seen, torch.zeros(1, 4), SamplingParams(repetition_penalty=2.0))
    assert torch.equal(got, torch.tensor([[1.0, -2.0, 0.5, -0.5]]))
    # A penalty below 1 rewards repetition the same way round.
    got = apply_penalties(logits, seen, torch.zeros(1, 4), SamplingParams(repetition_penalty=0.5))
    assert torch.equal(got, torch.tensor([[4.0, -0.5, 0.5, -0.5]]))


def test_presence_and_frequency_penalties_use_generated_counts():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5]])
    seen = torch.tensor([[True, True, True, True]])  # the repetition penalty is off: `seen` must not matter
    generated = torch.tensor([[0.0, 2.0, 1.0, 0.0]])
    got = apply_penalties(logits, seen, generated, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    # token 1: -1 - 0.5 - 2 * 0.25 = -2;  token 2: 0.5 - 0.5 - 0.25 = -0.25
    assert torch.equal(got, torch.tensor([[2.0, -2.0, -0.25, -0.5]]))


def test_token_counts():
    counts = token_counts([[1, 3, 3], [0]], 4)
    assert torch.equal(counts, torch.tensor([[0.0, 1.0, 0.0, 2.0], [1.0, 0.0, 0.0, 0.0]]))


def test_sampled_logprobs():
    # Temperature 1 with nothing else: the model's own log_softmax; greedy reports that distribution too.
    logits = torch.randn(3, 50)
    assert torch.allclose(sampled_logprobs(logits, t1()), torch.log_softmax(logits, -1), atol=1e-6)
    greedy = SamplingParams(temperature=0.0, top_k=2)
    assert torch.allclose(sampled_logprobs(logits, greedy), torch.log_softmax(logits, -1), atol=1e-6)
    # Otherwise the processed distribution, -inf where a token was removed.
    assert torch.allclose(sampled_logprobs(LOGITS, t1(top_k=2)).exp(), torch.tensor([[0, 0.5 / 0.8, 0, 0.3 / 0.8]]))
    assert sampled_logprobs(LOGITS, t1(top_k=2))[0, 0] == float("-inf")


def test_sampling_params_check_on_construction():
    with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\]"):
        SamplingParams(min_p=2.0)
    assert not SamplingParams().penalized and SamplingParams(frequency_penalty=0.1).penalized


@pytest.mark.parametrize("kwargs, message", [
    (dict(min_p=2.0), r"min_p must be in \[0, 1\] \(0 disables it\), got 2.0"),
    (dict(min_p=-0.1), r"min_p must be in \[0, 1\]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty must be > 0"),
    (dict(presence_penalty=3.0), r"presence_penalty must be in \[-2, 2\]"),
    (dict(frequency_penalty=-2.5), r"frequency_penalty must be in \[-2, 2\]"),
])
def test_invalid_control_parameters(kwargs, message):
    params = dict(temperature=1.0, top_k=0, top_p=1.0) | kwargs
    with pytest.raises(ValueError, match=message):
        check_sampling(**params)


@pytest.mark.parametrize("kwargs", [
    dict(temperature=1e-38), dict(temperature=5e-324), dict(temperature=1e30), dict(top_p=1e-300),
    dict(min_p=1.0), dict(repetition_penalty=1e-300), dict(repetition_penalty=1e300),
    dict(temperature=1e-38, top_p=1e-300, repetition_penalty=1e-300),
])
def test_every_accepted_value_samples_a_valid_token(kwargs):
    """Extreme but valid parameters never overflow into NaN probabilities (which kill multinomial)."""
    params = SamplingParams(**{"temperature": 0.8} | kwargs)
    logits = torch.tensor([[3.0, -2.0, 0.5, 3.0 - 1e-6, -80.0], [0.0, 1.0, -1.0, 0.5, 0.25]])  # (2, 5)
    seen = torch.tensor([[True, True, False, False, True], [True, False, False, False, False]])
    penalized = apply_penalties(logits, seen, torch.zeros(2, 5), params)
    probs = logits_to_probs(penalized, params)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(2))
    g = torch.Generator().manual_seed(0)
    tokens = sample(penalized, params, g)
    assert probs[torch.arange(2), tokens].gt(0).all()
    if params.temperature < 1e-30 or params.top_p < 1e-30:  # greedy in effect: the most likely token
        assert tokens.tolist() == penalized.argmax(-1).tolist()


# Logit bias, min_tokens and ignore_eos (OpenAI's logit_bias, vLLM's min_tokens and ignore_eos).

@pytest.mark.parametrize("kwargs, message", [
    (dict(logit_bias=((5, 100.5),)), r"logit_bias of token 5 must be a number in \[-100, 100\], got 100.5"),
    (dict(logit_bias=((5, -101),)), r"logit_bias of token 5 must be a number in \[-100, 100\], got -101"),
    (dict(logit_bias=((5, float("nan")),)), r"logit_bias of token 5 must be a number in \[-100, 100\], got nan"),
    (dict(logit_bias=((5, "1"),)), r"logit_bias of token 5 must be a number"),
    (dict(logit_bias=((-1, 1.0),)), r"logit_bias token ids must be integers >= 0, got -1"),
    (dict(logit_bias=((2.0, 1.0),)), r"logit_bias token ids must be integers >= 0, got 2.0"),
    (dict(logit_bias=((True, 1.0),)), r"logit_bias token ids must be integers >= 0, got True"),
    (dict(logit_bias=((1, 2, 3),)), r"logit_bias entries must be \(token id, bias\) pairs, got \(1, 2, 3\)"),
    (dict(logit_bias=((4, 1.0), (4, 2.0))), "logit_bias gives token 4 twice"),
    (dict(min_tokens=-1), r"min_tokens must be an integer >= 0 \(0 disables it\), got -1"),
    (dict(min_tokens=2.5), r"min_tokens must be an integer >= 0"),
    (dict(ignore_eos="yes"), "ignore_eos must be true or false, got 'yes'"),
])
def test_invalid_bias_and_stop_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_logit_bias_is_one_hashable_value_whatever_its_order():
    a = SamplingParams(logit_bias=((9, 1), (2, -3.5)))
    b = SamplingParams(logit_bias={2: -3.5, 9: 1.0})  # as an OpenAI request body holds it
    assert a == b and hash(a) == hash(b) and a.logit_bias == ((2, -3.5), (9, 1.0))
    assert SamplingParams(logit_bias=[[1, -100], [0, 100]]).logit_bias == ((0, 100.0), (1, -100.0))


def test_logit_bias_is_added_and_checked_against_the_vocabulary():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(logit_bias=((0, 10.0), (3, -2.5)))
    before = logits.clone()
    assert torch.equal(apply_logit_bias(logits, params), torch.tensor([[11.0, 2.0, 3.0, 1.5], [10.0, 0.0, 0.0, -2.5]]))
    assert torch.equal(logits, before)  # a new tensor: the caller's logits are left alone
    plain = SamplingParams()
    assert apply_logit_bias(logits, plain) is logits  # no bias: nothing computed, bit for bit as before
    with pytest.raises(ValueError, match=r"logit_bias token 4 is outside the vocabulary \(ids 0 to 3\)"):
        apply_logit_bias(logits, SamplingParams(logit_bias=((4, 1.0),)))
    check_logit_bias(((3, 1.0),), vocab_size=4)
    with pytest.raises(ValueError, match=r"logit_bias token 160 is outside the vocabulary \(ids 0 to 159\)"):
        check_logit_bias(((0, 1.0), (160, 1.0)), vocab_size=160)
    # -100 bans and +100 forces in greedy, against logits of a realistic spread
    wide = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 5
    top = wide.argmax(-1)
    assert sample(apply_logit_bias(wide, SamplingParams(logit_bias=((int(top[0]), -100),))), plain)[0] != top[0]
    assert sample(apply_logit_bias(wide, SamplingParams(logit_bias=((7, 100),))), plain).tolist() == [7, 7, 7]


def test_hold_stop_ids_until_min_tokens():
    logits = torch.tensor([[5.0, 1.0, 2.0, 0.0]] * 3)  # (3, 4): stop ids 0 and 3
    params = SamplingParams(min_tokens=2)
    held = hold_stop_ids(logits, params, [0, 1, 2], [0, 3])
    inf = float("-inf")
    assert torch.equal(held, torch.tensor([[inf, 1.0, 2.0, inf], [inf, 1.0, 2.0, inf], [5.0, 1.0, 2.0, 0.0]]))
    assert hold_stop_ids(logits, params, [2, 3, 9], [0, 3]) is logits  # every row is past min_tokens
    assert hold_stop_ids(logits, SamplingParams(), [0, 0, 0], [0, 3]) is logits
    # a row whose grammar allows only EOS keeps it: the grammar wins, and the row still has a token to sample
    only_eos = torch.tensor([[2.0, inf, inf, inf], [2.0, 1.0, inf, inf]])
    assert torch.equal(hold_stop_ids(only_eos, params, [0, 0], [0]), torch.tensor([[2.0, inf, inf, inf],
                                                                                    [inf, 1.0, inf, inf]]))
