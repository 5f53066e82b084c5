"""Fill-in-the-middle without a server (features/fim.py, /v1/completions' suffix, serving/llamacpp.py's /infill) and
through the app over a tiny random model: the FIM tokens found by name or by GGUF metadata, the PSM prompt's exact
ids, the 400 for a model without them (SmolLM2's vocabulary has none), llama.cpp's answer and stream shapes. Also
the smaller protocol points served with them: echo with max_tokens 0 alone, /tokenize's llama.cpp shape."""
import asyncio
import json

import httpx
import pytest

from features.fim import FimTokens, find_fim_tokens, infill_prompt
from helpers import toy_bpe
from serving.answer import Answer
from serving.app import make_app
from serving.contract import Event
from serving.engine import Engine, EngineConfig
from serving.llamacpp import InfillAnswer, parse_infill
from serving.protocol import BadRequest, parse_request, parse_tokenize, tokenize_answer

LIMITS = {"max_len": 200, "max_chars": 10 ** 6}
STARCODER = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>", "<repo_name>")  # ids 104-108
QWEN = ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")


def text_ids(tok, s: str) -> list[int]:
    return tok.encode(s, bos=False, special=False)


@pytest.fixture(scope="module")
def fim_tok():
    return toy_bpe(STARCODER)


def test_fim_tokens_by_name_by_gguf_metadata_and_missing(smollm2_tokenizer):
    assert find_fim_tokens(toy_bpe(STARCODER)) == FimTokens(104, 105, 106, repo=108, file_sep=107)
    assert find_fim_tokens(toy_bpe(QWEN)) == FimTokens(104, 106, 105, repo=108, file_sep=109, pad=107)
    # the ids a GGUF names win over names (here none of the known ones)
    meta = {"fim_pre_token_id": 105, "fim_suf_token_id": 104, "fim_mid_token_id": 106}
    assert find_fim_tokens(toy_bpe(("<a>", "<b>", "<c>"), **meta)) == FimTokens(105, 104, 106)
    with pytest.raises(ValueError, match=r"lacks prefix \(<\|fim_prefix\|> / <fim_prefix>\), suffix"):
        find_fim_tokens(smollm2_tokenizer)  # SmolLM2-135M's vocabulary has <file_sep>, <repo_name>, no FIM tokens


def test_infill_prompt_is_psm_with_repo_level_extra(fim_tok):
    tok, fim = fim_tok, find_fim_tokens(fim_tok)
    ids = infill_prompt(tok, fim, "def add(a, b): return ", " # done", prompt="a")
    assert ids == [104, *text_ids(tok, "def add(a, b): return a"), 105, *text_ids(tok, " # done"), 106]
    extra = infill_prompt(tok, fim, "x = ", "", [("a.py", "y = 1")])
    assert extra == [108, *text_ids(tok, "myproject\n"), 107, *text_ids(tok, "a.py\n"), *text_ids(tok, "y = 1"),
                     107, *text_ids(tok, "filename\n"), 104, *text_ids(tok, "x = "), 105, 106]
    # text is text: a FIM token's name typed in the code is characters, not the token
    assert infill_prompt(tok, fim, "<fim_middle>", "")[1:-2] == text_ids(tok, "<fim_middle>")
    # no file separator: the chunks are joined by a snippet line, no repository name
    plain = toy_bpe(STARCODER[:3])
    assert infill_prompt(plain, find_fim_tokens(plain), "x", "", [("a.py", "y")]) == [
        *text_ids(plain, "\n\n--- snippet ---\n\ny"), 104, *text_ids(plain, "x"), 105, 106]


def test_completions_suffix(fim_tok, smollm2_tokenizer):
    tok = fim_tok
    call = parse_request({"prompt": ["def f(", "x"], "suffix": "): pass", "max_tokens": 3}, False, tok, **LIMITS)
    fim = find_fim_tokens(tok)
    assert [r.prompt for r in call.requests] == [infill_prompt(tok, fim, p, "): pass") for p in ("def f(", "x")]
    assert call.texts == ["def f(", "x"] and call.requests[0].max_new_tokens == 3
    assert list(call.requests[0].stop) == ["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<repo_name>", "<file_sep>"]
    assert parse_request({"prompt": "x", "suffix": ""}, False, tok, **LIMITS).requests[0].prompt == tok.encode("x")
    for body, param in [({"prompt": "x", "suffix": "y", "echo": True}, "echo"),
                        ({"prompt": [1, 2], "suffix": "y"}, "prompt"), ({"prompt": "x", "suffix": 3}, "suffix")]:
        with pytest.raises(BadRequest) as e:
            parse_request(body, False, tok, **LIMITS)
        assert e.value.param == param
    with pytest.raises(BadRequest, match="not trained for.*fim_prefix") as e:
        parse_request({"prompt": "x", "suffix": "y"}, False, smollm2_tokenizer, **LIMITS)
    assert e.value.param == "suffix"


def test_parse_infill(fim_tok, smollm2_tokenizer):
    tok = fim_tok
    body = {"input_prefix": "x = ", "input_suffix": " + 1", "input_extra": [{"filename": "a.py", "text": "y"}],
            "prompt": "f(", "n_predict": 5, "repeat_penalty": 1.1, "top_k": 0, "seed": -1, "stop": ["\n"],
            "cache_prompt": True}
    call, return_tokens = parse_infill(body, tok, **LIMITS)
    r = call.requests[0]
    assert r.prompt == infill_prompt(tok, find_fim_tokens(tok), "x = ", " + 1", [("a.py", "y")], "f(")
    assert (r.max_new_tokens, r.seed, call.ignored, return_tokens) == (5, None, ("cache_prompt",), False)
    assert list(r.stop) == ["\n", "<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<repo_name>", "<file_sep>"]
    p = r.params  # llama.cpp's defaults where the body says nothing
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty) == (0.8, 0, 0.95, 0.05, 1.1)
    call, _ = parse_infill({"input_prefix": "x", "input_suffix": "", "temperature": None}, tok, **LIMITS)
    assert call.requests[0].params.temperature == 0.8
    assert call.requests[0].max_new_tokens == LIMITS["max_len"] - len(call.requests[0].prompt)  # -1: to the end
    for bad, param in [({"input_prefix": "x"}, "input_suffix"), ({"input_suffix": ""}, "input_prefix"),
                       ({"input_prefix": "", "input_suffix": "", "n_predict": 0}, "n_predict"),
                       ({"input_prefix": "", "input_suffix": "", "repeat_penalty": -1}, "repeat_penalty"),
                       ({"input_prefix": "", "input_suffix": "", "input_extra": [{"text": 1}]}, "input_extra")]:
        with pytest.raises(BadRequest) as e:
            parse_infill(bad, tok, **LIMITS)
        assert e.value.param == param
    with pytest.raises(BadRequest, match="fim_prefix"):
        parse_infill({"input_prefix": "", "input_suffix": ""}, smollm2_tokenizer, **LIMITS)


def test_infill_answer_and_stream_shapes(fim_tok):
    call, _ = parse_infill({"input_prefix": "x", "input_suffix": "", "stream": True}, fim_tok, **LIMITS)
    answer = InfillAnswer(call, fim_tok, "m", return_tokens=True)
    n = len(call.requests[0].prompt)
    lines = answer.add(0, Event(0, "ab", [66, 67], False, None, n, 2, 0))
    lines += answer.add(0, Event(0, "c", [68], True, "eos", n, 3, 0))
    data = [json.loads(line.removeprefix("data: ")) for line in lines]
    assert [(d["content"], d["stop"], d["tokens"]) for d in data] == [("ab", False, [66, 67]), ("c", False, [68]),
                                                                       ("", True, [])]
    last = data[-1]
    assert (last["stop_type"], last["tokens_predicted"], last["tokens_evaluated"]) == ("eos", 3, n)
    body = answer.body()
    assert (body["content"], body["tokens"], body["stop"]) == ("abc", [66, 67, 68], True)
    assert body["prompt"] == "<fim_prefix>x<fim_suffix><fim_middle>"


def test_echo_with_max_tokens_0_alone_and_tokenize_shapes(smollm2_tokenizer):
    tok = smollm2_tokenizer
    call = parse_request({"prompt": "The capital", "echo": True, "max_tokens": 0}, False, tok, **LIMITS)
    r = call.requests[0]
    assert (r.max_new_tokens, r.prompt_logprobs, r.logprobs) == (0, 0, None)  # the prefill alone
    answer = Answer(call, tok, {"id": "x"})
    answer.add(0, Event(0, "", [], True, "length", len(r.prompt), 0, 0, prompt_logprobs=[None] * len(r.prompt)))
    choice = answer.body()["choices"][0]
    assert (choice["text"], choice["logprobs"]) == ("The capital", None)
    ids = tok.encode("Hello world")
    assert parse_tokenize({"content": "Hello world"}, tok, 10 ** 6) == ids  # llama.cpp: no BOS unless add_special
    body = {"content": "Hello world", "with_pieces": True, "return_token_strs": True}
    out = tokenize_answer(body, ids, tok, 100)
    assert out["tokens"] == [{"id": i, "piece": p} for i, p in zip(ids, ["Hello", " world"])]
    assert out["token_strs"] == ["Hello", "Ġworld"] and out["count"] == 2
    assert tokenize_answer({"prompt": "x"}, ids, tok, 100)["tokens"] == ids
    with pytest.raises(BadRequest):
        parse_tokenize({"content": "a", "prompt": "a"}, tok, 10 ** 6)


def test_infill_and_suffix_through_the_app(tiny, fim_tok):
    """The routes over a tiny random model with a FIM vocabulary: greedy /infill (whole and streamed) and
    /v1/completions with a suffix generate the tokens the engine computes over the PSM prompt; a FIM token the
    model writes ends the middle (this model writes <file_sep> first after "x = ")."""
    engine = Engine(tiny, fim_tok, EngineConfig(num_blocks=32, max_running=4, token_budget=64))
    app = make_app(engine, fim_tok, "m")
    fim = find_fim_tokens(fim_tok)
    prompt = infill_prompt(fim_tok, fim, "def f(a): ", " # end")
    want = engine.generate([prompt], max_new_tokens=6, stop=fim.stops(fim_tok))[0]
    assert len(want.tokens) == 6 and want.finish_reason == "length"

    async def main():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8000",
                                         timeout=60) as c:
                body = {"input_prefix": "def f(a): ", "input_suffix": " # end", "n_predict": 6, "temperature": 0,
                        "return_tokens": True}
                whole = (await c.post("/infill", json=body)).json()
                streamed = await c.post("/infill", json={**body, "stream": True})
                completion = (await c.post("/v1/completions", json={"prompt": "def f(a): ", "suffix": " # end",
                                                                   "max_tokens": 6, "temperature": 0})).json()
                ended = (await c.post("/infill", json={**body, "input_prefix": "x = ", "input_suffix": " + 1"})).json()
                return whole, streamed.text, completion, ended

    whole, streamed, completion, ended = asyncio.run(main())
    assert whole["tokens"] == want.tokens and whole["content"] == want.text and whole["tokens_predicted"] == 6
    assert whole["tokens_evaluated"] == len(prompt) and whole["stop_type"] == "limit"
    lines = [json.loads(line.removeprefix("data: ")) for line in streamed.split("\n\n") if line]
    assert "".join(d["content"] for d in lines) == want.text and lines[-1]["stop"] and "[DONE]" not in streamed
    assert completion["choices"][0]["text"] == want.text and completion["usage"]["prompt_tokens"] == len(prompt)
    assert (ended["tokens"], ended["content"], ended["stop_type"]) == ([fim.file_sep], "", "word")
