"""How a model's forwards run: the one policy every loop calls (decode.generate and generate_batch, the speculative
loop and its draft, the engine, bench.py). `Step(model, mode)` is bound to its model and called as
`step(tokens, input_pos, cache, all_logits=False) -> logits`; `step.mode` is what runs ("none", "blocks" or
"full"), "auto" resolved, and "none" again once a compile that was allowed to fail has failed: every report of
what ran (generate.py's summary line, the server's log, bench.py) reads it.

Prefill is compute-bound and runs eager; a decode step reads every weight for one token, so on CPU its time goes
to per-op dispatch as much as to bandwidth, which compiling removes (dev/LOG.md). On CPU the model's attention and
linear layers take the CPU's own paths (device_paths, ops/cpu.py).

Shape legend: B rows, T tokens fed, V vocab.
"""
import functools
import sys
import types
from collections.abc import Callable
from contextlib import contextmanager

import torch

from kvcache import KVCache
from model import Attention, Block, Linear, Transformer
from ops import cpu
from ops.invariant import BatchInvariant
from ops.wide import MEMORY_SHARE
from quantize import Int8Linear, compiled_head

COMPILE_MODES = ("auto", "none", "blocks", "full")
# The decode steps after which compiling the blocks saves more than it costs on CPU: 2-6 s to compile with a warm
# Inductor cache (more with a cold one) against 3-8 ms saved a step (dev/LOG.md).
COMPILE_PAYS_AFTER = 1000
COMPILE_HELP = ("none: eager; blocks: one compiled graph for every layer's decode step (seconds to compile); "
        "full: the whole decode step as one graph (about a minute to compile on CPU, fastest); auto "
        f"(default): blocks on CPU for a dense model in one process when it pays (a server, at least "
        f"{COMPILE_PAYS_AFTER} new tokens, or a chat once it has decoded that many), else none")
DETERMINISTIC_HELP = ("batch-invariant forwards: a request's logits are bitwise the same whatever else is batched "
        "with it, however its prefill is chunked and whether its prefix was cached (eager; slower: README, Exactness)")


def device_paths(model: Transformer, mode: str = "none") -> Transformer:
    """Give the model's attention and linear layers the paths of the device it is on: the CPU's own (ops/cpu.py)
    on CPU, the model's plain SDPA and F.linear elsewhere. Step calls it with its mode (a `full` step's one-token
    attention is written as reductions over the cache: cpu.full_step_attention), and so does what runs a model
    outside a Step (gptq.sampled_sequences, scripts/streaming.py)."""
    on_cpu = model.embed_tokens.weight.device.type == "cpu"
    attention = cpu.full_step_attention if mode == "full" else cpu.attention
    for module in model.modules():
        if isinstance(module, Attention):
            module.attend = attention if on_cpu else Attention.attend  # model.sdpa
        elif isinstance(module, Linear):
            packed = getattr(module, "packed_weight", None)  # pack_linears'
            product = cpu.linear if packed is None else functools.partial(cpu.linear, packed=packed)
            module.product = product if on_cpu else Linear.product  # F.linear
    return model


def pack_linears(model: Transformer) -> None:
    """Give each float Linear of a CPU model its weight packed for oneDNN (cpu.pack), once: device_paths then installs
    it for the many-row products of a compiled step. A second copy of the weights (packs_rows says where it fits)."""
    for module in model.modules():
        if isinstance(module, Linear) and getattr(module, "packed_weight", None) is None:
            module.packed_weight = cpu.pack(module.weight)


def forward_logits(model: Transformer, tokens: torch.Tensor, input_pos: torch.Tensor, cache: KVCache,
                   all_logits: bool = False, block: Callable | None = None, steps: bool = False) -> torch.Tensor:
    """tokens (B, T) at input_pos (T,) or (B, T) -> the logits after the last token (B, V), or after every token
    (B, T, V). With T = 1 this is the decode step: fixed shapes, the function torch.compile compiles.
    block(layer, x, input_pos, cos, sin, mask, layer_cache, steps): what runs each layer in place of its own forward
    (the blocks mode's compiled Block.forward); None: the model's own forward. steps: decode steps, not a prefill."""
    if block is None:
        logits = model(tokens, input_pos, cache, all_logits=all_logits, steps=steps)
    else:
        x, cos, sin, mask = model.inputs(tokens, input_pos, cache)
        for layer, layer_cache in zip(model.layers, cache.layers):
            x = block(layer, x, input_pos, cos, sin, mask, layer_cache, steps)
        logits = model.head(x, all_logits)
    return logits if all_logits else logits[:, -1]


@contextmanager
def gemv_backend(tokens: torch.Tensor, steps: bool = True):
    """A one-row step multiplies one row by every weight matrix (a GEMV). On CPU, torch's own GEMV kernel streams
    bf16 weights about twice as fast as oneDNN there (when not compiled as cpu.linear's reduction), while oneDNN is
    the faster one for two rows or more, so it is off for one row.
    Not for a one-token prefill (steps False): it rounds as the same token in a longer prefill does."""
    if tokens.device.type != "cpu" or tokens.numel() != 1 or not steps:
        yield
        return
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = enabled


def packs_rows(model: Transformer, memory_bytes: int | None = None) -> bool:
    """Whether a `full` step's graph of many rows reads the model's float linear weights (float32, bf16) packed in
    oneDNN's blocked layout (pack_linears, cpu.packed_linear): on CPU, where that second copy of them takes at most a
    quarter of memory_bytes (default: this machine's; MEMORY_SHARE, the wide copy's rule). A GEMM of a few rows over a
    plain matrix first reorders it, every call: SmolLM2 in bf16 on an AVX-512 Zen 4, an 8-row step's linears 24.8 ms
    plain against 14.0 packed (dev/LOG.md). One row keeps its reduction over the plain weight (cpu.linear)."""
    if model.embed_tokens.weight.device.type != "cpu":
        return False
    size = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, Linear))
    return 0 < size * MEMORY_SHARE <= (memory_bytes or cpu.memory_bytes())


def eager(model: Transformer, tokens: torch.Tensor, input_pos: torch.Tensor, cache: KVCache,
          all_logits: bool = False, block: Callable | None = None, steps: bool = False) -> torch.Tensor:
    """forward_logits with the matmul backend that suits the row count (gemv_backend)."""
    with gemv_backend(tokens, steps):
        return forward_logits(model, tokens, input_pos, cache, all_logits, block, steps)


def own_code(fn: Callable) -> Callable:
    """fn with a code object of its own. Dynamo keeps compiled graphs on the code object, so two copies never
    share a graph (see Step.compile_full)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def skip_module_guards(guards) -> list[bool]:
    """Dynamo's guard filter for the full step: keep every guard except those on the model's modules. Dynamo checks
    its guards before every call, and nearly all of them check that each module still has its attributes, types
    and no hooks: a large part of a small model's CPU step (dev/LOG.md). A model does not change once built;
    each Step compiles code of its own (own_code); the KV cache, the inputs and global state stay guarded."""
    return [not g.orig_guard.source.is_unspecialized_nn_module() for g in guards]


def auto_mode(model: Transformer, decode_steps: int | None = None) -> str:
    """What "auto" runs: "blocks" on CPU, where the eager step is dominated by per-op dispatch, for a dense model in
    one process, when it pays: for decode_steps at least COMPILE_PAYS_AFTER, or unbounded (None: a server, or a
    chat, where Step.account defers it); "none" for fewer, on CUDA, for Mixtral (no compile) and under tensor
    parallelism (tp.py)."""
    dense = model.args.n_experts is None and all(block.all_reduce is None for block in model.layers)
    pays = decode_steps is None or decode_steps >= COMPILE_PAYS_AFTER
    return "blocks" if model.embed_tokens.weight.device.type == "cpu" and dense and pays else "none"


def vector_width(model: Transformer) -> dict:
    """Inductor's option naming the vector width its CPU kernels are written for: the width it picks anyway (512
    bits where torch dispatches AVX-512, 256 under ATEN_CPU_CAPABILITY=avx2), so nothing changes but its cache
    key. Inductor's on-disk cache leaves the capability out of the key (torch 2.13), so without the option a run
    under avx2 reuses kernels written for 16-float vectors and compiles them for 8-float ones; their loads and
    stores of 16 then copy 16 floats through an 8-float stack buffer: NaN logits and a corrupted heap."""
    if model.embed_tokens.weight.device.type != "cpu":
        return {}
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return {"cpp.simdlen": pick_vec_isa().bit_width()}


def compile_failure(e: Exception) -> str:
    """A torch.compile error in one line."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"torch.compile failed ({type(e).__name__}: {first[:200]})"


def check_deterministic(mode: str, compile_prefill: bool, model: Transformer | None = None) -> None:
    """The deterministic mode runs eagerly, and not for Mixtral: a one-row MoE step adds its k experts' outputs in
    the router's order, a batch in expert order (model.MoE), and a sum's rounding depends on its order. Without a
    model (the flags, before it loads), the compile mode only."""
    if mode not in ("auto", "none") or compile_prefill:
        raise ValueError(f"--deterministic runs eagerly; it cannot take --compile {mode}"
                         f"{' --compile-prefill' if compile_prefill else ''}")
    if model is not None and model.args.n_experts is not None:
        raise ValueError("--deterministic does not support mixture-of-experts models (Mixtral)")


class Step:
    """One model's forwards. "none": eager. "blocks": each decode step (and each verify: every position's logits,
    at most cpu.DECODE_QUERIES tokens) runs its layers through one compiled Block.forward; the layers share their
    code and shapes, so one graph serves all of them (and later processes, from Inductor's cache): seconds to compile
    where the whole step takes about a minute. A verify's own graph (its token count symbolic after the second
    count) computes each row as the decode step's graph does, so greedy speculative == plain greedy (README,
    Exactness). "full": the whole one-token step as one graph (CUDA graphs on GPU), and with compile_prefill the
    multi-token forwards too, their length symbolic. "auto": auto_mode's choice, where a failed compile (no C++
    compiler, say) prints one warning and goes on eagerly; an explicit mode turns it into a one-line ValueError.
    decode_steps: the decode steps the caller will run (None: unbounded), for auto's choice; pay_as_you_go (a chat):
    unbounded, but auto starts eager and compiles once the steps run pay for it (account)."""

    def __init__(self, model: Transformer, mode: str = "none", compile_prefill: bool = False,
                 deterministic: bool = False, decode_steps: int | None = None, pay_as_you_go: bool = False):
        if mode not in COMPILE_MODES:
            raise ValueError(f"unknown compile mode {mode!r}; choose from {', '.join(COMPILE_MODES)}")
        self.model = model
        self.deterministic = deterministic
        if deterministic:
            check_deterministic(mode, compile_prefill, model)
            mode = "none"
        self.fallback = mode == "auto" and not compile_prefill
        self.failed = False  # the compile failed and the step went on eagerly (mode "none")
        self.mode = "full" if compile_prefill else auto_mode(model, decode_steps) if mode == "auto" else mode
        self.decoded, self.deferred = 0, None  # pay_as_you_go: the decode steps run, and the mode to compile then
        if mode == "auto" and pay_as_you_go and self.mode == "blocks":
            self.mode, self.deferred = "none", "blocks"
        if self.mode != "none" and model.args.n_experts is not None:
            # Which experts run depends on the router's output, and each expert is its own module (so quantization
            # and tensor parallelism treat it as a dense MLP): a graph cannot pick a module by a computed index.
            raise ValueError("--compile does not support mixture-of-experts models (Mixtral); run with --compile none")
        device_paths(model, self.mode)
        self.set_up(compile_prefill)

    def set_up(self, compile_prefill: bool = False) -> None:
        """The compiled callables self.mode runs (compiled on their first call)."""
        on_cpu = self.model.embed_tokens.weight.device.type == "cpu"
        self.packed = self.mode == "full" and packs_rows(self.model)  # its many-row graph reads packed weights
        self.packed_now = False  # made at its first call (pack)
        compiled_head(self.model, self.mode != "none")  # a Q8_0 head's words where the load made them (AVX2)
        # On CPU, the code that calls a graph's kernels in C++ instead of Python: less time per step for a longer
        # first compile (dev/LOG.md).
        options = {}
        if on_cpu and self.mode != "none":
            options = {"cpp_wrapper": True, **vector_width(self.model)}  # 3 s
            import torch._inductor.inductor_prims  # noqa: F401 (the prim cpu.materialized calls; Inductor's own)
        if self.mode == "blocks":
            # Dynamo keeps its graphs on the code object, guarded on the module types (those guards stay): every
            # layer of this model shares one graph. A code object of its own per Step keeps another model's graphs,
            # and the shapes Dynamo has seen change there (which it then compiles as symbolic), out of this one's.
            self.block = torch.compile(own_code(Block.forward), fullgraph=True, options=options)
        if self.mode == "full":
            self.one, self.many = self.compile_full(options, compile_prefill)

    @property
    def cuda_graphs(self) -> bool:
        """Whether the one-token step replays CUDA graphs ("full" on a GPU): its output buffer is reused by the next
        replay, and every new input shape records another graph."""
        return self.mode == "full" and self.model.embed_tokens.weight.device.type == "cuda"

    def account(self, decode_steps: int) -> bool:
        """An open-ended caller's (a chat's) count after each answer: with pay_as_you_go, auto runs eagerly until the
        decode steps run reach COMPILE_PAYS_AFTER, when eager's overhead has cost about what the compile will, and
        compiles then (a ski rental: at most twice the better choice in hindsight, and no compile before a first
        answer). Between answers, so that no answer switches mid-way. True when the step now compiles."""
        self.decoded += decode_steps
        if self.deferred is None or self.decoded < COMPILE_PAYS_AFTER:
            return False
        self.mode, self.deferred = self.deferred, None
        self.set_up()
        return True

    def compile_full(self, options: dict, prefill: bool) -> tuple[Callable, Callable]:
        """The one-token forward as one graph, and the multi-token one (compiled with prefill, else eager). On GPU,
        CUDA graphs remove the per-kernel launch cost, and for int8 weights coordinate-descent tuning makes
        Inductor write each GEMV as a fused reduction that casts the int8 weight in registers."""
        # guard_filter_fn came with torch 2.8; before it, every guard is checked
        guards = {"guard_filter_fn": skip_module_guards} if hasattr(torch.compiler, "skip_all_guards_unsafe") else {}
        options = {**options, **guards}
        if self.cuda_graphs:
            int8 = any(isinstance(x, Int8Linear) for x in self.model.modules())
            options.update({"triton.cudagraphs": True, "coordinate_descent_tuning": int8})
        one = torch.compile(own_code(forward_logits), fullgraph=True, options=options)
        many = torch.compile(own_code(forward_logits), fullgraph=True, dynamic=True,
                             options={**guards, **vector_width(self.model)}) if prefill else forward_logits
        return one, many

    def pack(self, tokens: torch.Tensor) -> None:
        """Before the first `full` step of many rows (packs_rows): pack the weights its graph reads (pack_linears), so
        that a one-row caller (generate.py) never makes the copy."""
        if self.packed and tokens.shape[0] > 1 and not self.packed_now:
            pack_linears(self.model)
            device_paths(self.model, self.mode)
            self.packed_now = True

    def __call__(self, tokens: torch.Tensor, input_pos: torch.Tensor, cache: KVCache, all_logits: bool = False,
                 prefill: bool = False) -> torch.Tensor:
        """tokens (B, T) at input_pos (T,) or (B, T) -> logits (B, V), or (B, T, V) with all_logits. prefill: the
        tokens are a prompt's (or a chunk of it), which the CPU attends otherwise than decode steps (ops/cpu.py),
        so that a prompt computes the same however it is split; else decode steps (one, or a verify's)."""
        model, T, steps = self.model, tokens.shape[1], not prefill
        if self.deterministic:  # one backend and one shape per op (invariant.py), whatever the rows
            with BatchInvariant():
                return forward_logits(model, tokens, input_pos, cache, all_logits, None, steps)
        try:
            if self.mode == "blocks" and steps and (T == 1 or all_logits and T <= cpu.DECODE_QUERIES):
                return eager(model, tokens, input_pos, cache, all_logits, self.block, steps)
            if self.mode == "full":
                if T > 1 or prefill:
                    return self.many(model, tokens, input_pos, cache, all_logits, None, steps)
                self.pack(tokens)
                with gemv_backend(tokens):
                    return self.one(model, tokens, input_pos, cache, all_logits, None, steps)
            if self.mode != "none":  # a prefill: eager, but a compiled head compiles its kernel on the first
                return eager(model, tokens, input_pos, cache, all_logits, None, steps)
        except torch._dynamo.exc.TorchDynamoException as e:
            if not self.fallback:
                raise ValueError(f"{compile_failure(e)}; run with --compile none") from None
            print(f"warning: {compile_failure(e)}; decoding without it", file=sys.stderr)
            self.mode, self.failed = "none", True
            compiled_head(model, False)
        return eager(model, tokens, input_pos, cache, all_logits, None, steps)
