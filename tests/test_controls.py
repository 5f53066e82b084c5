"""Generation controls against simple references: the sampling order, penalties in the loop, logprobs,
stop strings, batched prompts vs one at a time, and a chat session's reused cache vs a fresh run."""
import math
import random

import pytest
import torch

from generate import (Session, TextStream, complete, complete_batch, generate, generate_batch, generate_steps,
                      held_back, pick)
from sample import SamplingParams, apply_penalties, logits_to_logprobs, token_counts
from tiny_models import hf_to_ours, make_hf

torch.set_grad_enabled(False)


@pytest.fixture(scope="module")
def tiny():
    return hf_to_ours(make_hf("llama-gqa"))


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    from load import load_model
    from tokenizer import load_tokenizer

    model, path = load_model(smollm2_gguf, "cpu", torch.float32)
    return model, load_tokenizer(path)


def last_logits(model, seq: list[int]) -> torch.Tensor:
    """(V,) next-token logits of `seq` from one uncached forward: the simple path."""
    return model(torch.tensor([seq]), torch.arange(len(seq)))[0, -1]


# The sampling order, through the function the generation loop calls.

def test_order_penalties_temperature_top_k_top_p_min_p():
    p = torch.tensor([0.04, 0.4, 0.06, 0.3, 0.2])
    seen = torch.tensor([[False, True, False, False, False]])
    generated = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0]])  # token 1 was generated once
    params = SamplingParams(temperature=0.5, top_k=4, top_p=0.8, min_p=0.5, presence_penalty=0.5)
    _, (step,) = pick(p.log()[None], params, torch.Generator().manual_seed(0), seen, generated, logprobs=5)
    w = p * torch.tensor([1, math.exp(-0.5), 1, 1, 1])  # presence penalty: token 1's logit - 0.5; top is now 3
    w = w ** 2  # temperature 0.5 squares the odds: [.0082, .3033, .0186, .4638, .2061] normalized
    w[0] = 0  # top-k 4 drops the least likely
    w[2] = 0  # top-p 0.8: tokens 3, 1 (.7734) then 4 reach it; token 2 is dropped
    w[4] = 0  # min-p 0.5: token 4 (.2118) is under half of token 3 (.4766)
    expected = w / w.sum()  # [0, .3954, 0, .6046, 0]
    got = torch.zeros(5)
    for i, lp in step.top:
        got[i] = math.exp(lp)
    assert torch.allclose(got, expected, atol=1e-6)
    assert [i for i, _ in step.top] == [3, 1]  # only tokens with probability left, most likely first
    assert step.token in (1, 3)
    # pick updates the penalty state with the token it drew
    assert generated[0, step.token] == 2.0 if step.token == 1 else generated[0, step.token] == 1.0


def greedy_penalized_uncached(model, prompt, n, params):
    """Greedy with penalties recomputed from scratch every step, on an uncached forward."""
    seq = list(prompt)
    for _ in range(n):
        seen = token_counts([seq], model.args.vocab_size) > 0
        generated = token_counts([seq[len(prompt):]], model.args.vocab_size)
        logits = apply_penalties(last_logits(model, seq)[None], seen, generated, params.repetition_penalty,
                                 params.presence_penalty, params.frequency_penalty)
        seq.append(logits.argmax(-1).item())
    return seq[len(prompt):]


def test_penalized_greedy_matches_uncached_reference(tiny):
    prompt = [5, 17, 42, 99, 3, 5, 5]
    params = SamplingParams(repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.4)
    got = list(generate(tiny, prompt, 30, repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.4))
    assert got == greedy_penalized_uncached(tiny, prompt, 30, params)
    assert got != list(generate(tiny, prompt, 30))  # the penalties changed something


# Logprobs

def test_logprobs_at_temperature_1_are_the_models_log_softmax(tiny):
    prompt = [5, 17, 42, 99, 3]
    steps = list(generate_steps(tiny, prompt, 20, SamplingParams(temperature=1.0), torch.Generator().manual_seed(1),
                                logprobs=3))
    seq = list(prompt)
    for step in steps:
        ref = torch.log_softmax(last_logits(tiny, seq), -1)
        assert abs(step.logprob - ref[step.token].item()) <= 1e-5
        top_lp, top_ids = ref.topk(3)
        assert [i for i, _ in step.top] == top_ids.tolist()
        assert max(abs(v - r) for (_, v), r in zip(step.top, top_lp.tolist())) <= 1e-5
        seq.append(step.token)


def test_logprobs_are_of_the_processed_distribution(tiny):
    prompt = [5, 17, 42, 99, 3]
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9)
    steps = list(generate_steps(tiny, prompt, 20, params, torch.Generator().manual_seed(2), logprobs=50))
    seq = list(prompt)
    for step in steps:
        ref = logits_to_logprobs(last_logits(tiny, seq)[None], 0.7, 20, 0.9)[0]
        assert abs(step.logprob - ref[step.token].item()) <= 1e-5
        kept = int((ref > float("-inf")).sum())
        assert len(step.top) == kept <= 20  # fewer than 50 alternatives: top-k/top-p removed the rest
        assert abs(sum(math.exp(v) for _, v in step.top) - 1) < 1e-5
        seq.append(step.token)


def test_greedy_logprobs_are_the_unfiltered_distribution(tiny):
    prompt = [5, 17, 42]
    (step,) = generate_steps(tiny, prompt, 1, SamplingParams(temperature=0.0, top_k=2), logprobs=4)
    ref = torch.log_softmax(last_logits(tiny, prompt), -1)
    assert step.token == ref.argmax().item() and abs(step.logprob - ref.max().item()) <= 1e-5
    assert len(step.top) == 4


# Stop strings, on the SmolLM2 tokenizer (byte-level BPE, characters split over tokens)

def stream_pieces(tokenizer, ids, stop):
    """Push ids until a stop string is found (as complete() does); flush at the end of the ids."""
    text, pieces = TextStream(tokenizer, stop), []
    for i in ids:
        pieces.append(text.push(i))
        if text.stopped:
            return text, pieces
    pieces.append(text.flush())
    return text, pieces


def reference_cut(tokenizer, ids, stop):
    """The non-streamed answer: decode everything, cut at the earliest stop string."""
    full = tokenizer.decode(ids)
    starts = [full.find(s) for s in stop if s in full]
    return full[:min(starts)] if starts else full


def test_stop_string_spanning_tokens_is_held_back_and_never_printed(smol):
    _, tok = smol
    ids = tok.encode("The answer is: 42")  # 'The', ' answer', ' is', ':', ' ', '4', '2'
    text, pieces = stream_pieces(tok, ids, ["answer is:"])
    assert pieces[:2] == ["The", " "]  # 'answer' might start the stop string: held back
    assert pieces[2] == ""  # 'answer is' still might
    assert text.stopped and text.text == "The " == "".join(pieces)
    assert len(pieces) == 4  # stopped at ':', the token that completed it


def test_stop_string_prefix_that_does_not_complete(smol):
    _, tok = smol
    ids = tok.encode("The answer is: 42")
    text, pieces = stream_pieces(tok, ids, ["answer was", "42!"])
    assert pieces[1] == " " and pieces[2] == "answer is"  # released once ' is' rules 'answer was' out
    assert pieces[-2:] == ["", "42"]  # '42' might start '42!' until the generation ends
    assert not text.stopped and "".join(pieces) == text.text == "The answer is: 42"


def test_stop_string_inside_a_multibyte_character_run(smol):
    _, tok = smol
    ids = tok.encode("naïve café 日本語 ok")
    text, pieces = stream_pieces(tok, ids, ["本語"])
    assert text.stopped and "".join(pieces) == text.text == "naïve café 日"


def test_streamed_text_equals_the_cut_full_decode_for_many_stop_strings(smol):
    _, tok = smol
    source = "Hello world, hello there!\n\nThe answer is: 42. naïve café 日本語 ok"
    ids = tok.encode(source)
    rng = random.Random(0)
    for _ in range(60):
        a = rng.randrange(len(source))
        stops = [source[a:a + rng.randint(1, 6)], rng.choice(["xyz", "42!", "lo w", "e"])]
        text, pieces = stream_pieces(tok, ids, stops)
        expected = reference_cut(tok, ids, stops)
        assert "".join(pieces) == text.text == expected, stops
        assert not any(s in text.text for s in stops)


def test_held_back():
    assert held_back("The answer", ["answer is"]) == 6
    assert held_back("abcab", ["abcabd"]) == 5  # the longest possible start wins
    assert held_back("abc", ["xyz", "c!"]) == 1
    assert held_back("abc", ["abc"]) == 0  # a complete match is not held back: it is cut


def test_empty_stop_string_is_rejected(smol):
    _, tok = smol
    with pytest.raises(ValueError, match="stop strings must be non-empty, got ''"):
        TextStream(tok, ["ok", ""])


def test_complete_with_a_stop_string_over_several_tokens(smol):
    model, tok = smol
    prompt = tok.encode("The capital of France is")
    plain = complete(model, tok, prompt, 8)  # ' Paris.\n\nThe answer is:'
    assert plain.text == " Paris.\n\nThe answer is:" and plain.finish_reason == "length"
    pieces = []
    c = complete(model, tok, prompt, 8, stop=["\n\nThe answer"], on_text=pieces.append)
    assert c.text == "".join(pieces) == " Paris."
    assert c.finish_reason == "stop" and c.tokens == plain.tokens[:6]  # ends at ' answer', which completed it
    # A prefix of the stop string ('\n\nThe ') appears, but it never completes: the text is unchanged.
    pieces = []
    c = complete(model, tok, prompt, 8, stop=["\n\nThe question"], on_text=pieces.append)
    assert c.text == "".join(pieces) == plain.text and c.finish_reason == "length"


# Batched prompts vs one at a time

def test_batched_greedy_matches_one_at_a_time(tiny):
    g = torch.Generator().manual_seed(0)
    lengths = [3, 17, 9, 40, 250]  # the last one reaches the 256-token context before max_new_tokens
    prompts = [torch.randint(1, 160, (n,), generator=g).tolist() for n in lengths]
    alone = [list(generate(tiny, p, 20)) for p in prompts]
    stop = alone[1][4]  # ends row 1 early, and any other row that produces it
    alone = [list(generate(tiny, p, 20, stop_ids=[stop])) for p in prompts]
    rows = [[] for _ in prompts]
    for step_rows in generate_batch(tiny, prompts, 20, stop_ids=[stop]):
        for b, step in enumerate(step_rows):
            if step is not None:
                rows[b].append(step.token)
    assert rows == alone
    assert len(alone[4]) == 256 - 250 + 1 and len(alone[1]) <= 5 and len({len(r) for r in alone}) >= 3


def test_batched_penalties_and_logprobs_match_one_at_a_time(tiny):
    prompts = [[5, 5, 6], [9, 8, 7, 6, 5, 4, 3, 2, 1, 5, 5], [42] * 6]
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2)
    alone = [list(generate_steps(tiny, p, 12, params, logprobs=2)) for p in prompts]
    rows = [[] for _ in prompts]
    for step_rows in generate_batch(tiny, prompts, 12, params, logprobs=2):
        for b, step in enumerate(step_rows):
            rows[b].append(step)
    for got, ref in zip(rows, alone):
        assert [s.token for s in got] == [s.token for s in ref]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(got, ref)) <= 1e-5


def test_batched_smollm2_matches_one_at_a_time(smol):
    model, tok = smol
    texts = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived",
             "def fibonacci(n):", "List three colors:"]
    prompts = [tok.encode(t) for t in texts]
    assert len({len(p) for p in prompts}) == 4
    batch = complete_batch(model, tok, prompts, 16, stop=["\n\n"])
    for c, prompt in zip(batch, prompts):
        ref = complete(model, tok, prompt, 16, stop=["\n\n"])
        assert (c.tokens, c.text, c.finish_reason) == (ref.tokens, ref.text, ref.finish_reason)
    assert {c.finish_reason for c in batch} == {"stop", "length"}


def test_batch_rejects_no_prompts(tiny):
    with pytest.raises(ValueError, match="no prompts"):
        next(generate_batch(tiny, [], 4))


# A chat session: the cache is kept across turns

def test_session_prefills_only_the_new_tokens(tiny):
    session = Session(tiny)
    turn1 = [5, 17, 42, 99, 3]
    out1 = list(generate(tiny, turn1, 10, session=session))
    # The last generated token was never fed, so it is not in the cache.
    assert session.tokens == turn1 + out1[:-1] and session.cache.max_seq_len == 15
    turn2 = turn1 + out1 + [7, 8, 9]
    assert session.reusable(turn2) == len(turn1) + len(out1) - 1
    out2 = list(generate(tiny, turn2, 10, session=session))
    assert session.cache.max_seq_len == 30  # grew (doubling) to hold 18 + 10, keeping what it held
    assert out2 == list(generate(tiny, turn2, 10))
    # History that differs from the cache (an edited turn) reuses only the common prefix.
    turn3 = turn2[:4] + [1, 2] + turn2[6:] + out2 + [11]
    assert session.reusable(turn3) == 4
    assert list(generate(tiny, turn3, 10, session=session)) == list(generate(tiny, turn3, 10))


def test_session_cache_limit(tiny):
    session = Session(tiny, max_seq_len=16)
    with pytest.raises(ValueError, match="the prompt is 20 tokens, longer than the session's limit of 15"):
        list(generate(tiny, list(range(1, 21)), 4, session=session))
    assert len(list(generate(tiny, list(range(1, 11)), 40, session=session))) == 16 - 10 + 1


def test_smollm2_chat_second_turn_matches_a_fresh_run(smol):
    model, tok = smol
    session = Session(model, max_seq_len=512)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt1 = tok.encode(tok.apply_chat_template(messages), bos=False)
    first = complete(model, tok, prompt1, 40, session=session)
    assert first.finish_reason == "eos" and first.prefilled == len(prompt1)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And of Germany?"}]
    prompt2 = tok.encode(tok.apply_chat_template(messages), bos=False)
    second = complete(model, tok, prompt2, 40, session=session)
    fresh = complete(model, tok, prompt2, 40)
    assert second.tokens == fresh.tokens and second.text == fresh.text
    # Only the new turn was prefilled: everything up to the reply's last token (EOS, never fed) was cached.
    assert second.prefilled == len(prompt2) - (len(prompt1) + len(first.tokens) - 1)
    assert second.prefilled < 20 < len(prompt2)
