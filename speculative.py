"""Speculative decoding (Leviathan et al. 2023, Chen et al. 2023): a cheap draft proposes k tokens, the target
scores all of them in one forward pass, and a rejection rule keeps the output distribution exactly the target's.

Shape legend: B independent trials (1 in generation), K drafted tokens, V vocab.
Three draft sources share one interface, `propose(context, k, params, generator) -> (tokens, q)`:
  ModelDraft        a separate small model, or the target itself re-loaded quantized (self-draft), own KV cache;
  PromptLookupDraft the continuation of the latest earlier match of the context's last n-gram (q is one-hot).
"""
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from decode import check_request, check_step, common_prefix, end_reason, new_cache
from model import Transformer
from sample import apply_logit_bias, hold_stop_ids, logits_to_probs, sample
from params import SamplingParams, Token, check_logit_bias
from step import Step


def verify(p: torch.Tensor, q: torch.Tensor, draft_tokens: torch.Tensor,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The accept/reject rule. p (B, K+1, V): target probabilities after the context and each draft; q (B, K, V):
    the draft's, from which draft_tokens (B, K) were drawn (one-hot for a deterministic proposal).
    Returns (n_accepted (B,), next_token (B,)): emit draft_tokens[:n] and then next_token."""
    B, K = draft_tokens.shape
    p_x = p[:, :K].gather(-1, draft_tokens[..., None])[..., 0]  # (B, K) target probability of each draft
    q_x = q.gather(-1, draft_tokens[..., None])[..., 0]  # (B, K) draft probability of each draft (> 0: drawn)
    r = torch.rand((B, K), generator=generator, device=p.device)  # (B, K) uniform in [0, 1)
    # Accept draft i with probability min(1, p(x)/q(x)), written without a division: r * q(x) < p(x).
    accepted = r * q_x < p_x  # (B, K)
    n = accepted.long().cumprod(dim=-1).sum(dim=-1)  # (B,) drafts accepted before the first rejection
    # The token after the accepted drafts comes from row n of p, corrected by row n of q:
    #   rejected at n < K: sample from normalize((p - q)+), the mass the draft under-proposed;
    #   all K accepted:    the padded q row is zero, so this is p itself, the bonus token.
    q_pad = torch.cat([q, q.new_zeros(B, 1, q.shape[-1])], dim=1)  # (B, K+1, V)
    rows = torch.arange(B, device=p.device)
    residual = (p[rows, n] - q_pad[rows, n]).clamp(min=0)  # (B, V)
    # (p - q)+ is zero only where p == q, and then no draft is ever rejected; fall back to p for rounding.
    empty = residual.sum(dim=-1, keepdim=True) <= 0  # (B, 1)
    residual = torch.where(empty, p[rows, n], residual)
    next_token = torch.multinomial(residual, 1, generator=generator)[:, 0]  # (B,) multinomial normalizes
    return n, next_token


def verify_greedy(target_argmax: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature 0: accept drafts while they equal the target's argmax; the next token is the target's argmax
    after the last accepted one. target_argmax (B, K+1), draft_tokens (B, K) -> (n_accepted (B,), next (B,))."""
    K = draft_tokens.shape[1]
    n = (target_argmax[:, :K] == draft_tokens).long().cumprod(dim=-1).sum(dim=-1)  # (B,)
    return n, target_argmax.gather(-1, n[:, None])[:, 0]


def accept(logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None, params: SamplingParams,
           generator: torch.Generator | None) -> tuple[int, int]:
    """One verify's rule for one sequence: target logits (k'+1, V) after the last token and each draft, the drafts
    (k') and their q (k', V; None for a deterministic proposal) -> (drafts accepted, the token after them)."""
    draft_t = torch.tensor([drafts], dtype=torch.long, device=logits.device)  # (1, k')
    if params.temperature == 0:
        n, nxt = verify_greedy(logits.argmax(dim=-1)[None], draft_t)
    else:
        p = logits_to_probs(logits, params)[None]  # (1, k'+1, V)
        if q is None:  # a deterministic proposal: q is one-hot on the drafted tokens
            q = torch.nn.functional.one_hot(draft_t[0], p.shape[-1]).to(p.dtype)  # (k', V)
        n, nxt = verify(p, q[None], draft_t, generator)
    return n.item(), nxt.item()


class ModelDraft:
    """A draft model with its own KV cache: a smaller model sharing the target's tokenizer, or the target
    re-loaded quantized (self-draft). It samples k tokens autoregressively and returns their q rows."""

    def __init__(self, model: Transformer, target: Transformer, step: Step | None = None):
        if model.args.vocab_size != target.args.vocab_size:
            raise ValueError(f"draft model vocab_size {model.args.vocab_size} != target vocab_size "
                             f"{target.args.vocab_size}; the draft must share the target's tokenizer")
        self.model, self.step = model, check_step(step, model)
        self.cache = None
        self.cached: list[int] = []  # tokens whose keys/values the cache holds, at positions 0..len-1
        self.forwards = 0  # draft forward passes, for the cost ratio c

    def start(self, max_seq: int) -> None:
        self.cache, self.cached, self.forwards = new_cache(self.model, 1, max_seq), [], 0

    def propose(self, context: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
        """k draft tokens after `context`, and q (k, V) (None when greedy: the rule needs no q)."""
        if k == 0:
            return [], None
        device = self.model.embed_tokens.weight.device
        # Rollback by position: slots past the common prefix are stale and are simply written again.
        n = common_prefix(self.cached, context)
        del self.cached[n:]
        feed = torch.tensor([context[n:]], device=device)  # (1, T): the prompt at first, then 1-2 new tokens
        logits = self.step(feed, torch.arange(n, len(context), device=device), self.cache)  # (1, V)
        self.cached.extend(context[n:])
        tokens, qs = [], []
        for i in range(k):
            self.forwards += 1
            logits = apply_logit_bias(logits, params)  # drafts the target's bias would forbid are drafts wasted
            if params.temperature == 0:
                x = logits.argmax(dim=-1)  # (1,)
            else:
                qs.append(logits_to_probs(logits, params)[0])  # (V,)
                x = torch.multinomial(qs[-1], 1, generator=generator)  # (1,)
            tokens.append(x.item())
            if i == k - 1:
                break  # the last draft is fed with the next verify's tokens, if it is accepted
            logits = self.step(x.view(1, 1), torch.tensor([len(context) + i], device=device), self.cache)
            self.cached.append(tokens[-1])
        return tokens, torch.stack(qs) if qs else None


class PromptLookupDraft:
    """Prompt lookup decoding: find the latest earlier occurrence of the context's last n tokens (n from
    max_ngram down to 1) and propose what followed it. Deterministic, so q is one-hot; may propose nothing."""

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram
        self.forwards = 0  # no model: costs nothing

    def start(self, max_seq: int) -> None:
        pass

    def propose(self, context: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
        L = len(context)
        for n in range(min(self.max_ngram, L - 1), 0, -1):
            suffix = context[L - n:]
            for i in range(L - n - 1, -1, -1):  # latest match first, never the suffix itself
                if context[i:i + n] == suffix:
                    return context[i + n:i + n + k], None
        return [], None


@dataclass
class SpecStats:
    """What one speculative run did: per verify, how many drafts were proposed and accepted, and the time
    spent in the draft and in the target."""
    k: int
    rounds: list[tuple[int, int]] = field(default_factory=list)  # (proposed, accepted) per target verify
    draft_s: float = 0.0
    target_s: float = 0.0
    draft_forwards: int = 0

    @property
    def acceptance(self) -> float:
        proposed = sum(p for p, _ in self.rounds)
        return sum(a for _, a in self.rounds) / proposed if proposed else float("nan")

    @property
    def tokens_per_verify(self) -> float:
        return sum(a + 1 for _, a in self.rounds) / len(self.rounds) if self.rounds else float("nan")

    @property
    def predicted_tokens_per_verify(self) -> float:
        """(1 - a^(k+1)) / (1 - a) averaged over the verifies' own k (i.i.d. acceptance with rate a)."""
        a = self.acceptance
        if not self.rounds or a != a:
            return float("nan")
        return sum(k + 1 if a == 1 else (1 - a ** (k + 1)) / (1 - a) for k, _ in self.rounds) / len(self.rounds)

    @property
    def cost_ratio(self) -> float:
        """c: one draft forward's time over one target verify's time (0 for prompt lookup)."""
        if not self.rounds or not self.draft_forwards:
            return 0.0
        return (self.draft_s / self.draft_forwards) / (self.target_s / len(self.rounds))

    def report(self) -> str:
        hist = Counter(a for _, a in self.rounds)  # only the counts that occurred: k may be large
        empty = sum(1 for p, _ in self.rounds if p == 0)
        k_mean = sum(p for p, _ in self.rounds) / max(len(self.rounds), 1)
        c = self.cost_ratio
        return (f"speculative k={self.k} | verifies {len(self.rounds)} ({empty} with no draft) | "
                f"acceptance a={self.acceptance:.3f} | tokens/verify {self.tokens_per_verify:.2f} "
                f"(predicted (1-a^(k+1))/(1-a) = {self.predicted_tokens_per_verify:.2f}) | "
                f"c={c:.3f}, predicted speed-up {self.tokens_per_verify / (1 + k_mean * c):.2f}x | "
                f"accepted per verify (accepted:verifies) {' '.join(f'{a}:{n}' for a, n in sorted(hist.items()))}")


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # CUDA is asynchronous: time the work, not its launch
    return time.perf_counter()


@torch.inference_mode()
def generate(
    model: Transformer,
    draft: ModelDraft | PromptLookupDraft,
    prompt: list[int],
    *,
    max_new_tokens: int,
    params: SamplingParams = SamplingParams(),
    generator: torch.Generator | None = None,
    stop_ids: Sequence[int] = (),
    k: int = 4,
    stats: SpecStats | None = None,
    step: Step | None = None,
) -> Iterator[Token]:
    """Yield Tokens as decode.generate does (the same end rule, the same distribution, logit bias and min_tokens
    included; greedy output is token-identical), drafting up to k tokens per target forward."""
    if k < 1:
        raise ValueError(f"speculate k must be >= 1, got {k}")
    if params.penalized:
        raise ValueError("repetition/presence/frequency penalties are not supported with speculative decoding")
    context = model.args.max_seq_len
    check_request(prompt, max_new_tokens, context)
    check_logit_bias(params.logit_bias, model.args.vocab_size)
    # As decode.generate: the cache holds prompt + generated tokens; the very last token is never fed.
    max_seq = min(len(prompt) + max_new_tokens, context)
    limit = min(max_new_tokens, max_seq - len(prompt) + 1)  # tokens to generate
    stats = stats if stats is not None else SpecStats(k)
    device = model.embed_tokens.weight.device
    step = check_step(step, model)
    cache = new_cache(model, 1, max_seq)
    draft.start(max_seq)

    def target_logits(logits: torch.Tensor, n_generated: int) -> torch.Tensor:
        """(T, V) target logits, row i after n_generated + i generated tokens -> as sample_tokens processes them."""
        return hold_stop_ids(apply_logit_bias(logits, params), params, range(n_generated, n_generated + len(logits)),
                             stop_ids)

    logits = step(torch.tensor([prompt], device=device), torch.arange(len(prompt), device=device), cache,
                  prefill=True)
    first = Token(sample(target_logits(logits, 0), params, generator).item())
    tokens = list(prompt) + [first.id]
    first.end = end_reason(first.id, 1, len(tokens), max_new_tokens, max_seq, stop_ids, ignore_eos=params.ignore_eos)
    yield first
    if first.end:
        return
    while True:
        pos = len(tokens) - 1  # the last token's position: not yet in the target's cache
        # Never draft past the last token to generate: drafts + 1 token <= what is left (keeps pos + k < max_seq).
        k_now = min(k, limit - (len(tokens) - len(prompt)) - 1)
        t0 = _now(device)
        drafts, q = draft.propose(tokens, k_now, params, generator)  # k' <= k_now tokens, q (k', V) or None
        t1 = _now(device)
        kd = len(drafts)
        # One target forward over the last token and the drafts: row i is p after tokens + drafts[:i].
        fed = torch.tensor([[tokens[-1]] + drafts], device=device)  # (1, k'+1)
        positions = torch.arange(pos, pos + kd + 1, device=device)
        logits = step(fed, positions, cache, all_logits=True)  # (1, k'+1, V)
        logits = target_logits(logits[0], len(tokens) - len(prompt))  # (k'+1, V)
        n, nxt = accept(logits, drafts, q, params, generator)
        t2 = _now(device)
        stats.draft_s += t1 - t0
        stats.target_s += t2 - t1
        stats.draft_forwards = draft.forwards
        stats.rounds.append((kd, n))
        # The target's cache now holds tokens + drafts[:n] correctly; slots after them are stale and are
        # overwritten by the next verify, which starts at the next token's position (rollback by position).
        for t in drafts[:n] + [nxt]:
            tokens.append(t)
            out = Token(t, end=end_reason(t, len(tokens) - len(prompt), len(tokens), max_new_tokens, max_seq,
                                          stop_ids, ignore_eos=params.ignore_eos))
            yield out
            if out.end:
                return


