"""Next-token sampling: pure functions of logits and an explicit torch.Generator, and sample_tokens, the one
sampling step every loop (plain, batched, engine) calls.

Order: penalties -> logit bias -> grammar masks -> min_tokens (stop ids held back) -> temperature -> top-k ->
top-p -> min-p -> draw. Temperature 0 is greedy (argmax of the processed logits), not a tiny float. The knobs
(SamplingParams, checked when built) and the Token a step gives are params.py's, which needs no torch.
Shape legend: B rows, V vocab.
"""
from collections.abc import Sequence

import torch

from features.constraint import Matcher
from features.grammar import advance, mask_logits
from model import Transformer
from params import SamplingParams, Token, check_logit_bias


def token_counts(rows: list[list[int]], vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(B, V) float counts of each token id in each row of `rows`."""
    counts = torch.zeros(len(rows), vocab_size, device=device)
    for b, ids in enumerate(rows):
        counts[b].index_add_(0, torch.tensor(ids, dtype=torch.long, device=device), torch.ones(len(ids), device=device))
    return counts


def apply_penalties(logits: torch.Tensor, seen: torch.Tensor, generated: torch.Tensor,
                    params: SamplingParams) -> torch.Tensor:
    """(B, V) logits -> penalized (B, V) float logits.

    Repetition penalty (HF/CTRL): the logit of every token in `seen` (prompt and generated, (B, V) bool) is
    divided by the penalty if positive, multiplied if negative. Presence/frequency (OpenAI), over generated
    tokens only: logit -= presence * (count > 0) + frequency * count, with `generated` the (B, V) counts.
    """
    logits = logits.float()
    if params.repetition_penalty != 1.0:
        # In float32 a penalty past its range would be 0 or inf (0 * inf is NaN), and dividing by a tiny one
        # overflows (inf - inf is NaN in the softmax): the penalty and the result are kept finite.
        tiny, big = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
        r = min(max(params.repetition_penalty, tiny), big)
        penalized = torch.where(logits > 0, logits / r, logits * r).clamp(-big, big)
        logits = torch.where(seen, penalized, logits)
    if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
        logits = logits - params.presence_penalty * (generated > 0).float() - params.frequency_penalty * generated
    return logits


def apply_logit_bias(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(B, V) logits -> (B, V) float logits with params.logit_bias added (a new tensor); ValueError for a token id
    past V. Without a bias the logits are returned as they are."""
    if not params.logit_bias:
        return logits
    check_logit_bias(params.logit_bias[-1:], logits.shape[-1])  # sorted by id: the last is the largest
    ids = torch.tensor([token for token, _ in params.logit_bias], device=logits.device)  # (N,)
    bias = torch.tensor([b for _, b in params.logit_bias], device=logits.device)  # (N,)
    return logits.float().index_add(-1, ids, bias.expand(logits.shape[0], -1))  # (B, N) into (B, V)


def hold_stop_ids(logits: torch.Tensor, params: SamplingParams, n_generated: Sequence[int],
                  stop_ids: Sequence[int]) -> torch.Tensor:
    """(B, V) logits -> (B, V) logits with the stop ids at -inf in the rows that generated fewer than
    params.min_tokens tokens (n_generated, per row, before this one). A row that would have no token left keeps
    them: its grammar is complete and allows only EOS, and the grammar wins (else nothing could be sampled)."""
    if params.min_tokens == 0 or not stop_ids or all(n >= params.min_tokens for n in n_generated):
        return logits
    early = torch.tensor([n < params.min_tokens for n in n_generated], device=logits.device)[:, None]  # (B, 1)
    held = logits.index_fill(-1, torch.tensor(list(stop_ids), device=logits.device), float("-inf"))  # (B, V)
    left = (held > float("-inf")).any(dim=-1, keepdim=True)  # (B, 1)
    return torch.where(early & left, held, logits)


def logits_to_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(B, V) logits -> (B, V) log-probabilities after temperature (> 0), top-k, top-p (nucleus) and min-p,
    renormalized over the tokens kept; -inf for the tokens removed. The most likely token is always kept."""
    # Shifted so the largest logit is 0: a tiny temperature then sends the others to -inf, never to +inf. Below
    # float32's smallest normal number the divisor would round to 0 (0/0); any T that small is greedy anyway.
    logits = logits.float()
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / max(params.temperature,
                                                                      torch.finfo(torch.float32).tiny)
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]  # (B, 1) smallest logit kept
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_probs, order = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True)  # (B, V)
        # Drop a token once the more likely ones already cover top_p; the token crossing it stays.
        sorted_drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= params.top_p
        sorted_drop[:, 0] = False  # a top_p below float32's resolution (1e-300 -> 0) keeps the most likely token
        drop = torch.zeros_like(sorted_drop).scatter_(-1, order, sorted_drop)  # back to vocab order
        logits = logits.masked_fill(drop, float("-inf"))
    if params.min_p > 0.0:
        # Keep tokens at least min_p times as likely as the most likely one (the most likely always stays).
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(B, V) logits -> (B, V) probabilities after temperature (> 0), top-k, top-p and min-p."""
    return logits_to_logprobs(logits, params).exp()


def sampled_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(B, V) log-probabilities of the distribution `sample` draws from. Greedy (temperature 0) has no
    distribution to draw from, so it reports the model's own: log_softmax of the logits, unfiltered."""
    if params.temperature == 0:
        return torch.log_softmax(logits.float(), dim=-1)
    return logits_to_logprobs(logits, params)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, V) logits (penalties already applied) -> (B,) token ids."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    return torch.multinomial(logits_to_probs(logits, params), 1, generator=generator).squeeze(-1)


def penalty_state(params: SamplingParams, prompts: Sequence[list[int]],
                  model: Transformer) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(seen (B, V) bool: prompt tokens, generated (B, V) zero counts) when penalties are on, else (None, None)."""
    if not params.penalized:
        return None, None
    seen = token_counts(list(prompts), model.args.vocab_size, model.embed_tokens.weight.device) > 0
    return seen, torch.zeros(seen.shape, device=seen.device)


def sample_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                  seen: torch.Tensor | None, generated: torch.Tensor | None,
                  logprobs: int | None, matchers: Sequence[Matcher | None] | None = None, *,
                  n_generated: Sequence[int] | None = None, stop_ids: Sequence[int] = ()
                  ) -> tuple[torch.Tensor, list[Token]]:
    """(B, V) logits -> (B,) next tokens: penalties, logit bias, the grammar masks (a row's matcher, if any, sets the
    tokens its grammar forbids to -inf, then takes the sampled token), min_tokens (hold_stop_ids: n_generated is
    each row's count of tokens generated before this one), then sample.sample; counts them into the penalty state
    (seen, generated) in place. Also a Token per row, with the log-probabilities it was drawn from and the top
    `logprobs` alternatives when logprobs is not None."""
    if seen is not None:
        logits = apply_penalties(logits, seen, generated, params)
    logits = apply_logit_bias(logits, params)
    if matchers is not None:
        logits = mask_logits(logits, list(matchers))
    if params.min_tokens:
        assert n_generated is not None and len(n_generated) == len(logits), "min_tokens needs n_generated per row"
        logits = hold_stop_ids(logits, params, n_generated, stop_ids)
    tokens = sample(logits, params, generator)  # (B,)
    if matchers is not None:
        advance(list(matchers), tokens.tolist())
    if seen is not None:  # the new tokens count for the next step's penalties
        rows = torch.arange(len(tokens), device=tokens.device)
        seen[rows, tokens] = True
        generated[rows, tokens] += 1
    if logprobs is None:
        return tokens, [Token(t) for t in tokens.tolist()]
    lp = sampled_logprobs(logits, params)  # (B, V)
    chosen = lp.gather(-1, tokens[:, None])[:, 0].tolist()  # (B,)
    top_lp, top_ids = lp.topk(min(logprobs, lp.shape[-1]), dim=-1)  # (B, N)
    out = []
    for b, token in enumerate(tokens.tolist()):
        # Tokens that top-k/top-p/min-p removed have probability 0: they are no alternative. Among equal
        # log-probabilities the chosen token goes first (topk orders ties arbitrarily; argmax takes the first).
        top = [(i, v) for i, v in zip(top_ids[b].tolist(), top_lp[b].tolist()) if v > float("-inf")]
        top.sort(key=lambda iv: (-iv[1], iv[0] != token))
        out.append(Token(token, chosen[b], top))
    return tokens, out
