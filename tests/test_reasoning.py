"""Reasoning split out of answers (features/reasoning.py): <think> blocks and gpt-oss's harmony messages read as
they stream, however the text is cut, into chat's reasoning_content (Messages' thinking blocks, Responses' reasoning
items); chat_template_kwargs reach the template; the chat stream's role goes out with the first token, not before
the prefill."""
import copy
import json

import pytest

from features.reasoning import HARMONY, ReasoningParser, Tags, detect_tags, opens_thinking, tags_named
from serving.answer import Answer
from helpers import stream_pieces
from serving.contract import Event
from serving.protocol import BadRequest, parse_request

LIMITS = {"max_len": 512, "max_chars": 10 ** 6}
HEAD = {"id": "x", "object": "chat.completion", "created": 0, "model": "m"}
OUTPUT = "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?"


def split(text: str, cuts: list[int], thinking: bool = False, tags: Tags = Tags()) -> tuple[str, str]:
    """(reasoning, content) of text fed in the pieces the cuts make."""
    parser = ReasoningParser(tags, thinking)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    got = {"reasoning": "", "content": ""}
    for k, piece in enumerate(pieces):
        for kind, part in parser.feed(piece, final=k == len(pieces) - 1):
            got[kind] += part
    assert (got["reasoning"], got["content"]) == (parser.reasoning, parser.content)
    return got["reasoning"], got["content"]


def test_a_think_block_is_split_off_however_the_stream_cuts_it():
    whole = split(OUTPUT, [])
    assert whole == ("\nThe user greets me.\n", "Hello! How can I help?")
    for cut in range(1, len(OUTPUT)):  # every place a piece can end, tags cut in two included
        assert split(OUTPUT, [cut]) == whole, cut
    assert split(OUTPUT, list(range(1, len(OUTPUT)))) == whole  # one character at a time


def test_text_without_a_leading_block_is_all_content():
    assert split("Hello <think>not reasoning</think> there", [3, 9]) == ("", "Hello <think>not reasoning</think> there")
    assert split("  <thin", [4]) == ("", "  <thin")  # looked like a tag, the output ended: its text, as written
    assert split("", []) == ("", "")


def test_a_prompt_that_opens_the_block_leaves_the_model_inside_it():
    assert opens_thinking("<|im_start|>assistant\n<think>\n", Tags())  # DeepSeek-R1's template
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n", Tags())  # Qwen3, thinking off
    assert split("I should greet.</think>Hi", [5, 17], thinking=True) == ("I should greet.", "Hi")
    # cut off inside the block (max_tokens): all of it is reasoning, none content
    assert split("<think>still going", [9]) == ("still going", "")


def test_the_parser_is_picked_by_name_or_from_the_template():
    assert detect_tags("{% if '</think>' in content %}...{% endif %}") == Tags()
    assert detect_tags("{{ messages }}") is None and detect_tags(None) is None
    assert tags_named("none", "</think>") is None and tags_named("think", None) == Tags()
    assert detect_tags("{{- '<|start|>assistant<|channel|>final<|message|>' }}") == HARMONY  # gpt-oss's
    assert tags_named("harmony", None) == tags_named("openai_gptoss", None) == HARMONY
    with pytest.raises(ValueError, match="unknown reasoning parser 'r1'"):
        tags_named("r1", None)


def reasoning_tokenizer(tokenizer, template: str):
    tok = copy.copy(tokenizer)
    tok.chat_template = template
    return tok


THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                     "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
                     "<think>\n\n</think>\n\n{% endif %}")


def test_chat_template_kwargs_reach_the_template(smollm2_tokenizer):
    tok = reasoning_tokenizer(smollm2_tokenizer, THINKING_TEMPLATE)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    on = parse_request(body, True, tok, **LIMITS)
    off = parse_request({**body, "chat_template_kwargs": {"enable_thinking": False}}, True, tok, **LIMITS)
    assert tok.decode(off.requests[0].prompt).endswith("<think>\n\n</think>\n\n")
    assert off.requests[0].prompt[:len(on.requests[0].prompt)] == on.requests[0].prompt
    with pytest.raises(BadRequest, match="may not set messages") as e:
        parse_request({**body, "chat_template_kwargs": {"messages": []}}, True, tok, **LIMITS)
    assert e.value.param == "chat_template_kwargs"


def events(pieces: list[str]) -> list[Event]:
    return [Event(0, p, [k + 1], k == len(pieces) - 1, "eos" if k == len(pieces) - 1 else None, 3, k + 1, 0)
            for k, p in enumerate(pieces)]


def test_chat_answers_carry_reasoning_content_apart(smollm2_tokenizer):
    tok = reasoning_tokenizer(smollm2_tokenizer, THINKING_TEMPLATE + "{# </think> #}")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9}
    call = parse_request(body, True, tok, **LIMITS, reasoning=tags_named(None, tok.chat_template))
    answer = Answer(call, tok, HEAD)
    pieces = ["<thi", "nk>Greet", "ing.</th", "ink>\n\nHel", "lo!"]
    for e in events(pieces):
        answer.add(0, e)
    message = answer.body()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Hello!", "reasoning_content": "Greeting."}

    stream = parse_request({**body, "stream": True}, True, tok, **LIMITS, reasoning=call.reasoning)
    answer = Answer(stream, tok, HEAD)
    assert answer.opening() == []  # nothing before the first token: clients time TTFT from the first chunk
    chunks = [json.loads(c.removeprefix("data: ")) for e in events(pieces) for c in answer.add(0, e)]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Greeting."
    assert "".join(d.get("content", "") for d in deltas) == "Hello!"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_generate_prints_the_thinking_apart_or_hides_it(smollm2_tokenizer, capsys):
    """generate.py --chat's Output: the answer on stdout, the thinking on stderr (--hide-thinking: nowhere); with
    --json both in the object."""
    from features.chat import Output
    from params import Token

    tok = smollm2_tokenizer
    ids = tok.encode("<think>Greet back.</think>\n\nHello there!", bos=False)
    for show, as_json in [(True, False), (False, False), (True, True)]:
        out = Output(tok, quiet=True, as_json=as_json, reasoning=Tags(), show_thinking=show)
        c, content, calls = out.reply(iter([Token(i, 0.0, []) for i in ids]), prompt_tokens=3)
        printed = capsys.readouterr()
        assert (content, calls, c.text) == ("Hello there!", [], tok.decode(ids))
        if as_json:
            answer = json.loads(printed.out)
            assert (answer["content"], answer["reasoning"]) == ("Hello there!", "Greet back.")
        else:
            assert printed.out == "Hello there!\n"
            assert printed.err == ("Greet back." if show else "")


HARMONY_OUTPUT = ("<|channel|>analysis<|message|>The user greets.\nReply kindly.<|end|>"
                  "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?")


def harmony(text: str, cuts: list[int], thinking: bool = False) -> tuple[str, str]:
    return split(text, cuts, thinking, HARMONY)


def test_a_harmony_answer_is_split_however_the_stream_cuts_it():
    """gpt-oss: the analysis message is reasoning, the final one content, headers and ends dropped; every cut, and
    every pair of cuts, gives the whole text's split."""
    whole = harmony(HARMONY_OUTPUT, [])
    assert whole == ("The user greets.\nReply kindly.", "Hello! How can I help?")
    n = len(HARMONY_OUTPUT)
    for cut in range(1, n):
        assert harmony(HARMONY_OUTPUT, [cut]) == whole, cut
        for second in range(cut + 1, n, 7):
            assert harmony(HARMONY_OUTPUT, [cut, second]) == whole, (cut, second)
    assert harmony(HARMONY_OUTPUT, list(range(1, n))) == whole


def test_harmony_outputs_of_every_shape():
    final = "<|start|>assistant<|channel|>final<|message|>Hi"
    assert harmony("<|channel|>final<|message|>Hi", [4]) == ("", "Hi")  # no analysis (reasoning effort low)
    assert harmony("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
                   + final, [40]) == ("ab", "Hi")
    assert harmony("<|channel|>analysis<|message|>still thinking", [33]) == ("still thinking", "")  # max_tokens
    assert harmony("<|channel|>analysis<|message|>done<|end|><|start|>assist", [9]) == ("done", "")
    assert harmony("more<|end|>" + final, [6], thinking=True) == ("more", "Hi")  # the prompt opened the analysis
    assert opens_thinking("<|start|>assistant<|channel|>analysis<|message|>", HARMONY)
    assert not opens_thinking("<|start|>assistant", HARMONY)
    # a preamble on the commentary channel is content; a call (a recipient) is content as written: not parsed
    assert harmony("<|channel|>commentary<|message|>Checking.<|end|>" + final, [12]) == ("", "Checking.Hi")
    call = "<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{\"a\": 1}<|call|>"
    assert harmony("<|channel|>analysis<|message|>Use f.<|end|>" + call, [50, 60]) == ("Use f.", call)
    # text that opens no message: a model ignoring the format, as written
    assert harmony("Hello <|channel|>x", [2]) == ("", "Hello <|channel|>x")
    assert harmony("<|chan", []) == ("", "<|chan") and harmony("", []) == ("", "")


HARMONY_PIECES = ["<|channel|>", "analysis", "<|message|>", "The user ", "greets.", "<|end|>", "<|start|>",
                  "assistant", "<|channel|>", "final", "<|message|>", "Hello!"]


def sse(lines: list[str]) -> list[tuple[str, dict]]:
    """(event name, data) of Messages' and Responses' stream lines."""
    return [(n.removeprefix("event: "), json.loads(d.removeprefix("data: ")))
            for n, d in (line.strip().split("\n") for line in lines)]


def test_harmony_answers_through_chat_messages_and_responses(smollm2_tokenizer):
    """The three APIs shape a harmony answer from one Reader: chat's reasoning_content, Messages' thinking block,
    Responses' reasoning item; the content apart in each."""
    from serving.messages import MessagesAnswer, parse_messages
    from serving.responses import ResponsesAnswer, Store, parse_responses

    tok, grammar = smollm2_tokenizer, {"compile_grammar": lambda constraint: None}
    chat = parse_request({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9}, True, tok, **LIMITS,
                         reasoning=HARMONY)
    answer = Answer(chat, tok, HEAD)
    for e in events(HARMONY_PIECES):
        answer.add(0, e)
    message = answer.body()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Hello!", "reasoning_content": "The user greets."}

    body = {"model": "m", "max_tokens": 60, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    call = parse_messages(json.dumps(body).encode(), tok, **LIMITS, **grammar, reasoning=HARMONY)
    answer = MessagesAnswer(call, tok, "m")
    deltas = [d["delta"] for n, d in sse(stream_pieces(answer, HARMONY_PIECES)) if n == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "The user greets."
    assert answer.body()["content"] == [{"type": "thinking", "thinking": "The user greets.", "signature": ""},
                                        {"type": "text", "text": "Hello!"}]

    store = Store()
    call = parse_responses(json.dumps({"model": "m", "input": "hi", "stream": True}).encode(), tok, store, **LIMITS,
                           **grammar, reasoning=HARMONY)
    answer = ResponsesAnswer(call, tok, "m", store)
    output = sse(stream_pieces(answer, HARMONY_PIECES))[-1][1]["response"]["output"]
    assert [o["type"] for o in output] == ["reasoning", "message"]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "The user greets."}]
    assert output[1]["content"][0]["text"] == "Hello!"
