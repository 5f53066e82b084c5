"""step.Step, the one policy for how a model's forwards run: its modes, what `auto` picks, the compiled block and
the compiled step against eager, per-model graphs, the prefill compile, the GEMV backend, and a compile failure
(a fallback to eager that the step then reports, or a one-line error), and Inductor's on-disk cache shared by
processes that dispatch different CPU kernels."""
import copy

import pytest
import torch

from ops import gemv
from helpers import run_py
from kvcache import KVCache
from model import Attention, Linear
from ops import cpu
from step import (COMPILE_PAYS_AFTER, Step, auto_mode, device_paths, eager, gemv_backend, pack_linears,
                  packs_rows)


@pytest.mark.slow
def test_step_modes(tiny):
    assert Step(tiny).mode == "none" and Step(tiny, "none").mode == "none"
    assert Step(tiny, "full").mode == "full" and Step(tiny, compile_prefill=True).mode == "full"
    assert Step(tiny, "blocks").mode == "blocks" and Step(tiny, "auto").mode == "blocks"  # a dense model on CPU
    assert Step(tiny).model is tiny
    with pytest.raises(ValueError, match=r"^unknown compile mode 'fast'; choose from auto, none, blocks, full$"):
        Step(tiny, "fast")


@pytest.mark.slow
def test_auto_compiles_blocks_for_a_dense_model_in_one_cpu_process(tiny):
    from tiny_models import hf_to_ours, make_hf

    assert auto_mode(tiny) == "blocks"
    # a one-shot answer is compiled only when it is long enough to pay for the compile
    assert auto_mode(tiny, COMPILE_PAYS_AFTER) == "blocks" and auto_mode(tiny, COMPILE_PAYS_AFTER - 1) == "none"
    assert Step(tiny, "auto", decode_steps=16).mode == "none" and Step(tiny, "blocks", decode_steps=16).mode == "blocks"
    sharded = copy.deepcopy(tiny)
    for block in sharded.layers:
        block.all_reduce = lambda t: t  # what tp.install sets: a collective inside every block
    assert auto_mode(sharded) == "none"
    moe = hf_to_ours(make_hf("mixtral-8x2"))
    assert auto_mode(moe) == "none" and Step(moe, "auto").mode == "none"
    with pytest.raises(ValueError, match=r"^--compile does not support mixture-of-experts"):
        Step(moe, "blocks")


def test_loops_refuse_a_step_of_another_model(tiny):
    from decode import generate

    with pytest.raises(AssertionError, match="a Step runs the model it was made for"):
        list(generate(tiny, [1, 2, 3], max_new_tokens=2, step=Step(copy.deepcopy(tiny))))


def test_step_installs_the_cpus_paths_and_they_agree_with_the_models(tiny):
    """A model runs its plain SDPA and F.linear until step.device_paths (which Step calls) gives it ops/cpu.py's on
    CPU; a prefill and decode steps through those agree with the plain ones (<= 1e-5), and a model moved off the CPU
    gets its plain paths back."""
    from model import Attention, Linear, Transformer, sdpa
    from ops import cpu

    plain = Transformer(tiny.args)
    plain.load_state_dict(tiny.state_dict())
    attn, linears = plain.layers[0].self_attn, [m for m in plain.modules() if isinstance(m, Linear)]
    assert attn.attend is sdpa and all(m.product is torch.nn.functional.linear for m in linears)
    fast = copy.deepcopy(plain)
    Step(fast)
    assert all(a.attend is cpu.attention for a in fast.modules() if isinstance(a, Attention))
    assert all(m.product is cpu.linear for m in fast.modules() if isinstance(m, Linear))

    def decode(forward) -> torch.Tensor:  # a 3-token prefill and 4 decode steps: logits (5, V)
        cache = KVCache.for_model(tiny.args, 1, 8, torch.float32, "cpu")
        out = [forward(torch.tensor([[1, 2, 3]]), torch.arange(3), cache)]
        out += [forward(torch.tensor([[pos]]), torch.tensor([pos]), cache) for pos in range(3, 7)]
        return torch.cat(out)

    want, got = decode(lambda *a: plain(*a)[:, -1]), decode(Step(fast))
    assert (got - want).abs().max() <= 1e-5
    device_paths(fast.to("meta"))
    assert all(a.attend is sdpa for a in fast.modules() if isinstance(a, Attention))


def test_a_prefill_attends_through_sdpa_and_decode_steps_through_decode_attention(tiny, monkeypatch):
    """On CPU, decode steps and a verify's (at most DECODE_QUERIES tokens) attend through ops/cpu.py's
    decode_attention; a prefill through SDPA however few its tokens (a prompt's last ones after a prefix-cache hit,
    one token included), as the same tokens in a longer prefill do."""
    from ops import cpu

    calls, decode_attention = [], cpu.decode_attention

    def counted(q, k, v, mask):  # (the number of queries)
        calls.append(q.shape[2])
        return decode_attention(q, k, v, mask)

    monkeypatch.setattr(cpu, "decode_attention", counted)
    model = copy.deepcopy(tiny)
    step, layers = Step(model), model.args.n_layers
    cache = KVCache.for_model(model.args, 1, 32, torch.float32, "cpu")
    step(torch.arange(1, 21)[None], torch.arange(20), cache, prefill=True)  # a long prefill
    step(torch.arange(1, 6)[None], torch.arange(20, 25), cache, prefill=True)  # 5 more, as after a cache hit
    step(torch.tensor([[7]]), torch.tensor([25]), cache, prefill=True)  # and one
    assert calls == []
    step(torch.tensor([[7]]), torch.tensor([26]), cache)  # a decode step
    step(torch.arange(1, 5)[None], torch.arange(27, 31), cache, all_logits=True)  # a verify of 4
    assert calls == [1] * layers + [4] * layers


def greedy_steps(step: Step, prompt: list[int], n: int, rows: int = 1) -> torch.Tensor:
    """Prefill `prompt` (in `rows` identical rows), then n greedy one-token steps: the logits (n + 1, rows, V)."""
    cache = KVCache.for_model(step.model.args, rows, len(prompt) + n, torch.float32, "cpu")
    logits = step(torch.tensor([prompt] * rows), torch.arange(len(prompt)), cache)
    out = [logits]
    for pos in range(len(prompt), len(prompt) + n):
        logits = step(logits.argmax(-1, keepdim=True), torch.tensor([pos]), cache)
        out.append(logits)
    return torch.stack(out)


@pytest.mark.slow
def test_blocks_match_eager(tiny):
    """--compile blocks (the CPU default): one compiled Block.forward runs every layer of a decode step. 24 greedy
    steps give eager's logits (<= 1e-4), for one row and for three; another prompt recompiles nothing; an int4 copy
    of the model (other module types, as a self-draft has) gets its own eager logits from its own step."""
    import torch._dynamo

    from quantize import quantize_model

    torch._dynamo.reset()
    step = Step(tiny, "blocks")
    for rows in (1, 3):
        fast, slow = greedy_steps(step, [7, 8, 9], 24, rows), greedy_steps(Step(tiny), [7, 8, 9], 24, rows)
        assert (fast - slow).abs().max() <= 1e-4
    with torch._dynamo.config.patch(error_on_recompile=True):
        again = greedy_steps(step, [11, 12, 13], 24)  # the same cache size: a new one is a new shape
    assert (again - greedy_steps(Step(tiny), [11, 12, 13], 24)).abs().max() <= 1e-4
    int4 = quantize_model(copy.deepcopy(tiny), "int4:32")
    fast, slow = greedy_steps(Step(int4, "blocks"), [7, 8, 9], 24), greedy_steps(Step(int4), [7, 8, 9], 24)
    assert torch.equal(fast.argmax(-1), slow.argmax(-1))
    assert (fast - slow).abs().max() <= 1e-2 * slow.abs().max()  # the bf16 kernel; the code around it is fused


@pytest.mark.slow
def with_q8_0_head(model, monkeypatch):
    """model with its float head as a GGUF Q8_0 head (Int8GroupLinear), loaded as on an AVX2 CPU: with words."""
    from quantize import Int8GroupLinear

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    w = model.lm_head.weight.view(model.args.vocab_size, -1, 32)  # (N, K/32, 32)
    scales = (w.abs().amax(-1) / 127).clamp(min=1e-8)  # (N, K/32)
    head = Int8GroupLinear(model.args.dim, model.args.vocab_size)
    head.load_codes((w / scales[..., None]).round().to(torch.int8).flatten(1), scales)
    model.lm_head = head
    return model


@pytest.mark.slow
def test_a_compiled_step_runs_the_q8_0_heads_words(tiny, monkeypatch, capsys):
    """blocks and full run a Q8_0 head's words (quantize.compiled_head); eager runs its halves, and so does a step
    whose compile failed, whatever forward (prefill or decode) compiled first."""
    model = with_q8_0_head(copy.deepcopy(tiny), monkeypatch)
    assert Step(model, "blocks") and model.lm_head.compiled
    assert Step(model) and not model.lm_head.compiled
    assert Step(model, "full") and model.lm_head.compiled
    monkeypatch.setattr(torch, "compile", broken_compile)
    monkeypatch.setattr(gemv, "compiled", lambda fn, shapes: broken_compile(fn))
    step = Step(model, "auto")
    assert model.lm_head.compiled
    fell_back = greedy_steps(step, [7, 8, 9], 2)  # the prefill compiles the head's kernel first
    assert step.mode == "none" and step.failed and not model.lm_head.compiled
    assert capsys.readouterr().err.count("\n") == 1
    assert torch.equal(fell_back, greedy_steps(Step(model), [7, 8, 9], 2))


@pytest.mark.slow
def test_the_full_step_runs_the_q8_0_heads_words_as_their_own_kernel(tiny, monkeypatch):
    """Under full, a Q8_0 head's words run as an op of their own inside the whole-step graph (gemv.gemv_rows, its
    kernel compiled alone): 8 greedy steps of one row and of three give the logits of the exact product with the
    head's dequantized weight (<= 1e-4, as blocks gives eager's), and the op ran, once a row."""
    import torch._dynamo

    torch._dynamo.reset()
    model = with_q8_0_head(copy.deepcopy(tiny), monkeypatch)
    exact = copy.deepcopy(model)
    exact.lm_head = torch.nn.Linear(model.args.dim, model.args.vocab_size, bias=False)
    exact.lm_head.weight.data = model.lm_head.dequantize()
    calls = []
    kernel = gemv.compiled

    def counted(fn, shapes):
        one = kernel(fn, shapes)
        return lambda *args: calls.append(shapes) or one(*args)

    monkeypatch.setattr(gemv, "compiled", counted)
    step = Step(model, "full")
    assert step.mode == "full" and model.lm_head.compiled
    for rows in (1, 3):
        calls.clear()
        logits = greedy_steps(step, [7, 8, 9], 8, rows)
        assert len(calls) == 9 * rows  # the prefill's last position and 8 steps, each row
        assert (logits - greedy_steps(Step(exact), [7, 8, 9], 8, rows)).abs().max() <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("head", ["int4", "q8_0"])
def test_a_verify_runs_the_compiled_block_row_for_row(tiny, head, monkeypatch):
    """Under blocks, a verify (every position's logits, a few tokens) runs the compiled block too: its rows equal
    the compiled one-token steps' bitwise, for every verify length (the length is symbolic after the second). With
    int4 weights, as the default path runs: a float matmul rounds one row and several differently (README). The head
    as int4 codes, or as a Q8_0 head's words on AVX2 (one kernel a row)."""
    import torch._dynamo

    from quantize import quantize_model

    torch._dynamo.reset()
    int4 = quantize_model(copy.deepcopy(tiny), "int4:32", quantize_head=head == "int4")
    if head == "q8_0":
        int4 = with_q8_0_head(int4, monkeypatch)
    step = Step(int4, "blocks")
    assert getattr(int4.lm_head, "compiled", False) == (head == "q8_0")
    prompt, follow = [7, 8, 9], [10, 11, 12, 13, 14]
    for T in (1, 5, 3, 2, 4):
        caches = [KVCache.for_model(int4.args, 1, 16, torch.float32, "cpu") for _ in range(2)]
        for cache in caches:
            step(torch.tensor([prompt]), torch.arange(3), cache)
        rows = [step(torch.tensor([[t]]), torch.tensor([3 + i]), caches[0]) for i, t in enumerate(follow[:T])]
        verify = step(torch.tensor([follow[:T]]), torch.arange(3, 3 + T), caches[1], all_logits=True)[0]
        assert torch.equal(torch.cat(rows), verify), T



@pytest.mark.slow
def test_a_chat_runs_eager_until_its_decoded_tokens_pay_for_the_compile(tiny, monkeypatch):
    """pay_as_you_go (generate.py --interactive): auto starts eager and compiles blocks only once the answers so far
    have decoded COMPILE_PAYS_AFTER tokens, between answers; an explicit mode compiles at once; a model auto never
    compiles stays eager."""
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(fn) or fn)
    step = Step(tiny, "auto", pay_as_you_go=True)
    assert step.mode == "none" and step.deferred == "blocks" and not compiled
    assert step.account(COMPILE_PAYS_AFTER - 1) is False and step.mode == "none" and not compiled
    assert step.account(1) is True and step.mode == "blocks" and len(compiled) == 1
    assert step.account(5000) is False and len(compiled) == 1  # compiled once
    assert torch.equal(greedy_steps(step, [7, 8, 9], 3), greedy_steps(Step(tiny), [7, 8, 9], 3))
    assert Step(tiny, "blocks", pay_as_you_go=True).mode == "blocks" and len(compiled) == 2
    none = Step(tiny, "auto", decode_steps=16, pay_as_you_go=True)  # a one-shot answer too short to pay
    assert none.mode == "none" and none.deferred is None and none.account(COMPILE_PAYS_AFTER) is False

def broken_compile(fn, **kwargs):
    """A torch.compile whose compiled function fails as Inductor does when it cannot build a kernel."""
    import torch._dynamo.exc

    def fail(*args, **kwargs):
        raise torch._dynamo.exc.BackendCompilerFailed("inductor", RuntimeError("CppCompileError: no g++"), None)
    return fail


@pytest.mark.slow
def test_auto_blocks_fall_back_to_eager_when_compiling_fails(tiny, monkeypatch, capsys):
    """The default must run where torch.compile cannot (no C++ compiler): one warning, then eager's logits, and the
    step says it runs eagerly (what the summary line reads). Asked for explicitly (--compile blocks), the failure
    is a one-line error."""
    monkeypatch.setattr(torch, "compile", broken_compile)
    step = Step(tiny, "auto")
    assert step.mode == "blocks" and not step.failed
    assert torch.equal(greedy_steps(step, [7, 8, 9], 4), greedy_steps(Step(tiny), [7, 8, 9], 4))
    assert step.mode == "none" and step.failed
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: torch.compile failed (BackendCompilerFailed")
    assert err.rstrip().endswith("decoding without it")
    with pytest.raises(ValueError, match=r"torch.compile failed \(BackendCompilerFailed.*run with --compile none"):
        greedy_steps(Step(tiny, "blocks"), [7, 8, 9], 1)


@pytest.mark.slow
def test_the_full_steps_many_rows_take_packed_weights(tiny):
    """On CPU the full step's graph of several rows reads each linear's weight packed once for oneDNN (step.packs_rows,
    cpu.packed_linear), made at its first call of several rows, never for one row. Its one-token attention is written
    as reductions (ops.cpu.full_step_attention). 8 greedy steps of one row and of three give eager's logits (<= 1e-4);
    the three-row graph calls the packed product and, unlike a frozen graph, enters Inductor's on-disk cache."""
    from unittest import mock

    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch._inductor import config
    from torch._inductor.graph import GraphLowering

    model = copy.deepcopy(tiny)  # packing gives the shared model's linears a second weight
    torch._dynamo.reset()
    counters.clear()
    step = Step(model, "full")
    assert step.packed and all(m.attend is cpu.full_step_attention for m in model.modules() if isinstance(m, Attention))
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    codes = []
    with config.patch(fx_graph_cache=False), mock.patch.object(GraphLowering, "save_output_code", codes.append):
        for rows in (1, 3):
            logits = greedy_steps(step, [7, 8, 9], 8, rows)
            assert (logits - greedy_steps(Step(tiny), [7, 8, 9], 8, rows)).abs().max() <= 1e-4
            packed = [getattr(m, "packed_weight", None) for m in linears]
            assert all(p is None for p in packed) if rows == 1 else all(p is not None and p.tensor.is_mkldnn for p in packed)
    assert len(codes) == 2 and "packed_linear" not in codes[0] and "tinyllm::packed_linear" in codes[1]
    torch._dynamo.reset()
    greedy_steps(Step(model, "full"), [7, 8, 9], 2, 3)  # the three-row graph compiled again, through the cache
    assert counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_hit"] == 1
    assert counters["inductor"]["fxgraph_cache_bypass"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_compiled_one_row_product_over_a_norms_output_equals_f_linear(dtype):
    """cpu.linear compiled for one row: a multiply-and-sum over the row, materialized (a norm's output here, the
    producer Inductor would otherwise recompute for every output row; the speed is dev/LOG.md's), equal to F.linear's
    product (float32 to float rounding, bf16 to its own); eager, cpu.materialized is the identity and the product is
    F.linear's, bitwise."""
    import torch.nn.functional as F
    import torch._inductor.inductor_prims  # noqa: F401 (what Step imports before it compiles)

    g = torch.Generator().manual_seed(3)
    x, gain = torch.randn(1, 1, 64, generator=g), torch.rand(64, generator=g) + 0.5
    weight, bias = torch.randn(48, 64, generator=g).to(dtype), torch.randn(48, generator=g).to(dtype)

    def normed(x, gain):
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * gain).to(dtype)  # (1, 1, 64)

    def normed_product(x, gain, weight, bias):
        return cpu.linear(normed(x, gain), weight, bias)  # (1, 1, 48)

    ref = normed_product(x, gain, weight, bias)
    row = normed(x, gain)
    assert torch.equal(ref, F.linear(row, weight, bias)) and torch.equal(cpu.materialized(row), row)
    got = torch.compile(normed_product, fullgraph=True, dynamic=False)(x, gain, weight, bias)
    assert got.shape == ref.shape and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.float() - ref.float()).abs().max() <= tol * ref.float().abs().max()


def test_a_deep_copy_of_a_packed_model_packs_its_own(tiny):
    """pack_linears gives each float linear a oneDNN-packed weight, which device_paths binds to its product; a deep
    copy of the model (whose weights may then change) gets None in its place, not the original's packing, and both
    compute eager logits as before."""
    model = copy.deepcopy(tiny)
    pack_linears(model)
    device_paths(model)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed_weight.tensor.is_mkldnn and m.product.keywords["packed"] is m.packed_weight
                           for m in linears)
    twin = copy.deepcopy(model)
    twins = [m for m in twin.modules() if isinstance(m, Linear)]
    assert all(m.packed_weight is None and m.product.keywords["packed"] is None for m in twins)
    tokens = torch.tensor([[7, 8, 9]])
    ref = eager(tiny, tokens, torch.arange(3), KVCache.for_model(tiny.args, 1, 3, torch.float32, "cpu"))
    for m in (model, twin):
        assert torch.equal(eager(m, tokens, torch.arange(3), KVCache.for_model(m.args, 1, 3, torch.float32, "cpu")), ref)


def test_packed_rows_are_a_cpu_path_within_a_quarter_of_memory(tiny):
    size = sum(m.weight.numel() * m.weight.element_size() for m in tiny.modules() if isinstance(m, Linear))
    assert packs_rows(tiny, memory_bytes=4 * size) and not packs_rows(tiny, memory_bytes=4 * size - 1)
    assert not Step(tiny).packed  # eager: no graph to freeze


@pytest.mark.slow
def test_a_compile_failure_is_a_one_line_value_error(tiny, monkeypatch):
    monkeypatch.setattr(torch, "compile", broken_compile)
    step = Step(tiny, "full")
    cache = KVCache.for_model(tiny.args, 1, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"torch.compile failed \(BackendCompilerFailed.*run with --compile none"):
        step(torch.tensor([[1]]), torch.tensor([0]), cache)


@pytest.mark.slow
def test_compiled_decode_matches_eager_without_recompiling(tiny):
    """32 greedy steps: the full step's logits equal eager ones; after warm-up, another generation of the same
    shape must not recompile (error_on_recompile turns a recompile into an exception)."""
    import torch._dynamo

    def greedy_logits(step: Step, prompt: list[int], n: int) -> torch.Tensor:
        cache = KVCache.for_model(tiny.args, 1, len(prompt) + n, torch.float32, "cpu")
        logits = tiny(torch.tensor([prompt]), torch.arange(len(prompt)), cache)[:, -1]
        out = [logits]
        for pos in range(len(prompt), len(prompt) + n - 1):
            logits = step(logits.argmax(-1, keepdim=True), torch.tensor([pos]), cache)
            out.append(logits)
        return torch.cat(out)  # (n, V)

    torch._dynamo.reset()
    compiled = Step(tiny, "full")
    assert (greedy_logits(compiled, [7, 8, 9, 10], 32) - greedy_logits(Step(tiny), [7, 8, 9, 10], 32)).abs().max() \
        <= 1e-4
    with torch._dynamo.config.patch(error_on_recompile=True):
        again = greedy_logits(compiled, [11, 12, 13, 14], 32)
    assert (again - greedy_logits(Step(tiny), [11, 12, 13, 14], 32)).abs().max() <= 1e-4


@pytest.mark.slow
def test_compiled_steps_keep_each_models_graphs(tiny):
    """The full step drops Dynamo's guards on the model's modules (step.skip_module_guards), so a graph must never
    serve another model: steps of models of the same shapes whose constants (norm eps) and module types (int4
    linears, as a self-draft has) differ give each model its own eager logits, in either order."""
    import torch._dynamo

    from quantize import quantize_model

    other = copy.deepcopy(tiny)
    for m in other.modules():
        if hasattr(m, "eps"):
            m.eps = 0.5  # a Python constant: baked into the graph, not an input to it
    models = [tiny, other, quantize_model(copy.deepcopy(tiny), "int4:32")]
    torch._dynamo.reset()
    steps = [Step(model, "full") for model in models]
    for _ in range(2):
        for model, step in zip(models, steps):
            caches = [KVCache.for_model(model.args, 1, 8, torch.float32, "cpu") for _ in range(2)]
            for cache in caches:
                model(torch.tensor([[1, 2, 3]]), torch.arange(3), cache)
            token, pos = torch.tensor([[4]]), torch.tensor([3])
            slow, fast = eager(model, token, pos, caches[0]), step(token, pos, caches[1])
            assert (fast - slow).abs().max() <= 1e-2 * slow.abs().max()


@pytest.mark.slow
def test_compiled_prefill_has_dynamic_length(tiny):
    """--compile-prefill: prompts of several lengths give eager's logits (<= 1e-4); compiled with the length
    symbolic from the start, so later lengths recompile nothing, but for the one switch of attention kernel past
    DECODE_QUERIES tokens (ops/cpu.py)."""
    import torch._dynamo

    from ops.cpu import DECODE_QUERIES

    def prefill(step: Step, n: int) -> torch.Tensor:
        cache = KVCache.for_model(tiny.args, 1, 64, torch.float32, "cpu")
        return step(torch.arange(1, n + 1)[None], torch.arange(n), cache)

    torch._dynamo.reset()
    compiled = Step(tiny, "full", compile_prefill=True)
    for i, n in enumerate([5, 9, DECODE_QUERIES, DECODE_QUERIES + 7, 40]):
        with torch._dynamo.config.patch(error_on_recompile=i not in (0, 3)):
            assert (prefill(compiled, n) - prefill(Step(tiny), n)).abs().max() <= 1e-4


# A fresh process: a random model of the tiny shapes (head dim 24, MLP width 112: kernels with partial vectors),
# two rows decoded by blocks and by the full step with its compiled prefill; prints how far each is from eager.
COMPILED_VS_EAGER = """
import torch
from kvcache import KVCache
from model import ModelArgs, Transformer
from step import Step

torch.manual_seed(0)
torch.set_grad_enabled(False)
model = Transformer(ModelArgs(vocab_size=160, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=24,
                              hidden_dim=112, max_seq_len=64))

def decode(step, n=8, rows=2):
    cache = KVCache.for_model(model.args, rows, 5 + n, torch.float32, "cpu")
    logits = [step(torch.arange(1, 6).repeat(rows, 1), torch.arange(5), cache)]
    for pos in range(5, 5 + n):
        logits.append(step(logits[-1].argmax(-1, keepdim=True), torch.tensor([pos]), cache))
    return torch.stack(logits)

ref = decode(Step(model))
print((decode(Step(model, "blocks")) - ref).abs().max().item())  # the default CPU mode; full is one more minute
"""


@pytest.mark.slow
def test_a_cache_written_for_avx512_serves_no_avx2_process(tmp_path, monkeypatch):
    """Two processes share Inductor's cache, one with AVX-512 kernels, then one under ATEN_CPU_CAPABILITY=avx2 (as
    the suite runs both): each compiles kernels of its own vector width (step.vector_width), so the second gets
    eager's logits too. It used to load the first one's kernels, written for 16-float vectors, and build them for
    8-float ones: NaN logits, and in longer runs a corrupted heap."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    if not {256, 512} <= {isa.bit_width() for isa in valid_vec_isa_list()}:
        pytest.skip("Inductor writes only one vector width for this CPU: no other can reuse its kernels")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    for capability in (None, "avx2"):
        if capability is None:
            monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
        else:
            monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
        result = run_py("-c", COMPILED_VS_EAGER)
        assert result.returncode == 0, (capability, result.stderr[-2000:])
        assert all(float(d) <= 1e-4 for d in result.stdout.split()), (capability, result.stdout)


def test_gemv_backend_only_for_single_row_cpu_steps(tiny):
    assert torch.backends.mkldnn.enabled
    with gemv_backend(torch.tensor([[5]])):
        assert not torch.backends.mkldnn.enabled  # one row: MKL's GEMV
    assert torch.backends.mkldnn.enabled  # restored
    with gemv_backend(torch.tensor([[5], [6]])):
        assert torch.backends.mkldnn.enabled  # two rows: oneDNN stays
    # Same logits whichever backend runs the bf16 matmuls (up to bf16 rounding of the accumulation order).
    bf16 = copy.deepcopy(tiny).to(torch.bfloat16)
    cache = KVCache.for_model(bf16.args, 1, 8, torch.bfloat16, "cpu")
    bf16(torch.tensor([[1, 2, 3]]), torch.arange(3), cache)
    token, pos = torch.tensor([[4]]), torch.tensor([3])
    reference = bf16(token, pos, cache)[:, -1]  # oneDNN, torch's default
    assert (eager(bf16, token, pos, cache) - reference).abs().max() <= 0.05 * reference.abs().max()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["int8", "int4:32"])
def test_compiled_quantized_decode_matches_eager(tiny, mode):
    """int8 and int4 weights under torch.compile on CPU (int8 used to die in Inductor's lowering of
    _weight_int8pack_mm): compiled greedy tokens and logits equal the eager ones."""
    import torch._dynamo

    from quantize import quantize_model

    model = quantize_model(copy.deepcopy(tiny), mode)
    torch._dynamo.reset()
    compiled = Step(model, "full")
    cache_a = KVCache.for_model(model.args, 1, 24, torch.float32, "cpu")
    cache_b = KVCache.for_model(model.args, 1, 24, torch.float32, "cpu")
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    a = eager(model, prompt, torch.arange(5), cache_a)
    b = compiled(prompt, torch.arange(5), cache_b)
    for pos in range(5, 20):
        token = a.argmax(-1, keepdim=True)
        assert torch.equal(token, b.argmax(-1, keepdim=True))
        a = eager(model, token, torch.tensor([pos]), cache_a)
        b = compiled(token, torch.tensor([pos]), cache_b)
        assert (a - b).abs().max() <= 1e-2  # both run the bf16 kernels; the code around them is fused
