"""From tokens to text: stop strings held back and cut on a real byte-level tokenizer (characters split over
tokens), and complete()/complete_batch() over hand-made streams of Tokens: EOS, length, stop strings, streamed
pieces that concatenate to the text, and the stream closed once a stop string ends it."""
import json
import random

import pytest

from helpers import ToyTokenizer, complete_greedy
from params import Token
from text import (MAX_STOP_CHARS, MAX_STOP_STRINGS, Completion, StopStrings, TextStream, check_stop, complete,
                  complete_batch, completion_json, finish_reason, push_token)


# ---- TextStream on the SmolLM2 tokenizer (byte-level BPE, characters split over tokens) ----

def stream_pieces(tokenizer, ids, stop):
    """Push ids until a stop string is found (as complete() does); flush at the end of the ids."""
    text, pieces = TextStream(tokenizer, stop), []
    for i in ids:
        pieces.append(text.push(i))
        if text.stopped:
            return text, pieces
    pieces.append(text.flush())
    return text, pieces


def reference_cut(text: str, stop) -> str:
    """The non-streamed answer: the text up to the first character that completes a stop string, without the
    longest stop string ending there."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stop if text[:end].endswith(s)]
        if ending:
            return text[:end - max(map(len, ending))]
    return text


def test_stop_string_spanning_tokens_is_held_back_and_never_printed(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("The answer is: 42")  # 'The', ' answer', ' is', ':', ' ', '4', '2'
    text, pieces = stream_pieces(tok, ids, ["answer is:"])
    assert pieces[:2] == ["The", " "]  # 'answer' might start the stop string: held back
    assert pieces[2] == ""  # 'answer is' still might
    assert text.stopped and text.text == "The " == "".join(pieces)
    assert len(pieces) == 4  # stopped at ':', the token that completed it


def test_stop_string_prefix_that_does_not_complete(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("The answer is: 42")
    text, pieces = stream_pieces(tok, ids, ["answer was", "42!"])
    assert pieces[1] == " " and pieces[2] == "answer is"  # released once ' is' rules 'answer was' out
    assert pieces[-2:] == ["", "42"]  # '42' might start '42!' until the generation ends
    assert not text.stopped and "".join(pieces) == text.text == "The answer is: 42"


def test_stop_string_inside_a_multibyte_character_run(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("naïve café 日本語 ok")
    text, pieces = stream_pieces(tok, ids, ["本語"])
    assert text.stopped and "".join(pieces) == text.text == "naïve café 日"


def test_streamed_text_equals_the_cut_full_decode_for_many_stop_strings(smollm2_tokenizer):
    tok = smollm2_tokenizer
    source = "Hello world, hello there!\n\nThe answer is: 42. naïve café 日本語 ok"
    ids = tok.encode(source)
    rng = random.Random(0)
    for _ in range(60):
        a = rng.randrange(len(source))
        stops = [source[a:a + rng.randint(1, 6)], rng.choice(["xyz", "42!", "lo w", "e"])]
        text, pieces = stream_pieces(tok, ids, stops)
        expected = reference_cut(tok.decode(ids), stops)
        assert "".join(pieces) == text.text == expected, stops
        assert not any(s in text.text for s in stops)


def test_held_back():
    assert StopStrings(["answer is"]).held_back("The answer") == 6
    assert StopStrings(["abcabd"]).held_back("abcab") == 5  # the longest possible start wins
    assert StopStrings(["xyz", "c!"]).held_back("abc") == 1
    assert StopStrings(["abc"]).held_back("abc") == 0  # a complete match is not held back: it is cut
    assert StopStrings(["abx", "b", "bcd"]).held_back("zab") == 2
    assert StopStrings([]).held_back("abc") == 0


def test_first_stop_string_to_complete_wins():
    tok = ToyTokenizer()
    for stop, want in [(["<3>", "<2><3><4>"], "<1><2>"),  # <3> completes first, though the other starts earlier
                       (["<2><3>", "3>"], "<1>"),  # both complete at the same character: the longest one is cut
                       (["<2><3>", "<9>"], "<1>")]:
        text, pieces = stream_pieces(tok, [1, 2, 3, 4, 5], stop)
        assert text.stopped and "".join(pieces) == text.text == want == reference_cut("<1><2><3><4><5>", stop)


def test_many_overlapping_stop_strings_match_the_reference():
    """Random stop strings over a small alphabet (prefixes, suffixes and repeats of each other) and random token
    texts: the streamed text is always the reference cut."""
    rng = random.Random(1)

    class Chunks:  # token i is the text chunks[i]
        def stream(self):
            class Decoder:
                def push(self, token):
                    return chunks[token]

                def flush(self):
                    return ""
            return Decoder()

    for _ in range(300):
        chunks = ["".join(rng.choice("ab") for _ in range(rng.randint(0, 4))) for _ in range(12)]
        stop = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 7))) for _ in range(rng.randint(1, 6))]
        text, pieces = stream_pieces(Chunks(), range(len(chunks)), stop)
        assert "".join(pieces) == text.text == reference_cut("".join(chunks), stop), (chunks, stop)


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError, match="stop strings must be non-empty, got ''"):
        check_stop(["ok", ""])
    with pytest.raises(ValueError, match="stop strings must be non-empty, got ''"):
        TextStream(ToyTokenizer(), ["ok", ""])


def test_stop_string_limits():
    check_stop(["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS)  # at the limits: accepted
    with pytest.raises(ValueError, match=f"stop takes at most {MAX_STOP_STRINGS} strings, got 300000"):
        TextStream(ToyTokenizer(), ["x"] * 300_000)
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_CHARS} characters, got one of {MAX_STOP_CHARS + 1}"):
        check_stop(["ok", "x" * (MAX_STOP_CHARS + 1)])


def counted(name: str):
    """str's method `name`, counting its calls in CountedStr.ops."""
    def op(self, *args):
        CountedStr.ops += 1
        return getattr(str, name)(self, *args)
    return op


class CountedStr(str):
    """A str that counts the operations done on it (comparisons, slices, prefix and suffix tests), in `ops`."""
    ops = 0
    __lt__, __gt__, __eq__, __hash__ = counted("__lt__"), counted("__gt__"), counted("__eq__"), str.__hash__
    __getitem__, startswith, endswith = counted("__getitem__"), counted("startswith"), counted("endswith")


def test_work_per_token_barely_grows_with_the_number_of_stop_strings():
    """16 times the stop strings, each token the start of one of them: under 3 times the operations on them per
    token (a bisection's log), where a scan over every string took 23 times more (300,000 strings made every
    token of every request slower)."""
    def work(n: int) -> int:
        text = TextStream(ToyTokenizer(), [CountedStr(f"<{i}><x>") for i in range(n)])
        CountedStr.ops = 0
        pieces = [text.push(i % 64) for i in range(200)] + [text.flush()]
        assert "".join(pieces) == text.text == ToyTokenizer().decode([i % 64 for i in range(200)])
        return CountedStr.ops

    assert 0 < work(MAX_STOP_STRINGS) < 3 * work(MAX_STOP_STRINGS // 16)


# ---- complete() over hand-made streams (ToyTokenizer: token i is the text '<i>') ----

def tokens_of(ids: list[int], end: str | None) -> list[Token]:
    """Tokens with ids, the last one marked with `end` as the decode loops mark it."""
    return [Token(i, end=end if n == len(ids) - 1 else None) for n, i in enumerate(ids)]


def test_complete_ends_at_eos_without_its_text():
    pieces = []
    c = complete(iter(tokens_of([3, 4, 9], "eos")), ToyTokenizer(eos_ids=[9]), 5, on_text=pieces.append)
    assert (c.text, c.tokens, c.finish_reason) == ("<3><4>", [3, 4, 9], "eos")  # EOS counted, not printed
    assert "".join(pieces) == c.text and (c.prompt_tokens, c.prefilled) == (5, 5)
    assert [s.id for s in c.steps] == c.tokens and c.ttft_s <= c.total_s


def test_complete_ends_at_length():
    c = complete(iter(tokens_of([3, 4, 5], "length")), ToyTokenizer(), 2, prefilled=1)
    assert (c.text, c.tokens, c.finish_reason, c.prefilled) == ("<3><4><5>", [3, 4, 5], "length", 1)


def test_complete_cuts_at_a_stop_string_and_closes_the_stream():
    pulled, closed = [], []

    def stream():  # a decode loop that would run to 10 tokens
        try:
            for i in range(1, 11):
                pulled.append(i)
                yield Token(i, end="length" if i == 10 else None)
        finally:
            closed.append(True)

    pieces = []
    c = complete(stream(), ToyTokenizer(), 4, stop=["<4><5>"], on_text=pieces.append)
    assert (c.text, c.tokens, c.finish_reason) == ("<1><2><3>", [1, 2, 3, 4, 5], "stop")
    assert "".join(pieces) == c.text and "<4>" not in "".join(pieces)  # '<4>' was held back, then cut
    assert pulled == [1, 2, 3, 4, 5] and closed == [True]  # no token computed past the stop string


def test_streamed_pieces_concatenate_to_the_text():
    pieces = []
    # '<2>' might start '<2><7>' and '<3' might start '<3>!': held back until ruled out, then released.
    c = complete(iter(tokens_of([1, 2, 3, 4, 2, 6], "length")), ToyTokenizer(), 1, stop=["<2><7>", "<3>!"],
                 on_text=pieces.append)
    assert c.finish_reason == "length" and c.text == "<1><2><3><4><2><6>" == "".join(pieces)
    assert pieces[0] == "<1>" and len(pieces) > 1


def test_stop_string_wins_over_eos_and_length():
    c = complete(iter(tokens_of([1, 2], "length")), ToyTokenizer(), 1, stop=["<2>"])
    assert (c.text, c.finish_reason) == ("<1>", "stop")


def test_push_token_and_finish_reason():
    text = TextStream(ToyTokenizer(), ["<8>"])
    assert push_token(text, Token(5)) == "<5>" and push_token(text, Token(9, end="eos")) == ""
    assert finish_reason("eos", text) == "eos" and finish_reason(None, text) is None
    push_token(text, Token(8))
    assert text.stopped and finish_reason("length", text) == "stop"


def test_complete_batch_freezes_each_row_at_its_end():
    # One list per step, as generate_batch yields them: row 1 ends by EOS at step 2 (then None), row 2 at a stop
    # string at step 2 (the loop knows no stop strings: its later token is ignored), row 0 by length at step 3.
    steps = [[Token(1), Token(5), Token(7)],
             [Token(2), Token(9, end="eos"), Token(4)],
             [Token(3, end="length"), None, Token(6)]]
    done = complete_batch(iter(steps), ToyTokenizer(eos_ids=[9]), [2, 3, 4], stop=["<4>"])
    assert [(c.text, c.tokens, c.finish_reason) for c in done] == [
        ("<1><2><3>", [1, 2, 3], "length"), ("<5>", [5, 9], "eos"), ("<7>", [7, 4], "stop")]
    assert [c.prompt_tokens for c in done] == [2, 3, 4]


def test_completion_json():
    tok = ToyTokenizer()
    c = Completion("<1>", [1, 2], "eos", 3, 3, [Token(1, -0.5, [(1, -0.5), (4, -1.5)]), Token(2, -0.1, [(2, -0.1)])],
                   ttft_s=0.5, total_s=1.5)
    out = json.loads(json.dumps(completion_json(c, tok)))
    assert (out["text"], out["finish_reason"], out["tokens"], out["prompt_tokens"]) == ("<1>", "eos", [1, 2], 3)
    assert out["timings"] == {"ttft_ms": 500.0, "total_ms": 1500.0, "decode_tokens_per_s": 1.0}
    assert out["logprobs"][0] == {"token": 1, "text": "<1>", "logprob": -0.5,
                                  "top": [{"token": 1, "text": "<1>", "logprob": -0.5},
                                          {"token": 4, "text": "<4>", "logprob": -1.5}]}
    plain = completion_json(Completion("<1>", [1], "length", 3, 3, [Token(1)]), tok)
    assert "logprobs" not in plain and plain["timings"]["decode_tokens_per_s"] is None


# ---- on the real model ----

@pytest.mark.slow
def test_complete_with_a_stop_string_over_several_tokens(smollm2):
    model, tok = smollm2
    prompt = tok.encode("The capital of France is")
    plain = complete_greedy(model, tok, prompt, 8)  # ' Paris.\n\nThe answer is:'
    assert plain.text == " Paris.\n\nThe answer is:" and plain.finish_reason == "length"
    pieces = []
    c = complete_greedy(model, tok, prompt, 8, stop=["\n\nThe answer"], on_text=pieces.append)
    assert c.text == "".join(pieces) == " Paris."
    assert c.finish_reason == "stop" and c.tokens == plain.tokens[:6]  # ends at ' answer', which completed it
    # A prefix of the stop string ('\n\nThe ') appears, but it never completes: the text is unchanged.
    pieces = []
    c = complete_greedy(model, tok, prompt, 8, stop=["\n\nThe question"], on_text=pieces.append)
    assert c.text == "".join(pieces) == plain.text and c.finish_reason == "length"
