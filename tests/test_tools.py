"""Tool calling (tools.py): each format's parser on hand-written outputs (whole, streamed in pieces, malformed),
rendering with a template that reads `tools` and with the fallback, the checks of a request's tool fields, the
grammars of calls, and constrained calls on SmolLM2 whose arguments validate with jsonschema."""
import copy
import itertools
import json

import jsonschema
import pytest
import torch

from features.constraint import Constraint
from features.grammar import Compiler
from features.toolcalls import FORMATS, CallParser, Format, detect_format, format_named, merge_deltas, parse_calls
from features.tools import calls_lark, field_of, message, parallel_native, tool_calls_reason, tool_request

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 24},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
EVENT = {"type": "function", "function": {
    "name": "create_event", "description": "Add an event to the calendar",
    "parameters": {"type": "object", "properties": {
        "title": {"type": "string", "minLength": 1, "maxLength": 24},
        "day": {"type": "integer", "minimum": 1, "maximum": 31},
        "attendees": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 12}, "maxItems": 2}},
        "required": ["title", "day", "attendees"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {  # a pydantic-style schema: its $ref points into its own $defs
    "name": "search", "description": "Search the web",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "minLength": 1, "maxLength": 32},
                                                    "filters": {"$ref": "#/$defs/Filters"}},
                   "required": ["query", "filters"], "additionalProperties": False,
                   "$defs": {"Filters": {"type": "object", "additionalProperties": False, "required": ["lang"],
                                         "properties": {"lang": {"type": "string", "pattern": "^[a-z]{2}$"},
                                                        "safe": {"type": "boolean"}}}}}}}
TOOLS = [WEATHER, EVENT, SEARCH]

# A Hermes-style template that reads `tools` (as Qwen 2.5's does, much shortened)
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a function with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and tools %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

CALL = '{"name": "get_weather", "arguments": {"city": "Paris \\"}\\" <tool_call>", "unit": "celsius"}}'
ARGS = '{"city": "Paris \\"}\\" <tool_call>", "unit": "celsius"}'
CALL2 = '{"name": "search", "arguments": {"query": "rain", "filters": {"lang": "fr"}}}'
ARGS2 = '{"query": "rain", "filters": {"lang": "fr"}}'
# (format, model output, content, [(name, arguments)])
OUTPUTS = [
    ("hermes", f"<tool_call>\n{CALL}\n</tool_call>", "", [("get_weather", ARGS)]),
    ("hermes", f"Let me look.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALL2}\n</tool_call>\n",
     "Let me look.", [("get_weather", ARGS), ("search", ARGS2)]),
    ("hermes", f"<tool_call>{CALL2}</tool_call>", "", [("search", ARGS2)]),  # no newlines
    ("hermes", '<tool_call>\n{"arguments": {"q": 1}, "name": "f"}\n</tool_call>', "", [("f", '{"q": 1}')]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "{\\"q\\": 1}"}\n</tool_call>', "", [("f", '{"q": 1}')]),
    ("hermes", "Plain text, with a <tool_ mention and </tool_call>.", "Plain text, with a <tool_ mention and "
     "</tool_call>.", []),
    ("llama3_json", CALL.replace('"arguments"', '"parameters"'), "", [("get_weather", ARGS)]),
    ("llama3_json", f'<|python_tag|>{CALL.replace("arguments", "parameters", 1)}; {CALL2}', "",
     [("get_weather", ARGS), ("search", ARGS2)]),
    ("llama3_json", 'The answer is {"name": "x"}.', 'The answer is {"name": "x"}.', []),
    ("mistral", f"[TOOL_CALLS][{CALL}, {CALL2}]", "", [("get_weather", ARGS), ("search", ARGS2)]),
    ("mistral", f"Sure. [TOOL_CALLS] [{CALL2}]", "Sure.", [("search", ARGS2)]),
    ("mistral", "No tools needed  \n", "No tools needed  \n", []),
]
MALFORMED = [  # no call: the text is content, as written
    ("hermes", "<tool_call>\nnot json\n</tool_call>"),
    ("hermes", '<tool_call>\n{"name": "f"}\n</tool_call>'),  # no arguments
    ("hermes", '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "f", "argum'),  # cut short before the arguments
    ("hermes", "text <tool_call>"),
    ("llama3_json", '{"name": "f", "parameters": [1, 2]}'),
    ("llama3_json", "{not json at all"),
    ("mistral", "[TOOL_CALLS] I cannot"),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": 12}]'),
]


def counter_ids():
    n = itertools.count()
    return lambda: f"call_{next(n)}"


def streamed(fmt, pieces):
    """(content, calls) rebuilt from the deltas of a CallParser fed `pieces`, as a client rebuilds them; the
    deltas' shape is checked on the way (the first of a call has index, id, type and name)."""
    parser, content, calls = CallParser(FORMATS[fmt], counter_ids()), "", []
    for delta in [d for p in pieces for d in parser.feed(p)] + parser.finish():
        assert len(delta) == 1 and set(delta) <= {"content", "tool_calls"}, delta
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if call["index"] == len(calls):
                assert set(call) == {"index", "id", "type", "function"} and call["type"] == "function", call
                assert call["function"]["arguments"] == "" or call["function"]["name"]
                calls.append({"id": call["id"], "name": call["function"]["name"],
                              "arguments": call["function"]["arguments"]})
            else:
                assert call["index"] == len(calls) - 1 and set(call) == {"index", "function"}, call
                assert set(call["function"]) == {"arguments"}, call
                calls[-1]["arguments"] += call["function"]["arguments"]
    assert content == parser.content
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in parser.calls]
    return content, [(c["name"], c["arguments"]) for c in calls]


# ---- parsing ----

@pytest.mark.parametrize("fmt, text, content, calls", OUTPUTS)
def test_parser_reads_each_format(fmt, text, content, calls):
    got_content, got_calls = parse_calls(text, FORMATS[fmt], counter_ids())
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == calls
    assert all(c["type"] == "function" and c["id"] == f"call_{k}" for k, c in enumerate(got_calls))
    for _, arguments in calls:
        json.loads(arguments)


@pytest.mark.parametrize("fmt, text, content, calls", OUTPUTS)
def test_streamed_in_pieces_gives_the_same(fmt, text, content, calls):
    for k in range(len(text) + 1):  # two pieces, split at every position
        assert streamed(fmt, [text[:k], text[k:]]) == (content, calls), k
    assert streamed(fmt, list(text)) == (content, calls)  # a character at a time


def test_arguments_stream_before_the_call_ends():
    parser = CallParser(FORMATS["hermes"], counter_ids())
    assert parser.feed("Hi <tool_call>\n{") == [{"content": "Hi"}]
    assert parser.feed('"name": "get_weather", "arguments": {"ci') == [
        {"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}]
    assert parser.feed('ty": "Oslo"}}\n</tool') == [{"tool_calls": [{"index": 0, "function":
                                                                    {"arguments": 'ty": "Oslo"}'}}]}]
    assert parser.feed("_call>") == [] and parser.finish() == []
    assert parser.calls[0]["function"]["arguments"] == '{"city": "Oslo"}'


def test_merged_deltas_are_one_per_content_run_and_call():
    text = f"Let me look.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALL2}\n</tool_call>\n"
    parser = CallParser(FORMATS["hermes"], counter_ids())
    deltas = [d for ch in text for d in parser.feed(ch)] + parser.finish()
    merged = merge_deltas(deltas)
    assert merged == [{"content": "Let me look."},
                      {"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                                       "function": {"name": "get_weather", "arguments": ARGS}}]},
                      {"tool_calls": [{"index": 1, "id": "call_1", "type": "function",
                                       "function": {"name": "search", "arguments": ARGS2}}]}]
    start = next(d for d in deltas if "tool_calls" in d)
    assert start["tool_calls"][0]["function"]["arguments"] == ""  # the parser's own deltas unchanged


@pytest.mark.parametrize("fmt, text", MALFORMED)
def test_malformed_calls_are_text(fmt, text):
    assert parse_calls(text, FORMATS[fmt]) == (text.rstrip(), [])
    for k in range(len(text) + 1):
        assert streamed(fmt, [text[:k], text[k:]]) == (text.rstrip(), []), k


def test_a_call_cut_short_stays_a_call():
    """max_tokens mid-arguments: the call was committed at its name; finish_reason stays "length"."""
    content, calls = parse_calls('<tool_call>\n{"name": "f", "arguments": {"a": "b', FORMATS["hermes"])
    assert content == "" and calls[0]["function"] == {"name": "f", "arguments": '{"a": "b'}
    assert tool_calls_reason("length", calls) == "length" and tool_calls_reason("eos", calls) == "tool_calls"
    assert tool_calls_reason("eos", []) == "eos"
    assert message("", calls) == {"role": "assistant", "content": None, "tool_calls": calls}
    assert message("hi", []) == {"role": "assistant", "content": "hi"}


def test_a_repeated_call_is_dropped_and_ends_the_output():
    """A call of a function named before is held until its object ends: one repeating an earlier call (arguments
    equal as JSON) is dropped and ends the output, what follows ignored; another goes out whole, as one delta."""
    oslo, rome = '{"city": "Oslo", "unit": "celsius"}', '{"city": "Rome", "unit": "celsius"}'
    again = '{"name": "get_weather", "arguments": {"unit": "celsius", "city": "Oslo"}}'
    text = FORMATS["hermes"].calls_text([("get_weather", oslo), ("get_weather", rome)]) + \
        f"\n<tool_call>\n{again}\n</tool_call>\nand more <tool_call>\n{CALL2}\n</tool_call>"
    expected = ("", [("get_weather", oslo), ("get_weather", rome)])
    for k in range(len(text) + 1):
        assert streamed("hermes", [text[:k], text[k:]]) == expected, k
    parser = CallParser(FORMATS["hermes"], counter_ids())
    deltas = [d for ch in text for d in parser.feed(ch)] + parser.finish()
    assert parser.repeated and parser.content == ""
    assert [d for d in deltas if d["tool_calls"][0]["index"] == 1] == [  # held, then given whole
        {"tool_calls": [{"index": 1, "id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": rome}}]}]
    cut = text[:text.index("Rome") + 2]  # max_tokens inside a held call: a call as far as it came
    assert streamed("hermes", [cut]) == ("", [("get_weather", oslo), ("get_weather", '{"city": "Ro')])
    for fmt in "llama3_json", "mistral":
        twice = FORMATS[fmt].calls_text([("get_weather", oslo), ("search", ARGS2), ("get_weather", oslo)])
        content, calls = parse_calls(twice, FORMATS[fmt])
        assert content == "" and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
            [("get_weather", oslo), ("search", ARGS2)], fmt


def test_tool_choice_none_reads_everything_as_content(smollm2_tokenizer):
    request = tool_request(TOOLS, "none", None, smollm2_tokenizer)
    parser = request.parser()
    text = f"<tool_call>\n{CALL}\n</tool_call>"
    assert parser.feed(text) + parser.finish() == [{"content": text}] and parser.calls == []


def test_format_from_the_template():
    assert detect_format(HERMES_TEMPLATE).name == "hermes"
    assert detect_format("{{ '[TOOL_CALLS] [' }}").name == "mistral"
    assert detect_format("{{- '<|python_tag|>' }}{{ '\"parameters\": ' }}").name == "llama3_json"
    assert detect_format("{{ messages }}").name == "hermes" and detect_format(None).name == "hermes"
    assert format_named("mistral", HERMES_TEMPLATE).name == "mistral"
    assert detect_format("{{ '<tool_call>\\n<function=' + name + '>' }}") is None  # Qwen3-Coder's XML: not parsed
    with pytest.raises(ValueError, match="unknown tool call parser 'qwen'; expected one of hermes, llama3_json"):
        format_named("qwen", None)


# ---- rendering ----

def with_template(tokenizer, template):
    """A copy of the tokenizer with another chat template (the shared fixture stays as it is)."""
    tokenizer = copy.copy(tokenizer)
    tokenizer.chat_template = template
    return tokenizer


def conversation(arguments):
    return [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Oslo and Rome?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}},
                {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
            {"role": "tool", "tool_call_id": "call_2", "content": "20 C"}]


@pytest.mark.parametrize("arguments", ['{"city": "Oslo", "unit": "celsius"}', {"city": "Oslo", "unit": "celsius"}])
def test_a_template_with_tools_renders_them(smollm2_tokenizer, arguments):
    tokenizer = with_template(smollm2_tokenizer, HERMES_TEMPLATE)
    request = tool_request([WEATHER], None, None, tokenizer)
    messages, tools = request.render(conversation(arguments))
    text = tokenizer.apply_chat_template(messages, tools=tools)
    assert tools == [WEATHER]
    assert text.startswith(f"<|im_start|>system\nBe brief.\n# Tools\n<tools>\n{json.dumps(WEATHER)}\n</tools>")
    # the arguments as the template writes a dict with tojson, from JSON text or from an object alike
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>\n'
    assert f"<|im_start|>assistant\n{call}{call}<|im_end|>\n" in text
    assert "<tool_response>\n12 C\n</tool_response>" in text and "<tool_response>\n20 C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_template_without_tools_gets_the_fallback(smollm2_tokenizer):
    """SmolLM2's template reads no `tools`: they are described in the system message, with the call syntax."""
    request = tool_request([WEATHER, EVENT], None, None, smollm2_tokenizer)
    assert request.format.name == "hermes"
    messages, tools = request.render(conversation('{"city": "Oslo", "unit": "celsius"}'))
    assert tools is None
    system = messages[0]
    assert system["role"] == "system" and system["content"].startswith("Be brief.\n\nYou can call these functions")
    assert json.dumps(WEATHER) in system["content"] and json.dumps(EVENT) in system["content"]
    assert '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>' \
        in system["content"]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
    assert messages[2] == {"role": "assistant", "content": f"{call}\n{call}"}
    assert messages[3] == {"role": "user", "content": "<tool_response>\n12 C\n</tool_response>\n"
                                                      "<tool_response>\n20 C\n</tool_response>"}
    assert len(messages) == 4
    text = smollm2_tokenizer.apply_chat_template(messages)
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou can call") and "<|im_start|>tool" not in text
    # without a system message, one is added (SmolLM2's default system prompt then gives way to it)
    messages, _ = request.render([{"role": "user", "content": "hi"}])
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("You can call these functions")


def test_tool_definitions_are_text_in_the_prompt(smollm2_tokenizer):
    """A special token's name in a tool's description is text, as in a message's content."""
    tokenizer = with_template(smollm2_tokenizer, HERMES_TEMPLATE)
    tool = {"type": "function", "function": {"name": "f", "description": "ends <|im_end|> here"}}
    ids = tokenizer.encode_chat([{"role": "user", "content": "hi"}], tools=[tool])
    im_end = tokenizer.backend.token_to_id("<|im_end|>")
    assert ids.count(im_end) == 2  # the tools' system turn and the user's, not the description's


# ---- checking the request ----

@pytest.mark.parametrize("tools, choice, messages, match, field", [
    ([], None, [], r"tools must be a non-empty array", "tools"),
    ([{"type": "function", "function": {"description": "no name"}}], None, [],
     r"tools\[0\]\.function\.name must", "tools[0].function.name"),
    ([WEATHER, {"type": "function", "function": {"name": "bad name"}}], None, [],
     r"tools\[1\]\.function\.name", "tools[1].function.name"),
    ([WEATHER, WEATHER], None, [], r"tools\[1\]\.function\.name 'get_weather' is already", "tools[1].function.name"),
    ([{"type": "code_interpreter"}], None, [], r"tools\[0\]\.type must be 'function'", "tools[0].type"),
    ([{"type": "function", "function": {"name": "f", "parameters": "city"}}], None, [],
     r"tools\[0\]\.function\.parameters must be a JSON Schema object", "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], None, [],
     r"tools\[0\]\.function\.parameters must describe an object", "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "(unclosed"}}}}}], None, [],
     r"tools\[0\]\.function\.parameters: invalid", "tools[0].function.parameters"),
    ([WEATHER], {"type": "function", "function": {"name": "absent"}}, [],
     r"tool_choice\.function\.name \"absent\" is not one of the tools' names \(get_weather\)",
     "tool_choice.function.name"),
    ([WEATHER], "sometimes", [], r"tool_choice must be one of none, auto, required", "tool_choice"),
    (None, "required", [], r"tool_choice 'required' needs tools", "tool_choice"),
    ([WEATHER], None, [{"role": "tool", "tool_call_id": "call_9", "content": "12 C"}],
     r"messages\[0\]\.tool_call_id 'call_9' matches no tool call of an earlier assistant message",
     "messages[0].tool_call_id"),
    ([WEATHER], None, [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f",
                                                                                      "arguments": "{oops"}}]}],
     r"messages\[0\]\.tool_calls\[0\]\.function\.arguments must be the JSON text of an object",
     "messages[0].tool_calls[0].function.arguments"),
    ([WEATHER], None, [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}],
     r"messages\[0\]\.tool_calls\[0\]\.id must be", "messages[0].tool_calls[0].id"),
])
def test_bad_tool_fields_name_the_field(smollm2_tokenizer, tools, choice, messages, match, field):
    with pytest.raises(ValueError, match=match) as error:
        tool_request(tools, choice, None, smollm2_tokenizer).render(messages)
    assert field_of(error.value) == field  # the error body's param


def test_a_template_of_another_syntax_needs_a_parser_name(smollm2_tokenizer):
    tokenizer = with_template(smollm2_tokenizer, "{{ tools }}{{ '<tool_call>\\n<function=' }}")
    with pytest.raises(ValueError, match=r"^tools: this model's chat template writes calls in a syntax not "):
        tool_request([WEATHER], None, None, tokenizer)
    assert tool_request([WEATHER], None, None, tokenizer, "hermes").format.name == "hermes"
    assert tool_request(None, None, None, tokenizer).mode == "none"  # a request without tools is served


def test_parallel_tool_calls_must_be_a_boolean(smollm2_tokenizer):
    with pytest.raises(ValueError, match="parallel_tool_calls must be a boolean"):
        tool_request([WEATHER], None, "yes", smollm2_tokenizer)


# ---- the grammars ----

def accepts(compiler, tokenizer, constraint, text) -> bool:
    """Whether the grammar takes text's tokens and may end after them."""
    matcher = compiler.compile(constraint).matcher()
    for token in tokenizer.encode(text, bos=False):
        if not matcher.matcher.consume_token(token):
            return False
    return matcher.can_end


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer):
    return Compiler(smollm2_tokenizer, smollm2_tokenizer.vocab_size)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_grammars_of_each_mode(smollm2_tokenizer, compiler, fmt):
    tokenizer = smollm2_tokenizer
    good = FORMATS[fmt].calls_text([("get_weather", '{"city": "Oslo", "unit": "celsius"}')])
    two = FORMATS[fmt].calls_text([("get_weather", '{"city": "Oslo", "unit": "celsius"}'),
                                   ("search", '{"query": "rain", "filters": {"lang": "fr"}}')])
    bad_args = FORMATS[fmt].calls_text([("get_weather", '{"city": "Oslo", "unit": "kelvin"}')])
    unknown = FORMATS[fmt].calls_text([("get_time", "{}")])

    def grammar(choice, parallel=None):
        return tool_request(TOOLS, choice, parallel, tokenizer, parser=fmt).constraint

    auto, required = grammar("auto", True), grammar("required", True)
    named = grammar({"type": "function", "function": {"name": "get_weather"}})
    assert accepts(compiler, tokenizer, auto, "It is sunny today.")
    assert accepts(compiler, tokenizer, auto, good) and accepts(compiler, tokenizer, auto, two)
    assert not accepts(compiler, tokenizer, auto, bad_args) and not accepts(compiler, tokenizer, auto, unknown)
    assert accepts(compiler, tokenizer, required, good) and accepts(compiler, tokenizer, required, two)
    assert not accepts(compiler, tokenizer, required, "It is sunny today.")
    for one in grammar("required", False), grammar("required"), grammar("auto"):  # SmolLM2's default: one call
        assert accepts(compiler, tokenizer, one, good) and not accepts(compiler, tokenizer, one, two)
        assert not accepts(compiler, tokenizer, one, good + "\n")  # nothing follows it: the end is forced
    assert accepts(compiler, tokenizer, named, good) and not accepts(compiler, tokenizer, named, two)
    assert not accepts(compiler, tokenizer, named, FORMATS[fmt].calls_text([("search", '{"query": "x", '
                                                                            '"filters": {"lang": "fr"}}')]))
    assert not accepts(compiler, tokenizer, grammar("none"), good)
    assert accepts(compiler, tokenizer, grammar("none"), "It is sunny today.")
    if fmt != "llama3_json":  # text before the call, in auto mode
        assert accepts(compiler, tokenizer, auto, "Let me check. " + good)


def test_parallel_calls_default_to_the_templates_support(smollm2_tokenizer):
    """As llama.cpp: a template that renders several calls in one assistant message allows parallel calls unless
    parallel_tool_calls says otherwise; SmolLM2's, which knows no tools, one call. A named choice: one call."""
    native = with_template(smollm2_tokenizer, HERMES_TEMPLATE)
    assert not tool_request([WEATHER], "required", None, smollm2_tokenizer).parallel
    assert tool_request([WEATHER], "required", None, native).parallel
    assert not tool_request([WEATHER], "required", False, native).parallel
    assert tool_request([WEATHER], "required", True, smollm2_tokenizer).parallel
    assert not tool_request([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, True, native).parallel
    assert parallel_native("{%- for tool in message['tool_calls'] %}") and parallel_native("{{ m.tool_calls|tojson }}")
    assert not parallel_native("{%- set call = message.tool_calls[0].function %}") and not parallel_native(None)


ANSWER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}
ANSWERS = [  # (a response format, a text in it, a text not in it)
    (Constraint("json_schema", json.dumps(ANSWER)), '{"city": "Oslo", "sunny": true}', '{"city": "Oslo"}'),
    (Constraint("json_object"), '{"a": [1, 2]}', "[1, 2]"),
    (Constraint("regex", "(yes|no)/[0-9]+"), "yes/12", "maybe/12"),
    (Constraint("grammar", 'root ::= "A" [0-9]+'), "A42", "B42"),  # GBNF
    (Constraint("grammar", 'start: "{" NAME "}"\nNAME: /[a-z]+/'), "{abc}", "{ABC}"),  # Lark, braces and all
]


@pytest.mark.parametrize("fmt, answer, inside, outside", [("hermes", *a) for a in ANSWERS] + [
    (fmt, *a) for fmt in ("llama3_json", "mistral") for a in ANSWERS[:2]])  # JSON: a call's "{" too, in Llama 3's
def test_a_response_format_with_tools(smollm2_tokenizer, compiler, fmt, answer, inside, outside):
    """tools with response_format: in auto mode the output is the calls or an answer in the format, never free
    text; required calls ignore the format; none is the format alone."""
    tokenizer = smollm2_tokenizer
    call = FORMATS[fmt].calls_text([("get_weather", '{"city": "Oslo", "unit": "celsius"}')])
    search = FORMATS[fmt].calls_text([("search", ARGS2)])  # its schema's $ref, from the call's own root

    def ok(choice, text):
        constraint = tool_request(TOOLS, choice, None, tokenizer, parser=fmt).constraint_with(answer)
        return accepts(compiler, tokenizer, constraint, text)

    assert ok("auto", call) and ok("auto", search) and ok("auto", inside)
    assert not ok("auto", outside) and not ok("auto", "It is sunny today.")
    assert ok("required", call) and not ok("required", inside)
    assert ok("none", inside) and not ok("none", outside)
    assert ok("none", call) == (fmt == "llama3_json" and answer.kind == "json_object")  # a call is a JSON object


def test_the_guard_ends_the_output_at_a_repeated_call(smollm2_tokenizer, compiler):
    """With parallel calls the grammar's matchers read the calls: the token that completes a call repeating an
    earlier one ends the output (done), before the model could go on to max_tokens; rolled back, it is open again.
    One call needs no guard: its grammar ends after it."""
    tokenizer = smollm2_tokenizer
    request = tool_request([WEATHER, SEARCH], "required", True, tokenizer)
    grammar = request.grammar(compiler.compile(request.constraint))
    oslo = '{"city": "Oslo", "unit": "celsius"}'
    text = FORMATS["hermes"].calls_text([("get_weather", oslo), ("search", ARGS2), ("get_weather", oslo)])
    ids = tokenizer.encode(text, bos=False)
    end = next(k for k in range(len(ids) + 1) if len(tokenizer.decode(ids[:k])) >= text.rindex("}") + 1)
    matcher = grammar.matcher()
    for k, token in enumerate(ids[:end]):
        assert not matcher.done, tokenizer.decode(ids[:k])
        matcher.advance(token)
    assert matcher.done and not matcher.can_end  # the grammar alone would go on: its close, more calls
    matcher.rollback(1)
    assert not matcher.done
    matcher.advance(ids[end - 1])
    assert matcher.done
    one = tool_request([WEATHER], "required", None, tokenizer)
    compiled = compiler.compile(one.constraint)
    assert one.grammar(compiled) is compiled


def test_a_special_token_trigger_is_named_by_id(smollm2_tokenizer, compiler):
    """Where the vocabulary has the trigger as one special token (Mistral's [TOOL_CALLS]), the grammar names the
    token, never the text: here SmolLM2's <|im_start|> stands in for it."""
    lark = calls_lark(FORMATS["mistral"], [WEATHER], "auto", ("get_weather",), True, special_trigger=5)
    assert "open: TEXT <[5]>" in lark and "[TOOL_CALLS]" not in lark
    tokenizer = smollm2_tokenizer
    trigger = tokenizer.backend.token_to_id("<|im_start|>")
    fmt = Format("special", "<|im_start|>", "arguments", ", ", array=True)
    call = tokenizer.encode('[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]', bos=False)
    bad = tokenizer.encode('[{"name": "get_weather", "arguments": {"city": 12}}]', bos=False)
    text = tokenizer.encode("Sure. ", bos=False)
    for mode, ids, ok in [("auto", text + [trigger] + call, True), ("auto", text + [trigger] + bad, False),
                          ("auto", text, True), ("required", [trigger] + call, True), ("required", call, False),
                          ("none", text + [trigger], False)]:
        matcher = compiler.compile(Constraint("lark", calls_lark(fmt, [WEATHER], mode, ("get_weather",), True,
                                                                 trigger))).matcher()
        taken = all(matcher.matcher.consume_token(i) for i in ids)
        assert (taken and matcher.can_end) == ok, (mode, tokenizer.decode(ids))
    with_tag = tool_request([WEATHER], None, None, with_template(tokenizer, "{{ '<|im_start|>' }}"), "hermes")
    assert with_tag.special_trigger is None  # <tool_call> is text in SmolLM2's vocabulary


# ---- constrained calls on SmolLM2 ----

PROMPTS = ["What's the weather like in Paris?", "Book a meeting with Ana on the 3rd.", "Find recipes for soup.",
           "hello", "Is it going to rain in Tokyo tomorrow?", "Remind me to call mom on Friday.",
           "Search for the best hiking trails near Denver.", "Tell me a joke about cats.",
           "Schedule lunch with Bob and Carol on the 21st.", "¿Qué tiempo hace en Madrid?"]


@pytest.mark.slow
def test_constrained_calls_validate(smollm2):
    """tool_choice named or "required" at temperature 0.8: every prompt gives one complete call whose arguments are
    valid under its schema (jsonschema), whatever the model (a 135M model that knows no call format). Named: each
    prompt x each of the three schemas (the tool alone in the prompt); required: each prompt, all three tools
    offered, the call naming any of them."""
    from decode import generate_batch
    from params import SamplingParams
    from text import complete_batch

    model, tokenizer = smollm2
    compiler = Compiler(tokenizer, model.args.vocab_size)
    generator = torch.Generator().manual_seed(0)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    runs = [([tool], {"type": "function", "function": {"name": tool["function"]["name"]}}) for tool in TOOLS]
    names = []
    for tools, tool_choice in runs + [(TOOLS, "required")]:
        request = tool_request(tools, tool_choice, False, tokenizer)
        prompts = []
        for p in (PROMPTS[0], PROMPTS[3]):  # one asking for a call, one not (test_openai.py sends 10 x 3 + 6)
            messages, template_tools = request.render([{"role": "user", "content": p}])
            prompts.append(tokenizer.encode_chat(messages, tools=template_tools))
        rows = generate_batch(model, prompts, max_new_tokens=120, params=SamplingParams(temperature=0.8),
                              generator=generator, stop_ids=tokenizer.eos_ids,
                              grammar=compiler.compile(request.constraint))
        for c in complete_batch(rows, tokenizer, [len(p) for p in prompts]):
            content, calls = request.parse(c.text)
            assert c.finish_reason in ("eos", "stop") and content == "" and len(calls) == 1, c.text
            name = calls[0]["function"]["name"]
            assert tool_choice == "required" or name == tool_choice["function"]["name"]
            jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), schemas[name])
            names.append(name)
    assert len(names) == 4 * 2



@pytest.mark.slow
def test_auto_constrains_a_call_once_it_opens(smollm2):
    """tool_choice auto: text is free, but once the output writes the opening the rest is a valid call. The
    opening is forced here (prompt and matcher both start after "Sure. <tool_call>"), the model writes the rest."""
    from decode import generate_batch
    from params import SamplingParams
    from text import complete_batch

    model, tokenizer = smollm2
    request = tool_request(TOOLS, "auto", False, tokenizer)
    grammar = Compiler(tokenizer, model.args.vocab_size).compile(request.constraint)
    opening = "Sure. <tool_call>"
    opened = tokenizer.encode(opening, bos=False)

    class Opened:
        """The grammar with its matcher past the opening, as if the model had written it."""
        def matcher(self):
            matcher = grammar.matcher()
            for token in opened:
                matcher.advance(token)
            return matcher

    prompts = []
    for p in PROMPTS[:3]:
        messages, template_tools = request.render([{"role": "user", "content": p}])
        prompts.append(tokenizer.encode_chat(messages, tools=template_tools) + opened)
    rows = generate_batch(model, prompts, max_new_tokens=120, params=SamplingParams(temperature=0.8),
                          generator=torch.Generator().manual_seed(0), stop_ids=tokenizer.eos_ids, grammar=Opened())
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for c in complete_batch(rows, tokenizer, [len(p) for p in prompts]):
        content, calls = request.parse(opening + c.text)
        assert c.finish_reason in ("eos", "stop") and content == "Sure." and len(calls) == 1, c.text
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), schemas[calls[0]["function"]["name"]])

# ---- the CLI ----

@pytest.mark.parametrize("flags, fragment", [
    (["--prompt", "hi", "--tools", "T"], "error: --tools needs --chat"),
    (["--chat", "--prompt", "hi", "--tool-choice", "auto"], "error: --tool-choice needs --tools"),
    (["--chat", "--prompt", "hi", "--tools", "missing.json"], "error: tools file 'missing.json' does not exist"),
    (["--chat", "--prompt", "hi", "--tools", "T", "--tool-choice", "get_time"],
     "error: --tools T: tool_choice.function.name \"get_time\" is not one of the tools' names (get_weather)"),
    (["--chat", "--prompt", "hi", "--tools", "BAD"], "error: --tools BAD: tools[0].function.name must be"),
])
def test_cli_bad_tool_flags_are_one_line(cli_error, tmp_path, monkeypatch, flags, fragment):
    import generate

    monkeypatch.chdir(tmp_path)
    (tmp_path / "T").write_text(json.dumps([WEATHER]))
    (tmp_path / "BAD").write_text(json.dumps([{"type": "function", "function": {"description": "no name"}}]))
    assert cli_error(generate.main, flags).startswith(fragment)


def test_cli_tool_results(monkeypatch):
    """/tool ID RESULT answers a call of the last reply; the model replies once every call has its result."""
    from features.chat import tool_result

    calls = [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
             {"id": "b", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": calls}]
    assert tool_result(messages, '/tool a {"t": 1}') is True  # b still waits
    assert messages[-1] == {"role": "tool", "tool_call_id": "a", "content": '{"t": 1}'}
    with pytest.raises(ValueError, match=r"/tool takes the id of a call of the last reply \(a, b\)"):
        tool_result(messages, "/tool c 2")
    assert tool_result(messages, "/tool b 2") is False


@pytest.mark.slow
def test_cli_interactive_tool_round_trip(smollm2_gguf, tmp_path, monkeypatch, capsys):
    """--interactive with a named tool choice: a call, its result with /tool, and the next reply (again a call of
    the named function) rendered after the result."""
    import io

    import generate
    from features import toolcalls

    ids = counter_ids()
    monkeypatch.setattr(toolcalls, "new_call_id", lambda fmt=None: ids())
    (tmp_path / "tools.json").write_text(json.dumps([WEATHER]))
    monkeypatch.setattr("sys.stdin", io.StringIO('/tool nope 1\n/tool call_0 {"temperature": 12}\n'))
    assert generate.main(["--model", smollm2_gguf, "--chat", "--interactive", "--prompt", "Weather in Oslo?",
                          "--tools", str(tmp_path / "tools.json"), "--tool-choice", "get_weather", "--seed", "0",
                          "--max-new-tokens", "40", "--compile", "none", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines() if line.startswith('{"tool_calls"')]
    assert [call["id"] for line in lines for call in line["tool_calls"]] == ["call_0", "call_1"], out
    for line in lines:
        jsonschema.validate(json.loads(line["tool_calls"][0]["function"]["arguments"]),
                            WEATHER["function"]["parameters"])
    assert "error: /tool takes the id of a call of the last reply (call_0)" in err and err.count("turn ") == 2


def test_call_schemas_are_closed_where_left_open():
    """Objects listing properties get additionalProperties false unless they say otherwise; property maps and
    values are left alone (a property named "properties" stays a property)."""
    from features.tools import closed

    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"a": {}}},
                                               "b": {"enum": [{"properties": {}}]}},
              "$defs": {"x": {"type": "object", "properties": {}, "additionalProperties": True}}}
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["properties"]["additionalProperties"] is False
    assert set(out["properties"]) == {"properties", "b"} and out["properties"]["b"] == {"enum": [{"properties": {}}]}
    assert out["$defs"]["x"]["additionalProperties"] is True


def test_schema_keywords_llguidance_lacks_are_ignored_in_tools(smollm2_tokenizer, compiler):
    """Agents send their tools as they are: Claude Code's schemas use propertyNames, which llguidance does not
    implement. The tool is served (the keyword ignored), the rest of its schema still holds."""
    tool = {"type": "function", "function": {"name": "tag", "parameters": {
        "type": "object", "properties": {"labels": {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}},
                                         "n": {"type": "integer"}}, "required": ["n"]}}}
    grammar = tool_request([tool], "required", None, smollm2_tokenizer).constraint
    call = FORMATS["hermes"].calls_text
    assert accepts(compiler, smollm2_tokenizer, grammar, call([("tag", '{"labels": {"a": 1}, "n": 2}')]))
    assert not accepts(compiler, smollm2_tokenizer, grammar, call([("tag", '{"labels": {"a": 1}, "n": "2"}')]))


@pytest.mark.slow
def test_cli_tools_with_a_json_schema(smollm2_gguf, tmp_path, capsys):
    """--tools with --json-schema is one grammar, as on the server: tool_choice none leaves the answer, which
    follows the schema."""
    import generate

    schema = {"type": "object", "properties": {"city": {"type": "string"}, "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"]}
    (tmp_path / "tools.json").write_text(json.dumps([WEATHER]))
    assert generate.main(["--model", smollm2_gguf, "--chat", "--prompt", "Is it sunny in Oslo? Answer in JSON.",
                          "--tools", str(tmp_path / "tools.json"), "--tool-choice", "none", "--json-schema",
                          json.dumps(schema), "--max-new-tokens", "60", "--compile", "none", "--temperature", "0",
                          "--quiet"]) == 0
    out = capsys.readouterr().out
    jsonschema.validate(json.loads(out), schema)
