"""The serving engine against decode.generate: continuous batching with chunked prefill, prefix-cache hits and
preemption token-identical to single runs, per-request sampling, failures confined to their request, and block
accounting; parallel sampling (each choice a seeded single run, forks sharing blocks, best_of ranking), logprobs, and
prompt logprobs against an uncached forward. (The paged cache itself is checked against the static one in
test_kvcache.py.)"""
import copy
import os
import random

import pytest
import torch

from serving import choices as choices_module
import decode
from serving import scheduler
from step import Step
from serving.engine import Engine, EngineConfig, QueueFull, Request
from helpers import ROOT, ToyTokenizer
from ops.cpu import native_bf16
from params import SamplingParams
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
    # decode batches padded to 1, 2, 4, 8 or 12 rows and power-of-two block-table widths (as for CUDA graphs)
    "buckets": EngineConfig(block_size=4, num_blocks=200, max_running=12, token_budget=24, bucket_batches=True),
    # while any sequence decodes, at most 3 prompt tokens a step (a prompt alone still takes the budget)
    "prefill-chunk": EngineConfig(block_size=4, num_blocks=200, max_running=16, token_budget=64, prefill_chunk=3),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_concurrent_greedy_equals_single_runs(model, name):
    prompts = random_prompts(LENGTHS)
    prompts += [prompts[2][:30] + [7, 8], prompts[5] + [1, 2, 3]]  # share full blocks with earlier prompts
    expected = [greedy_ids(model, p, 20) for p in prompts]
    engine = Engine(model, ToyTokenizer(), CONFIGS[name])
    for _ in range(2):  # the second round hits the prefix cache (where memory allows)
        got = engine.generate(prompts, max_new_tokens=20)
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


def test_bucket_pads_to_powers_of_two_up_to_the_cap():
    from serving.engine import bucket

    assert [bucket(n, 12) for n in (1, 2, 3, 4, 5, 8, 9, 12)] == [1, 2, 4, 4, 8, 8, 12, 12]


@pytest.mark.slow
def test_a_compiled_step_on_buckets_matches_eager_and_compiles_twice(model, monkeypatch):
    """The engine as it runs CUDA graphs, on CPU: a "full" compiled decode step over padded batches. Batches of 1 to 7
    rows run 1, 2, 4 or 8 (padded) rows and the tokens are eager's; Dynamo compiles the one-token graph twice (one
    row, and every other bucket and block-table width with symbolic sizes), however many buckets the batches fill."""
    import torch._dynamo

    prompts = random_prompts([3, 17, 40, 9, 33, 5, 21])
    expected = [greedy_ids(model, p, 12) for p in prompts]
    shapes = []  # (rows, block-table width) of each compiled call
    step = Step(model, "full")
    original = step.one

    def recorded(model, tokens, input_pos, cache, *rest):
        shapes.append(tuple(cache.tables.shape))
        return original(model, tokens, input_pos, cache, *rest)

    monkeypatch.setattr(step, "one", recorded)
    config = EngineConfig(block_size=4, num_blocks=200, max_running=8, token_budget=24, bucket_batches=True)
    engine = Engine(model, ToyTokenizer(), config, step)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert [c.tokens for c in engine.generate(prompts, max_new_tokens=12)] == expected
    rows, widths = {b for b, _ in shapes}, {n for _, n in shapes}
    assert rows <= {1, 2, 4, 8} and {1, 8} <= rows  # every batch padded to a bucket (7 rows: 8)
    assert widths <= {2, 4, 8, 16} and len(widths) >= 2  # a batch's longest table: up to 13 blocks (40 + 12)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "blocks"])
def test_a_compiled_engine_compiles_at_warm_up_and_never_after(model, mode):
    """On CPU (no padding) a compiled engine's warm_up makes every graph its decode steps need: one row, and more
    rows, with the sizes symbolic. Batches of 1 to 7 rows over block tables that grow then compile nothing more,
    and the tokens are eager's."""
    import torch._dynamo

    prompts = random_prompts([3, 17, 40, 9, 33, 5, 21])
    expected = [greedy_ids(model, p, 12) for p in prompts]
    config = EngineConfig(block_size=4, num_blocks=200, max_running=8, token_budget=24)
    engine = Engine(model, ToyTokenizer(), config, Step(model, mode))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert not engine.buckets and engine.warm_up() == [1, 2, 3]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs <= 4  # full: one row, and the rest (its sizes marked); blocks: its mask and cos change rank too
    assert [c.tokens for c in engine.generate(prompts, max_new_tokens=12)] == expected
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@pytest.mark.slow
def test_a_compiled_engines_wide_step_is_compiled_and_answers_as_the_kernels(model):
    """With wide_rows beside a `full` narrow step, the float32 copy's decode steps are a compiled graph of their own
    (its weights packed for oneDNN, read through cpu.packed_linear): warm-up compiles both steps, nothing compiles
    after it, and a batch of int4 rows decodes the narrow eager engine's greedy tokens."""
    import torch._dynamo
    from ops.wide import WideLinear
    from quantize import quantize_model

    q = quantize_model(copy.deepcopy(model), "int4:32")
    prompts = random_prompts([5, 11, 2, 7, 9], seed=4)
    expected = [greedy_ids(q, p, 10) for p in prompts]
    config = EngineConfig(block_size=4, num_blocks=80, max_running=8, wide_rows=4)
    engine = Engine(q, ToyTokenizer(), config, Step(q, "full"))
    assert engine.wide_step.mode == "full"
    assert all(m.packed for m in engine.wide_step.model.modules() if isinstance(m, WideLinear))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert engine.warm_up() == [1, 2, 3, 4, 5]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs == 3  # the narrow step's one-row and many-row graphs, and the wide step's
    assert [c.tokens for c in engine.generate(prompts, max_new_tokens=10)] == expected
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    eager = Engine(q, ToyTokenizer(), config, Step(q))
    assert eager.wide_step.mode == "none"  # beside an eager narrow step the copy's steps stay eager


def test_prefix_hit_verifies_tokens(model):
    """A block whose chained hash matches but whose tokens differ (a forced collision) is not reused."""
    prompts = random_prompts([20, 20], seed=3)
    expected = [greedy_ids(model, p, 8) for p in prompts]
    eng = Engine(model, ToyTokenizer(), EngineConfig(block_size=4, num_blocks=60))
    original = scheduler.chain_hash
    try:
        scheduler.chain_hash = lambda previous, tokens: previous * 31 + len(tokens)  # collides on every block
        got = [eng.generate([p], max_new_tokens=8)[0] for p in prompts]
    finally:
        scheduler.chain_hash = original
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
        def __call__(self, tokens, input_pos, cache, all_logits=False, prefill=False):
            shapes.append(tuple(tokens.shape))
            return super().__call__(tokens, input_pos, cache, all_logits, prefill)

    step = Recording(model)

    prompts = random_prompts([5, 11], seed=4)
    eng = Engine(model, ToyTokenizer(), EngineConfig(block_size=4, num_blocks=60), step=step)
    assert [c.tokens for c in eng.generate(prompts, max_new_tokens=6)] == [greedy_ids(model, p, 6) for p in prompts]
    assert (1, 5) in shapes and (1, 11) in shapes and (2, 1) in shapes  # two prefills, then decodes together


def test_a_steps_prefill_tokens_respect_the_chunk_budget(model, monkeypatch):
    """With prefill_chunk, a step that decodes computes at most that many prompt tokens (a step with no decodes
    takes the token budget), and the tokens are an unchunked run's."""
    plans = []
    schedule = scheduler.Scheduler.schedule

    def recording(self):
        decodes, chunks = schedule(self)
        plans.append((len(decodes), sum(n for _, n in chunks)))
        return decodes, chunks

    monkeypatch.setattr(scheduler.Scheduler, "schedule", recording)
    prompts = random_prompts([6, 50, 3, 70])
    unchunked = Engine(model, ToyTokenizer(), EngineConfig(block_size=4, num_blocks=200))
    expected = unchunked.generate(prompts, max_new_tokens=12)
    plans.clear()
    eng = Engine(model, ToyTokenizer(), EngineConfig(block_size=4, num_blocks=200, token_budget=32, prefill_chunk=5))
    assert [c.tokens for c in eng.generate(prompts, max_new_tokens=12)] == [c.tokens for c in expected]
    assert all(prefill <= 5 for decodes, prefill in plans if decodes)
    assert (0, 32) in plans  # the first step: no stream yet, the budget's prefill
    assert sum(prefill for _, prefill in plans) == sum(map(len, prompts))  # each prompt token computed once
    assert sum(1 for decodes, prefill in plans if decodes and prefill == 5) >= 12  # the 70-token prompt, 5 a step


def test_bad_chunk_and_wide_settings(model):
    for field, value in (("prefill_chunk", 0), ("wide_rows", 0)):
        with pytest.raises(ValueError, match=f"{field} must be >= 1, got 0"):
            Engine(model, ToyTokenizer(), EngineConfig(**{field: value}))


def test_wide_rows_auto_picks_the_row_count_by_kernel_and_memory(model):
    """serve.py's --wide-rows auto: under torch's AVX2 kernels a float32 copy for int4 codes from INT4_ROWS rows and
    int8 codes from SLOW_ROWS; under its AVX-512 ones a bf16 copy for both from BF16_ROWS where the CPU computes bf16
    natively and the activations are bf16, else none; bf16 weights without native bf16 from SLOW_ROWS either way;
    nothing for a float32 model or bf16 computed natively; off when the copy would pass a quarter of memory."""
    from ops.wide import (BF16_ROWS, BF16_ROWS_FULL, INT4_ROWS, INT4_ROWS_FULL, SLOW_ROWS, auto_rows, copy_dtype,
                          widens)
    from quantize import quantize_model

    def auto(m, mode="none", memory=10 ** 12, native_bf16=False, avx512=False):
        return auto_rows(m, memory, mode, native_bf16=native_bf16, avx512=avx512)

    assert auto(model) == (None, "off: no layer it pays for")
    int4 = quantize_model(copy.deepcopy(model), "int4:32")
    rows, why = auto(int4)
    assert rows == INT4_ROWS and "float32 copy" in why and auto(int4, "blocks", native_bf16=True)[0] == INT4_ROWS
    assert auto(int4, "full")[0] == INT4_ROWS_FULL
    off = (None, "off: torch's AVX-512 int4/int8 kernels beat a float32 copy")
    assert auto(int4, avx512=True) == off and auto(int4, avx512=True, native_bf16=True) == off  # float32 activations
    int4_bf16 = quantize_model(copy.deepcopy(model).to(torch.bfloat16), "int4:32")
    assert copy_dtype(int4_bf16, True) == torch.bfloat16 and copy_dtype(int4_bf16, False) == torch.float32
    rows, why = auto(int4_bf16, avx512=True, native_bf16=True)
    assert rows == BF16_ROWS and "bfloat16 copy" in why
    assert auto(int4_bf16, "full", avx512=True, native_bf16=True)[0] == BF16_ROWS_FULL
    int8 = quantize_model(copy.deepcopy(model), "int8")
    assert auto(int8, "full", native_bf16=True)[0] == SLOW_ROWS and auto(int8, avx512=True)[0] is None
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    assert auto(bf16, "full")[0] == SLOW_ROWS and auto(bf16, native_bf16=True)[0] is None
    assert auto(bf16, avx512=True)[0] == SLOW_ROWS  # an AVX-512 CPU without bf16 units
    size = sum(4 * m.in_features * m.out_features for m in int4.modules() if hasattr(m, "dequantize"))
    assert auto(int4, memory=4 * size)[0] == INT4_ROWS
    rows, why = auto(int4, memory=4 * size - 1)
    assert rows is None and why.startswith("off: its float32 copy")
    size16 = sum(2 * m.in_features * m.out_features for m in int4_bf16.modules() if widens(m))  # bf16 bytes
    assert auto(int4_bf16, memory=4 * size16, avx512=True, native_bf16=True)[0] == BF16_ROWS
    assert auto(int4_bf16, memory=4 * size16 - 1, avx512=True, native_bf16=True)[0] is None


def test_wide_rows_run_the_dequantized_copy_and_answer_as_the_kernels(model):
    """wide_rows: decode batches of that many rows and prefill chunks of that many tokens run ops.wide's float32 (or
    bf16) copy of an int4 model's layers (its tensors otherwise the model's own); its logits are the kernel path's within
    the kernel's bf16 activation rounding, and its greedy tokens are the same."""
    from ops.wide import WideLinear, wide_model
    from quantize import Int4Linear, quantize_model

    q = quantize_model(copy.deepcopy(model), "int4:32")
    assert wide_model(model) is None  # a float32 model: nothing to widen
    wide = wide_model(q)
    assert not any(isinstance(m, Int4Linear) for m in wide.modules())
    assert sum(isinstance(m, WideLinear) for m in wide.modules()) == sum(isinstance(m, Int4Linear) for m in q.modules())
    assert wide.embed_tokens.weight is q.embed_tokens.weight and wide.norm.weight is q.norm.weight
    tokens = torch.tensor(random_prompts([12, 12, 12], seed=3))  # (3, 12)
    want, got = (m(tokens, torch.arange(12), None, all_logits=True) for m in (q, wide))
    assert (got - want).abs().max() < 0.05 * want.abs().max()  # bf16 activations in the kernel
    if torch.backends.mkldnn.is_available():  # the same matrices in oneDNN's layout: float32 rounding apart
        packed = wide_model(q, packed=True)(tokens, torch.arange(12), None, all_logits=True)
        assert (packed - got).abs().max() < 1e-4 * got.abs().max()
    half = wide_model(q, dtype=torch.bfloat16)  # the copy where the CPU computes bf16 natively (ops.wide.copy_dtype)
    assert all(m.weight.dtype == torch.bfloat16 for m in half.modules() if isinstance(m, WideLinear))
    got16 = half(tokens, torch.arange(12), None, all_logits=True)
    assert got16.dtype == got.dtype and (got16 - got).abs().max() < 0.05 * got.abs().max()
    if torch.backends.mkldnn.is_available() and native_bf16(torch.device("cpu")):  # oneDNN packs bf16 there
        packed16 = wide_model(q, packed=True, dtype=torch.bfloat16)(tokens, torch.arange(12), None, all_logits=True)
        assert (packed16 - got16).abs().max() < 0.02 * got16.abs().max()
    rows = []  # (whether the wide copy ran it, rows x tokens)

    class Recording(Step):
        def __call__(self, tokens, input_pos, cache, all_logits=False, prefill=False):
            rows.append((self.model is not q, tokens.numel()))
            return super().__call__(tokens, input_pos, cache, all_logits, prefill)

    prompts = random_prompts([5, 11, 2, 7], seed=4)
    expected = [greedy_ids(q, p, 10) for p in prompts]
    eng = Engine(q, ToyTokenizer(), EngineConfig(block_size=4, num_blocks=80, wide_rows=3), step=Recording(q))
    eng.wide_step = Recording(eng.wide_step.model)
    assert [c.tokens for c in eng.generate(prompts, max_new_tokens=10)] == expected
    assert all(is_wide == (n >= 3) for is_wide, n in rows)
    assert {n for is_wide, n in rows if is_wide} == {4, 5, 7, 11} and (False, 2) in rows  # decodes of 4 rows


def test_stop_eos_and_max_tokens(model):
    prompt = random_prompts([10], seed=7)[0]
    full = greedy_ids(model, prompt, 12)
    eng = Engine(model, ToyTokenizer(eos_ids=[full[5]]), EngineConfig(block_size=4, num_blocks=60))
    c = eng.generate([prompt], max_new_tokens=12)[0]
    assert c.finish_reason == "eos" and c.tokens == full[:full.index(full[5]) + 1]
    eng = Engine(model, ToyTokenizer(), EngineConfig(block_size=4, num_blocks=60))
    c = eng.generate([prompt], max_new_tokens=12, stop=[f"<{full[3]}>"])[0]
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
        ids.append(eng.submit(Request(prompt, max_new_tokens=rng.randrange(1, 12),
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

    returned, emit = [], eng.outputs.emit  # Outputs returns what to abort; the engine aborts it
    eng.outputs.emit = lambda: returned.append(emit()) or returned[-1]
    bad = eng.submit(Request(prompts[0], max_new_tokens=8, on_event=broken))
    eng.submit(Request(prompts[1], max_new_tokens=8, on_event=events.append))
    while eng.step():
        pass
    assert "client bug" in capsys.readouterr().err
    assert [ids for ids in returned if ids] == [[bad]]  # once: its callback is called no more
    assert [t for e in events for t in e.token_ids] == greedy_ids(model, prompts[1], 8)
    assert eng.stats()["blocks_used"] == 0 and eng.stats()["requests_finished"] == 2


def test_a_failure_fails_only_its_request_and_the_engine_serves_on(model, monkeypatch, capsys):
    """A request whose sampling raises ends with finish_reason "error" (one stderr line, no traceback); the rows
    batched with it are exact, and a forward that raises fails that step's rows only."""
    model = copy.deepcopy(model)  # its forward is patched below
    prompts = random_prompts([6, 9, 12], seed=12)
    poisoned = SamplingParams(temperature=0.5)
    real_sample_tokens = choices_module.sample_tokens

    def sample_tokens(logits, params, *args, **kw):
        if params is poisoned:
            raise FloatingPointError("overflow in sampling")
        return real_sample_tokens(logits, params, *args, **kw)

    monkeypatch.setattr(choices_module, "sample_tokens", sample_tokens)
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
    done = eng.generate(prompts[:2], max_new_tokens=8)
    assert [c.finish_reason for c in done] == ["error", "error"]
    monkeypatch.setattr(model, "forward", real_forward)
    assert eng.generate([prompts[0]], max_new_tokens=8)[0].tokens == greedy_ids(model, prompts[0], 8)
    assert eng.stats()["blocks_used"] == 0


def test_bad_requests(model):
    eng = Engine(model, ToyTokenizer(), EngineConfig(block_size=4, num_blocks=10, max_waiting=2, max_running=4))
    with pytest.raises(ValueError, match="the prompt is empty"):
        eng.submit(Request([]))
    with pytest.raises(ValueError, match="needs up to 13 KV blocks; the pool has 9"):
        eng.submit(Request([1] * 40, max_new_tokens=10))
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
    expected = [greedy_ids(model, p, 16, stop_ids=tok.eos_ids) for p in prompts]
    eng = Engine(model, tok, EngineConfig(block_size=16, num_blocks=256, token_budget=128))
    got = eng.generate(prompts, max_new_tokens=16)
    assert [c.tokens for c in got] == expected


@pytest.mark.slow
def test_smollm2_a_prefix_cache_hit_answers_as_a_miss(smollm2_gguf, smollm2_tokenizer):
    """SmolLM2 as loaded by default (int4 codes, the Q8_0 head in bf16, where "The" and "L" are a near-tie for this
    chat's first token): the same chat twice, the second a prefix-cache hit whose last 5 tokens are prefilled alone,
    gives the first's tokens and generate()'s. The 5 went through decode_attention once and answered otherwise."""
    from load import load_model

    model, _ = load_model(smollm2_gguf, "cpu", torch.float32)
    tok = smollm2_tokenizer
    chat = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
                      bos=False)
    want = greedy_ids(model, chat, 12, stop_ids=tok.eos_ids)
    eng = Engine(model, tok, EngineConfig(block_size=16, num_blocks=64))
    first, second = (eng.generate([chat], max_new_tokens=12)[0].tokens for _ in range(2))
    assert eng.stats()["blocks_cached"] >= len(chat) // 16  # the second was a hit
    assert first == second == want, (tok.decode(first), tok.decode(second))


# ---- parallel sampling (n, best_of), logprobs, prompt logprobs ----

def run(eng, *requests):
    """Serve requests to the end; per request id, its events."""
    events = {}
    for r in requests:
        r.on_event = lambda e: events.setdefault(e.request_id, []).append(e)
        eng.submit(r)
    while eng.step():
        pass
    return events


def by_choice(events):
    """A request's events -> per choice index, (token ids, finish reason, its events)."""
    out = {}
    for e in events:
        ids, reason, evs = out.setdefault(e.index, ([], None, []))
        assert reason is None, f"event after choice {e.index} finished"
        ids.extend(e.token_ids)
        evs.append(e)
        out[e.index] = (ids, e.finish_reason if e.finished else None, evs)
    return out


def assert_no_block_held(eng):
    stats = eng.stats()
    assert stats["running"] == stats["waiting"] == stats["blocks_used"] == 0
    assert all(r == 0 for r in eng.blocks.refs)
    assert len(eng.blocks.free) + len(eng.blocks.evictable) == stats["blocks_total"]


SAMPLED = SamplingParams(temperature=1.0, top_k=40, repetition_penalty=1.1)


@pytest.mark.parametrize("params", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", ["roomy", "preemption"])
def test_choice_i_is_the_request_alone_with_seed_plus_i(model, name, params):
    """n = 4 with seed s: choice i is decode.generate with a generator seeded s + i (so choice 0 is the request with
    n = 1), with forks that share the prompt's blocks, and, in a 30-block pool, forks preempted and recomputed."""
    prompts = random_prompts([42, 23], seed=21)
    eng = Engine(model, ToyTokenizer(), CONFIGS[name])
    events = run(eng, *(Request(p, params, 20, seed=7 + 10 * k, n=4) for k, p in enumerate(prompts)))
    for k, p in enumerate(prompts):
        got = by_choice(events[k])
        assert sorted(got) == [0, 1, 2, 3]
        for i, (ids, reason, _) in got.items():
            assert ids == greedy_ids(model, p, 20, params, generator=torch.Generator().manual_seed(7 + 10 * k + i))
            assert reason == "length"
    if name == "preemption":
        assert eng.stats()["preemptions"] > 0
    assert_no_block_held(eng)
    alone = run(eng, Request(prompts[0], params, 20, seed=7))  # n = 1: what it always gave
    assert [t for e in alone[2] for t in e.token_ids] == by_choice(events[0])[0][0]
    assert [e.index for e in alone[2]] == [0] * 20 and alone[2][-1].tokens is None


def test_forks_share_the_prompt_blocks(model):
    """One request with n = 4 holds fewer blocks than 4 requests of its prompt (prefix caching off), and every
    block is free again after it. The prompt's last block is partial: each fork but one copies it."""
    prompt = random_prompts([42], seed=22)[0]
    config = EngineConfig(block_size=4, num_blocks=200, max_running=16, token_budget=512, prefix_caching=False)

    def peak_blocks(*requests):
        eng = Engine(model, ToyTokenizer(), config)
        for r in requests:
            eng.submit(r)
        peak = 0
        while eng.step():
            peak = max(peak, eng.stats()["blocks_used"])
        assert_no_block_held(eng)
        assert len(eng.blocks.free) == config.num_blocks - 1
        return peak

    shared = peak_blocks(Request(prompt, SAMPLED, 16, seed=1, n=4))
    separate = peak_blocks(*(Request(prompt, SAMPLED, 16, seed=1 + i) for i in range(4)))
    print(f"blocks held: n=4 {shared}, 4 requests {separate}")
    assert shared < separate
    # Between steps a sequence holds at most positions 0..55 (the block for its last fed token is taken and given
    # back in its last step): 14 blocks alone; the forks share the prompt's 10 full blocks and have 4 each of
    # their own, the copy of the partial one and three more.
    assert (shared, separate) == (10 + 4 * 4, 4 * 14)


def test_a_prompt_to_fork_keeps_room_for_its_forks(model):
    """A request with n = 4 takes 4 of max_running's slots when admitted: the short prompts queued behind it wait
    instead of filling the room its forks need (6 running sequences, over max_running)."""
    eng = Engine(model, ToyTokenizer(), EngineConfig(block_size=4, num_blocks=100, max_running=4, token_budget=16))
    for k, p in enumerate(random_prompts([30, 5, 5], seed=27)):
        eng.submit(Request(p, SAMPLED, 6, seed=0, n=4 if k == 0 else 1))
    peak = 0
    while eng.step():
        peak = max(peak, eng.stats()["running"])
    assert peak == 4 and eng.stats()["requests_finished"] == 3


def test_best_of_returns_the_n_most_likely(model):
    """best_of = 4, n = 2: the two of the four sampled choices with the highest cumulative logprob, in that order,
    as one event each at the end, indexed 0 and 1."""
    prompt = random_prompts([15], seed=23)[0]
    eng = Engine(model, ToyTokenizer(), CONFIGS["roomy"])
    four = by_choice(run(eng, Request(prompt, SAMPLED, 12, seed=3, n=4, logprobs=0))[0])
    total = {i: sum(t.logprob for e in evs for t in e.tokens) for i, (_, _, evs) in four.items()}
    ranked = sorted(total, key=lambda i: -total[i])
    assert len(set(total.values())) == 4
    events = run(eng, Request(prompt, SAMPLED, 12, seed=3, n=2, best_of=4))[1]
    assert [e.index for e in events] == [0, 1] and all(e.finished for e in events)
    assert [e.token_ids for e in events] == [four[i][0] for i in ranked[:2]]
    assert events[0].tokens is None  # logprobs were not asked for
    assert_no_block_held(eng)


def test_abort_ends_every_choice(model):
    eng = Engine(model, ToyTokenizer(), CONFIGS["roomy"])
    events = []
    rid = eng.submit(Request(random_prompts([9], seed=24)[0], SAMPLED, 50, n=3, on_event=events.append))
    eng.step()  # the prompt is in: three choices
    eng.step()
    eng.abort(rid)
    while eng.step():
        pass
    finals = [e for e in events if e.finished]
    assert sorted(e.index for e in finals) == [0, 1, 2] and {e.finish_reason for e in finals} == {"abort"}
    events.clear()
    rid = eng.submit(Request([1, 2, 3], max_new_tokens=5, n=2, on_event=events.append))
    eng.abort(rid)  # before its prompt is in: both choices end
    while eng.step():
        pass
    assert sorted((e.index, e.finish_reason, e.token_ids) for e in events) == [(0, "abort", []), (1, "abort", [])]
    assert_no_block_held(eng)


def test_generated_token_logprobs_are_decode_generates(model):
    prompt = random_prompts([11], seed=25)[0]
    expected = list(decode.generate(model, prompt, max_new_tokens=8, params=SAMPLED,
                                    generator=torch.Generator().manual_seed(4), logprobs=3))
    events = run(Engine(model, ToyTokenizer(), CONFIGS["roomy"]), Request(prompt, SAMPLED, 8, seed=4, logprobs=3))[0]
    tokens = [t for e in events for t in e.tokens]
    assert [t.id for t in tokens] == [t for e in events for t in e.token_ids] == [t.id for t in expected]
    for got, want in zip(tokens, expected):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [i for i, _ in got.top] == [i for i, _ in want.top]


def uncached_prompt_logprobs(model, prompt):
    """(T, V) log_softmax of one plain teacher-forced forward, no cache."""
    return torch.log_softmax(model(torch.tensor([prompt]), torch.arange(len(prompt)), all_logits=True)[0], dim=-1)


@pytest.mark.parametrize("name", ["roomy", "chunked-prefill"])
def test_prompt_logprobs_equal_an_uncached_forward(model, name):
    """Each prompt position's logprob and top 3 under the model's log_softmax, as one uncached forward gives them,
    chunked prefill or not; a second identical request (its blocks in the prefix cache) gets them again."""
    prompt = random_prompts([50], seed=26)[0]
    lp = uncached_prompt_logprobs(model, prompt)
    eng = Engine(model, ToyTokenizer(), CONFIGS[name])
    run(eng, Request(prompt, max_new_tokens=2))  # fills the prefix cache
    first = run(eng, Request(prompt, max_new_tokens=0, prompt_logprobs=3))[1]
    assert len(first) == 1 and first[0].finished and first[0].finish_reason == "length"
    assert first[0].token_ids == [] and first[0].completion_tokens == 0 and first[0].cached_tokens == 0
    got = first[0].prompt_logprobs
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        assert got[i].id == prompt[i]
        assert got[i].logprob == pytest.approx(lp[i - 1, prompt[i]].item(), abs=1e-5)
        assert [t for t, _ in got[i].top] == lp[i - 1].topk(3).indices.tolist()
        assert [v for _, v in got[i].top] == pytest.approx(lp[i - 1].topk(3).values.tolist(), abs=1e-5)
    again = by_choice(run(eng, Request(prompt, max_new_tokens=4, prompt_logprobs=3, n=2))[2])
    for i in (0, 1):
        evs = again[i][2]
        assert evs[0].prompt_logprobs == got and all(e.prompt_logprobs is None for e in evs[1:])
        assert again[i][0] == greedy_ids(model, prompt, 4)
    assert_no_block_held(eng)


def test_bad_parallel_requests(model):
    eng = Engine(model, ToyTokenizer(), EngineConfig(block_size=4, num_blocks=60, max_running=4))
    for request, message in [(Request([1, 2], n=0), "n must be >= 1"),
                             (Request([1, 2], n=3, best_of=2), "best_of must be >= n"),
                             (Request([1, 2], n=5), "at most the engine's max_running"),
                             (Request([1, 2], max_new_tokens=0), "max_new_tokens must be >= 1"),
                             (Request([1, 2], logprobs=-1), "logprobs must be >= 0")]:
        with pytest.raises(ValueError, match=message):
            eng.submit(request)
