"""The rolling cache with attention sinks (sinks.py): its slot bookkeeping against a list that is simply appended
to and cut, its logits against the full cache while the sequence fits, its rotation rule against attention
computed from scratch over the tokens it keeps, the paged form against the static one, and the decode loops
(single, batched, multi-turn) running past the model's context."""
import copy
import dataclasses

import pytest
import torch

from decode import Session, generate, generate_batch
from kvcache import BlockPool, KVCache, LayerKVCache
from model import apply_rope
from params import SamplingParams
from features.sinks import SinkKVCache, SinkLayer, SinkWindow, slot_of, slot_positions
from tiny_models import last_logits


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def kept(n: int, sinks: int, window: int) -> list[int]:
    """The positions a cache of `window` slots keeping `sinks` holds after positions 0..n-1, in cache order."""
    return list(range(min(n, sinks))) + list(range(max(sinks, n - (window - sinks)), n))


@pytest.mark.parametrize("sinks,window", [(0, 5), (2, 7), (4, 8), (1, 2), (3, 16)])
def test_slot_positions_follow_the_positions_kept(sinks, window):
    """Written one position at a time into slot_of's slots, each slot holds a kept position, and slot_positions
    numbers the slots by their rank in cache order (sinks, then the window); empty slots get `window`."""
    slots = [None] * window
    for last in range(4 * window):
        slots[slot_of(torch.tensor(last), sinks, window)] = last
        order = kept(last + 1, sinks, window)
        assert sorted(p for p in slots if p is not None) == order
        want = [window if p is None else order.index(p) for p in slots]
        assert slot_positions(torch.tensor([last]), sinks, window, window).tolist() == want
        rows = slot_positions(torch.tensor([[last], [0]]), sinks, window, window + 3)  # (2, W + 3): padded slots
        assert rows[0].tolist() == want + [window] * 3 and rows[1, 0] == 0 and (rows[1, 1:] == window).all()


def feed(model, tokens: list[int], cache, chunk: int) -> torch.Tensor:
    """Logits (1, n, V) after each token: the first `chunk` in one forward, then one token a forward."""
    x = torch.tensor([tokens])
    out = [model(x[:, :chunk], torch.arange(chunk), cache, all_logits=True)]
    out += [model(x[:, t:t + 1], torch.tensor([t]), cache) for t in range(chunk, len(tokens))]
    return torch.cat(out, dim=1)


@torch.inference_mode()
def test_sinks_equal_the_full_cache_while_the_sequence_fits(tiny):
    """Up to `window` positions the rolling cache holds what a KVCache of as many slots holds, keys rotated as they
    are read instead of as they are written: the same logits, bit for bit (in model dtype), per row of a batch
    too; int8 keys quantized before RoPE stay as close to float as the int8 KVCache does."""
    W, shape = 24, SinkWindow(4, 24)
    tokens = torch.randint(1, 160, (W,), generator=torch.Generator().manual_seed(0)).tolist()
    full = feed(tiny, tokens, KVCache.for_model(tiny.args, 1, W, torch.float32, "cpu"), 10)
    assert torch.equal(feed(tiny, tokens, SinkKVCache.for_model(tiny, 1, shape), 10), full)
    int8 = feed(tiny, tokens, SinkKVCache.for_model(tiny, 1, shape, kv_dtype="int8"), 10)
    assert rel_err(int8, full) < 0.02
    # a batch at per-row positions, row 1 four positions behind row 0, against the same batch in a KVCache
    batch = []
    for cache in (KVCache.for_model(tiny.args, 2, W, torch.float32, "cpu"), SinkKVCache.for_model(tiny, 2, shape)):
        tiny(torch.tensor([tokens[:10], tokens[:10]]), torch.arange(10), cache)
        pos, out = torch.tensor([[10], [6]]), []
        for _ in range(W - 10):
            out.append(tiny(torch.tensor([[tokens[pos[0, 0]]], [tokens[pos[1, 0]]]]), pos, cache))  # (2, 1, V)
            pos += 1
        batch.append(torch.cat(out, dim=1))
    assert torch.equal(batch[1], batch[0])


def one_layer(model):
    """The model cut to its first layer: its keys depend on the tokens alone, not on what the cache held before."""
    cut = copy.deepcopy(model)
    cut.layers = cut.layers[:1]
    cut.args = dataclasses.replace(model.args, n_layers=1)
    return cut


@torch.inference_mode()
def test_gemma3_sinks_rotate_each_layer_by_its_own_table():
    """Gemma 3's sliding layers have their own RoPE base: the rolling cache rotates each layer's keys by that layer's
    table, so while the sequence fits it gives the full cache's logits, bit for bit."""
    from tiny_models import hf_to_ours, make_hf

    model = hf_to_ours(make_hf("gemma3"))
    W = 24
    tokens = torch.randint(1, 160, (W,), generator=torch.Generator().manual_seed(0)).tolist()
    full = feed(model, tokens, KVCache.for_model(model.args, 1, W, torch.float32, "cpu"), 10)
    assert torch.equal(feed(model, tokens, SinkKVCache.for_model(model, 1, SinkWindow(4, W)), 10), full)


@pytest.mark.parametrize("sinks", [4, 0])
@torch.inference_mode()
def test_rotation_rule_is_exact_against_attention_from_scratch(tiny, sinks):
    """Past the window, each step's logits are those of an uncached forward over just the tokens the cache keeps,
    at positions 0..n-1 in cache order (StreamingLLM's positions), for a one-layer model (whose keys do not depend
    on what was evicted before): the ring's slots, their read-time rotation and the query's position are right."""
    model, W = one_layer(tiny), 16
    tokens = torch.randint(1, 160, (3 * W + 5,), generator=torch.Generator().manual_seed(1)).tolist()
    got = feed(model, tokens, SinkKVCache.for_model(model, 1, SinkWindow(sinks, W)), 9)[0]  # (n, V)
    for n in range(W - 3, len(tokens) + 1):
        want = last_logits(model, [tokens[p] for p in kept(n, sinks, W)])
        assert (got[n - 1] - want).abs().max() < 1e-5, n


@torch.inference_mode()
def test_keys_read_are_the_kept_keys_rotated_from_scratch(tiny):
    """The layer rule alone, bit for bit: after every write the keys a SinkLayer returns at its visible slots, in
    cache order, are the raw keys of the positions kept rotated at 0..n-1; values are as written."""
    S, W, K, D = 3, 10, 2, tiny.args.head_dim
    layer = SinkLayer(LayerKVCache(1, K, W, D, torch.float32, "cpu"), S, W, tiny.rope_cos, tiny.rope_sin)
    raw_k, raw_v = torch.randn(1, K, 4 * W, D), torch.randn(1, K, 4 * W, D)  # (1, K, positions, D)
    for p in range(4 * W):
        keys, values = layer.update(torch.tensor([p]), None, raw_v[:, :, p:p + 1], k_unrotated=raw_k[:, :, p:p + 1])
        k_pos = slot_positions(torch.tensor([p]), S, W, W)
        order = kept(p + 1, S, W)
        visible = [int((k_pos == i).nonzero()) for i in range(len(order))]  # slot of cache position i
        n = len(order)
        want = apply_rope(raw_k[:, :, order], tiny.rope_cos[:n], tiny.rope_sin[:n])
        assert torch.equal(keys[:, :, visible], want) and torch.equal(values[:, :, visible], raw_v[:, :, order])


@torch.inference_mode()
def test_paged_sinks_equal_static_sinks(tiny):
    """Two rows at different positions past the window, their W slots in blocks scattered through a pool: the
    logits of the paged rolling cache equal each row's static one."""
    shape, bs = SinkWindow(4, 16), 4
    pool = BlockPool.for_model(tiny.args, 12, bs, torch.float32, "cpu")
    tables = torch.tensor([[5, 3, 9, 1], [2, 11, 8, 6]])  # (2, 4): the 16 slots of each row
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(1, 160, (50,), generator=g).tolist() for _ in range(2)]
    statics = [SinkKVCache.for_model(tiny, 1, shape) for _ in rows]
    for b, tokens in enumerate(rows):  # prefill row 0 with 12 tokens, row 1 with 7, in the pool and alone
        n = (12, 7)[b]
        x, pos = torch.tensor([tokens[:n]]), torch.arange(n)
        got = tiny(x, pos, SinkKVCache.paged(tiny, pool, tables[b:b + 1], shape), all_logits=True)
        assert (got - tiny(x, pos, statics[b], all_logits=True)).abs().max() <= 1e-5
    pos = torch.tensor([[12], [7]])
    for _ in range(36):  # row 0 to position 47, row 1 to 42: both turn the ring twice
        x = torch.tensor([[rows[b][pos[b, 0]]] for b in range(2)])  # (2, 1)
        got = tiny(x, pos, SinkKVCache.paged(tiny, pool, tables, shape))[:, -1]  # (2, V)
        for b in range(2):
            want = tiny(x[b:b + 1], pos[b], statics[b])[0, -1]
            assert (got[b] - want).abs().max() <= 1e-5
        pos += 1


@torch.inference_mode()
def test_rows_with_their_own_sink_counts_equal_each_alone(tiny):
    """SinkWindow((0, 4), W): one batch whose rows keep 0 and 4 sinks (streaming.py's comparison) gives each row's
    logits of a cache with that count alone, past the window."""
    W = 16
    tokens = torch.randint(1, 160, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    x = torch.tensor([tokens] * 2)
    both = SinkKVCache.for_model(tiny, 2, SinkWindow((0, 4), W))
    got = [tiny(x[:, :W], torch.arange(W).expand(2, W), both, all_logits=True)]
    got += [tiny(x[:, t:t + 1], torch.full((2, 1), t), both) for t in range(W, len(tokens))]
    got = torch.cat(got, dim=1)  # (2, n, V)
    for b, sinks in enumerate((0, 4)):
        want = feed(tiny, tokens, SinkKVCache.for_model(tiny, 1, SinkWindow(sinks, W)), W)[0]
        assert (got[b] - want).abs().max() < 1e-5


def greedy_stream(model, prompt: list[int], n: int, shape: SinkWindow) -> list[int]:
    """The plain loop over a rolling cache: what of the prompt lies before the window in one forward, the rest
    and the n - 1 tokens fed back one a forward, greedy."""
    cache, first = SinkKVCache.for_model(model, 1, shape), min(len(prompt), shape.window)
    logits = model(torch.tensor([prompt[:first]]), torch.arange(first), cache)[0, -1]
    for p in range(first, len(prompt)):
        logits = model(torch.tensor([[prompt[p]]]), torch.tensor([p]), cache)[0, -1]
    out = [int(logits.argmax())]
    for p in range(len(prompt), len(prompt) + n - 1):
        out.append(int(model(torch.tensor([[out[-1]]]), torch.tensor([p]), cache)[0, -1].argmax()))
    return out


def ids(tokens) -> list[int]:
    return [t.id for t in tokens]


@pytest.fixture(scope="module")
def short(tiny):
    """The tiny model with a context of 48 positions."""
    model = copy.deepcopy(tiny)
    model.args = dataclasses.replace(tiny.args, max_seq_len=48)
    model.reset_rope()
    return model


@torch.inference_mode()
def test_generate_runs_past_the_context_through_a_window(tiny, short):
    """decode.generate with a window: the tokens of the plain loop over a rolling cache, past the model's context
    (48 positions: 100); and while the sequence fits the window, those of generate without one."""
    prompt = list(range(3, 23))
    shape = SinkWindow(4, 32)
    plain = list(generate(short, prompt, max_new_tokens=80))  # without a window, the context ends it ...
    assert len(plain) == 48 - 20 + 1 and plain[-1].end == "length"
    got = ids(generate(short, prompt, max_new_tokens=80, window=shape))  # ... with one, 100 positions
    assert len(got) == 80 and got == greedy_stream(short, prompt, 80, shape)
    with pytest.raises(ValueError, match="cache_window .* 64 is larger than the model's context of 48"):
        next(generate(short, prompt, max_new_tokens=80, window=SinkWindow(4, 64)))
    assert ids(generate(tiny, prompt, max_new_tokens=30, window=SinkWindow(4, 64))) == \
        ids(generate(tiny, prompt, max_new_tokens=30))
    # a prompt longer than the window is fed one token a forward past it
    long = list(range(3, 103))
    assert ids(generate(tiny, long, max_new_tokens=5, window=shape)) == greedy_stream(tiny, long, 5, shape)


@torch.inference_mode()
def test_batch_rows_through_a_window_equal_each_alone(tiny):
    """generate_batch with a window, one prompt longer than the window: each row's tokens are its own alone."""
    prompts, shape = [list(range(5, 25)), list(range(40, 85))], SinkWindow(4, 32)
    rows = list(generate_batch(tiny, prompts, max_new_tokens=60, window=shape))
    for b, prompt in enumerate(prompts):
        assert [r[b].id for r in rows] == ids(generate(tiny, prompt, max_new_tokens=60, window=shape))


@torch.inference_mode()
def test_a_session_through_a_window_chats_past_it(tiny):
    """Multi-turn through a rolling cache: the second turn feeds only its new tokens to a cache that has turned
    and gives the tokens a fresh run over the whole conversation gives; a conversation that departs from what the
    turned cache holds is recomputed from its start."""
    shape = SinkWindow(4, 32)
    session = Session(tiny, window=shape)
    first = list(range(3, 23))
    reply = ids(generate(tiny, first, max_new_tokens=40, session=session))
    second = first + reply + [7, 8, 9, 10]
    assert session.reusable(second) == len(first) + 39  # all it fed: the last reply token is fed with the turn
    got = ids(generate(tiny, second, max_new_tokens=20, session=session))
    assert got == ids(generate(tiny, second, max_new_tokens=20, window=shape))
    edited = second[:10] + [99] + second[11:]
    assert session.reusable(edited) == 0
    assert ids(generate(tiny, edited, max_new_tokens=20, session=session)) == \
        ids(generate(tiny, edited, max_new_tokens=20, window=shape))


@pytest.mark.parametrize("flags,fragment", [
    (["--sink-tokens", "4"], "--sink-tokens needs --cache-window"),
    (["--cache-window", "4", "--sink-tokens", "4"], "must be larger than the 4 sink tokens, got 4"),
    (["--cache-window", "8", "--sink-tokens", "-1"], "sink_tokens (--sink-tokens) must be >= 0, got -1"),
    (["--cache-window", "64", "--ctx-size", "32"], "it cannot take --ctx-size"),
    (["--cache-window", "64", "--prompt-lookup"], "--cache-window is not supported with speculative decoding"),
])
def test_window_flags_are_one_line_errors(cli_error, flags, fragment):
    import generate as cli

    assert fragment in cli_error(cli.main, ["--prompt", "hi", *flags])


def test_generate_cli_runs_past_the_context(cli_error, capsys, tiny_text_dir):
    """generate.py --cache-window on the tiny folder (context 256): 300 new tokens after the prompt, the summary
    line naming the window; a window past the context is one error line naming it."""
    import generate as cli

    run = ["--model", tiny_text_dir, "--prompt", "hi", "--temperature", "0", "--compile", "none", "--dtype",
           "float32", "--ignore-eos"]
    assert cli.main([*run, "--max-new-tokens", "300", "--cache-window", "32", "--sink-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "generated tokens 300 |" in err and "| kv window 32 (2 sinks)" in err
    assert "cache_window (--cache-window) 512 is larger than the model's context of 256" in \
        cli_error(cli.main, [*run, "--cache-window", "512"])


@torch.inference_mode()
def test_engine_through_a_window_serves_past_the_context(short):
    """The engine with cache_window (paged rolling cache, blocks as a ring): a prompt longer than the window and
    two sampled choices of another (forks sharing a ring that each rewrites: copy on write), 60 tokens each past
    the model's context of 48. Each choice is decode.generate with the window (choice i seeded seed + i), no
    sequence ever holds more than the window's blocks, and every block is given back. Prefix caching is refused
    with a window."""
    from serving.engine import Engine, EngineConfig, Request
    from helpers import ToyTokenizer

    shape = SinkWindow(4, 32)
    with pytest.raises(ValueError, match="needs prefix caching off"):
        Engine(short, ToyTokenizer(), EngineConfig(block_size=4, num_blocks=40, cache_window=32))
    cfg = EngineConfig(block_size=4, num_blocks=40, cache_window=32, sink_tokens=4, prefix_caching=False,
                       token_budget=24, max_running=8)
    eng = Engine(short, ToyTokenizer(), cfg)
    sampled = SamplingParams(temperature=1.0, ignore_eos=True)
    requests = [(list(range(40, 85)), SamplingParams(ignore_eos=True), 1), (list(range(90, 100)), sampled, 2)]
    events, most = {}, 0
    for prompt, params, n in requests:
        eng.submit(Request(prompt, params, 60, seed=7, n=n,
                           on_event=lambda e: events.setdefault((e.request_id, e.index), []).extend(e.token_ids)))
    while eng.step():
        most = max(most, max((len(s.blocks) for s in eng.scheduler.running), default=0))
    assert most == 32 // 4 and eng.stats()["blocks_used"] == 0 and all(r == 0 for r in eng.blocks.refs)
    assert sorted(events) == [(0, 0), (1, 0), (1, 1)]
    for (rid, i), got in events.items():
        prompt, params, _ = requests[rid]
        want = generate(short, prompt, max_new_tokens=60, params=params, window=shape,
                        generator=torch.Generator().manual_seed(7 + i))
        assert got == ids(want), (rid, i)


def test_serve_flags_make_a_rolling_engine(tiny, tiny_text_dir):
    """serve.py --cache-window W --sink-tokens S: the engine's per-server setting, prefix caching off, and a
    --max-model-len past the model's context (256) that the server then allows; the flags' errors."""
    from serve import check_flags, make_engine, parse_args, serve_config
    from serving.app import Server
    from tokenizer import load_tokenizer

    args = parse_args(["--cache-window", "32", "--sink-tokens", "2", "--max-model-len", "1000"])
    check_flags(args)
    tokenizer = load_tokenizer(tiny_text_dir)
    engine = make_engine(args, tiny, tokenizer)
    cfg = engine.config
    assert (cfg.cache_window, cfg.sink_tokens, cfg.prefix_caching) == (32, 2, False)
    assert Server(engine, tokenizer, "tiny", serve_config(args)).max_len == 1000
    for flags, fragment in ((["--sink-tokens", "2"], "--sink-tokens needs --cache-window"),
                            (["--cache-window", "2", "--sink-tokens", "2"], "must be larger than the 2 sink")):
        with pytest.raises(ValueError, match=fragment):
            check_flags(parse_args(flags))
    with pytest.raises(ValueError, match="512 is larger than the model's context of 256"):
        make_engine(parse_args(["--cache-window", "512"]), tiny, tokenizer)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["blocks", "full"])
@torch.inference_mode()
def test_compiled_decode_steps_through_a_window_equal_eager(tiny, mode):
    """The rolling cache keeps the compiled step's fixed shapes: a compiled step (its graph traced through
    SinkLayer's ring writes and read-time rotation) past the window gives the eager step's logits, per-row
    positions too."""
    from step import Step

    shape = SinkWindow(4, 16)
    tokens = torch.randint(1, 160, (2, 40), generator=torch.Generator().manual_seed(4))
    out = []
    for step in (Step(tiny), Step(tiny, mode)):
        cache = SinkKVCache.for_model(tiny, 2, shape)
        step(tokens[:, :10], torch.arange(10), cache)
        pos, logits = torch.tensor([[10], [8]]), []
        for _ in range(30):
            logits.append(step(torch.stack([tokens[0, pos[0]], tokens[1, pos[1]]]), pos, cache))  # (2, V)
            pos += 1
        out.append(torch.stack(logits))
    assert (out[1] - out[0]).abs().max() < 1e-4
