"""The decode loops: prefill the prompt in one forward pass, then decode one token per step against a KV cache.

Prefill processes T prompt tokens per weight read, so it is compute-bound; each decode step reads every weight to
produce one token, so it is memory-bandwidth-bound. How a forward runs (eager, or compiled) is step.Step, bound to
its model: every loop here takes one (eager when none is given). The loops share one rule for when generation ends
(`end_reason`) and mark the last Token with it.

The loops run under torch.inference_mode (no autograd bookkeeping on any op), so the caches they make are inference
tensors: write to one again only inside inference mode.

Shape legend: B rows, T tokens fed, V vocab.
"""
import sys
from collections.abc import Iterator, Sequence

import torch

from features.constraint import Grammar, Matcher
from kvcache import KVCache
from model import Transformer
from sample import penalty_state, sample_tokens
from params import SamplingParams, Token, check_logit_bias
from features.sinks import SinkKVCache, SinkWindow
from step import Step

PAD_ID = 0  # feeds finished batch rows; its keys/values are never attended
UNBOUNDED = sys.maxsize  # the length a sequence through a rolling cache (sinks.py) may reach


def new_cache(model: Transformer, batch_size: int, max_seq_len: int, kv_dtype: str = "model",
              window: SinkWindow | None = None) -> KVCache | SinkKVCache:
    """The KV cache every generation path uses (single, batched, session) for sequences of up to max_seq_len
    positions; kv_dtype as KVCache takes it. With a window, a rolling cache (sinks.py) of at most window slots."""
    if window is not None:
        return SinkKVCache.for_model(model, batch_size, window, max_seq_len, kv_dtype)
    weight = model.embed_tokens.weight
    return KVCache.for_model(model.args, batch_size, max_seq_len, weight.dtype, weight.device, kv_dtype)


def max_positions(model: Transformer, window: SinkWindow | None) -> int:
    """The positions a sequence may fill: the model's context, unbounded through a rolling cache."""
    if window is None:
        return model.args.max_seq_len
    window.check(model.args.max_seq_len)
    return UNBOUNDED


def prefill(step: Step, tokens: list[int], start: int, cache: KVCache | SinkKVCache, device) -> torch.Tensor:
    """Feed `tokens` at positions start.. through the cache; the logits after the last one (1, V). A rolling
    cache takes what lies past its window one token a forward (SinkKVCache.spans)."""
    end = start + len(tokens)
    spans = cache.spans(start, end) if isinstance(cache, SinkKVCache) else [(start, end)]
    for a, b in spans:
        logits = step(torch.tensor([tokens[a - start:b - start]], device=device), torch.arange(a, b, device=device),
                      cache, prefill=True)
    return logits


def end_reason(token: int, n_new: int, n_tokens: int, max_new_tokens: int, max_len: int,
               stop_ids: Sequence[int], matcher: Matcher | None = None, *, ignore_eos: bool = False) -> str | None:
    """Whether generation ends after `token`, the n_new-th generated token, making n_tokens in all: "eos" for a stop
    id (unless ignore_eos), "stop" when the sequence's grammar (matcher) is complete and only EOS could follow,
    "length" after max_new_tokens or once the sequence fills max_len positions (the last token is never fed, so it
    needs no position of its own), else None. The one rule of every loop (plain, batched, speculative, engine)."""
    if token in stop_ids and not ignore_eos:
        return "eos"
    if matcher is not None and matcher.done:
        return "stop"
    if n_new >= max_new_tokens or n_tokens > max_len:
        return "length"
    return None


def check_request(prompt: list[int], max_new_tokens: int, max_seq: int, what: str = "the model's context") -> None:
    """Raise a ValueError for an empty or too long prompt, or max_new_tokens < 1."""
    if not prompt:
        raise ValueError("the prompt is empty")
    if len(prompt) >= max_seq:
        raise ValueError(f"the prompt is {len(prompt)} tokens, longer than {what} of {max_seq - 1}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


def check_step(step: Step | None, model: Transformer) -> Step:
    """The step a loop runs: the one given, which must be bound to the loop's model, or an eager one."""
    if step is None:
        return Step(model)
    assert step.model is model, "a Step runs the model it was made for"
    return step


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

    def __init__(self, model: Transformer, max_seq_len: int | None = None, kv_dtype: str = "model",
                 window: SinkWindow | None = None):
        self.model, self.kv_dtype, self.window = model, kv_dtype, window
        # the most the conversation may grow to: the context, unbounded through a rolling cache (window)
        self.max_seq_len = max_seq_len or max_positions(model, window)
        self.cache: KVCache | SinkKVCache | None = None
        self.tokens: list[int] = []

    def reserve(self, n: int) -> KVCache:
        """The cache, grown to hold n positions (at least doubling, up to max_seq_len) with its contents kept.
        Attention covers every slot, so a cache sized to the conversation beats one sized to the context."""
        old = self.cache
        if self.window is not None:  # a rolling cache: its window, from the start
            self.cache = old or new_cache(self.model, 1, self.window.window, self.kv_dtype, self.window)
            return self.cache
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
        fed again: its logits start the decoding. A rolling cache that turned holds no longer what it evicted: a
        prompt that departs from the conversation is recomputed from its start."""
        n = common_prefix(self.tokens, prompt[:-1])
        turned = self.window is not None and len(self.tokens) > self.window.window
        return 0 if turned and n < len(self.tokens) else n


@torch.inference_mode()
def generate(
    model: Transformer,
    prompt: list[int],
    *,
    max_new_tokens: int,
    params: SamplingParams = SamplingParams(),
    generator: torch.Generator | None = None,
    stop_ids: Sequence[int] = (),
    step: Step | None = None,
    logprobs: int | None = None,
    session: Session | None = None,
    kv_dtype: str = "model",
    grammar: Grammar | None = None,
    window: SinkWindow | None = None,
) -> Iterator[Token]:
    """Yield the generated Tokens, the last one marked with why it ended (end_reason). With a session, its cache
    is reused: only the part of `prompt` it does not hold yet is prefilled. With a grammar, the output follows it
    (grammar.py): its own matcher masks every step. With a window (or a session's), the cache rolls (sinks.py):
    the sequence may run past the model's context."""
    if session is None:
        context = max_positions(model, window)
        check_request(prompt, max_new_tokens, context)
        # The cache holds the prompt and the generated tokens, never more than the model's context (or the window).
        max_seq = min(len(prompt) + max_new_tokens, context)
        cache, start = new_cache(model, 1, max_seq, kv_dtype, window), 0
    else:
        assert window is None, "a session has its own window"
        check_request(prompt, max_new_tokens, session.max_seq_len, "the session's limit")
        cache = session.reserve(len(prompt) + max_new_tokens)
        max_seq = cache.max_seq_len if session.window is None else session.max_seq_len
        # Slots past the reused prefix are stale; each is rewritten before any query at or after it reads it.
        start = session.reusable(prompt)
    check_logit_bias(params.logit_bias, model.args.vocab_size)
    device = model.embed_tokens.weight.device
    step = check_step(step, model)
    seen, generated = penalty_state(params, [prompt], model)
    matcher = None if grammar is None else grammar.matcher()

    logits = prefill(step, prompt[start:], start, cache, device)  # (1, V)
    if session is not None:
        session.tokens = list(prompt)
    pos = len(prompt)  # where the next sampled token is fed
    for n_new in range(1, max_new_tokens + 1):
        token, (out,) = sample_tokens(logits, params, generator, seen, generated, logprobs,
                                      None if matcher is None else [matcher], n_generated=[n_new - 1],
                                      stop_ids=stop_ids)  # (1,)
        out.end = end_reason(out.id, n_new, pos + 1, max_new_tokens, max_seq, stop_ids, matcher,
                             ignore_eos=params.ignore_eos)
        yield out
        if out.end:
            return
        logits = step(token.view(1, 1), torch.tensor([pos], device=device), cache)
        if session is not None:
            session.tokens.append(out.id)
        pos += 1


def prefill_rows(model: Transformer, step: Step, prompts: list[list[int]], limits: list[int],
                 cache: KVCache | SinkKVCache, kv_dtype: str, window: SinkWindow | None) -> torch.Tensor:
    """Prefill each prompt into its row of the batch cache; the (B, V) logits after each.
    Each prompt is prefilled alone, in a cache of the size it has alone (limits[b]), and its keys and values are copied
    into its row: every row then holds exactly what the prompt alone would (a padded forward's attention would round
    differently), and the decode steps compute each row as a one-row step does (README, Exactness). Prefill is
    compute-bound: one forward per prompt costs what one padded forward would."""
    device = model.embed_tokens.weight.device
    last = []
    for b, prompt in enumerate(prompts):
        alone = new_cache(model, 1, limits[b], kv_dtype, window)
        n = min(len(prompt), alone.max_seq_len)  # the slots written (a rolling cache's slot of a position is fixed)
        last.append(prefill(step, prompt, 0, alone, device))  # (1, V)
        for row_layer, batch_layer in zip(alone.layers, cache.layers):
            for a, c in zip(row_layer.buffers(), batch_layer.buffers()):
                c[b, :, :n] = a[0, :, :n]  # (K, n, D or 1)
    return torch.cat(last)  # (B, V)


@torch.inference_mode()
def generate_batch(
    model: Transformer,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    params: SamplingParams = SamplingParams(),
    generator: torch.Generator | None = None,
    stop_ids: Sequence[int] = (),
    step: Step | None = None,
    logprobs: int | None = None,
    kv_dtype: str = "model",
    grammar: Grammar | None = None,
    window: SinkWindow | None = None,
) -> Iterator[list[Token | None]]:
    """Generate for several prompts in one batch. Yields per step a Token for each running row, None for rows
    that ended (by generate's rule, per row); ends when every row has. With a grammar, each row has its matcher;
    with a window, every row's cache rolls (sinks.py)."""
    if not prompts:
        raise ValueError("no prompts to generate for")
    context = max_positions(model, window)
    for prompt in prompts:
        check_request(prompt, max_new_tokens, context)
    check_logit_bias(params.logit_bias, model.args.vocab_size)
    device = model.embed_tokens.weight.device
    step = check_step(step, model)
    B, lengths = len(prompts), [len(p) for p in prompts]
    limits = [min(n + max_new_tokens, context) for n in lengths]  # each row's max_seq when run alone
    cache = new_cache(model, B, max(limits), kv_dtype, window)
    seen, generated = penalty_state(params, prompts, model)
    matchers = None if grammar is None else [grammar.matcher() for _ in prompts]

    logits = prefill_rows(model, step, prompts, limits, cache, kv_dtype, window)  # (B, V)
    pos = torch.tensor(lengths, device=device)  # (B,) the position each row's next token is fed at
    done = [False] * B
    for n_new in range(1, max_new_tokens + 1):
        # A row that ended has no grammar left to follow: its matcher is dropped.
        live = None if matchers is None else [None if d else m for d, m in zip(done, matchers)]
        tokens, outs = sample_tokens(logits, params, generator, seen, generated, logprobs, live,
                                     n_generated=[n_new - 1] * B, stop_ids=stop_ids)  # (B,)
        for b, (out, p) in enumerate(zip(outs, pos.tolist())):
            out.end = None if done[b] else end_reason(out.id, n_new, p + 1, max_new_tokens, limits[b], stop_ids,
                                                      None if live is None else live[b], ignore_eos=params.ignore_eos)
        yield [None if finished else out for finished, out in zip(done, outs)]
        done = [finished or out.end is not None for finished, out in zip(done, outs)]
        if all(done):
            return
        # Rows that ended are fed a pad token at position 0: their cache is never read again.
        ended = torch.tensor(done, device=device)
        feed = tokens.masked_fill(ended, PAD_ID)[:, None]  # (B, 1)
        logits = step(feed, pos.masked_fill(ended, 0)[:, None], cache)  # (B, V)
        pos += 1
