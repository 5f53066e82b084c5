"""The generation loop against a plain uncached loop, its stopping rules, and the compiled decode step."""
import pytest
import torch

from generate import compile_decode, decode_one, generate
from kvcache import KVCache
from tiny_models import hf_to_ours, make_hf

torch.set_grad_enabled(False)


@pytest.fixture(scope="module")
def model():
    return hf_to_ours(make_hf("llama-gqa"))


def greedy_uncached(model, prompt: list[int], n: int) -> list[int]:
    """The simplest possible decoder: rerun the whole sequence for every new token."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(model(torch.tensor([seq]), torch.arange(len(seq)))[0, -1].argmax().item())
    return seq[len(prompt):]


def test_greedy_matches_uncached_loop(model):
    prompt = [5, 17, 42, 99, 3]
    assert list(generate(model, prompt, 40)) == greedy_uncached(model, prompt, 40)


def test_stops_after_stop_id(model):
    prompt = [5, 17, 42, 99, 3]
    full = list(generate(model, prompt, 40))
    stop = full[10]
    got = list(generate(model, prompt, 40, stop_ids=[stop]))
    assert got == full[: full.index(stop) + 1]


def test_stops_at_context_limit(model):
    context = model.args.max_seq_len  # 256
    prompt = list(range(1, 151)) + list(range(1, 101))  # 250 tokens
    got = list(generate(model, prompt, 100))
    # The last position (context - 1) can be fed, so its logits give one more token: context - len + 1.
    assert len(got) == context - len(prompt) + 1
    assert got == greedy_uncached(model, prompt, len(got))


def test_prompt_longer_than_context(model):
    with pytest.raises(ValueError, match="the prompt is 256 tokens, longer than the model's context of 255"):
        list(generate(model, [1] * 256, 10))


def test_seeded_sampling_is_reproducible(model):
    def run(seed):
        return list(generate(model, [1, 2, 3], 30, temperature=1.0, top_p=0.9,
                             generator=torch.Generator().manual_seed(seed)))
    assert run(3) == run(3)
    assert run(3) != run(4)


def test_compiled_decode_matches_eager_without_recompiling(model):
    """32 greedy steps: compiled logits equal eager ones; after warm-up, another generation of the
    same shape must not recompile (error_on_recompile turns a recompile into an exception)."""
    import torch._dynamo

    def greedy_logits(step, prompt: list[int], n: int) -> torch.Tensor:
        cache = KVCache.for_model(model.args, 1, len(prompt) + n, torch.float32, "cpu")
        logits = model(torch.tensor([prompt]), torch.arange(len(prompt)), cache)[:, -1]
        out = [logits]
        for pos in range(len(prompt), len(prompt) + n - 1):
            logits = step(model, logits.argmax(-1, keepdim=True), torch.tensor([pos]), cache)
            out.append(logits)
        return torch.cat(out)  # (n, V)

    torch._dynamo.reset()
    compiled = compile_decode(model)
    eager = greedy_logits(decode_one, [7, 8, 9, 10], 32)
    assert (greedy_logits(compiled, [7, 8, 9, 10], 32) - eager).abs().max() <= 1e-4
    with torch._dynamo.config.patch(error_on_recompile=True):
        again = greedy_logits(compiled, [11, 12, 13, 14], 32)
    assert (again - greedy_logits(decode_one, [11, 12, 13, 14], 32)).abs().max() <= 1e-4


def test_compiled_prefill_has_dynamic_length(model):
    """--compile-prefill: prompts of three lengths give eager's logits (<= 1e-4); compiled once, with the length
    symbolic from the start, later lengths recompile nothing."""
    import torch._dynamo

    def prefill(step, n: int) -> torch.Tensor:
        cache = KVCache.for_model(model.args, 1, 64, torch.float32, "cpu")
        return step(model, torch.arange(1, n + 1)[None], torch.arange(n), cache)

    torch._dynamo.reset()
    compiled = compile_decode(model, prefill=True)
    for i, n in enumerate([5, 9, 23]):
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            assert (prefill(compiled, n) - prefill(decode_one, n)).abs().max() <= 1e-4


def test_gemv_backend_only_for_single_row_cpu_steps(model):
    from generate import gemv_backend

    assert torch.backends.mkldnn.enabled
    with gemv_backend(torch.tensor([[5]])):
        assert not torch.backends.mkldnn.enabled  # one row: MKL's GEMV
    assert torch.backends.mkldnn.enabled  # restored
    with gemv_backend(torch.tensor([[5], [6]])):
        assert torch.backends.mkldnn.enabled  # two rows: oneDNN stays
    # Same logits whichever backend runs the bf16 matmuls (up to bf16 rounding of the accumulation order).
    bf16 = hf_to_ours(make_hf("llama-gqa")).to(torch.bfloat16)
    cache = KVCache.for_model(bf16.args, 1, 8, torch.bfloat16, "cpu")
    bf16(torch.tensor([[1, 2, 3]]), torch.arange(3), cache)
    token, pos = torch.tensor([[4]]), torch.tensor([3])
    reference = bf16(token, pos, cache)[:, -1]  # oneDNN, torch's default
    assert (decode_one(bf16, token, pos, cache) - reference).abs().max() <= 0.05 * reference.abs().max()
