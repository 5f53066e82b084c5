"""OpenAI's Responses API (serving/responses.py): input items -> the chat request that asks the same (messages,
function calls and their outputs, instructions, text.format, the stored conversation of previous_response_id) and
the 400s; engine Events -> a response and its typed events. The `openai` SDK against the server on SmolLM2 (slow)."""
import asyncio
import importlib
import json

import pytest

from helpers import stream_pieces
from serving.contract import Event
from serving.protocol import BadRequest
from serving.responses import ResponsesAnswer, Store, chat_body, parse_responses

TOOL = {"type": "function", "name": "get_weather", "description": "Get the weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
LIMITS = {"max_len": 512, "max_chars": 10 ** 6, "compile_grammar": lambda constraint: None}


def test_items_become_chat_messages_and_the_store_continues_a_conversation():
    store = Store(size=2)
    body = {"model": "m", "instructions": "Be brief.", "max_output_tokens": 30, "tools": [TOOL],
            "tool_choice": {"type": "function", "name": "get_weather"}, "reasoning": {"effort": "none"},
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                      {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sure."}]},
                      {"type": "reasoning", "id": "rs_1", "summary": []},
                      {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c1", "output": "Sunny"}]}
    chat, conversation = chat_body(body, store)
    assert chat["messages"][0] == {"role": "system", "content": "Be brief."} and chat["messages"][1:] == conversation
    assert conversation == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Sure.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}]
    assert chat["max_tokens"] == 30 and chat["tool_choice"] == {"type": "function",
                                                                "function": {"name": "get_weather"}}
    assert chat["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}
    store.put({"id": "resp_1"}, conversation)
    later, _ = chat_body({"previous_response_id": "resp_1", "input": "And tomorrow?"}, store)
    assert later["messages"] == [*conversation, {"role": "user", "content": "And tomorrow?"}]  # no instructions
    store.put({"id": "resp_2"}, [])
    store.put({"id": "resp_3"}, [])  # over the size: the oldest goes
    assert store.get("resp_1") is None and store.delete("resp_3") and not store.delete("resp_3")
    small = Store(size=10, max_chars=250)
    for k in range(5):
        small.put({"id": f"r{k}"}, [{"role": "user", "content": "x" * 60}])  # 109 characters each
    assert [small.get(f"r{k}") is not None for k in range(5)] == [False, False, False, True, True]
    small.put({"id": "huge"}, [{"role": "user", "content": "x" * 1000}])  # alone over the bound: kept, alone
    assert small.get("huge") is not None and small.get("r4") is None and small.chars < 1100


@pytest.mark.parametrize("change, param, words", [
    ({"input": None}, "input", "input is required"),
    ({"previous_response_id": "resp_gone"}, "previous_response_id", "is not stored here"),
    ({"tools": [{"type": "web_search"}]}, "tools", 'the built-in tool "web_search" is not served'),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice", "is not served"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "input_image"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "item_reference"),
    ({"text": {"format": {"type": "xml"}}}, "text", "text.format must be"),
])
def test_bad_bodies_are_400s_naming_the_field(change, param, words):
    body = {"model": "m", "input": "hi", **change}
    with pytest.raises(BadRequest, match=words) as e:
        chat_body({k: v for k, v in body.items() if v is not None}, Store())
    assert e.value.param == param


def typed_events(lines: list[str]) -> list[dict]:
    out = []
    for line in lines:
        name, data = line.strip().split("\n")
        out.append(json.loads(data.removeprefix("data: ")))
        assert out[-1]["type"] == name.removeprefix("event: ")
    return out


def test_a_function_call_streams_as_an_item_and_is_stored(smollm2_tokenizer):
    tok, store = smollm2_tokenizer, Store()
    body = {"model": "m", "input": "Weather in Paris?", "stream": True, "tools": [TOOL], "max_output_tokens": 60}
    call = parse_responses(json.dumps(body).encode(), tok, store, **LIMITS)
    answer = ResponsesAnswer(call, tok, "m", store)
    pieces = ["On it.", "<tool_call>\n", '{"name": "get_weather", "arguments": {"ci', 'ty": "Paris"}}',
              "\n</tool_call>"]
    lines = stream_pieces(answer, pieces)
    events = typed_events(lines)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.function_call_arguments.done" in kinds
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert json.loads(arguments) == {"city": "Paris"}
    output = events[-1]["response"]["output"]
    assert [o["type"] for o in output] == ["message", "function_call"]
    assert output[0]["content"][0]["text"] == "On it." and output[1]["arguments"] == arguments
    response, conversation = store.get(answer.id)
    assert response == answer.body() and conversation[-1]["tool_calls"][0]["id"] == output[1]["call_id"]


def test_a_response_cut_by_max_output_tokens_is_incomplete(smollm2_tokenizer):
    tok, store = smollm2_tokenizer, Store()
    body = {"model": "m", "input": "hi", "max_output_tokens": 2, "store": False}
    answer = ResponsesAnswer(parse_responses(json.dumps(body).encode(), tok, store, **LIMITS), tok, "m", store)
    answer.add(0, Event(0, "Hi there", [1, 2], True, "length", 9, 2, 0))
    response = answer.body()
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["usage"]["output_tokens"] == 2 and store.get(answer.id) is None  # store: false


# ---- the openai SDK against the server ----

def serve(reference, fn):
    import openai

    from serving.app import make_app
    from serving.engine import Engine, EngineConfig

    httpx = importlib.import_module(openai.DefaultAsyncHttpxClient.__mro__[1].__module__.split(".")[0])
    model, tokenizer = reference
    app = make_app(Engine(model, tokenizer, EngineConfig(num_blocks=128, max_running=8, token_budget=64)),
                   tokenizer, "m")

    async def main():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8000",
                                         timeout=120) as h:
                client = openai.AsyncOpenAI(base_url="http://127.0.0.1:8000/v1", api_key="x", http_client=h,
                                            max_retries=0)
                return await fn(client)

    return asyncio.run(main())


@pytest.mark.slow
def test_the_openai_sdk_creates_streams_and_continues_with_function_outputs(smollm2):
    import openai

    async def fn(client):
        ask = {"model": "m", "input": "What is the capital of France?", "temperature": 0, "max_output_tokens": 24}
        made = await client.responses.create(**ask)
        async with client.responses.stream(**ask) as stream:
            deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
            streamed = await stream.get_final_response()
        assert made.output_text == "".join(deltas) == streamed.output_text and "Paris" in made.output_text
        weather = {"model": "m", "tools": [TOOL], "temperature": 0, "max_output_tokens": 60}
        called = await client.responses.create(input="What is the weather in Paris?", **weather,
                                               tool_choice={"type": "function", "name": "get_weather"})
        call = next(o for o in called.output if o.type == "function_call")
        assert isinstance(json.loads(call.arguments)["city"], str)
        required = await client.responses.create(input="What is the weather in Paris?", **weather,
                                                 tool_choice="required")
        assert [o.type for o in required.output] == ["function_call"] and required.status == "completed"
        assert isinstance(json.loads(required.output[0].arguments)["city"], str)
        after = await client.responses.create(previous_response_id=called.id, **weather, input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 22 C"}])
        assert after.status in ("completed", "incomplete") and after.previous_response_id == called.id
        assert after.usage.input_tokens > called.usage.input_tokens  # the stored conversation came first
        assert (await client.responses.retrieve(after.id)).output_text == after.output_text
        await client.responses.delete(after.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(after.id)
        report = {"type": "object", "properties": {"city": {"type": "string"}, "weather": {"type": "string"}},
                  "required": ["city", "weather"], "additionalProperties": False}
        typed = await client.responses.create(  # what the Agents SDK sends for an agent with tools and output_type
            input="Give a weather report for Paris.", **weather,
            text={"format": {"type": "json_schema", "name": "Report", "schema": report, "strict": True}})
        kinds = [o.type for o in typed.output]
        assert kinds == ["function_call"] or set(json.loads(typed.output_text)) == {"city", "weather"}, kinds
        with pytest.raises(openai.BadRequestError, match="web_search"):
            await client.responses.create(model="m", input="hi", tools=[{"type": "web_search"}])

    serve(smollm2, fn)


def test_reasoning_becomes_a_reasoning_item(smollm2_tokenizer):
    from features.reasoning import Tags

    tok, store = smollm2_tokenizer, Store()
    body = {"model": "m", "input": "hi", "stream": True}
    call = parse_responses(json.dumps(body).encode(), tok, store, **LIMITS, reasoning=Tags())
    answer = ResponsesAnswer(call, tok, "m", store)
    pieces = ["<think>Greet", " back.</think>", "Hello!"]
    lines = stream_pieces(answer, pieces)
    events = typed_events(lines)
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert reasoning == "Greet back."
    output = events[-1]["response"]["output"]
    assert [o["type"] for o in output] == ["reasoning", "message"]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "Greet back."}]
    assert output[1]["content"][0]["text"] == "Hello!"
    assert store.get(answer.id)[1][-1] == {"role": "assistant", "content": "Hello!"}  # the thinking is not carried
