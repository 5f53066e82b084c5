"""The serving engine against decode.generate: continuous batching with chunked prefill, prefix-cache hits and
preemption token-identical to single runs, per-request sampling, failures confined to their request, and block
accounting. (The paged cache itself is checked against the static one in test_kvcache.py.)"""
import copy
import os
import random

import pytest
import torch

import engine as engine_module
from step import Step
from engine import Engine, EngineConfig, QueueFull, Request
from helpers import ROOT, ToyTokenizer
from sample import SamplingParams
from tiny_models import greedy_ids


@pytest.fixture(scope="module")
def model(tiny):
    """The shared tiny model (fp32, context 256); a test that patches it works on a copy."""
    return tiny


def random_prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 160, (n,), generator=g).tolist() for n in lengths]


LENGTHS = [3, 17, 40, 9, 33, 64, 5, 21, 50, 12]


CONFIGS = {
    "roomy": EngineConfig(block_size=4, num_blocks=200, max_running=16, token_budget=512),
    "chunked-prefill": EngineConfig(block_size=4, num_blocks=200, max_running=16, token_budget=24),
    "preemption": EngineConfig(block_size=4, num_blocks=30, max_running=16, token_budget=24),
    "static-batching": EngineConfig(block_size=8, num_blocks=100, max_running=4, token_budget=64,
                                    static_batching=True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_concurrent_greedy_equals_single_runs(model, name):
    prompts = random_prompts(LENGTHS)
    prompts += [prompts[2][:30] + [7, 8], prompts[5] + [1, 2, 3]]  # share full blocks with earlier prompts
    expected = [greedy_ids(model, p, 20) for p in prompts]
    engine = Engine(model, ToyTokenizer(), CONFIGS[name])
    for _ in range(2):  # the second round hits the prefix cache (where memory allows)
        got = engine.generate(prompts, max_tokens=20)
        assert [c.tokens for c in got] == expected
        assert [c.text for c in got] == ["".join(f"<{t}>" for t in e) for e in expected]
        assert all(c.finish_reason == "length" for c in got)
    stats = engine.stats()
    assert stats["running"] == stats["waiting"] == stats["blocks_used"] == 0
    if name == "preemption":
        assert stats["preemptions"] > 0
    if name == "roomy":
        assert got[11].prefilled < len(prompts[11])  # prefix hit: fewer prompt tokens computed
        assert max(c.prefilled for c in got) < 10  # second round: (almost) every prompt from the cache


def test_prefix_hit_verifies_tokens(model):
    """A block whose chained hash matches but whose tokens differ (a forced collision) is not reused."""
    prompts = random_prompts([20, 20], seed=3)
    expected = [greedy_ids(model, p, 8) for p in prompts]
    eng = Engine(model, ToyTokenizer(), EngineConfig(block_size=4, num_blocks=60))
    original = engine_module.chain_hash
    try:
        engine_module.chain_hash = lambda previous, tokens: previous * 31 + len(tokens)  # collides on every block
        got = [eng.generate([p], max_tokens=8)[0] for p in prompts]
    finally:
        engine_module.chain_hash = original
    assert [c.tokens for c in got] == expected
    assert got[1].prefilled == 20  # nothing reused: the tokens did not match


def test_sampled_requests_match_generate_with_the_same_seed(model):
    """Each request samples with its own parameters and generator: seeded, the engine's tokens are
    decode.generate's tokens with that seed, however the requests are batched."""
    prompts = random_prompts([7, 25, 13, 40], seed=5)
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, repetition_penalty=1.2)
    expected = []
    for i, p in enumerate(prompts):
        g = torch.Generator().manual_seed(100 + i)
        expected.append(greedy_ids(model, p, 16, params, generator=g))
    eng = Engine(model, ToyTokenizer(), EngineConfig(block_size=4, num_blocks=100, max_running=4, token_budget=16))
    results = {}
    for i, p in enumerate(prompts):
        eng.submit(Request(p, params, 16, seed=100 + i,
                           on_event=lambda e: results.setdefault(e.request_id, []).extend(e.token_ids)))
    while eng.step():
        pass
    assert [results[i] for i in range(len(prompts))] == expected


def test_engine_runs_the_step_it_is_given(model):
    """The engine's forwards go through the step it is given (step.Step), prefill chunks and batched decodes
    alike."""
    shapes = []

    class Recording(Step):
        def __call__(self, tokens, input_pos, cache, all_logits=False):
            shapes.append(tuple(tokens.shape))
            return super().__call__(tokens, input_pos, cache, all_logits)

    step = Recording(model)

    prompts = random_prompts([5, 11], seed=4)
    eng = Engine(model, ToyTokenizer(), EngineConfig(block_size=4, num_blocks=60), step=step)
    assert [c.tokens for c in eng.generate(prompts, max_tokens=6)] == [greedy_ids(model, p, 6) for p in prompts]
    assert (1, 5) in shapes and (1, 11) in shapes and (2, 1) in shapes  # two prefills, then decodes together


def test_stop_eos_and_max_tokens(model):
    prompt = random_prompts([10], seed=7)[0]
    full = greedy_ids(model, prompt, 12)
    eng = Engine(model, ToyTokenizer(eos_ids=[full[5]]), EngineConfig(block_size=4, num_blocks=60))
    c = eng.generate([prompt], max_tokens=12)[0]
    assert c.finish_reason == "eos" and c.tokens == full[:full.index(full[5]) + 1]
    eng = Engine(model, ToyTokenizer(), EngineConfig(block_size=4, num_blocks=60))
    c = eng.generate([prompt], max_tokens=12, stop=[f"<{full[3]}>"])[0]
    assert c.finish_reason == "stop" and c.text == "".join(f"<{t}>" for t in full[:full.index(full[3])])


def test_logit_bias_min_tokens_and_ignore_eos_as_decode_generate(model):
    """A request's logit bias, min_tokens and ignore_eos act in the engine as in decode.generate, batched with
    requests without them; a bias past the vocabulary fails that request alone."""
    prompts = random_prompts([10, 23, 6], seed=8)
    stop = 9
    requests = [SamplingParams(logit_bias=((stop, 100),), min_tokens=5), SamplingParams(),
                SamplingParams(logit_bias=((stop, 100),), ignore_eos=True)]
    expected = [greedy_ids(model, p, 12, params, stop_ids=[stop]) for p, params in zip(prompts, requests)]
    assert [len(e) for e in expected] == [6, len(expected[1]), 12]
    eng = Engine(model, ToyTokenizer(eos_ids=[stop]), EngineConfig(block_size=4, num_blocks=60, max_running=4))
    events = {}
    for p, params in zip(prompts, requests):
        eng.submit(Request(p, params, 12, on_event=lambda e: events.setdefault(e.request_id, []).append(e)))
    eng.submit(Request(prompts[0], SamplingParams(logit_bias=((160, 1.0),)), 12,
                       on_event=lambda e: events.setdefault(e.request_id, []).append(e)))
    while eng.step():
        pass
    assert [[t for e in events[i] for t in e.token_ids] for i in range(3)] == expected
    assert [events[i][-1].finish_reason for i in range(4)] == ["eos", events[1][-1].finish_reason, "length", "error"]
    assert "logit_bias token 160 is outside the vocabulary" in events[3][-1].error


def test_block_accounting_with_aborts(model):
    """120 requests of random lengths through a 40-block pool, a quarter aborted at random moments: afterwards
    no block is held, and free + cached blocks make up the whole pool."""
    rng = random.Random(0)
    eng = Engine(model, ToyTokenizer(), EngineConfig(block_size=4, num_blocks=40, max_running=6, token_budget=32,
                                                     max_waiting=200))
    finished = {}
    ids = []
    for n in range(120):
        prompt = [rng.randrange(1, 160) for _ in range(rng.randrange(1, 60))]
        if n % 3 == 0 and ids:  # some shared prefixes
            prompt = [rng.randrange(1, 160) for _ in range(8)] * 2 + prompt[:20]
        ids.append(eng.submit(Request(prompt, max_tokens=rng.randrange(1, 12),
                                      on_event=lambda e: e.finished and finished.setdefault(e.request_id, e))))
        if rng.random() < 0.25:
            eng.abort(rng.choice(ids))
        if n % 4 == 0:
            eng.step()
    while eng.step():
        if rng.random() < 0.05:
            eng.abort(rng.choice(ids))
    assert sorted(finished) == ids
    assert any(e.finish_reason == "abort" for e in finished.values())
    stats = eng.stats()
    assert stats["running"] == stats["waiting"] == stats["blocks_used"] == 0
    assert all(r == 0 for r in eng.blocks.refs)
    assert len(eng.blocks.free) + len(eng.blocks.evictable) == stats["blocks_total"]


def test_a_failing_callback_aborts_only_its_request(model, capsys):
    prompts = random_prompts([6, 9], seed=11)
    eng = Engine(model, ToyTokenizer(), EngineConfig(block_size=4, num_blocks=60, max_running=4))
    events = []

    def broken(event):
        raise RuntimeError("client bug")

    eng.submit(Request(prompts[0], max_tokens=8, on_event=broken))
    eng.submit(Request(prompts[1], max_tokens=8, on_event=events.append))
    while eng.step():
        pass
    assert "client bug" in capsys.readouterr().err
    assert [t for e in events for t in e.token_ids] == greedy_ids(model, prompts[1], 8)
    assert eng.stats()["blocks_used"] == 0 and eng.stats()["requests_finished"] == 2


def test_a_failure_fails_only_its_request_and_the_engine_serves_on(model, monkeypatch, capsys):
    """A request whose sampling raises ends with finish_reason "error" (one stderr line, no traceback); the rows
    batched with it are exact, and a forward that raises fails that step's rows only."""
    model = copy.deepcopy(model)  # its forward is patched below
    prompts = random_prompts([6, 9, 12], seed=12)
    poisoned = SamplingParams(temperature=0.5)
    real_sample_tokens = engine_module.sample_tokens

    def sample_tokens(logits, params, *args, **kw):
        if params is poisoned:
            raise FloatingPointError("overflow in sampling")
        return real_sample_tokens(logits, params, *args, **kw)

    monkeypatch.setattr(engine_module, "sample_tokens", sample_tokens)
    eng = Engine(model, ToyTokenizer(), EngineConfig(block_size=4, num_blocks=60, max_running=4))
    events = {}
    for p, params in zip(prompts, [SamplingParams(), poisoned, SamplingParams()]):
        eng.submit(Request(p, params, 8, on_event=lambda e: events.setdefault(e.request_id, []).append(e)))
    while eng.step():
        pass
    assert events[1][-1].finish_reason == "error" and "overflow in sampling" in events[1][-1].error
    for i in (0, 2):
        assert [t for e in events[i] for t in e.token_ids] == greedy_ids(model, prompts[i], 8)
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1 and "request 1 failed" in err

    calls = {"n": 0}
    real_forward = model.forward

    def forward(*args, **kwargs):  # the 3rd forward raises: a decode step of both rows
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", forward)
    done = eng.generate(prompts[:2], max_tokens=8)
    assert [c.finish_reason for c in done] == ["error", "error"]
    monkeypatch.setattr(model, "forward", real_forward)
    assert eng.generate([prompts[0]], max_tokens=8)[0].tokens == greedy_ids(model, prompts[0], 8)
    assert eng.stats()["blocks_used"] == 0


def test_bad_requests(model):
    eng = Engine(model, ToyTokenizer(), EngineConfig(block_size=4, num_blocks=10, max_waiting=2, max_running=4))
    with pytest.raises(ValueError, match="the prompt is empty"):
        eng.submit(Request([]))
    with pytest.raises(ValueError, match="needs up to 13 KV blocks; the pool has 9"):
        eng.submit(Request([1] * 40, max_tokens=10))
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        eng.submit(Request([1, 2], stop=[""]))
    eng.submit(Request([1, 2]))
    eng.submit(Request([3, 4]))
    with pytest.raises(QueueFull, match="the queue is full"):
        eng.submit(Request([5, 6]))
    with pytest.raises(ValueError, match="token_budget"):
        Engine(model, ToyTokenizer(), EngineConfig(max_running=64, token_budget=32))


@pytest.mark.slow
def test_smollm2_concurrent_greedy_equals_single_runs(smollm2):
    """8 real prompts of mixed lengths, fp32, chunked prefill: the same tokens as decode.generate, one at a time."""
    model, tok = smollm2
    with open(os.path.join(ROOT, "data", "pride_and_prejudice_ch1-2.txt"), encoding="utf-8") as f:
        text = f.read()
    prompts = [tok.encode(text[i * 300:i * 300 + n]) for i, n in enumerate([40, 400, 120, 900, 60, 250, 700, 30])]
    expected = [greedy_ids(model, p, 24, stop_ids=tok.eos_ids) for p in prompts]
    eng = Engine(model, tok, EngineConfig(block_size=16, num_blocks=256, token_budget=128))
    got = eng.generate(prompts, max_tokens=24)
    assert [c.tokens for c in got] == expected
