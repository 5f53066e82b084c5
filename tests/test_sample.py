"""Sampling: hand-computed top-k/top-p examples, greedy, parameter checks, and draws against the distribution."""
import pytest
import torch

from sample import check_sampling, logits_to_probs, sample

PROBS = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
LOGITS = PROBS.log()


def test_temperature_zero_is_argmax():
    logits = torch.randn(5, 50)
    assert torch.equal(sample(logits, temperature=0.0), logits.argmax(-1))


def test_temperature_scales_logits():
    assert torch.allclose(logits_to_probs(LOGITS, 2.0), torch.softmax(LOGITS / 2.0, -1))
    assert torch.allclose(logits_to_probs(LOGITS, 1.0), PROBS)


def test_top_k():
    assert torch.allclose(logits_to_probs(LOGITS, 1.0, top_k=2), torch.tensor([[0, 0.5 / 0.8, 0, 0.3 / 0.8]]))
    assert torch.allclose(logits_to_probs(LOGITS, 1.0, top_k=10), PROBS)  # k >= V keeps everything


@pytest.mark.parametrize("top_p, expected", [
    (0.4, [0, 1.0, 0, 0]),  # the most likely token alone already covers 0.4
    (0.7, [0, 0.5 / 0.8, 0, 0.3 / 0.8]),  # 0.5 < 0.7, so the next token (0.3) joins
    (0.8, [0, 0.5 / 0.8, 0, 0.3 / 0.8]),  # 0.5 + 0.3 reaches 0.8 exactly: nothing more
    (0.9, [0, 0.5 / 0.95, 0.15 / 0.95, 0.3 / 0.95]),
    (1.0, [0.05, 0.5, 0.15, 0.3]),
])
def test_top_p(top_p, expected):
    assert torch.allclose(logits_to_probs(LOGITS, 1.0, top_p=top_p), torch.tensor([expected]), atol=1e-6)


def test_order_temperature_then_top_k_then_top_p():
    # T=0.5 sharpens to [.0061, .6944, .0625, .25]/..., top-k 3 drops the smallest, top-p 0.75 keeps two.
    probs = logits_to_probs(LOGITS, 0.5, top_k=3, top_p=0.75)
    sharp = torch.softmax(LOGITS / 0.5, -1)[0]
    assert torch.allclose(probs[0], torch.tensor([0, sharp[1], 0, sharp[3]]) / (sharp[1] + sharp[3]))


def test_seeded_draws_are_reproducible_and_follow_the_distribution():
    logits = LOGITS.expand(20000, 4)
    a = sample(logits, 1.0, generator=torch.Generator().manual_seed(7))
    b = sample(logits, 1.0, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    freq = torch.bincount(a, minlength=4) / 20000
    assert (freq - PROBS[0]).abs().max() < 0.015


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(temperature=float("nan")), "temperature must be >= 0"),
    (dict(top_k=-1), "top_k must be >= 0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
])
def test_invalid_parameters(kwargs, message):
    params = dict(temperature=1.0, top_k=0, top_p=1.0) | kwargs
    with pytest.raises(ValueError, match=message):
        check_sampling(**params)
