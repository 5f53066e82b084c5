"""The KV caches: the int8 cache against the float one, per-row writes against shared ones, and the paged cache
(blocks scattered through a pool) against the static cache."""
import pytest
import torch

from kvcache import BlockPool, KVCache, PagedKVCache


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def random_prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 160, (n,), generator=g).tolist() for n in lengths]


def test_static_cache_per_row_positions_write_what_shared_positions_write():
    B, K, S, D = 2, 3, 16, 8
    k, v = torch.randn(B, K, 5, D), torch.randn(B, K, 5, D)
    pos = torch.arange(3, 8)
    shared = KVCache(1, B, K, S, D, torch.float32, "cpu")
    k_all, v_all = shared.layers[0].update(pos, k, v)
    assert k_all.shape == (B, K, S, D) and torch.equal(k_all[:, :, 3:8], k) and torch.equal(v_all[:, :, 3:8], v)
    assert k_all[:, :, :3].abs().sum() == 0 and k_all[:, :, 8:].abs().sum() == 0  # nothing else written
    per_row = KVCache(1, B, K, S, D, torch.float32, "cpu")
    k_rows, v_rows = per_row.layers[0].update(pos.expand(B, -1), k, v)
    assert torch.equal(k_rows, k_all) and torch.equal(v_rows, v_all)


def test_int8_kv_cache_update_and_bytes():
    B, K, S, D, L = 2, 3, 16, 64, 4
    fp = KVCache(L, B, K, S, D, torch.float32, "cpu")
    q8 = KVCache(L, B, K, S, D, torch.float32, "cpu", kv_dtype="int8")
    assert fp.bytes_per_token == 2 * L * K * D * 4
    assert q8.bytes_per_token == 2 * L * K * (D + 4)  # int8 values plus a float32 scale per token and head
    assert q8.nbytes == q8.bytes_per_token * B * S
    torch.manual_seed(0)
    k, v = torch.randn(B, K, 5, D), torch.randn(B, K, 5, D)
    pos = torch.arange(3, 8)
    k_all, v_all = q8.layers[0].update(pos, k, v)
    assert k_all.shape == (B, K, S, D) and k_all.dtype == torch.float32
    step = k.abs().amax(-1, keepdim=True) / 127  # half a step is the most rounding can move a value
    assert ((k_all[:, :, 3:8] - k).abs() <= step * 0.5 + 1e-6).all()
    assert (v_all[:, :, 3:8] - v).abs().max() < 0.02
    # per-row positions (B, T) write the same values as shared positions
    per_row = KVCache(L, B, K, S, D, torch.float32, "cpu", kv_dtype="int8")
    k_rows, _ = per_row.layers[0].update(pos.expand(B, -1), k, v)
    assert torch.equal(k_rows, k_all)
    with pytest.raises(ValueError, match="unknown KV cache dtype 'fp8'"):
        KVCache(L, B, K, S, D, torch.float32, "cpu", kv_dtype="fp8")


def test_int8_kv_cache_decode_close_to_float_cache(tiny):
    tokens = torch.randint(0, tiny.args.vocab_size, (1, 24))
    out = {}
    for kv in ("model", "int8"):
        cache = KVCache.for_model(tiny.args, 1, 24, torch.float32, "cpu", kv_dtype=kv)
        logits = [tiny(tokens[:, :16], torch.arange(16), cache)]
        for t in range(16, 24):
            logits.append(tiny(tokens[:, t:t + 1], torch.tensor([t]), cache))
        out[kv] = torch.cat(logits, dim=1)
    assert rel_err(out["int8"], out["model"]) < 0.02


def test_paged_logits_equal_static_cache(tiny):
    """Two rows at different positions, blocks scattered through the pool: the logits of a prefill in two chunks
    and of batched decode steps equal the static cache's."""
    model = tiny
    pool = BlockPool.for_model(model.args, 40, 4, torch.float32, "cpu")
    tables = torch.tensor([[5, 3, 9, 1, 2, 7, 11, 12, 13, 14, 15, 16],
                           [20, 39, 21, 22, 8, 23, 24, 25, 26, 27, 28, 29]])  # (2, 12): 48 positions each
    prompts = random_prompts([30, 21])
    for b, prompt in enumerate(prompts):
        static = KVCache.for_model(model.args, 1, 48, torch.float32, "cpu")
        paged = PagedKVCache(pool, tables[b:b + 1])
        x = torch.tensor([prompt])
        for lo, hi in [(0, 13), (13, len(prompt))]:
            want = model(x[:, lo:hi], torch.arange(lo, hi), static, all_logits=True)
            got = model(x[:, lo:hi], torch.arange(lo, hi), paged, all_logits=True)
            assert (got - want).abs().max() <= 1e-5
    # batched decode: row 0 at position 30, row 1 at 21 (per-row positions), against each row's static cache
    statics = []
    for prompt in prompts:
        statics.append(KVCache.for_model(model.args, 1, 48, torch.float32, "cpu"))
        model(torch.tensor([prompt]), torch.arange(len(prompt)), statics[-1])
    pos = torch.tensor([[30], [21]])
    for step in range(5):
        tokens = torch.tensor([[7 + step], [90 - step]])
        got = model(tokens, pos, PagedKVCache(pool, tables))[:, -1]
        for b in range(2):
            want = model(tokens[b:b + 1], pos[b], statics[b])[:, -1]
            assert (got[b] - want[0]).abs().max() <= 1e-5
        pos += 1
