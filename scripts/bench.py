"""Benchmarks against the roofline, and the capacity-planning arithmetic.

Batch-1 decode reads every weight (and the KV cache) once per token, so its ceiling is
memory bandwidth / bytes per step; prefill pushes many tokens through each weight read and is
compute-bound. bench.py measures this machine's bandwidth itself and reports how close decode gets.

  python bench.py --model M [--dtype bfloat16] [--compile [none|blocks|full]] [--batch-size 1] [--prompt-len 32]
      [--new-tokens 128]
  python bench.py --shape llama-2-7b --device cuda --compile      # random weights, no download
  python bench.py --plan --shape llama-2-7b [--memory-gib 80] [--context 4096]
  python bench.py --json-schema schema.json --batch-size 1 16    # + what structured output's masking costs a step
  python bench.py --engine --batch-size 1 16 64 256 --compile    # the serving engine's decode steps per batch
  python bench.py --engine --batch-size 1 8 32 --vs-generate [--wide-rows 16]  # + beside generate.py's step
  python bench.py --engine --long-prompt 2000 --batch-size 4 --prefill-chunk 8  # streams' ITL, long prompt
  python bench.py --table out/*.json                             # the --json files of several runs as one table

A mixture of experts (Mixtral) holds all E experts in memory but a batch-1 decode step reads only the k its token
is routed to: its decode ceiling comes from those active bytes, its memory plan from all of them.
"""
import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

from cli import (DTYPES, THREADS, Range, check_output_file, check_ranges, default_model, pick_device, pick_dtype,
                 run_cli, set_threads)
from decode import generate, generate_batch
from kvcache import cache_dims
from load import load_model
from model import ModelArgs, Transformer
from quantize import describe, quantize_model, weight_bytes
from params import SamplingParams
from step import COMPILE_MODES, DETERMINISTIC_HELP, Step

# Published shapes, for random-weight runs and capacity plans.
SHAPES = {
    "smollm2-135m": ModelArgs(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, hidden_dim=1536,
                              rope_theta=100000.0, max_seq_len=8192, tie_embeddings=True),
    "llama-3.2-1b": ModelArgs(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, hidden_dim=8192,
                              rope_theta=500000.0, max_seq_len=131072, tie_embeddings=True),
    "llama-2-7b": ModelArgs(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, hidden_dim=11008, max_seq_len=4096),
    "llama-3-8b": ModelArgs(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden_dim=14336,
                            rope_theta=500000.0, max_seq_len=8192),
    "mistral-7b": ModelArgs(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden_dim=14336,
                            max_seq_len=32768, rope_theta=1000000.0),
    "mixtral-8x7b": ModelArgs(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden_dim=14336,
                              max_seq_len=32768, rope_theta=1000000.0, n_experts=8, n_experts_per_token=2),
    "deepseek-v2-lite": ModelArgs(
        vocab_size=102400, dim=2048, n_layers=27, n_heads=16, hidden_dim=10944, head_dim=192, rope_dim=64,
        kv_lora_rank=512, v_head_dim=128, rope_interleaved=True, n_experts=64, n_experts_per_token=6,
        moe_hidden_dim=1408, n_shared_experts=2, dense_layers=(0,), moe_renormalize=False, max_seq_len=163840,
        rope_scaling={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}),
    "deepseek-v3": ModelArgs(
        vocab_size=129280, dim=7168, n_layers=61, n_heads=128, hidden_dim=18432, head_dim=192, rope_dim=64,
        kv_lora_rank=512, q_lora_rank=1536, v_head_dim=128, rope_interleaved=True, n_experts=256,
        n_experts_per_token=8, moe_hidden_dim=2048, n_shared_experts=1, dense_layers=(0, 1, 2), n_group=8,
        topk_group=4, router_scoring="sigmoid", routed_scaling=2.5, max_seq_len=163840,
        rope_scaling={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    "gpt-oss-20b": ModelArgs(
        vocab_size=201088, dim=2880, n_layers=24, n_heads=64, n_kv_heads=8, head_dim=64, hidden_dim=2880,
        n_experts=32, n_experts_per_token=4, sliding_window=128, sliding_layers=tuple(range(0, 24, 2)),
        attn_sinks=True, qkv_bias=True, o_bias=True, moe_bias=True, swiglu_limit=7.0, rope_theta=150000.0,
        max_seq_len=131072, rope_scaling={"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                                          "beta_fast": 32, "beta_slow": 1, "truncate": False}),
}
BYTES_PER_WEIGHT = {"fp32": 4, "bf16/fp16": 2, "int8": 1, "int4": 0.5}
GiB, KiB = 1024**3, 1024


def attention_params(args: ModelArgs) -> int:
    """One layer's attention weights: q, o and k, v; MLA's q (or its low-rank pair and norm), the latent's down- and
    up-projections and norm, o."""
    C, H, D = args.dim, args.n_heads, args.head_dim
    if args.kv_lora_rank is None:  # (gpt-oss: q/k/v and o biases, a sink per head)
        biases = args.qkv_bias * D * (H + 2 * args.n_kv_heads) + args.o_bias * C + args.attn_sinks * H
        return C * D * (2 * H + 2 * args.n_kv_heads) + biases
    R, P, Dv, Q = args.kv_lora_rank, args.rope_dim, args.v_head_dim, args.q_lora_rank
    q = C * H * D if Q is None else C * Q + Q + Q * H * D
    return q + C * (R + P) + R + R * H * (D - P + Dv) + H * Dv * C


def param_count(args: ModelArgs, active: bool = False) -> int:
    """All parameters, or with active those a batch-1 decode step reads (a mixture of experts: k of its E experts
    per layer, its shared experts, and the whole router)."""
    dense = 3 * args.dim * args.hidden_dim
    mlp = [dense] * args.n_layers
    if args.n_experts is not None:
        F = args.moe_hidden_dim or args.hidden_dim
        expert = 3 * args.dim * F + args.moe_bias * (2 * F + args.dim)  # gpt-oss: its biases
        # V3: its correction bias; gpt-oss: the router's bias
        router = args.n_experts * (args.dim + (args.router_scoring == "sigmoid") + args.moe_bias)
        moe = (args.n_experts_per_token if active else args.n_experts) * expert + router + \
            args.n_shared_experts * expert
        mlp = [dense if i in args.dense_layers else moe for i in range(args.n_layers)]
    norms = (2 * args.n_layers + 1) * args.dim
    embeddings = args.vocab_size * args.dim * (1 if args.tie_embeddings else 2)
    return args.n_layers * attention_params(args) + sum(mlp) + norms + embeddings


def kv_table(names: list[str], context: int = 32768, bytes_per_value: float = 2) -> str:
    """A markdown table of what each shape's KV cache holds per token and per `context`-token sequence (the cache
    here keeps every layer's whole sequence), and per sequence where windowed layers keep only their window."""
    kinds = {"llama-2-7b": "MHA", "llama-3-8b": "GQA", "mistral-7b": "GQA", "deepseek-v2-lite": "MLA",
             "deepseek-v3": "MLA", "gpt-oss-20b": "GQA, half sliding (128)"}
    k = f"{context // 1024}k"
    lines = [f"| shape | attention | KV KiB/token | GiB per {k}-token sequence | GiB per {k} with windows kept to "
             "their length |", "|---|---|---:|---:|---:|"]
    for name in names:
        args = SHAPES[name]
        token = kv_bytes_per_token(args, bytes_per_value)
        windowed = token / args.n_layers * sum(min(context, window_of(args, i)) for i in range(args.n_layers))
        lines.append(f"| {name} | {kinds.get(name, 'GQA')} | {token / KiB:g} | {token * context / GiB:.3g} | "
                     f"{windowed / GiB:.3g} |")
    return "\n".join(lines)


def window_of(args: ModelArgs, layer: int) -> int | float:
    """How many past tokens layer `layer` attends to: its sliding window, or all (inf)."""
    windowed = args.sliding_window is not None and (args.sliding_layers is None or layer in args.sliding_layers)
    return args.sliding_window if windowed else float("inf")


def kv_bytes_per_token(args: ModelArgs, bytes_per_value: float) -> float:
    """Layers x kv heads x (key + value dims) x bytes, for one sequence (MLA: its latent, kvcache.cache_dims)."""
    heads, key_dim, value_dim = cache_dims(args)
    return args.n_layers * heads * (key_dim + value_dim) * bytes_per_value


def plan(args: ModelArgs, name: str, memory_gib: float, context: int, bandwidth_gbs: float, peak_tflops: float,
         kv_bytes: float) -> str:
    """The seeds' arithmetic: what fits in memory_gib, and where decode stops being bandwidth-bound."""
    n, active = param_count(args), param_count(args, active=True)
    kv_token = kv_bytes_per_token(args, kv_bytes)
    lines = [f"capacity plan: {name}, {n / 1e9:.2f} B parameters, memory {memory_gib:g} GiB, context {context}, "
             f"bandwidth {bandwidth_gbs:g} GB/s, peak {peak_tflops:g} TFLOP/s, KV cache {kv_bytes:g} bytes/value"]
    if args.n_experts is not None:
        lines.append(f"mixture of experts: a batch-1 decode step reads {args.n_experts_per_token} of "
                     f"{args.n_experts} experts per layer, {active / 1e9:.2f} B active parameters "
                     f"({100 * active / n:.1f}%); the decode ceiling is from the active bytes")
    lines += [f"KV cache: {kv_token / KiB:g} KiB/token, {kv_token * context / GiB:.3g} GiB per sequence at "
              f"{context} tokens",
              f"{'weights':>10} {'GiB':>8} {'max seqs':>9} {'decode ceiling tok/s (B=1)':>27} "
              f"{'compute-bound at B':>19}" + (f" {'active GiB':>11}" if active != n else "")]
    for precision, bpw in BYTES_PER_WEIGHT.items():
        weight_bytes = n * bpw
        free = memory_gib * GiB - weight_bytes
        max_seqs = max(0, int(free // (kv_token * context)))
        ceiling = bandwidth_gbs * 1e9 / (active * bpw)  # every active weight read once per step
        # Each step does 2 FLOPs per active weight per sequence; it turns compute-bound when that takes longer
        # than reading the weights: B > peak FLOP/s x bytes per weight / (2 x bandwidth), times total / active
        # for a mixture of experts, whose batches that large route tokens to every expert (all weights read).
        crossover = peak_tflops * 1e12 * bpw / (2 * bandwidth_gbs * 1e9) * n / active
        lines.append(f"{precision:>10} {weight_bytes / GiB:8.2f} {max_seqs:9d} {ceiling:27.1f} {crossover:19.0f}"
                     + (f" {active * bpw / GiB:11.2f}" if active != n else ""))
    return "\n".join(lines)


def measure_bandwidth(device: torch.device, nbytes: int = GiB) -> float:
    """GB/s of a large-tensor read (sum) on device, best of several."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    times = []
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        x.sum()
        sync(device)
        times.append(time.perf_counter() - t0)
    return nbytes / min(times) / 1e9


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype) -> float:
    """TFLOP/s of a large square matmul in dtype on device, best of several: prefill's ceiling."""
    n = 8192 if device.type == "cuda" else 1024
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up
    times = []
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / min(times) / 1e12


def prefill_flops(args: ModelArgs, tokens: int) -> float:
    """Matmul FLOPs of a prefill of `tokens` tokens: 2 per weight per token (every linear layer and the head;
    the embedding is a lookup) plus causal attention's q k^T and p v (2 x 2 x H x D per query-key pair)."""
    embedding_lookup = 0 if args.tie_embeddings else args.vocab_size * args.dim
    norms = (2 * args.n_layers + 1) * args.dim
    linear = param_count(args, active=True) - embedding_lookup - norms  # a token goes through k experts
    pairs = tokens * (tokens + 1) / 2  # causal: query i sees keys 0..i
    return 2 * linear * tokens + 4 * args.n_layers * args.n_heads * args.head_dim * pairs


def step_weight_bytes(model, batch_size: int) -> float:
    """Weight bytes a decode step of batch_size one-token rows reads: all of a dense model's but the embedding (one
    row a token, unless it is the head too); of a mixture of
    experts, those of the experts its rows are routed to: k per layer for one row, and for more the expected
    number of distinct experts under uniform routing, E (1 - (1 - k/E)^B) (an estimate: real routers are not)."""
    args = model.args
    embedding = model.embed_tokens.weight
    # A step reads one row of the embedding per token; all of it only when it is also the head (tied, float).
    unread = 0 if getattr(model.lm_head, "weight", None) is embedding else embedding.nbytes
    if args.n_experts is None:
        return weight_bytes(model) - unread
    E, k = args.n_experts, args.n_experts_per_token
    # one expert of every MoE layer (DeepSeek's first layers are dense)
    one_expert = sum(weight_bytes(layer.mlp.experts[0]) for layer in model.layers if hasattr(layer.mlp, "experts"))
    return weight_bytes(model) - unread - (E - E * (1 - (1 - k / E) ** batch_size)) * one_expert


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_once(model, step: Step, batch_size: int, prompt_len: int, new_tokens: int, device) -> dict:
    """One greedy generation from random prompts through the loop users run (decode.generate, or generate_batch for
    several rows) with `step`: the time to the first token (prefill and its sample) and per later token."""
    args = model.args
    prompts = torch.randint(0, args.vocab_size, (batch_size, prompt_len)).tolist()
    greedy = SamplingParams(temperature=0)  # no stop ids: every run generates new_tokens
    tokens = generate(model, prompts[0], max_new_tokens=new_tokens, params=greedy, step=step) if batch_size == 1 \
        else generate_batch(model, prompts, max_new_tokens=new_tokens, params=greedy, step=step)
    sync(device)
    t0 = time.perf_counter()
    next(tokens)
    sync(device)
    ttft = time.perf_counter() - t0
    t1 = time.perf_counter()
    n = sum(1 for _ in tokens)  # each one is one decode step (and its sample)
    sync(device)
    assert n == new_tokens - 1, f"{n} decode steps vs {new_tokens - 1}"
    # the loop's static cache: k and v of every layer for prompt + new tokens, all read by each step
    kv_per_token = kv_bytes_per_token(args, model.embed_tokens.weight.element_size())
    return {"ttft": ttft, "tpot": (time.perf_counter() - t1) / n, "kv_per_token": kv_per_token,
            "cache_bytes": kv_per_token * batch_size * (prompt_len + new_tokens)}


def bench(model, device, batch_size: int, prompt_len: int, new_tokens: int, runs: int, step: Step,
          bandwidth: float, peak_tflops: float) -> dict:
    """Median timings of `runs` generations with `step`, after one that warms it up (and compiles it)."""
    t0 = time.perf_counter()
    run_once(model, step, batch_size, prompt_len, new_tokens if step.mode != "none" else min(new_tokens, 8), device)
    compile_s = time.perf_counter() - t0 if step.mode != "none" else 0.0
    results = [run_once(model, step, batch_size, prompt_len, new_tokens, device) for _ in range(runs)]
    ttft = statistics.median(r["ttft"] for r in results)
    tpot = statistics.median(r["tpot"] for r in results)
    wbytes = weight_bytes(model)
    step_bytes = step_weight_bytes(model, batch_size) + results[0]["cache_bytes"]  # the static cache: read whole
    prefill_tflops = batch_size * prefill_flops(model.args, prompt_len) / ttft / 1e12
    return {
        "batch_size": batch_size, "prompt_len": prompt_len, "new_tokens": new_tokens, "runs": runs,
        "compile_s": compile_s, "ttft_ms": ttft * 1e3, "prefill_tok_s": batch_size * prompt_len / ttft,
        "prefill_tflop_s": prefill_tflops, "prefill_peak_pct": 100 * prefill_tflops / peak_tflops,
        "tpot_ms": tpot * 1e3, "decode_tok_s": batch_size / tpot, "weight_bytes": wbytes,
        "kv_bytes_per_token": results[0]["kv_per_token"], "kv_bytes_total": results[0]["cache_bytes"],
        "achieved_gb_s": step_bytes / tpot / 1e9, "roofline_pct": 100 * step_bytes / tpot / 1e9 / bandwidth,
    }


def profile_decode(model, step: Step, prompt_len: int, steps: int, device) -> str:
    """Where a batch-1 decode step's time goes: torch.profiler over `steps` steps of decode.generate (after its
    prefill), the ops by their own time on the device (CPU time on a CPU), the top 15."""
    from torch.profiler import ProfilerActivity, profile

    prompt = torch.randint(0, model.args.vocab_size, (prompt_len,)).tolist()
    tokens = generate(model, prompt, max_new_tokens=steps + 1, params=SamplingParams(temperature=0), step=step)
    next(tokens)  # the prefill, not profiled
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        n = sum(1 for _ in tokens)
        sync(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return f"profile of {n} decode steps (batch 1):\n" + prof.key_averages().table(sort_by=key, row_limit=15)


@torch.inference_mode()
def mask_cost(grammar, vocab_size: int, batch_size: int, steps: int, device) -> dict:
    """Seconds per decode step that structured output adds: the masks of batch_size rows (sample.sample_tokens: one
    call for the batch; the engine: one per row) and the matchers taking their tokens. The rows walk the grammar
    along one path of random allowed tokens (seeded), starting over when it is complete."""
    from features.grammar import advance, mask_logits

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(batch_size, vocab_size, generator=generator).to(device)  # (B, V)
    times = {"batched": 0.0, "per_row": 0.0}
    for mode in times:
        matchers = [grammar.matcher() for _ in range(batch_size)]
        for _ in range(steps):
            sync(device)
            t0 = time.perf_counter()
            if mode == "batched":
                masked = mask_logits(logits, matchers)  # (B, V)
            else:
                masked = torch.cat([mask_logits(logits[b:b + 1], [m]) for b, m in enumerate(matchers)])  # (B, V)
            allowed = torch.isfinite(masked[0]).nonzero()[:, 0]  # every row is in the same state
            token = allowed[torch.randint(len(allowed), (1,), generator=generator)].item()
            advance(matchers, [token] * batch_size)
            sync(device)
            times[mode] += time.perf_counter() - t0
            if matchers[0].done:
                matchers = [grammar.matcher() for _ in range(batch_size)]
    return {mode: t / steps for mode, t in times.items()}


class NoText:
    """The engine's tokenizer in engine_bench: token ids only, no text (its cost is not the model's) and no
    end-of-sequence id."""
    eos_ids: list[int] = []

    def decode(self, ids: list[int]) -> str:
        return ""

    def stream(self) -> "NoText":
        return self

    def push(self, token: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


def engine_bench(model, step: Step, batch_sizes: list[int], prompt_len: int, new_tokens: int, runs: int,
                 bandwidth: float, wide_rows: int | None = None) -> list[dict]:
    """The serving engine (continuous batching over the paged KV cache; with a CUDA-graph step, batches padded to
    buckets) decoding batch_size sequences together: each run submits that many random prompts at once, which the
    engine prefills in its first step and then decodes as one batch to the end. The median run's time to the first
    token and time per decode step (the time after the last first token over the new_tokens - 1 steps), after one
    run that warms up (compiles, captures) that batch's shapes. Token ids only: no text is decoded."""
    from serving.engine import Engine, EngineConfig

    largest, blocks_per_seq = max(batch_sizes), -(-(prompt_len + new_tokens) // 16)
    config = EngineConfig(block_size=16, num_blocks=1 + largest * blocks_per_seq, max_running=largest,
                          max_waiting=largest, token_budget=largest * (prompt_len + 1), prefix_caching=False,
                          wide_rows=wide_rows)
    engine = Engine(model, NoText(), config, step)
    params = SamplingParams(temperature=0)  # no end-of-sequence id: every sequence decodes new_tokens
    kv_per_token = engine.pool.bytes_per_token
    rows = []
    for b in batch_sizes:
        timings = []
        for run in range(runs + 1):
            prompts = torch.randint(0, model.args.vocab_size, (b, prompt_len)).tolist()
            done = engine.generate(prompts, params, new_tokens)
            assert all(len(c.tokens) == new_tokens for c in done)
            first = max(c.ttft_s for c in done)  # every row's first token is in: the decode steps start
            if run:  # the first run warms up
                timings.append((statistics.median(c.ttft_s for c in done),
                                (done[0].total_s - first) / (new_tokens - 1)))
        ttft, step_s = sorted(timings, key=lambda t: t[1])[len(timings) // 2]  # the median run by its step time
        kv_read = kv_per_token * b * (prompt_len + new_tokens / 2)  # the rows' keys and values, mean over the steps
        step_bytes = step_weight_bytes(model, b) + kv_read
        rows.append({"batch_size": b, "prompt_len": prompt_len, "new_tokens": new_tokens, "runs": runs,
                     "ttft_ms": ttft * 1e3, "tpot_ms": step_s * 1e3, "decode_tok_s": b / step_s,
                     "weight_bytes": weight_bytes(model), "kv_bytes_per_token": kv_per_token,
                     "kv_bytes_total": kv_per_token * b * (prompt_len + new_tokens),
                     "achieved_gb_s": step_bytes / step_s / 1e9,
                     "roofline_pct": 100 * step_bytes / step_s / 1e9 / bandwidth})
    for r in rows:
        r["step_vs_1"] = r["tpot_ms"] / rows[0]["tpot_ms"] if rows[0]["batch_size"] == 1 else None
    return rows


def interleaved_steps(loops: dict, timer) -> dict:
    """The median seconds (by timer) of each loop's steps, the loops stepped in turn (one step of each, then the
    next round) so that a busy machine's slow spells fall on all of them alike; each loop's first item (the
    prefill) and two more (warm-up) untimed; until the shortest loop ends."""
    times = {name: [] for name in loops}
    for loop in loops.values():
        next(loop)
    for i in itertools.count():
        for name, loop in loops.items():
            t0 = timer()
            if next(loop, None) is None:
                return {name: statistics.median(t[2:] or t) for name, t in times.items()}
            times[name].append(timer() - t0)


def engine_steps(engine, prompts: list[list[int]], new_tokens: int):
    """Submit prompts to engine (greedy), then yield after each step while work remains (the first: the prefill)."""
    from serving.contract import Request

    for prompt in prompts:
        engine.submit(Request(prompt, SamplingParams(temperature=0), new_tokens))
    while engine.step():
        yield True


def step_vs_generate(model, step: Step, batch_sizes: list[int], prompt_len: int, new_tokens: int,
                     wide_rows: int | None) -> list[dict]:
    """One decode step's CPU time (this thread's: a busy machine takes the wall clock, not this) in generate.py's
    loop (decode.generate, generate_batch for several rows) and in the engine's (Engine.step: its schedule, paged
    cache, per-row sampling and events), the same rows, prompts and step; with wide_rows, the engine again with
    EngineConfig.wide_rows. The median step of each."""
    from serving.engine import Engine, EngineConfig

    rows = []
    for b in batch_sizes:
        prompts = torch.randint(0, model.args.vocab_size, (b, prompt_len)).tolist()
        greedy = SamplingParams(temperature=0)
        loops = {"generate_ms": generate(model, prompts[0], max_new_tokens=new_tokens, params=greedy, step=step)
                 if b == 1 else generate_batch(model, prompts, max_new_tokens=new_tokens, params=greedy, step=step)}
        for key, wide in (("engine_ms", None), ("wide_ms", wide_rows)):
            if key == "engine_ms" or wide is not None:
                config = EngineConfig(num_blocks=1 + b * -(-(prompt_len + new_tokens) // 16), max_running=b,
                                      token_budget=b * (prompt_len + 1), prefix_caching=False, wide_rows=wide)
                loops[key] = engine_steps(Engine(model, NoText(), config, step), prompts, new_tokens)
        times = interleaved_steps(loops, time.thread_time)
        rows.append({"batch_size": b, **{key: t * 1e3 for key, t in times.items()}})
    return rows


def print_step_vs_generate(rows: list[dict], header: str) -> None:
    print(header)
    print("batch | generate.py step CPU ms | engine step CPU ms | engine / generate | wide engine step CPU ms | "
          "wide / generate")
    for r in rows:
        wide = f"{r['wide_ms']:.1f} | {r['wide_ms'] / r['generate_ms']:.2f}x" if "wide_ms" in r else " | "
        print(f"{r['batch_size']} | {r['generate_ms']:.1f} | {r['engine_ms']:.1f} | "
              f"{r['engine_ms'] / r['generate_ms']:.2f}x | {wide}")


def percentile(samples: list[float], q: float) -> float:
    """The q-th percentile (0-100) of samples, nearest rank."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def stream_gaps(model, step: Step, streams: int, prompt_len: int, new_tokens: int, long_len: int | None,
                config) -> dict:
    """`streams` greedy requests of new_tokens decoding in the engine; once each has its first token, a
    long_len-token prompt arrives (None: none). Returns the streams' inter-token gaps (seconds of the engine
    thread's CPU time and of the wall clock, from their second token on; with the long prompt, those while it is
    prefilled) and the long prompt's time to its first token (CPU seconds)."""
    from serving.contract import Request
    from serving.engine import Engine

    engine = Engine(model, NoText(), config, step)
    stamps: dict[int, list[tuple[float, float]]] = {}  # request id -> (cpu, wall) at each token

    def record(event) -> None:
        stamps.setdefault(event.request_id, []).append((time.thread_time(), time.perf_counter()))

    vocab = model.args.vocab_size
    ids = [engine.submit(Request(torch.randint(0, vocab, (prompt_len,)).tolist(), SamplingParams(temperature=0),
                                 new_tokens, on_event=record)) for _ in range(streams)]
    while any(len(stamps.get(i, [])) < 2 for i in ids):  # every stream decodes
        engine.step()
    window, long_id = (time.thread_time(), math.inf), None
    if long_len is not None:
        long_id = engine.submit(Request(torch.randint(0, vocab, (long_len,)).tolist(), SamplingParams(temperature=0),
                                        1, on_event=record))
    while engine.step():
        if long_id in stamps and window[1] == math.inf:
            window = (window[0], stamps[long_id][0][0])
    gaps = [(b[0] - a[0], b[1] - a[1]) for i in ids for a, b in zip(stamps[i][1:], stamps[i][2:])
            if window[0] <= b[0] <= window[1]]
    return {"cpu": [g[0] for g in gaps], "wall": [g[1] for g in gaps],
            "ttft_s": None if long_id is None else window[1] - window[0]}


def long_prompt_bench(model, step: Step, streams: int, prompt_len: int, long_len: int, config) -> list[dict]:
    """The streams' inter-token latency (ITL) alone and while a long_len-token prompt is prefilled (stream_gaps),
    p50 and p99, CPU time and wall clock."""
    chunk = min(config.prefill_chunk or config.token_budget, config.token_budget - streams)
    new_tokens = 8 + -(-long_len // chunk)  # the streams decode until the long prompt is in, and then some
    rows = []
    for case, n in (("alone", None), (f"+ {long_len}-token prompt", long_len)):
        gaps = stream_gaps(model, step, streams, prompt_len, new_tokens, n, config)
        rows.append({"case": case, "samples": len(gaps["cpu"]), "ttft_s": gaps["ttft_s"],
                     **{f"itl_{clock}_p{q}_ms": percentile(gaps[clock], q) * 1e3 for clock in ("cpu", "wall")
                        for q in (50, 99)}})
    return rows


def print_long_prompt(rows: list[dict], header: str) -> None:
    print(header)
    print("case | ITL samples | ITL p50 ms (CPU) | ITL p99 ms (CPU) | p99 / alone | ITL p50 ms (wall) | "
          "ITL p99 ms (wall) | long prompt TTFT s (CPU)")
    for r in rows:
        ttft = "" if r["ttft_s"] is None else f"{r['ttft_s']:.2f}"
        print(f"{r['case']} | {r['samples']} | {r['itl_cpu_p50_ms']:.1f} | {r['itl_cpu_p99_ms']:.1f} | "
              f"{r['itl_cpu_p99_ms'] / rows[0]['itl_cpu_p99_ms']:.2f}x | {r['itl_wall_p50_ms']:.1f} | "
              f"{r['itl_wall_p99_ms']:.1f} | {ttft}")


def print_engine_table(rows: list[dict], header: str, bandwidth: float) -> None:
    print(header)
    print(f"measured memory bandwidth: {bandwidth:.1f} GB/s (1 GiB read); a step reads the weights once for every "
          "row and each row's keys and values")
    print("batch | TTFT ms | step ms | decode tok/s | step / 1-row step | KV MB | GB/s | % roofline")
    for r in rows:
        ratio = "" if r["step_vs_1"] is None else f"{r['step_vs_1']:.2f}x"
        print(f"{r['batch_size']} | {r['ttft_ms']:.1f} | {r['tpot_ms']:.2f} | {r['decode_tok_s']:.1f} | {ratio} | "
              f"{r['kv_bytes_total'] / 1e6:.1f} | {r['achieved_gb_s']:.1f} | {r['roofline_pct']:.0f}%")


def print_table(rows: list[dict], header: str, bandwidth: float, peak_tflops: float) -> None:
    print(header)
    print(f"measured memory bandwidth: {bandwidth:.1f} GB/s (1 GiB read); "
          f"measured matmul peak: {peak_tflops:.2f} TFLOP/s (square matmul in the model dtype)")
    cols = ["batch", "prompt", "TTFT ms", "prefill tok/s", "prefill TFLOP/s", "% peak", "TPOT ms", "decode tok/s",
            "weights MB", "KV B/token", "KV MB", "GB/s", "% roofline"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join([f"{r['batch_size']}", f"{r['prompt_len']}", f"{r['ttft_ms']:.1f}",
                          f"{r['prefill_tok_s']:.0f}", f"{r['prefill_tflop_s']:.3g}", f"{r['prefill_peak_pct']:.0f}%",
                          f"{r['tpot_ms']:.2f}", f"{r['decode_tok_s']:.1f}", f"{r['weight_bytes'] / 1e6:.1f}",
                          f"{r['kv_bytes_per_token']}", f"{r['kv_bytes_total'] / 1e6:.1f}",
                          f"{r['achieved_gb_s']:.1f}", f"{r['roofline_pct']:.0f}%"]))
    if "mask_ms" in rows[0]:
        print("structured output: batch | TPOT ms | mask ms (one call) | % of TPOT | mask ms (engine, per row) | "
              "% of TPOT")
        for r in rows:
            print(f"{r['batch_size']} | {r['tpot_ms']:.2f} | {r['mask_ms']:.3f} | "
                  f"{100 * r['mask_ms'] / r['tpot_ms']:.1f}% | {r['mask_per_row_ms']:.3f} | "
                  f"{100 * r['mask_per_row_ms'] / r['tpot_ms']:.1f}%")


def print_summary(paths: list[str]) -> None:
    """The --json files of several runs (gpu_check.sh's) as one table: a row per result, its decode speed beside the
    float weights' at the same model, compile mode, loop, batch and prompt ("vs float"), an engine step beside its
    1-row step, against each run's own measured bandwidth and matmul peak."""
    runs = []
    for path in paths:
        try:
            with open(path) as f:
                runs.append((os.path.basename(path).removesuffix(".json"), json.load(f)))
        except (OSError, ValueError) as e:
            raise ValueError(f"--table: cannot read {path!r}: {e}") from None

    def key(run: dict, r: dict) -> tuple:
        return run["model"], run["compile"], run.get("engine", False), r["batch_size"], r["prompt_len"]

    float_tok_s = {key(run, r): r["decode_tok_s"] for _, run in runs if run.get("weights") == "float"
                   for r in run["results"]}
    print("run | model | weights | step | loop | batch | prompt | TTFT ms | % matmul peak | TPOT ms | decode tok/s | "
          "vs float | step / 1-row step | GB/s | % bandwidth")
    for label, run in runs:
        loop = "engine" if run.get("engine") else "generate"
        for r in run["results"]:
            base = float_tok_s.get(key(run, r))
            peak = f"{r['prefill_peak_pct']:.0f}%" if "prefill_peak_pct" in r else ""
            ratio = "" if base is None else f"{r['decode_tok_s'] / base:.2f}x"
            vs_one = "" if r.get("step_vs_1") is None else f"{r['step_vs_1']:.2f}x"  # an engine run's
            print(f"{label} | {run['model']} | {run.get('weights', '?')} | {run['compile']} | {loop} | "
                  f"{r['batch_size']} | {r['prompt_len']} | {r['ttft_ms']:.1f} | {peak} | {r['tpot_ms']:.2f} | "
                  f"{r['decode_tok_s']:.1f} | {ratio} | {vs_one} | "
                  f"{r['achieved_gb_s']:.0f} | {r['roofline_pct']:.0f}%")
    for label, run in runs:
        print(f"{label}: {run['device']} {run['dtype']}, measured {run['bandwidth_gb_s']:.0f} GB/s and "
              f"{run['matmul_peak_tflop_s']:.1f} TFLOP/s")


def llama_bench(binary: str, path: str, threads: int, prompt_lens: list[int], new_tokens: int, runs: int) -> dict:
    """llama.cpp's tokens/s on the same GGUF file and thread count, from its llama-bench: {"pp512": ..., "tg128": ...}
    (tg from an empty context; ours decodes after the prompt)."""
    cmd = [binary, "-m", path, "-t", str(threads), "-p", ",".join(map(str, prompt_lens)), "-n", str(new_tokens),
           "-r", str(runs), "-o", "json"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise ValueError(f"--llama-bench {binary!r} failed: {e}") from None
    return {(f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"): r["avg_ts"] for r in json.loads(out)}


def print_peer(rows: list[dict], peer: dict, threads: int) -> None:
    """Ours beside llama.cpp's, same file and threads: prefill per prompt length, decode, and the ratio."""
    print(f"against llama.cpp (llama-bench, same file, {threads} threads): test | ours tok/s | llama.cpp tok/s | ratio")
    for r in rows:
        if r["batch_size"] == 1:
            for test, ours in ((f"pp{r['prompt_len']}", r["prefill_tok_s"]), (f"tg{r['new_tokens']}",
                                                                              r["decode_tok_s"])):
                print(f"{test} | {ours:.1f} | {peer[test]:.1f} | {ours / peer[test]:.2f}")


def cpu_class() -> str:
    """'AVX512' / 'AVX2' (the kernels torch dispatches) and the CPU's model name, for headers."""
    name = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                "") if os.path.exists("/proc/cpuinfo") else ""
    return f"{torch.backends.cpu.get_cpu_capability()} kernels{', ' + name if name else ''}"


# Each numeric flag's allowed values (cli.check_ranges), checked before anything runs.
RANGES = {"batch_size": Range(1, 4096), "prompt_len": Range(1, 2**20), "new_tokens": Range(2, 2**20),
          "runs": Range(1, 1000), "threads": THREADS, "memory_gib": Range(0, 2**20, above=True),
          "context": Range(1, 2**24), "bandwidth_gbs": Range(0, 1e6, above=True),
          "peak_tflops": Range(0, 1e6, above=True), "kv_bytes": Range(0, 8, above=True),
          "wide_rows": Range(1, 65536), "long_prompt": Range(2, 2**20), "prefill_chunk": Range(1, 2**24),
          "token_budget": Range(1, 2**24)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m scripts.bench", description="Decode/prefill benchmark against the memory-bandwidth roofline, "
                                "and capacity planning (--plan).")
    p.add_argument("--model", default=None, help="checkpoint (default: the offline SmolLM2 GGUF)")
    p.add_argument("--shape", choices=sorted(SHAPES), help="random weights of a published shape instead of --model")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    p.add_argument("--compile", nargs="?", const="full", default="auto", choices=COMPILE_MODES,
                   help="how the decode step runs, as generate.py --compile (default auto: as generate.py would for "
                   "--new-tokens)")
    p.add_argument("--deterministic", action="store_true", help=DETERMINISTIC_HELP)
    p.add_argument("--quantize", default=None, metavar="MODE", help="int8, int4, int4:GROUP or none (as generate.py)")
    p.add_argument("--quantize-head", action="store_true", help="with --quantize: the LM head too")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1])
    p.add_argument("--prompt-len", type=int, nargs="+", default=[32])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=5, help="timed runs; the median is reported")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--plan", action="store_true", help="print the capacity plan for --shape or --model's config")
    p.add_argument("--kv-table", action="store_true", help="print KV bytes per token and per --context-token "
                   "sequence for MHA, GQA and MLA published shapes (at --kv-bytes per value)")
    p.add_argument("--memory-gib", type=float, default=80.0, help="memory budget for --plan")
    p.add_argument("--context", type=int, default=4096, help="tokens per sequence for --plan")
    p.add_argument("--bandwidth-gbs", type=float, default=None, help="for --plan (default: measured here)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="peak matmul TFLOP/s for --plan "
                   "(default: H100/H200 dense bf16)")
    p.add_argument("--kv-bytes", type=float, default=2, help="bytes per KV value for --plan (2 = fp16)")
    p.add_argument("--json-schema", default=None, metavar="FILE_OR_JSON",
                   help="also measure what masking logits with this JSON Schema adds to each decode step")
    p.add_argument("--llama-bench", default=None, metavar="BINARY",
                   help="also run llama.cpp's llama-bench on the same GGUF file and threads, and print the ratios")
    p.add_argument("--profile", action="store_true", help="also profile batch-1 decode steps (torch.profiler) and "
                   "print the ops that take the most time")
    p.add_argument("--engine", action="store_true", help="run the serving engine (engine.py) instead of "
                   "decode.generate: each --batch-size as that many sequences submitted at once and decoded together")
    p.add_argument("--vs-generate", action="store_true", help="with --engine: also each batch's decode step in "
                   "generate.py's loop and in the engine's, as CPU time (the engine's overhead, on a busy machine)")
    p.add_argument("--wide-rows", type=int, default=None, metavar="ROWS", help="with --engine: the engine's "
                   "EngineConfig.wide_rows (serve.py --wide-rows)")
    p.add_argument("--long-prompt", type=int, default=None, metavar="N", help="with --engine: the first --batch-size "
                   "streams' inter-token latency alone and while an N-token prompt arrives and is prefilled")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="with --engine: serve.py --prefill-chunk")
    p.add_argument("--token-budget", type=int, default=256, help="with --long-prompt: serve.py --token-budget")
    p.add_argument("--table", nargs="+", default=None, metavar="JSON",
                   help="print the --json files of earlier runs as one table, and nothing else")
    p.add_argument("--quiet", action="store_true")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def model_under_test(args: argparse.Namespace, device: torch.device,
                     dtype: torch.dtype) -> tuple[Transformer, str, str | None]:
    """Random weights of --shape (quantized as asked), or --model loaded as generate.py loads it; returns the model,
    its name for the header and its path (None for a shape)."""
    if args.shape:
        with torch.device(device):
            model = Transformer(SHAPES[args.shape]).to(dtype).eval().requires_grad_(False)
        if args.quantize not in (None, "none"):
            model = quantize_model(model, args.quantize, args.quantize_head)
        return model, f"{args.shape} (random weights)", None
    model, path = load_model(args.model or default_model(), device, dtype,
                             progress=not args.quiet and sys.stderr.isatty(), quantize=args.quantize,
                             quantize_head=args.quantize_head)
    return model, os.path.basename(path.rstrip("/")), path


def add_mask_costs(rows: list[dict], args: argparse.Namespace, model, path: str | None, device) -> None:
    """--json-schema: each row's mask_ms and mask_per_row_ms (mask_cost) for the schema over the model's vocabulary."""
    from features.constraint import Constraint, json_schema_arg
    from features.grammar import Compiler
    from tokenizer import load_tokenizer

    if args.shape:
        raise ValueError("--json-schema needs a tokenizer: pass --model, not --shape")
    compiler = Compiler(load_tokenizer(path), model.args.vocab_size)
    grammar = compiler.compile(Constraint("json_schema", json_schema_arg(args.json_schema)))
    for r in rows:
        cost = mask_cost(grammar, model.args.vocab_size, r["batch_size"], args.new_tokens * args.runs, device)
        r["mask_ms"], r["mask_per_row_ms"] = cost["batched"] * 1e3, cost["per_row"] * 1e3


def check_args(args: argparse.Namespace) -> None:
    """The flags' ranges and combinations, before anything loads."""
    check_ranges(args, RANGES)  # --new-tokens >= 2: one prefill token, then decode steps
    check_output_file(args.json, "--json")
    if args.llama_bench and (args.shape or args.plan):
        raise ValueError("--llama-bench runs llama.cpp on the same GGUF file: pass --model (or its default), not "
                         "--shape or --plan")
    engine_only = [f for f in ("vs_generate", "wide_rows", "long_prompt", "prefill_chunk") if getattr(args, f)]
    if engine_only and not args.engine:
        raise ValueError(f"--{engine_only[0].replace('_', '-')} needs --engine")
    if args.engine and (len(args.prompt_len) > 1 or args.llama_bench or args.json_schema or args.deterministic
                        or args.profile):
        raise ValueError("--engine takes one --prompt-len, and not --llama-bench, --json-schema, --deterministic or "
                         "--profile")


def long_prompt_config(args: argparse.Namespace):
    """--long-prompt's engine: room for the streams and the long prompt, their blocks all in the pool."""
    from serving.engine import EngineConfig

    streams = args.batch_size[0]
    blocks = streams * -(-(args.prompt_len[0] + args.long_prompt) // 16) + -(-args.long_prompt // 16) + 2
    return EngineConfig(block_size=16, num_blocks=blocks, max_running=streams + 1, token_budget=args.token_budget,
                        prefill_chunk=args.prefill_chunk, wide_rows=args.wide_rows, prefix_caching=False)


def run_engine(args: argparse.Namespace, model, step: Step, header: str, bandwidth: float) -> list[dict]:
    """--engine's runs and tables: the long-prompt case, or the step per batch (and beside generate.py's)."""
    if args.long_prompt:
        rows = long_prompt_bench(model, step, args.batch_size[0], args.prompt_len[0], args.long_prompt,
                                 long_prompt_config(args))
        print_long_prompt(rows, f"engine, {args.batch_size[0]} streams, prefill chunk "
                          f"{args.prefill_chunk or 'unset'} (token budget {args.token_budget}): {header}")
        return rows
    rows = engine_bench(model, step, args.batch_size, args.prompt_len[0], args.new_tokens, args.runs, bandwidth,
                        args.wide_rows)
    print_engine_table(rows, f"engine: {header}", bandwidth)
    if args.vs_generate:
        costs = step_vs_generate(model, step, args.batch_size, args.prompt_len[0], args.new_tokens, args.wide_rows)
        print_step_vs_generate(costs, "one decode step, generate.py's loop against the engine's")
    return rows


def run(args: argparse.Namespace) -> None:
    check_args(args)
    if args.table:
        print_summary(args.table)
        return
    if args.kv_table:
        print(kv_table(["llama-2-7b", "llama-3-8b", "deepseek-v2-lite", "deepseek-v3", "gpt-oss-20b"], args.context,
                       args.kv_bytes))
        return
    device = pick_device(args.device)
    set_threads(args.threads)
    if args.plan:
        if args.shape is None:
            raise ValueError("--plan needs --shape (one of: " + ", ".join(sorted(SHAPES)) + ")")
        bandwidth = args.bandwidth_gbs or measure_bandwidth(device)
        print(plan(SHAPES[args.shape], args.shape, args.memory_gib, args.context, bandwidth, args.peak_tflops,
                   args.kv_bytes))
        return
    dtype, _ = pick_dtype(args.dtype, device)
    model, name, path = model_under_test(args, device, dtype)
    max_len = max(args.prompt_len) + args.new_tokens
    if max_len > model.args.max_seq_len:
        raise ValueError(f"prompt + new tokens = {max_len} exceeds the model's context of {model.args.max_seq_len}")
    bandwidth = measure_bandwidth(device)
    peak_tflops = measure_matmul_tflops(device, dtype)
    # as users get it: generate.py's step for new_tokens, or serve.py's (unbounded)
    step = Step(model, args.compile, deterministic=args.deterministic,
                decode_steps=None if args.engine else args.new_tokens)
    threads = f", {torch.get_num_threads()} threads ({cpu_class()})" if device.type == "cpu" else ""
    header = (f"{name} | {device.type} {str(dtype).removeprefix('torch.')}{threads} | "
              f"weights {describe(model)} | "
              f"{'eager' if step.mode == 'none' else 'compiled: ' + step.mode}"
              f"{', deterministic' if step.deterministic else ''}")
    if not args.long_prompt:
        header += f" | {args.new_tokens} new tokens, median of {args.runs}"
    if args.engine:
        rows = run_engine(args, model, step, header, bandwidth)
    else:
        rows = [bench(model, device, b, p, args.new_tokens, args.runs, step, bandwidth, peak_tflops)
                for b in args.batch_size for p in args.prompt_len]
        if args.json_schema is not None:
            add_mask_costs(rows, args, model, path, device)
        if step.mode != "none":
            header += f" | compile + first run {rows[0]['compile_s']:.1f} s"
        print_table(rows, header, bandwidth, peak_tflops)
        if args.profile:
            print(profile_decode(model, step, args.prompt_len[0], min(args.new_tokens - 1, 16), device))
    if args.llama_bench:
        print_peer(rows, llama_bench(args.llama_bench, path, torch.get_num_threads(), args.prompt_len,
                                     args.new_tokens, args.runs), torch.get_num_threads())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": name, "device": device.type, "dtype": str(dtype), "compile": step.mode,
                       "weights": describe(model), "engine": args.engine, "bandwidth_gb_s": bandwidth,
                       "matmul_peak_tflop_s": peak_tflops, "results": rows}, f, indent=2)


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
