"""The model against Hugging Face transformers on random weights, and its cached paths against the uncached one."""
import os

import pytest
import torch

from kvcache import KVCache
from model import ModelArgs, Transformer, attention_mask
from tiny_models import CONFIGS, SEQ_LEN, hf_to_ours, make_hf, reference_attention


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request):
    hf = make_hf(request.param)
    return hf, hf_to_ours(hf)


def tokens(batch: int = 1, seq: int = SEQ_LEN, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 160, (batch, seq), generator=torch.Generator().manual_seed(seed))


def decode_all(model: Transformer, toks: torch.Tensor, prefill: int, cache_len: int | None = None) -> torch.Tensor:
    """Prefill `prefill` tokens, then feed the rest one at a time; return all logits (B, T, V)."""
    B, T = toks.shape
    cache = KVCache.for_model(model.args, B, cache_len or T, torch.float32, "cpu")
    out = [model(toks[:, :prefill], torch.arange(prefill), cache, all_logits=True)]
    for i in range(prefill, T):
        out.append(model(toks[:, i:i + 1], torch.tensor([i]), cache))
    return torch.cat(out, dim=1)


def test_full_forward_matches_transformers(pair):
    hf, ours = pair
    toks = tokens(batch=2)
    ref = hf(toks).logits
    got = ours(toks, torch.arange(SEQ_LEN), all_logits=True)
    assert ref.abs().max() > 1.0  # logits large enough for the tolerance to mean something
    assert (got - ref).abs().max() <= 1e-4


def test_cached_decode_matches_transformers(pair):
    """Token by token with the cache (for Mistral: the sliding window applied in decode too)."""
    hf, ours = pair
    toks = tokens()
    ref = hf(toks).logits
    assert (decode_all(ours, toks, prefill=1) - ref).abs().max() <= 1e-4


@pytest.mark.parametrize("prefill", [1, 37])
def test_cached_equals_uncached(pair, prefill):
    _, ours = pair
    toks = tokens(batch=2)
    full = ours(toks, torch.arange(SEQ_LEN), all_logits=True)
    # A cache longer than needed: unwritten slots must stay invisible.
    assert (decode_all(ours, toks, prefill, cache_len=SEQ_LEN + 20) - full).abs().max() <= 1e-5


def test_chunked_prefill_equals_one_prefill(pair):
    _, ours = pair
    toks = tokens()
    one = ours(toks, torch.arange(SEQ_LEN), KVCache.for_model(ours.args, 1, SEQ_LEN, torch.float32, "cpu"),
               all_logits=True)
    cache = KVCache.for_model(ours.args, 1, SEQ_LEN, torch.float32, "cpu")
    first = ours(toks[:, :29], torch.arange(29), cache, all_logits=True)
    second = ours(toks[:, 29:], torch.arange(29, SEQ_LEN), cache, all_logits=True)
    assert (torch.cat([first, second], dim=1) - one).abs().max() <= 1e-5


def test_last_position_logits(pair):
    _, ours = pair
    toks = tokens()
    full = ours(toks, torch.arange(SEQ_LEN), all_logits=True)
    last = ours(toks, torch.arange(SEQ_LEN))
    assert last.shape == (1, 1, 160)
    assert (last[:, 0] - full[:, -1]).abs().max() <= 1e-6


def test_batch_rows_are_independent(pair):
    _, ours = pair
    toks = tokens(batch=3)
    batched = ours(toks, torch.arange(SEQ_LEN), all_logits=True)
    for b in range(3):
        alone = ours(toks[b:b + 1], torch.arange(SEQ_LEN), all_logits=True)
        assert (batched[b:b + 1] - alone).abs().max() <= 1e-5


@pytest.mark.parametrize("window", [None, 5])
def test_sdpa_matches_reference_attention(window):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 9, 16, generator=g)  # (B, H, T, D)
    k = torch.randn(2, 3, 20, 16, generator=g)  # (B, K, S, D)
    v = torch.randn(2, 3, 20, 16, generator=g)
    mask = attention_mask(torch.arange(11, 20), torch.arange(20), window)  # (T, S)
    got = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert (got - reference_attention(q, k, v, mask)).abs().max() <= 1e-5


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_matches_reference_and_one_query_steps(window, dtype):
    """The decode steps' attention on CPU: shared positions (mask (T, S)) and per-row positions (B, 1, T, S); with
    T queries, each equals its one-query call bitwise (a verify row is the decode step's row), and a longer cache
    whose extra slots are masked changes nothing (a batch row attends as the row alone)."""
    from ops.cpu import decode_attention

    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 6, 4, 16, generator=g).to(dtype)  # (B, H, T, D)
    k = torch.randn(3, 3, 20, 16, generator=g).to(dtype)  # (B, K, S, D)
    v = torch.randn(3, 3, 20, 16, generator=g).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    shared = attention_mask(torch.arange(12, 16), torch.arange(20), window)  # (T, S)
    per_row = attention_mask(torch.tensor([[1, 2, 3, 4], [9, 10, 11, 12], [16, 17, 18, 19]]), torch.arange(20),
                             window)[:, None]  # (B, 1, T, S)
    for mask in (shared, per_row):
        got = decode_attention(q, k, v, mask)
        assert (got.float() - reference_attention(q.float(), k.float(), v.float(), mask)).abs().max() <= tol
        for t in range(4):
            one = decode_attention(q[:, :, t:t + 1], k, v, mask[..., t:t + 1, :])
            assert torch.equal(got[:, :, t:t + 1], one)
        longer = [torch.cat([x, torch.randn(3, 3, 7, 16, generator=g).to(dtype)], dim=2) for x in (k, v)]
        padded = torch.cat([mask, torch.zeros(*mask.shape[:-1], 7, dtype=torch.bool)], dim=-1)  # (..., S + 7)
        assert torch.equal(decode_attention(q, *longer, padded), got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_written_decode_attention_matches_decode_attention(dtype):
    """A full step's one-token attention (ops.cpu.written_decode_attention, two reductions) against the decode steps'
    batched matmuls, for shared positions (mask (1, S)) and per-row ones (B, 1, 1, S)."""
    from ops.cpu import decode_attention, written_decode_attention

    g = torch.Generator().manual_seed(2)
    q = torch.randn(3, 6, 1, 16, generator=g).to(dtype)  # (B, H, 1, D)
    k = torch.randn(3, 3, 20, 16, generator=g).to(dtype)  # (B, K, S, D)
    v = torch.randn(3, 3, 20, 16, generator=g).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    shared = attention_mask(torch.tensor([13]), torch.arange(20), None)  # (1, S)
    per_row = attention_mask(torch.tensor([[2], [11], [19]]), torch.arange(20), 4)[:, None]  # (B, 1, 1, S)
    for mask in (shared, per_row):
        got = written_decode_attention(q, k, v, mask)
        assert got.dtype == dtype and got.shape == q.shape
        assert (got.float() - decode_attention(q, k, v, mask).float()).abs().max() <= tol


def test_sliding_window_mask_counts():
    mask = attention_mask(torch.arange(10), torch.arange(10), sliding_window=4)
    assert mask.sum(dim=1).tolist() == [1, 2, 3, 4, 4, 4, 4, 4, 4, 4]  # each query sees itself + 3 before
    assert not mask.triu(1).any()


def hf_config(**overrides) -> dict:
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
           "num_attention_heads": 2, "intermediate_size": 16}
    return {**cfg, **overrides}


def test_config_rope_layouts():
    """transformers >= 5 writes rope_parameters, older versions rope_scaling + rope_theta."""
    old = ModelArgs.from_hf_config(hf_config(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0}))
    new = ModelArgs.from_hf_config(hf_config(rope_parameters={"rope_theta": 500000.0, "rope_type": "linear",
                                                              "factor": 2.0}))
    assert old == new
    assert new.rope_theta == 500000.0 and new.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert ModelArgs.from_hf_config(hf_config(rope_parameters={"rope_type": "default"})).rope_scaling is None


@pytest.mark.parametrize("overrides, message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture 'GPT2LMHeadModel'"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "unsupported rope type 'dynamic'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' needs rope_scaling original_max"),
    ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
    ({"attention_bias": True}, "attention_bias"),
    # corrupt or hand-edited values: a ValueError naming the key, not an assert (gone under `python -O`) or a
    # TypeError/ZeroDivisionError from inside the model
    ({"num_attention_heads": 7, "num_key_value_heads": 3, "head_dim": 4},
     "7 attention heads are not a multiple of 3 key/value heads"),
    ({"head_dim": 3}, "head dim 3 is odd"),
    ({"vocab_size": None}, "config.json has no vocab_size"),
    ({"hidden_size": "8"}, r"config.json hidden_size must be a positive integer, got '8'"),
    ({"hidden_size": 8.0}, r"config.json hidden_size must be a positive integer, got 8.0"),
    ({"num_hidden_layers": True}, "config.json num_hidden_layers must be a positive integer, got True"),
    ({"num_hidden_layers": -1}, "config.json num_hidden_layers must be a positive integer, got -1"),
    ({"num_attention_heads": 0}, "config.json num_attention_heads must be a positive integer, got 0"),
    ({"num_key_value_heads": 0}, "config.json num_key_value_heads must be a positive integer, got 0"),
    ({"max_position_embeddings": 0}, "config.json max_position_embeddings must be a positive integer"),
    ({"rms_norm_eps": "1e-5"}, "config.json rms_norm_eps must be a positive number, got '1e-5'"),
    ({"rope_theta": float("inf")}, "config.json rope_theta must be a positive number, got inf"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),
    ({"architectures": "LlamaForCausalLM"}, "architectures must be a list"),
    ({"rope_scaling": "linear"}, "rope_scaling must be an object, got 'linear'"),
    ({"rope_scaling": {"rope_type": ["linear"]}}, r"unsupported rope type \['linear'\]"),
    ({"rope_scaling": {"rope_type": "linear"}}, "rope type 'linear' needs rope_scaling factor"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, "rope_scaling factor must be a positive number"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "rope type 'llama3' needs rope_scaling low_freq_factor, high_freq_factor, original_max_position_embeddings"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 16}}, "high_freq_factor 4.0 must be greater than"),
    ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 0}, "num_local_experts must be a positive"),
    ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 2, "num_experts_per_tok": 3},
     r"3 experts per token is not within 1..2 experts"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": -4}, "sliding_window must be a positive integer"),
])
def test_config_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_hf_config(hf_config(**overrides))


def test_config_that_is_not_an_object():
    with pytest.raises(ValueError, match="config.json must hold a JSON object, not a list"):
        ModelArgs.from_hf_config([hf_config()])


def test_config_defaults_still_load():
    """Optional keys unset or null take their defaults; a Mistral without a window has none."""
    args = ModelArgs.from_hf_config(hf_config(architectures=["MistralForCausalLM"], sliding_window=None,
                                              num_key_value_heads=None, head_dim=None))
    assert (args.n_kv_heads, args.head_dim, args.sliding_window, args.max_seq_len) == (2, 4, None, 4096)


def test_per_row_positions_match_single_rows(pair):
    """Rows of different lengths in one batch: right-padded prefill, then each row decodes at its own
    position. Pad slots past a row's end are overwritten before any query can see them."""
    _, ours = pair
    lengths, new = [7, 30, 18], 12
    seqs = [tokens(seq=n + new, seed=10 + i)[0] for i, n in enumerate(lengths)]
    B, T = len(seqs), max(lengths)
    prompt = torch.zeros(B, T, dtype=torch.long)
    for b, n in enumerate(lengths):
        prompt[b, :n] = seqs[b][:n]
    cache = KVCache.for_model(ours.args, B, T + new, torch.float32, "cpu")
    logits = ours(prompt, torch.arange(T).expand(B, T), cache, all_logits=True)
    got = [[logits[b, n - 1]] for b, n in enumerate(lengths)]
    for step in range(new):
        pos = torch.tensor(lengths)[:, None] + step  # (B, 1)
        token = torch.stack([seqs[b][n + step] for b, n in enumerate(lengths)])[:, None]
        out = ours(token, pos, cache)
        for b in range(B):
            got[b].append(out[b, -1])
    for b, n in enumerate(lengths):
        alone = ours(seqs[b][None], torch.arange(n + new), all_logits=True)[0, n - 1:]
        assert (torch.stack(got[b]) - alone).abs().max() <= 1e-5


def test_model_py_is_the_math_only():
    """model.py reads in one sitting (at most 350 lines) and holds no compiler, device or cache-kind policy: the CPU's
    own paths are ops/cpu.py's (step.device_paths), a rolling cache's raw keys are its own (update's k_unrotated)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model.py")
    source = open(path, encoding="utf-8").read()
    assert len(source.splitlines()) <= 350, len(source.splitlines())
    for policy in ("torch.compiler", "is_compiling", "device.type", "is_cuda", "cpu_capability", "rotates_keys",
                   "isinstance(cache"):
        assert policy not in source, policy
