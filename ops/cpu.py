"""The CPU's own paths for a model's attention and linear layers, which step.device_paths installs on a CPU model
(model.Attention.attend, model.Linear.product): a decode step's attention written out, a one-row product that a
compiled step computes as a vectorized reduction, and a compiled product of several rows over a weight packed once
for oneDNN (pack, packed_linear). The model's own paths (SDPA, F.linear) are the reference they are tested against
(tests/test_model.py, tests/test_step.py).

Shape legend: B batch, T queries, S key positions, H query heads, K kv heads, G = H / K, D head dim, N output rows.
"""
import math
import os

import torch
import torch.nn.functional as F

DECODE_QUERIES = 16  # decode steps of at most this many queries (a speculative verify) attend as one decode step does


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v for a few queries per row, written out: q (B, H, T, D), k and v (B, K, S, D),
    mask (T, S) or (B, 1, T, S). Each query is its own item of the two batched matmuls, so a T-query forward (a
    speculative verify) computes every query exactly as a one-query decode step does: one (T*G, S) product per kv
    head would not, since a matmul's blocking, and so its rounding, depends on its row count (README, Exactness).
    torch's CPU SDPA kernel tiles over queries, which is slow for one query per row. The products run in float32:
    torch's CPU batched matmul is slower in bf16 at these sizes by more than the cast of the cache costs."""
    B, H, T, D = q.shape
    K, S = k.shape[1], k.shape[2]
    G = H // K  # query heads per kv head
    qg = q.float().view(B, K, G, T, D).transpose(2, 3).reshape(B * K * T, G, D)  # (B*K*T, G, D)
    # each query's own view of its kv head; a copy only when T > 1
    kt = k.float()[:, :, None].expand(B, K, T, S, D).reshape(B * K * T, S, D)  # (B*K*T, S, D)
    vt = v.float()[:, :, None].expand(B, K, T, S, D).reshape(B * K * T, S, D)  # (B*K*T, S, D)
    scores = torch.bmm(qg, kt.transpose(1, 2)) / math.sqrt(D)  # (B*K*T, G, S)
    scores = torch.where(mask.reshape(-1, 1, T, 1, S), scores.view(B, K, T, G, S), float("-inf"))  # (B, K, T, G, S)
    p = torch.softmax(scores, dim=-1).view(B * K * T, G, S)  # (B*K*T, G, S)
    y = torch.bmm(p, vt).view(B, K, T, G, D)  # (B, K, T, G, D)
    return y.permute(0, 1, 3, 2, 4).reshape(B, H, T, D).to(q.dtype)  # (B, H, T, D)


def written_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """decode_attention for one query a row (T = 1) written as two reductions, for a compiled step: Inductor then
    reads each key and value where the cache holds them (a paged cache's gather fused into the loads), where the
    batched matmuls need them copied out in float32 first. SmolLM2's shapes, 32 rows of 256 positions, compiled, 2
    threads (AVX-512 Zen 4): 577 against 962 us a layer (dev/LOG.md)."""
    B, H, _, D = q.shape
    K, S = k.shape[1], k.shape[2]
    qg = q.float().view(B, K, H // K, 1, D)  # (B, K, G, 1, D)
    scores = (qg * k.float()[:, :, None]).sum(-1) / math.sqrt(D)  # (B, K, G, S)
    scores = torch.where(mask.reshape(-1, 1, 1, S), scores, float("-inf"))
    p = torch.softmax(scores, dim=-1)  # (B, K, G, S)
    y = (p[..., None] * v.float()[:, :, None]).sum(-2)  # (B, K, G, D)
    return y.reshape(B, H, 1, D).to(q.dtype)  # (B, H, 1, D)


def full_step_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                        steps: bool) -> torch.Tensor:
    """model.Attention's attend under a `full` compiled step (step.Step installs it): its compiled one-token decode
    through written_decode_attention, everything else (eager, a verify, a prefill) as attention. Not `blocks`, whose
    verify graph computes each query as its decode graph does (README, Exactness)."""
    if steps and q.shape[2] == 1 and torch.compiler.is_compiling():
        return written_decode_attention(q, k, v, mask)
    return attention(q, k, v, mask, steps)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, steps: bool) -> torch.Tensor:
    """model.Attention's attend on CPU: decode steps and verifies (`steps`, at most DECODE_QUERIES queries) through
    decode_attention; a prefill through SDPA however few its tokens (a chunk, or a prompt's last tokens after a
    prefix-cache hit), as the whole prompt's prefill does. SDPA's kernel mostly rounds a query's row the same for
    any number of queries (SmolLM2's shapes: a cache hit answers as a miss, tests/test_engine.py), decode_attention
    never as SDPA; --deterministic makes every split alike."""
    if steps and q.shape[2] <= DECODE_QUERIES:
        return decode_attention(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # (B, H, T, D)


# The weight dtypes whose one-row product a compiled step writes as a reduction (linear).
REDUCED_WEIGHTS = (torch.float32, torch.bfloat16)
# The weight dtypes a packed copy is made of for a compiled step's many-row products (pack).
PACKED_WEIGHTS = (torch.float32, torch.bfloat16)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: "PackedWeight | None" = None) -> torch.Tensor:
    """model.Linear's product on CPU. Compiled, a one-row product over float32 or bf16 weights is written as a
    multiply-and-sum over the row, computed once (materialized): Inductor makes that a vectorized reduction that
    streams the weight faster than torch's GEMV kernels (float32: about twice MKL's; bf16: SmolLM2's one-row step
    12.7 -> 11.5 ms on an AVX-512 Zen 4, dev/LOG.md). Compiled, many rows go through `packed`, the weight in oneDNN's
    blocked layout (pack), where there is one. Eager it is F.linear."""
    if x.shape[:-1].numel() == 1 and weight.dtype in REDUCED_WEIGHTS and torch.compiler.is_compiling():
        row = materialized(x.reshape(1, -1).float())  # (1, K)
        y = (weight.float() * row).sum(-1)  # (N,)
        y = y if bias is None else y + bias
        return y.view(*x.shape[:-1], weight.shape[0]).to(x.dtype)  # (..., N)
    if packed is not None and torch.compiler.is_compiling():
        y = torch.ops.tinyllm.packed_linear(x.reshape(-1, x.shape[-1]), packed.tensor, bias)  # (M, N)
        return y.view(*x.shape[:-1], weight.shape[0])  # (..., N)
    return F.linear(x, weight, bias)


class PackedWeight:
    """A linear's weight (N, K) packed in oneDNN's blocked layout (pack): an opaque tensor, which copy.deepcopy cannot
    copy. A deep copy of its module gets None in its place (plain products, packed again if a step asks), never the
    original's packing: the copy's own weight may change."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def __deepcopy__(self, memo: dict) -> None:
        return None


def pack(weight: torch.Tensor) -> PackedWeight | None:
    """weight (N, K) packed for packed_linear; None where the dtype has no packed GEMM here (bf16 where oneDNN lacks
    the AVX-512 it needs for it)."""
    bf16 = weight.dtype == torch.bfloat16
    if weight.dtype not in PACKED_WEIGHTS or bf16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight, None))


def packed_linear(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows (M, K) -> (M, N) through oneDNN's GEMM over a packed weight (pack). A GEMM of a few rows over a plain
    matrix first reorders it, every call: SmolLM2 in bf16, an 8-row step's linears 24.8 ms plain against 14.0 packed
    (AVX-512 Zen 4, dev/LOG.md). An op of its own in a compiled graph (tinyllm::packed_linear), the packed weight one
    of its inputs: Inductor's own oneDNN linear takes a packed weight only as a frozen constant, and a graph with such
    constants never enters its on-disk cache (it cannot pickle them), so a server compiled it again at every start."""
    return torch.ops.mkldnn._linear_pointwise(rows.contiguous(), packed, bias, "none", [], "")


# tinyllm::packed_linear, registered plainly (torch.library.custom_op's wrapper costs ~17 us a call where this costs
# ~3, and a step makes one call per linear: 121 for SmolLM2). For every dispatch key, the packed weight being a
# oneDNN (MkldnnCPU) tensor; its fake computes the output's shape for Dynamo.
LIBRARY = torch.library.Library("tinyllm", "FRAGMENT")
LIBRARY.define("packed_linear(Tensor rows, Tensor packed, Tensor? bias) -> Tensor")
LIBRARY.impl("packed_linear", packed_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("tinyllm::packed_linear", lib=LIBRARY)
def _(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], packed.shape[0])  # (M, N)


def materialized(t: torch.Tensor) -> torch.Tensor:
    """t, computed into a buffer of its own in a compiled graph. Inductor inlines a cheap producer (the norm before
    q|k|v and gate|up, SwiGLU's silu(gate) * up before down) into the reduction that reads it, so a one-row
    product recomputed it for every output row: the bf16 step took 15 ms where aten's GEMV took 12.7 (dev/LOG.md).
    Inductor's own stride prim forces a buffer (it is registered by importing torch._inductor.inductor_prims, which
    step.Step does before it compiles); eager, it returns t."""
    return torch.ops.prims.inductor_force_stride_order(t, t.stride())


def native_bf16(device: torch.device, capability: str | None = None) -> str | None:
    """Why `device` computes bfloat16 natively (CUDA; a CPU with AVX512-BF16 or AMX), or None. On CPU the
    instructions must be there (CPUID) and torch must dispatch its AVX-512 kernels (capability, default
    torch.backends.cpu.get_cpu_capability(): ATEN_CPU_CAPABILITY=avx2 runs the AVX2 kernels, which emulate bf16)."""
    if device.type == "cuda":
        return "CUDA"
    if not avx512_kernels(capability):
        return None
    features = [name for name, has in (("AMX", torch.cpu._is_amx_tile_supported()),
                                       ("AVX512-BF16", torch.cpu._is_avx512_bf16_supported())) if has]
    return ", ".join(features) or None


def memory_bytes() -> int:
    """This machine's memory, in bytes (what a second copy of weights is measured against: ops.wide, step)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def avx512_kernels(capability: str | None = None) -> bool:
    """Whether torch dispatches its AVX-512 CPU kernels (capability, default torch.backends.cpu.get_cpu_capability():
    ATEN_CPU_CAPABILITY=avx2 makes an AVX-512 CPU run the AVX2 ones)."""
    return (capability or torch.backends.cpu.get_cpu_capability()).startswith("AVX512")
