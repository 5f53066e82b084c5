"""Anthropic's Messages API (serving/messages.py): bodies -> the chat request that asks the same (blocks, tools,
tool_choice, thinking, structured output) and the 400s, in Anthropic's error shape; engine Events -> a message and
its stream of named events. The official `anthropic` SDK against the server on SmolLM2 (slow)."""
import asyncio
import importlib
import json

import pytest

from helpers import stream_pieces
from serving.contract import Event
from serving.messages import MessagesAnswer, chat_body, error_body, parse_messages
from serving.protocol import BadRequest

TOOL = {"name": "get_weather", "description": "Get the weather for a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
LIMITS = {"max_len": 512, "max_chars": 10 ** 6, "compile_grammar": lambda constraint: None}


def test_blocks_tools_and_choices_become_chats():
    body = {"model": "claude", "max_tokens": 20, "system": [{"type": "text", "text": "Be brief."}],
            "stop_sequences": ["\n\n"], "tools": [TOOL], "tool_choice": {"type": "any",
                                                                         "disable_parallel_tool_use": True},
            "thinking": {"type": "disabled"}, "metadata": {"user_id": "u"},
            "messages": [{"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": [
                             {"type": "thinking", "thinking": "Use the tool.", "signature": "s"},
                             {"type": "text", "text": "Checking."},
                             {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                         {"role": "user", "content": [
                             {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                                 {"type": "text", "text": "Sunny"}]},
                             {"type": "text", "text": "And tomorrow?"}]}]}
    chat = chat_body(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
        {"role": "user", "content": "And tomorrow?"}]
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": TOOL["description"], "parameters": TOOL["input_schema"]}}]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["stop"] == ["\n\n"] and chat["chat_template_kwargs"] == {"enable_thinking": False}
    named = chat_body({**body, "tool_choice": {"type": "tool", "name": "get_weather"}})["tool_choice"]
    assert named == {"type": "function", "function": {"name": "get_weather"}}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = chat_body({**body, "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert fmt["response_format"]["json_schema"]["schema"] == schema


@pytest.mark.parametrize("change, param, words", [
    ({"max_tokens": None}, "max_tokens", "max_tokens: Field required"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages", '"image" block'),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "role must be user, assistant or system"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools", "server tool"),
    ({"tool_choice": {"type": "some"}}, "tool_choice", "tool_choice.type must be"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]}, "messages",
     "tool_result blocks to user turns"),
])
def test_bad_bodies_are_400s_naming_the_field(change, param, words):
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **change}
    with pytest.raises(BadRequest, match=words) as e:
        chat_body({k: v for k, v in body.items() if v is not None})
    assert e.value.param == param
    assert error_body(400, str(e.value)) == {"type": "error", "error": {"type": "invalid_request_error",
                                                                         "message": str(e.value)}}


def stream_events(lines: list[str]) -> list[tuple[str, dict]]:
    out = []
    for line in lines:
        name, data = line.strip().split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_a_tool_call_streams_as_a_tool_use_block(smollm2_tokenizer):
    tok = smollm2_tokenizer
    body = {"model": "m", "max_tokens": 60, "stream": True, "tools": [TOOL],
            "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    call = parse_messages(json.dumps(body).encode(), tok, **LIMITS)
    answer = MessagesAnswer(call, tok, "m")
    pieces = ["Let me check.", "<tool_call>\n", '{"name": "get_weather", "arguments": {"ci', 'ty": "Paris"}}',
              "\n</tool_call>"]
    lines = stream_pieces(answer, pieces)
    events = stream_events(lines)
    names = [name for name, _ in events]
    assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert names[-2:] == ["message_delta", "message_stop"]
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [b["type"] for b in starts] == ["text", "tool_use"] and starts[1]["name"] == "get_weather"
    partial = "".join(d["delta"]["partial_json"] for n, d in events if n == "content_block_delta"
                      and d["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == {"city": "Paris"}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use" and events[-2][1]["usage"]["output_tokens"] == 5
    whole = answer.body()
    assert [b["type"] for b in whole["content"]] == ["text", "tool_use"]
    assert whole["content"][1]["input"] == {"city": "Paris"} and whole["content"][1]["id"].startswith("toolu_")


def test_stop_reasons_follow_the_engines(smollm2_tokenizer):
    tok = smollm2_tokenizer
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "stop_sequences": ["."]}
    for reason, stop, expected in [("eos", None, "end_turn"), ("length", None, "max_tokens"),
                                   ("stop", ".", "stop_sequence")]:
        answer = MessagesAnswer(parse_messages(json.dumps(body).encode(), tok, **LIMITS), tok, "m")
        answer.add(0, Event(0, "Hi", [1], True, reason, 9, 1, 4, stop_string=stop))
        message = answer.body()
        assert (message["stop_reason"], message["stop_sequence"]) == (expected, stop)
        assert message["usage"]["input_tokens"] + message["usage"]["cache_read_input_tokens"] == \
            len(answer.call.requests[0].prompt)


# ---- the anthropic SDK against the server ----

def serve(reference, fn, **config):
    """Run `await fn(client, app)` with an AsyncAnthropic client on a fresh app over SmolLM2 (engine on a thread)."""
    anthropic = pytest.importorskip("anthropic")
    from serving.app import make_app
    from serving.engine import Engine, EngineConfig
    from serving.gate import ServeConfig

    httpx = importlib.import_module(anthropic.DefaultAsyncHttpxClient.__mro__[1].__module__.split(".")[0])
    model, tokenizer = reference
    app = make_app(Engine(model, tokenizer, EngineConfig(num_blocks=128, max_running=8, token_budget=64)),
                   tokenizer, "m", config=ServeConfig(**config))

    async def main():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8000",
                                         timeout=120) as h:
                client = anthropic.AsyncAnthropic(base_url="http://127.0.0.1:8000", api_key="k", http_client=h,
                                                  max_retries=0)
                return await fn(client, app)

    return asyncio.run(main())


GREEDY = {"extra_body": {"temperature": 0}}  # the 2026 SDK has no temperature argument; the API still takes it
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow
def test_the_anthropic_sdk_creates_streams_counts_and_calls_tools(smollm2):
    import anthropic

    async def fn(client, app):
        made = await client.messages.create(model="claude-x", max_tokens=24, messages=ASK, **GREEDY)
        async with client.messages.stream(model="claude-x", max_tokens=24, messages=ASK, **GREEDY) as stream:
            pieces = [text async for text in stream.text_stream]
            streamed = await stream.get_final_message()
        assert made.content[0].text == "".join(pieces) == streamed.content[0].text and "Paris" in made.content[0].text
        assert made.stop_reason == "end_turn" and made.usage.output_tokens == streamed.usage.output_tokens
        weather = [{"role": "user", "content": "What is the weather in Paris?"}]
        called = await client.messages.create(model="m", max_tokens=60, tools=[TOOL], messages=weather,
                                              tool_choice={"type": "tool", "name": "get_weather"}, **GREEDY)
        use = called.content[-1]
        assert called.stop_reason == "tool_use" and use.type == "tool_use" and isinstance(use.input["city"], str)
        after = await client.messages.create(model="m", max_tokens=24, tools=[TOOL], **GREEDY, messages=[
            *weather, {"role": "assistant", "content": called.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 22 C"}]}])
        assert after.content and after.stop_reason in ("end_turn", "max_tokens")
        counted = await client.messages.count_tokens(model="m", messages=ASK)
        assert counted.input_tokens == made.usage.input_tokens + made.usage.cache_read_input_tokens
        with pytest.raises(anthropic.BadRequestError) as e:
            await client.messages.create(model="m", max_tokens=None, messages=ASK)
        assert e.value.body["error"] == {"type": "invalid_request_error", "message": "max_tokens: Field required"}

    serve(smollm2, fn)


@pytest.mark.slow
def test_the_key_goes_in_x_api_key_and_refusals_are_anthropics(smollm2):
    import anthropic

    async def fn(client, app):
        made = await client.messages.create(model="m", max_tokens=4, messages=ASK, **GREEDY)  # sends x-api-key: k
        assert made.usage.output_tokens == 4
        with pytest.raises(anthropic.AuthenticationError) as e:
            await client.with_options(api_key="wrong").messages.create(model="m", max_tokens=4, messages=ASK)
        assert e.value.body["error"]["type"] == "authentication_error"

    serve(smollm2, fn, api_key="k")


def test_max_tokens_is_a_cap_cut_to_the_room_left(smollm2_tokenizer):
    """Claude Code asks for max_tokens 64,000 whatever the model: the rest of the context is what it gets."""
    body = {"model": "m", "max_tokens": 64000, "messages": [{"role": "user", "content": "hi"}]}
    request = parse_messages(json.dumps(body).encode(), smollm2_tokenizer, **LIMITS).requests[0]
    assert request.max_new_tokens == LIMITS["max_len"] - len(request.prompt)
    small = parse_messages(json.dumps({**body, "max_tokens": 5}).encode(), smollm2_tokenizer, **LIMITS)
    assert small.requests[0].max_new_tokens == 5
    with pytest.raises(BadRequest, match="max_tokens must be >= 1"):
        parse_messages(json.dumps({**body, "max_tokens": 0}).encode(), smollm2_tokenizer, **LIMITS)


def test_reasoning_becomes_a_thinking_block(smollm2_tokenizer):
    from features.reasoning import Tags

    tok = smollm2_tokenizer
    body = {"model": "m", "max_tokens": 60, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    call = parse_messages(json.dumps(body).encode(), tok, **LIMITS, reasoning=Tags())
    answer = MessagesAnswer(call, tok, "m")
    pieces = ["<think>", "The user ", "greets.</thi", "nk>\n\nHello!"]
    lines = stream_pieces(answer, pieces)
    events = stream_events(lines)
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert starts == [{"type": "thinking", "thinking": "", "signature": ""}, {"type": "text", "text": ""}]
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "The user greets."
    assert "".join(d.get("text", "") for d in deltas) == "Hello!"
    assert {"type": "signature_delta", "signature": ""} in deltas
    stops = [d["index"] for n, d in events if n == "content_block_stop"]
    assert stops == [0, 1]
    assert answer.body()["content"] == [{"type": "thinking", "thinking": "The user greets.", "signature": ""},
                                        {"type": "text", "text": "Hello!"}]
