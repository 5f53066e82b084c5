"""Speculative decoding: the accept/reject rule keeps the target's distribution (statistically, vectorized over
trials), greedy speculative output equals plain greedy for every draft source, and rollback leaves a clean cache."""
import copy
import os

import pytest
import torch

import speculative
from decode import generate
from step import Step
from helpers import ROOT
from model import ModelArgs, Transformer
from quantize import quantize_model
from sample import logits_to_probs
from params import SamplingParams
from speculative import ModelDraft, PromptLookupDraft, SpecStats, verify
from tiny_models import greedy_ids, hf_to_ours, make_hf

TRIALS = 200_000


def simulate(p_rows: torch.Tensor, propose, K: int, positions: int, generator: torch.Generator) -> torch.Tensor:
    """Run the speculative loop for TRIALS independent sequences over a context-free target: the target's
    distribution at position j is p_rows[j] (L, V). propose(start (N,)) -> (drafts (N, K), q (N, K, V)).
    Returns the emitted tokens (TRIALS, positions)."""
    L, V = p_rows.shape
    out = torch.full((TRIALS, positions), -1, dtype=torch.long)
    start = torch.zeros(TRIALS, dtype=torch.long)  # tokens each trial has emitted so far
    while (start < positions).any():
        live = (start < positions).nonzero()[:, 0]  # (N,)
        s = start[live]
        drafts, q = propose(s)
        rows = (s[:, None] + torch.arange(K + 1)).clamp(max=L - 1)  # (N, K+1) positions p is taken at
        n, nxt = verify(p_rows[rows], q, drafts, generator)
        emitted = torch.cat([drafts, torch.zeros_like(drafts[:, :1])], dim=1)  # (N, K+1)
        emitted[torch.arange(len(live)), n] = nxt  # drafts[:n], then the next token
        for i in range(K + 1):  # write emitted[:, i] at position s + i where i <= n and in range
            pos = s + i
            ok = (i <= n) & (pos < positions)
            out[live[ok], pos[ok]] = emitted[ok, i]
        start[live] = s + n + 1
    return out


def tv(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """Total-variation distance between the empirical distribution of `tokens` and p (V,)."""
    counts = torch.bincount(tokens, minlength=p.shape[0]).float()
    return 0.5 * (counts / counts.sum() - p).abs().sum().item()


PARAMS = SamplingParams(temperature=0.8, top_k=7, top_p=0.9)


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["poor", "good", "lookup"])
def test_speculative_sampling_is_lossless(draft):
    g = torch.Generator().manual_seed(0)
    K, V, L, positions = 4, 10, 12, 6
    p_logits = torch.randn(L, V, generator=g) * 2
    p_rows = logits_to_probs(p_logits, PARAMS)  # (L, V) the target
    if draft == "lookup":
        # A deterministic proposal per position (likely and unlikely tokens alike), q one-hot.
        fixed = torch.randint(0, V, (L + K,), generator=g)

        def propose(s):
            drafts = fixed[s[:, None] + torch.arange(K)]  # (N, K)
            return drafts, torch.nn.functional.one_hot(drafts, V).float()
    else:
        noise = 3.0 if draft == "poor" else 0.3
        q_logits = (torch.randn(L, V, generator=g) * 2 if draft == "poor" else p_logits) + \
            noise * torch.randn(L, V, generator=g)
        q_all = logits_to_probs(q_logits, PARAMS)  # (L, V)
        q_all = torch.cat([q_all, q_all[-1:].expand(K, V)])  # (L + K, V) positions past L reuse the last row

        def propose(s):
            q = q_all[s[:, None] + torch.arange(K)]  # (N, K, V)
            drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(len(s), K)  # (N, K)
            return drafts, q

    out = simulate(p_rows, propose, K, positions, g)
    assert (out >= 0).all()
    for j in (0, 3, 5):  # the first token, one inside a draft window, one after a bonus/resample
        assert tv(out[:, j], p_rows[j]) < 0.01, (draft, j)
    # The regimes are what they claim: the poor draft is rejected often, the good one rarely.
    drafts, q = propose(torch.zeros(TRIALS, dtype=torch.long))
    n, _ = verify(p_rows[torch.arange(K + 1)].expand(TRIALS, K + 1, V), q, drafts, g)
    accept_first = (n > 0).float().mean().item()
    if draft == "poor":
        assert accept_first < 0.6
    elif draft == "good":
        assert accept_first > 0.8


def test_verify_edge_cases():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.5, 0.5, 0.0]]])  # (1, 2, 3)
    q = torch.tensor([[[1.0, 0.0, 0.0]]])  # draft token 0 has p = 0: always rejected, resample gives 1
    n, nxt = verify(p, q, torch.tensor([[0]]), g)
    assert n.item() == 0 and nxt.item() == 1
    q = torch.tensor([[[0.0, 1.0, 0.0]]])  # p(x) = 1: always accepted, the bonus comes from row 1
    n, nxt = verify(p, q, torch.tensor([[1]]), g)
    assert n.item() == 1 and nxt.item() in (0, 1)


def spec_ids(target, draft, prompt, n, params=SamplingParams(), generator=None, **kw) -> list[int]:
    """The token ids of speculative.generate; kw as it takes them (stop_ids, k, stats, step)."""
    tokens = speculative.generate(target, draft, prompt, max_new_tokens=n, params=params, generator=generator, **kw)
    return [t.id for t in tokens]


def tiny_drafts(target, mode: str = "none"):
    """Every draft source, on the tiny target: another random model, the target quantized, prompt lookup; the
    models' forwards run as `mode` says (step.Step)."""
    other, int4 = hf_to_ours(make_hf("llama-gqa", seed=1)), quantize_model(copy.deepcopy(target), "int4:32")
    return {
        "other-seed": ModelDraft(other, target, Step(other, mode)),
        "int4-self": ModelDraft(int4, target, Step(int4, mode)),
        "lookup": PromptLookupDraft(),
    }


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_matches_plain_greedy_tiny(tiny, k):
    prompt = [5, 17, 42, 99, 3, 5, 17, 42, 7]
    want = greedy_ids(tiny, prompt, 48)
    for name, draft in tiny_drafts(tiny).items():
        stats = SpecStats(k)
        tokens = list(speculative.generate(tiny, draft, prompt, max_new_tokens=48, k=k, stats=stats))
        assert [t.id for t in tokens] == want, name
        assert [t.end for t in tokens] == [None] * 47 + ["length"], name  # the same end rule as decode.generate
        if name == "other-seed":  # a different random model: rejections happen, so rollback is exercised
            assert any(a < p for p, a in stats.rounds)


@pytest.mark.slow
def test_compiled_greedy_matches_plain_greedy_tiny(tiny):
    """One decode-step policy for every path: speculative decoding with the compiled step (target and draft)
    gives plain greedy's tokens."""
    import torch._dynamo

    torch._dynamo.reset()
    step = Step(tiny, "full")
    prompt = [5, 17, 42, 99, 3, 5, 17, 42, 7]
    want = greedy_ids(tiny, prompt, 32)
    for name, draft in tiny_drafts(tiny, "full").items():
        stats = SpecStats(4)
        assert spec_ids(tiny, draft, prompt, 32, k=4, stats=stats, step=step) == want, name
        assert len(stats.rounds) < 32, name  # drafts were accepted: verifies of several tokens were compiled too


def test_stop_ids_and_context_limit(tiny):
    prompt = [5, 17, 42, 99, 3]
    full = greedy_ids(tiny, prompt, 40)
    stop = full[10]
    draft = ModelDraft(hf_to_ours(make_hf("llama-gqa", seed=1)), tiny)
    tokens = list(speculative.generate(tiny, draft, prompt, max_new_tokens=40, stop_ids=[stop]))
    assert [t.id for t in tokens] == full[: full.index(stop) + 1] and tokens[-1].end == "eos"
    long_prompt = list(range(1, 151)) + list(range(1, 101))  # 250 of a 256 context
    want = greedy_ids(tiny, long_prompt, 50)
    for draft in tiny_drafts(tiny).values():
        assert spec_ids(tiny, draft, long_prompt, 50, k=4) == want


def test_bias_min_tokens_and_ignore_eos_match_plain_greedy(tiny):
    """The target's logits are processed as sample_tokens does, row by row of a verify: greedy speculative is plain
    greedy with a logit bias, min_tokens holding the stop ids (counted per drafted position) and ignore_eos."""
    prompt = [5, 17, 42, 99, 3, 5, 17, 42, 7]
    stop = 9
    for params in (SamplingParams(logit_bias=((stop, 100),), min_tokens=7),
                   SamplingParams(logit_bias=((stop, 6.0), (greedy_ids(tiny, prompt, 1)[0], -100)), min_tokens=3),
                   SamplingParams(logit_bias=((stop, 100),), ignore_eos=True)):
        want = [t.id for t in generate(tiny, prompt, max_new_tokens=24, params=params, stop_ids=[stop])]
        assert stop in want
        for name, draft in tiny_drafts(tiny).items():
            tokens = list(speculative.generate(tiny, draft, prompt, max_new_tokens=24, params=params, stop_ids=[stop]))
            assert [t.id for t in tokens] == want, (name, params)
    with pytest.raises(ValueError, match="logit_bias token 160 is outside the vocabulary"):
        spec_ids(tiny, PromptLookupDraft(), prompt, 5, SamplingParams(logit_bias=((160, 1.0),)))


def test_rollback_leaves_the_target_cache_exact(tiny):
    target = copy.deepcopy(tiny)  # its forward is spied on
    prompt = [5, 17, 42, 99, 3]
    draft = ModelDraft(hf_to_ours(make_hf("llama-gqa", seed=1)), target)
    stats = SpecStats(4)
    caches = []
    original = target.forward

    def spy(tokens, input_pos, cache=None, **kw):  # keep the target's cache for after the run
        if cache is not None and not caches:
            caches.append(cache)
        return original(tokens, input_pos, cache, **kw)

    target.forward = spy
    try:
        params = SamplingParams(temperature=1.0)
        out = spec_ids(target, draft, prompt, 40, params, torch.Generator().manual_seed(0), k=4, stats=stats)
    finally:
        del target.forward
    assert any(a < p for p, a in stats.rounds)  # rejections happened
    seq = prompt + out
    # The last token was never fed: feeding it now must attend to exactly seq (stale slots past it hidden).
    with torch.inference_mode():  # the loops run in inference mode: their cache takes writes only there
        cached = target(torch.tensor([seq[-1:]]), torch.tensor([len(seq) - 1]), caches[0])[0, -1]
    full = target(torch.tensor([seq]), torch.arange(len(seq)))[0, -1]
    assert (cached - full).abs().max().item() <= 1e-4


def test_sampling_runs_with_every_draft(tiny):
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.95, min_p=0.01)
    for name, draft in tiny_drafts(tiny).items():
        out = spec_ids(tiny, draft, [5, 17, 42, 5, 17], 30, params, torch.Generator().manual_seed(1))
        assert len(out) == 30, name


def test_bad_input(tiny):
    small = Transformer(ModelArgs(vocab_size=100, dim=64, n_layers=1, n_heads=4, hidden_dim=64))
    with pytest.raises(ValueError, match="vocab_size 100"):
        ModelDraft(small, tiny)
    with pytest.raises(ValueError, match="k must be >= 1, got 0"):
        spec_ids(tiny, PromptLookupDraft(), [1, 2, 3], 5, k=0)
    with pytest.raises(ValueError, match="not supported with speculative decoding"):
        spec_ids(tiny, PromptLookupDraft(), [1, 2, 3], 5, SamplingParams(repetition_penalty=1.2))


def test_prompt_lookup_proposes_the_latest_match():
    d = PromptLookupDraft()
    ctx = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert d.propose(ctx, 3, SamplingParams(), None)[0] == [7, 8, 5]  # the latest earlier "1 2 3"
    assert d.propose([4, 5, 6], 3, SamplingParams(), None)[0] == []


@pytest.mark.slow
def test_greedy_matches_plain_greedy_smollm2(smollm2):
    model, tok = smollm2
    chat = lambda text: tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), bos=False)
    with open(os.path.join(ROOT, "data", "pride_and_prejudice_ch1-2.txt"), encoding="utf-8") as f:
        paragraph = f.read(600).replace("\n", " ")
    prompts = {
        "int4-self": [tok.encode("The history of the Roman Empire"), chat("Write a short poem about the sea.")],
        "lookup": [chat(f"Repeat this paragraph: {paragraph}"), tok.encode("def fibonacci(n):")],
    }
    drafts = {"int4-self": ModelDraft(quantize_model(copy.deepcopy(model), "int4:32"), model),
              "lookup": PromptLookupDraft()}
    for name, draft in drafts.items():
        rejected, per_verify = False, []
        for prompt in prompts[name]:
            stats = SpecStats(4)
            got = spec_ids(model, draft, prompt, 48, stats=stats)
            assert got == greedy_ids(model, prompt, 48), name
            rejected |= any(a < p for p, a in stats.rounds)
            per_verify.append(stats.tokens_per_verify)
        assert rejected, name
        assert per_verify[0] > 1.4, (name, per_verify)  # the self-draft, and lookup on a repeat task, pay


def test_stats_report_stays_one_short_line_for_a_huge_k():
    stats = SpecStats(100_000, rounds=[(100_000, 3), (100_000, 0), (5, 5)])
    line = stats.report()
    assert "\n" not in line and len(line) < 400 and "0:1 3:1 5:1" in line
