"""protocol.py and answer.py without a server: request bodies -> engine Requests (and the 400s), engine Events ->
OpenAI's response bodies and stream chunks (logprobs shapes, echo, n x prompts indexing, usage)."""
import json

import pytest

from params import Token
from serving.contract import Event
from serving.answer import Answer
from serving.protocol import MAX_CHOICES, BadRequest, parse_detokenize, parse_json, parse_request, parse_tokenize

LIMITS = {"max_len": 512, "max_chars": 10 ** 6}
HEAD = {"id": "x", "object": "text_completion", "created": 0, "model": "m"}


def parse(body: dict, tokenizer, chat: bool = False):
    return parse_request(body, chat, tokenizer, **LIMITS)


def refused(body: dict, tokenizer, chat: bool = False) -> BadRequest:
    with pytest.raises(BadRequest) as e:
        parse(body, tokenizer, chat)
    return e.value


def event(text: str, ids: list[int], finished: bool = False, index: int = 0, tokens=None, prompt=None,
          n_prompt: int = 3, done: int = 1) -> Event:
    return Event(0, text, ids, finished, "length" if finished else None, n_prompt, done, 0, index=index,
                 tokens=tokens, prompt_logprobs=prompt)


def test_a_prompt_list_is_one_request_per_prompt(smollm2_tokenizer):
    tok = smollm2_tokenizer
    call = parse({"prompt": ["a b", [1, 2, 3], "c"], "max_tokens": 4, "n": 2, "seed": 7}, tok)
    assert [r.prompt for r in call.requests] == [tok.encode("a b"), [1, 2, 3], tok.encode("c")]
    assert call.texts == ["a b", tok.decode([1, 2, 3]), "c"]
    assert all(r.n == 2 and r.best_of == 2 and r.seed == 7 and r.max_new_tokens == 4 for r in call.requests)
    one = parse({"prompt": "a b", "max_tokens": 4}, tok)
    assert len(one.requests) == 1 and one.requests[0].prompt == call.requests[0].prompt


def test_choices_are_bounded_and_best_of_does_not_stream(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert refused({"prompt": "a", "n": 0}, tok).param == "n"
    assert refused({"prompt": "a", "n": 3, "best_of": 2}, tok).param == "best_of"
    assert refused({"prompt": ["a"] * 2, "n": MAX_CHOICES // 2 + 1}, tok).param == "n"
    assert refused({"prompt": "a", "n": 1, "best_of": 2, "stream": True}, tok).param == "best_of"
    assert parse({"prompt": "a", "n": 2, "best_of": 4}, tok).requests[0].best_of == 4
    assert refused({"prompt": [], "max_tokens": 1}, tok).param == "prompt"
    assert refused({"prompt": [[1, 2], 5]}, tok).param == "prompt"


def test_logprobs_fields(smollm2_tokenizer):
    tok = smollm2_tokenizer
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse({**chat, "logprobs": True, "top_logprobs": 3}, tok, chat=True).requests[0].logprobs == 3
    assert parse({**chat, "logprobs": True}, tok, chat=True).requests[0].logprobs == 0
    assert parse(chat, tok, chat=True).requests[0].logprobs is None
    assert refused({**chat, "top_logprobs": 2}, tok, chat=True).param == "top_logprobs"
    assert refused({**chat, "logprobs": True, "top_logprobs": 21}, tok, chat=True).param == "top_logprobs"
    assert refused({"prompt": "a", "logprobs": True}, tok).param == "logprobs"  # completions: an integer
    r = parse({"prompt": "a", "logprobs": 5}, tok).requests[0]
    assert (r.logprobs, r.prompt_logprobs) == (5, None)
    r = parse({"prompt": "a", "logprobs": 1, "echo": True, "max_tokens": 0}, tok).requests[0]
    assert (r.logprobs, r.prompt_logprobs, r.max_new_tokens) == (1, 1, 0)
    assert refused({"prompt": "a", "max_tokens": 0}, tok).param == "max_tokens"  # 0 only with echo


def test_sampling_extensions_and_logit_bias(smollm2_tokenizer):
    tok = smollm2_tokenizer
    p = parse({"prompt": "a", "logit_bias": {"5": -100, "3": 2.5}, "min_tokens": 4, "ignore_eos": True},
              tok).requests[0].params
    assert (p.logit_bias, p.min_tokens, p.ignore_eos) == (((3, 2.5), (5, -100.0)), 4, True)
    assert refused({"prompt": "a", "logit_bias": {"x": 1}}, tok).param == "logit_bias"
    assert refused({"prompt": "a", "logit_bias": {str(tok.vocab_size): 1}}, tok).param == "logit_bias"
    assert refused({"prompt": "a", "logit_bias": {"1": 101}}, tok).param == "logit_bias"
    assert refused({"prompt": "a", "min_tokens": -1}, tok).param == "min_tokens"
    assert refused({"prompt": "a", "ignore_eos": "yes"}, tok).param == "ignore_eos"


def test_unknown_fields_are_ignored_but_known_ones_checked(smollm2_tokenizer):
    tok = smollm2_tokenizer
    call = parse({"prompt": "a", "store": True, "metadata": {"k": "v"}, "reasoning_effort": "low"}, tok)
    assert call.ignored == ("metadata", "reasoning_effort", "store")
    assert refused({"prompt": "a", "store": True, "temperature": "hot"}, tok).param == "temperature"
    assert refused({"prompt": "a", "suffix": "z"}, tok).param == "suffix"
    opts = parse({"prompt": "a", "stream": True, "stream_options": {"include_usage": True,
                                                                    "continuous_usage_stats": True}}, tok)
    assert (opts.stream, opts.include_usage, opts.continuous_usage) == (True, True, True)


def test_tokenize_and_detokenize(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert parse_tokenize({"prompt": "hello world"}, tok, 10 ** 6) == tok.encode("hello world")
    assert parse_tokenize({"prompt": "<|im_end|>", "add_special_tokens": False}, tok, 10 ** 6) == tok.eos_ids[:1]
    chat = [{"role": "user", "content": "hi"}]
    assert parse_tokenize({"messages": chat}, tok, 10 ** 6) == tok.encode_chat(chat)
    assert parse_detokenize({"tokens": tok.encode("hello world")}, tok) == "hello world"
    with pytest.raises(BadRequest):
        parse_detokenize({"tokens": [tok.vocab_size]}, tok)
    with pytest.raises(BadRequest):
        parse_tokenize({"prompt": "a", "messages": chat}, tok, 10 ** 6)
    with pytest.raises(BadRequest):
        parse_json(b'{"a": "\\ud800"}')


def test_completion_logprobs_with_echo(smollm2_tokenizer):
    """echo: the prompt's text and tokens first, its first token's logprob null; text_offset counts characters
    of prompt + completion; top_logprobs maps token texts to logprobs, the token's own included."""
    tok = smollm2_tokenizer
    prompt = tok.encode("The capital")
    call = parse({"prompt": "The capital", "max_tokens": 1, "echo": True, "logprobs": 1}, tok)
    answer = Answer(call, tok, HEAD)
    paris = tok.encode(" of")[0]
    first = [None] + [Token(i, -1.0, [(i, -1.0)]) for i in prompt[1:]]
    answer.add(0, event(" of", [paris], True, tokens=[Token(paris, -0.5, [(paris, -0.5), (5, -2.0)])],
                        prompt=first, n_prompt=len(prompt)))
    choice = answer.body()["choices"][0]
    assert choice["text"] == "The capital of"
    lp = choice["logprobs"]
    assert lp["tokens"] == [tok.token_text(i) for i in [*prompt, paris]]
    assert lp["token_logprobs"] == [None, *[-1.0] * (len(prompt) - 1), -0.5]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][-1] == {" of": -0.5, tok.token_text(5): -2.0}
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:k]) for k in range(len(lp["tokens"]))]


def test_choices_are_indexed_prompt_times_n_and_usage_counts_each_prompt_once(smollm2_tokenizer):
    tok = smollm2_tokenizer
    call = parse({"prompt": ["a", "b"], "n": 2, "max_tokens": 1}, tok)
    answer = Answer(call, tok, HEAD)
    for i in (1, 0):
        for k in (1, 0):
            answer.add(i, event(f"p{i}c{k}", [3], True, index=k, n_prompt=5 + i))
    body = answer.body()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "p0c0"), (1, "p0c1"), (2, "p1c0"),
                                                                   (3, "p1c1")]
    prompt_tokens = sum(len(r.prompt) for r in call.requests)  # each prompt once, not once per choice
    assert body["usage"]["prompt_tokens"] == prompt_tokens and body["usage"]["completion_tokens"] == 4


def test_chat_stream_chunks_carry_logprobs_and_usage(smollm2_tokenizer):
    tok = smollm2_tokenizer
    call = parse({"messages": [{"role": "user", "content": "hi"}], "stream": True, "logprobs": True,
                  "top_logprobs": 1, "stream_options": {"include_usage": True}}, tok, chat=True)
    answer = Answer(call, tok, {**HEAD, "object": "chat.completion.chunk"})
    hello = tok.encode("Hello", bos=False)[0]
    chunks = answer.add(0, event("Hello", [hello], tokens=[Token(hello, -0.1, [(hello, -0.1)])]))
    chunks += answer.add(0, event("", [], True)) + answer.closing()
    data = [json.loads(c.removeprefix("data: ")) for c in chunks]
    assert data[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = data[1]["choices"][0]["logprobs"]["content"]
    assert content[0]["token"] == "Hello" and content[0]["bytes"] == list(b"Hello")
    assert content[0]["top_logprobs"] == [{"token": "Hello", "logprob": -0.1, "bytes": list(b"Hello")}]
    assert data[2]["choices"][0]["finish_reason"] == "length"
    assert [d["usage"] for d in data[:3]] == [None] * 3 and data[3]["choices"] == []
    assert data[3]["usage"]["completion_tokens"] == 1


def test_tools_with_a_response_format(smollm2_tokenizer):
    """tools and response_format (or a guided_* field) in one chat request: one grammar, the format the answer's
    (auto: the calls or the answer; required: calls only); a bad format is still a 400 naming its field. With
    parallel calls, the grammar's matchers end the output at a repeated call."""
    from features.grammar import Compiler
    from features.tools import GuardedGrammar

    tok = smollm2_tokenizer
    compile_grammar = Compiler(tok, tok.vocab_size).compile
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "integer"}}, "required": ["x"]}}}
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [tool],
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}

    def grammar(**fields):
        call = parse_request({**body, **fields}, True, tok, **LIMITS, compile_grammar=compile_grammar)
        return call.requests[0].grammar

    auto = grammar()
    assert "start: answer | " in auto.constraint.spec and json.dumps(schema)[:-1] in auto.constraint.spec
    assert "answer" not in grammar(tool_choice="required").constraint.spec
    assert "answer: %lark" in grammar(response_format=None, guided_regex="[a-z]+").constraint.spec
    assert not isinstance(auto, GuardedGrammar) and isinstance(grammar(parallel_tool_calls=True), GuardedGrammar)
    with pytest.raises(BadRequest) as e:
        grammar(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {
            "x": {"type": "string", "pattern": "(unclosed"}}}}})
    assert e.value.param == "response_format" and "invalid" in str(e.value)
