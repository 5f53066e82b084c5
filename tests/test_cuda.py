"""The CUDA paths: the int8/int4 kernels (tinygemm for int4) against their dequantize-then-matmul reference,
CUDA logits against CPU ones, the CUDA-graph compiled decode step (reduce-overhead, its guard filter) and the
compiled blocks against eager, Mixtral, grammar masks on GPU logits, and the serving engine over its paged cache,
eager and with CUDA graphs per batch bucket. They need a GPU, so CI (CPU only) skips them; the GPU check runs them
(`bash scripts/gpu_check.sh`: README, GPU; its past results in dev/LOG.md)."""
import copy
import re

import pytest
import torch
import torch.nn.functional as F

from ops import qkernels
import quantize as q
from serving.engine import Engine, EngineConfig
from features.grammar import Compiler, Constraint, mask_logits
from helpers import ToyTokenizer, toy_bpe
from step import Step
from kvcache import KVCache
from tiny_models import greedy_ids

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")
SHAPES = [(64, 64), (40, 72), (17, 33), (96, 160), (4096, 4096)]  # (N, K): odd ones take the padding path


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def quantized_linear(mode: str, n: int, k: int, dtype: torch.dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(k, n, bias=False).to(CUDA, dtype)
    module = q.make_quantized_linear(*q.parse_mode(mode), linear, dtype)
    module.load_state_dict(module.quantize_weight(linear.weight))
    return linear, module


@pytest.mark.parametrize("mode", ["int8", "int4:32", "int4:64", "int4:128", "int4:256"])
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7])
def test_cuda_kernel_matches_dequantize_then_matmul(mode, n, k, dtype, rows):
    linear, module = quantized_linear(mode, n, k, dtype)
    if mode.startswith("int4"):
        assert module.kernel == "cuda"  # tinygemm, not the reference path
    x = torch.randn(rows, 3, k, dtype=dtype, device=CUDA)
    y = module(x)
    assert y.shape == (rows, 3, n) and y.dtype == dtype
    assert rel_err(y, F.linear(x.float(), module.dequantize().float())) < 1e-2
    tolerance = 0.01 if mode == "int8" else 0.1
    assert rel_err(module.dequantize(), linear.weight) < tolerance


@pytest.mark.parametrize("n, k", SHAPES)
def test_cuda_int4_layout_round_trips_to_plain_codes(n, k):
    """tinygemm's packed layout reads back to the plain codes, and the state dict has the plain layout."""
    linear, module = quantized_linear("int4:32", n, k, torch.bfloat16)
    plain = module.quantize_weight(linear.weight)["weight"]
    assert torch.equal(qkernels.pack_int4(module.codes()), plain)
    assert torch.equal(module.state_dict()["weight"], plain)


def test_cuda_checkpoint_loads_on_cpu():
    """A state dict written on CUDA (plain layout) gives the same weight on CPU's kernel layout."""
    _, cuda_module = quantized_linear("int4:64", 96, 160, torch.bfloat16)
    cpu_module = q.Int4Linear(160, 96, 64)
    cpu_module.load_state_dict({k: v.cpu() for k, v in cuda_module.state_dict().items()})
    torch.testing.assert_close(cpu_module.dequantize(), cuda_module.dequantize().cpu(), rtol=0, atol=0)


@pytest.fixture(scope="module")
def models(tiny):
    return tiny, copy.deepcopy(tiny).to(CUDA)


def test_cuda_logits_match_cpu(models):
    cpu, cuda = models
    tokens = torch.randint(0, cpu.args.vocab_size, (2, 40))
    ref = cpu(tokens, torch.arange(40), all_logits=True)
    got = cuda(tokens.to(CUDA), torch.arange(40, device=CUDA), all_logits=True)
    assert (got.cpu() - ref).abs().max() <= 1e-4


def forced_logits(step: Step, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Prefill prompt, then feed `tokens` one decode step at a time: the logits (1 + len(tokens), V). Teacher
    forcing keeps two runs on the same inputs even where a near-tie would flip a greedy choice. Each step's
    output is cloned: a CUDA graph replay reuses its output buffer."""
    model = step.model
    cache = KVCache.for_model(model.args, 1, len(prompt) + len(tokens), model.embed_tokens.weight.dtype, CUDA)
    out = [model(torch.tensor([prompt], device=CUDA), torch.arange(len(prompt), device=CUDA), cache)[:, -1]]
    for pos, token in enumerate(tokens, start=len(prompt)):
        out.append(step(torch.tensor([[token]], device=CUDA), torch.tensor([pos], device=CUDA), cache).clone())
    return torch.cat(out)


@pytest.mark.slow
@pytest.mark.parametrize("mode", [None, "int8", "int4:32"])
def test_cuda_graph_decode_matches_eager_without_recompiling(models, mode):
    """reduce-overhead (CUDA graphs) decode == eager over 32 greedy steps; a second generation of the same
    shape does not recompile. fp32 for the float model (<= 1e-4); bf16, the kernels' dtype, quantized."""
    import torch._dynamo

    model = models[1]
    if mode is not None:
        model = q.quantize_model(copy.deepcopy(model).to(torch.bfloat16), mode)
    torch._dynamo.reset()
    compiled = Step(model, "full")
    for i, prompt in enumerate([[7, 8, 9, 10], [11, 12, 13, 14]]):
        tokens = greedy_ids(model, prompt, 31)
        eager = forced_logits(Step(model), prompt, tokens)
        tolerance = 1e-4 if mode is None else 2e-2 * eager.abs().max().item()
        with torch._dynamo.config.patch(error_on_recompile=i > 0):  # the second prompt: no recompiling
            got = forced_logits(compiled, prompt, tokens)
        assert (got - eager).abs().max() <= tolerance


def test_cuda_generate_matches_cpu(models):
    cpu, cuda = models
    prompt = [5, 17, 42, 99, 3]
    assert greedy_ids(cuda, prompt, 40) == greedy_ids(cpu, prompt, 40)


@pytest.mark.parametrize("mode", [None, "int8", "int4:32"])
def test_cuda_mixtral_matches_cpu(mode):
    """A tiny Mixtral on CUDA (the routing, the grouped prefill path, the k-expert decode path): float logits
    within 1e-4 of CPU and the same greedy tokens; quantized experts (tinygemm int4) close to the float model."""
    from tiny_models import hf_to_ours, make_hf

    cpu = hf_to_ours(make_hf("mixtral-8x2"))
    cuda = copy.deepcopy(cpu).to(CUDA)
    tokens = torch.randint(0, cpu.args.vocab_size, (2, 40))
    ref = cpu(tokens, torch.arange(40), all_logits=True)
    if mode is None:
        got = cuda(tokens.to(CUDA), torch.arange(40, device=CUDA), all_logits=True)
        assert (got.cpu() - ref).abs().max() <= 1e-4
        assert greedy_ids(cuda, [5, 17, 42, 99, 3], 24) == greedy_ids(cpu, [5, 17, 42, 99, 3], 24)
        return
    quantized = q.quantize_model(cuda, mode)
    got = quantized(tokens.to(CUDA), torch.arange(40, device=CUDA), all_logits=True)
    assert rel_err(got.cpu(), ref) < (0.05 if mode == "int8" else 0.5)


@pytest.mark.slow
def test_cuda_blocks_decode_matches_eager(models):
    """The blocks mode (one compiled Block.forward for every layer) on CUDA == eager over 24 greedy steps."""
    import torch._dynamo

    model = models[1]
    torch._dynamo.reset()
    prompt = [7, 8, 9, 10]
    tokens = greedy_ids(model, prompt, 23)
    eager = forced_logits(Step(model), prompt, tokens)
    assert (forced_logits(Step(model, "blocks"), prompt, tokens) - eager).abs().max() <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["none", "full"])
def test_cuda_engine_matches_cpu_single_runs(models, mode):
    """The engine on CUDA: continuous batching with chunked prefill over the paged cache, its decode batches eager or
    replayed as CUDA graphs, one per bucket of padded rows and block-table widths: the tokens of CPU single runs,
    with two graphs compiled (one row, and the rest with symbolic sizes)."""
    import torch._dynamo

    cpu, cuda = models
    prompts = [[5, 17, 42], [7, 8, 9, 10, 11], [3] * 20, [1, 2, 3, 4, 5, 6, 7], [9, 9], list(range(1, 40))]
    expected = [greedy_ids(cpu, p, 12) for p in prompts]
    config = EngineConfig(block_size=4, num_blocks=100, max_running=8, token_budget=24)
    engine = Engine(cuda, ToyTokenizer(), config, Step(cuda, mode))
    assert engine.buckets == (mode == "full") and engine.pool.k[0].is_cuda
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for _ in range(2):  # the second round replays the captured graphs (and hits the prefix cache)
        assert [c.tokens for c in engine.generate(prompts, max_new_tokens=12)] == expected
    if mode == "full":
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


def test_cuda_grammar_masks_gpu_logits(models):
    """Structured output on CUDA: the bitmask built on CPU masks GPU logits exactly as CPU ones, and the engine on
    CUDA constrained by a regex gives CPU's tokens, whose text matches it."""
    cpu, cuda = models
    toy = toy_bpe()
    grammar = Compiler(toy, cpu.args.vocab_size).compile(Constraint("regex", "[a-z]{2,5}-[0-9]{2,3}"))
    logits = torch.randn(2, cpu.args.vocab_size)
    matchers = [grammar.matcher(), None]
    assert torch.equal(mask_logits(logits.to(CUDA), matchers).cpu(), mask_logits(logits, matchers))
    prompts = [toy.encode("ab", bos=False), toy.encode("code:", bos=False)]
    config = EngineConfig(block_size=4, num_blocks=100, max_running=4, token_budget=24)
    got = [Engine(m, toy, config).generate(prompts, max_new_tokens=10, grammar=grammar) for m in (cpu, cuda)]
    assert [c.tokens for c in got[1]] == [c.tokens for c in got[0]]
    assert all(re.fullmatch("[a-z]{2,5}-[0-9]{2,3}", c.text) for c in got[1])
