"""Attention sinks: a rolling KV cache of W slots that keeps the first S positions (the sinks) and the latest W - S,
so generation and multi-turn chat run past the model's context in constant memory (StreamingLLM, Xiao et al. 2023:
the opening tokens take a large share of every query's attention whatever they say; evict them with the rest and
the model falls apart, keep them and it goes on).

Layout. Position p lives in slot p while p < S, else in slot S + (p - S) % (W - S): a ring after the sinks, so a
write is one index_copy_ into fixed-shape buffers (any kvcache layer: model dtype, int8, or a paged row's blocks)
and the compiled decode step keeps its shapes. Which position a slot holds follows from the newest position alone
(slot_positions): the cache keeps no bookkeeping, and the caller owns positions as with every cache.

Positions. As in StreamingLLM, the model sees positions within the cache: the sinks at 0..S-1, then the window in
order, the newest token at min(p, W - 1); RoPE never sees a position past W - 1, so the model's context bounds W,
not the sequence. Keys are stored before RoPE and rotated as they are read, by their slot's position at that step.
The alternative, keys stored rotated and turned back by one position for every token evicted, would rotate each
key hundreds of times: its rounding error grows with the sequence, and an int8 key would be re-quantized each
time. Rotating at read time is exact (a key is rotated once, from its stored value, by the position it has now) at
the cost of rotating W keys per layer and step, a few elementwise ops on (B, K, W, D) beside attention's products.

Chunks. A forward of T tokens writes them all before attending, so once the ring is full a later token would
overwrite keys an earlier one of the same forward still needs: a forward of T > 1 must end before position W
(`spans` splits a prompt so; past W it is one token a forward, as StreamingLLM evaluates). While the sequence fits
in W, the cache holds what a KVCache of W slots holds and the logits are the same (tests/test_sinks.py).

Shape legend: B batch, K kv heads, S slots attended (W, or a paged row's blocks), T new tokens, D head dim,
R rotated dims.
"""
from dataclasses import dataclass

import torch

from kvcache import BlockPool, KVCache, PagedKVCache
from model import Transformer, apply_rope


@dataclass(frozen=True)
class SinkWindow:
    """A rolling cache's shape: `window` slots per sequence, the first `sinks` positions kept for good; sinks may
    be one count per batch row (a tuple: the rows then take per-row positions (B, T)), as streaming.py compares
    window-only eviction (0) with sinks in one batch."""
    sinks: int | tuple[int, ...]
    window: int

    def check(self, context: int | None = None) -> None:
        """Raise a ValueError naming a bad value: 0 <= sinks < window <= the model's context (None: not known yet,
        as when the flags are checked before the model loads)."""
        counts = self.sinks if isinstance(self.sinks, tuple) else (self.sinks,)
        if min(counts) < 0:
            raise ValueError(f"sink_tokens (--sink-tokens) must be >= 0, got {min(counts)}")
        if self.window <= max(counts):
            raise ValueError(f"cache_window (--cache-window) must be larger than the {max(counts)} sink tokens, "
                             f"got {self.window}")
        if context is not None and self.window > context:
            raise ValueError(f"cache_window (--cache-window) {self.window} is larger than the model's context of "
                             f"{context}: RoPE positions within the window must be ones the model knows")


def slot_of(pos, sinks, window: int):
    """The slot each position is written to: p for the sinks, then a ring of window - sinks slots. Positions and
    sinks as ints (scheduler.py) or tensors (sinks (B, 1): per row)."""
    ring = window - sinks
    return pos - (pos >= sinks) * ((pos - sinks) // ring * ring)  # past the sinks: sinks + (pos - sinks) % ring


def slot_positions(last: torch.Tensor, sinks: int | torch.Tensor, window: int, n_slots: int) -> torch.Tensor:
    """The position the model sees for each of n_slots slots once position `last` ((1,), or (B, 1) per row) is
    written: (n_slots,) or (B, n_slots). A slot holding nothing (not written yet; past the window in a paged row's
    blocks) gets `window`, past every query's position, so the causal mask hides it."""
    ring = window - sinks
    s = torch.arange(n_slots, device=last.device)  # (n_slots,)
    held = last - (last - s) % ring  # a ring slot holds the newest position <= last that maps to it
    shift = (last + 1 - window).clamp(min=0)  # positions evicted from the window so far
    valid = torch.where(s < sinks, s <= last, (held >= sinks) & (s < window))
    return torch.where(valid, torch.where(s < sinks, s, held - shift), window)


class SinkLayer:
    """One layer of a SinkKVCache over a layer of its inner cache (LayerKVCache, Int8LayerKVCache or PagedLayer):
    writes each position's keys (before RoPE) and values into its slot, returns the keys rotated to their slots'
    positions."""

    def __init__(self, inner, sinks: int | torch.Tensor, window: int, rope_cos: torch.Tensor, rope_sin: torch.Tensor):
        self.inner, self.sinks, self.window = inner, sinks, window
        self.rope_cos, self.rope_sin = rope_cos, rope_sin  # the model's tables, (max_seq_len, R/2) float32

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_unrotated: torch.Tensor):
        """Write the keys before RoPE (k_unrotated; k, rotated at the positions the model sees, is not stored) and v,
        (B, K, T, D), for positions input_pos ((T,) or (B, T)); return every slot's keys rotated and values,
        (B, K, S, D)."""
        keys, values = self.inner.update(slot_of(input_pos, self.sinks, self.window), k_unrotated, v)  # (B, K, S, D)
        k_pos = slot_positions(input_pos[..., -1:], self.sinks, self.window, keys.shape[2])  # (S,) or (B, S)
        k_pos = k_pos.clamp(max=self.window - 1)  # a hidden slot's rotation does not matter
        # the model's rounding of its tables to the activations' dtype (Transformer.inputs)
        cos, sin = self.rope_cos[k_pos].to(keys.dtype), self.rope_sin[k_pos].to(keys.dtype)  # (.., S, R/2)
        if k_pos.dim() == 2:
            cos, sin = cos[:, None], sin[:, None]  # (B, 1, S, R/2): over the heads
        return apply_rope(keys, cos, sin), values

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return self.inner.buffers()


class SinkKVCache:
    """The KVCache interface as a rolling cache of `window` slots keeping `sinks` positions, over a KVCache of
    min(window, the longest the sequence can get) slots, or over a PagedKVCache (rows of at most window slots)."""

    def __init__(self, inner: KVCache | PagedKVCache, shape: SinkWindow, model: Transformer):
        if model.args.kv_lora_rank is not None:  # its keys are rotated inside the latent, which this cannot re-rotate
            raise ValueError("attention sinks (a rolling cache) do not take latent attention (MLA, DeepSeek) yet")
        sinks = shape.sinks
        if isinstance(sinks, tuple):  # one count per row: (B, 1), broadcast against per-row positions
            sinks = torch.tensor(sinks, device=model.rope_cos.device)[:, None]
        self.inner, self.sinks, self.window = inner, sinks, shape.window
        self.max_seq_len = inner.max_seq_len  # slots attended, not a limit on positions
        # each layer's own RoPE tables (Gemma 3's sliding layers have theirs)
        self.layers = [SinkLayer(layer, sinks, shape.window, *model.layer_rope(i))
                       for i, layer in enumerate(inner.layers)]

    @classmethod
    def for_model(cls, model: Transformer, batch_size: int, shape: SinkWindow, max_len: int | None = None,
                  kv_dtype: str = "model") -> "SinkKVCache":
        """A static cache for `model`; with max_len (the longest the sequences can get) below the window, of only
        max_len slots: the ring never turns then."""
        weight = model.embed_tokens.weight
        slots = shape.window if max_len is None else min(shape.window, max_len)
        inner = KVCache.for_model(model.args, batch_size, slots, weight.dtype, weight.device, kv_dtype)
        return cls(inner, shape, model)

    @classmethod
    def paged(cls, model: Transformer, pool: BlockPool, block_tables: torch.Tensor,
              shape: SinkWindow) -> "SinkKVCache":
        """Over the rows' blocks: a row holds the blocks of its first min(n, window) slots."""
        return cls(PagedKVCache(pool, block_tables), shape, model)

    def positions(self, input_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The positions RoPE and the mask give the queries at input_pos and each slot: within the window."""
        if input_pos.shape[-1] > 1 and not torch.compiler.is_compiling():  # a cheap guard on prefill forwards
            assert int(input_pos.max()) < self.window, f"a {input_pos.shape[-1]}-token forward past the window " \
                                                        f"{self.window} (SinkKVCache.spans)"
        last = input_pos[..., -1:]  # (1,) or (B, 1): the newest position written
        shift = (last + 1 - self.window).clamp(min=0)
        return input_pos - shift, slot_positions(last, self.sinks, self.window, self.max_seq_len)

    def spans(self, start: int, end: int) -> list[tuple[int, int]]:
        """The forwards that feed positions start..end-1: what lies before the window in one, then one each."""
        first = min(end, max(start, self.window))
        return ([(start, first)] if first > start else []) + [(p, p + 1) for p in range(first, end)]

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes
