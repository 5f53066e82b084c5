"""OpenAI's Responses API (POST /v1/responses), without a server: a Responses body (with the conversation of its
previous_response_id) -> the equivalent chat body, parsed by protocol.py into the same Call, and the engine's Events
-> a response object or its stream of typed events; Store keeps recent responses for previous_response_id and GET /
DELETE. What the OpenAI Agents SDK and Codex call. Pure: app.py does the HTTP."""
import json
import secrets
import threading
import time
from collections import OrderedDict

from serving.answer import Answer
from serving.contract import Event
from serving.protocol import BadRequest, Call, get, parse_capped, parse_json

# The fields read; others (include, truncation, user, prompt_cache_key, ...) are ignored with a log line.
FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "text", "max_output_tokens", "temperature",
          "top_p", "stream", "store", "previous_response_id", "parallel_tool_calls", "reasoning", "metadata"}
STORED = 256  # responses kept for previous_response_id, the oldest forgotten first
STORED_CHARS = 2 ** 26  # and their JSON text at most (64 Mi characters: 16 bodies at --max-body-bytes' 4 MiB)
TEXT_PARTS = ("input_text", "output_text", "text")


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


class Store:
    """Recent responses by id (at most `size`, and their text at most `max_chars` in all: each holds its whole
    conversation, so a long previous_response_id chain grows as its square), each with the conversation that led
    to it and its output as chat messages, so a request can continue from it. Read on worker threads, written on
    the event loop: locked."""

    def __init__(self, size: int = STORED, max_chars: int = STORED_CHARS):
        self.size, self.max_chars, self.items, self.lock = size, max_chars, OrderedDict(), threading.Lock()
        self.chars = 0

    def put(self, response: dict, messages: list[dict]) -> None:
        chars = len(json.dumps([response, messages]))
        with self.lock:
            self.items[response["id"]] = (response, messages, chars)
            self.chars += chars
            while len(self.items) > self.size or (self.chars > self.max_chars and len(self.items) > 1):
                self.chars -= self.items.popitem(last=False)[1][2]

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        with self.lock:
            item = self.items.get(response_id)
        return None if item is None else item[:2]

    def delete(self, response_id: str) -> bool:
        with self.lock:
            item = self.items.pop(response_id, None)
            self.chars -= 0 if item is None else item[2]
        return item is not None


def text_of(content, where: str) -> str:
    """A string, or an array of text parts, as one string; BadRequest for images and files."""
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else [None]
    bad = [p.get("type") if isinstance(p, dict) else p for p in parts
           if not isinstance(p, dict) or p.get("type") not in TEXT_PARTS or not isinstance(p.get("text"), str)]
    if bad:
        raise BadRequest(f"{where} must be a string or an array of text parts; got a part of type "
                         f"{json.dumps(bad[0])[:50]} (only text is served here)", "input")
    return "".join(p["text"] for p in parts)


def chat_messages(items, where: str = "input") -> list[dict]:
    """Responses input items as chat messages: function_call items join the assistant message before them as its
    tool_calls, function_call_output items become tool messages; reasoning items are dropped."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise BadRequest("input must be a string or an array of items", "input")
    out: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise BadRequest(f"{where}[{i}].role must be user, assistant, system or developer", "input")
            out.append({"role": "system" if role == "developer" else role,
                        "content": text_of(item.get("content"), f"{where}[{i}].content")})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise BadRequest(f"{where}[{i}]: a function_call needs call_id, name and arguments", "input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": None})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise BadRequest(f"{where}[{i}]: a function_call_output needs its call_id", "input")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": text_of(item.get("output", ""), f"{where}[{i}].output")})
        elif kind != "reasoning":
            raise BadRequest(f"{where}[{i}]: items of type {json.dumps(kind)[:50]} are not served here", "input")
    return out


def chat_tools(body: dict) -> dict:
    """tools and tool_choice in chat's shape; built-in tools (web search, file search, ...) are refused."""
    out = {}
    tools = get(body, "tools", "array")
    if tools:
        builtin = [t.get("type") if isinstance(t, dict) else t for t in tools
                   if not isinstance(t, dict) or t.get("type") != "function"]
        if builtin:
            raise BadRequest(f"tools: the built-in tool {json.dumps(builtin[0])[:50]} is not served here; only "
                             "function tools are", "tools")
        out["tools"] = [{"type": "function", "function": {
            "name": t.get("name"), "description": t.get("description") or "",
            "parameters": t.get("parameters") or {"type": "object", "properties": {}}}} for t in tools]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise BadRequest(f"tool_choice of type {json.dumps(choice.get('type'))[:50]} is not served here",
                             "tool_choice")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        out["tool_choice"] = choice
    if body.get("parallel_tool_calls") is not None:
        out["parallel_tool_calls"] = body["parallel_tool_calls"]
    return out


def chat_format(body: dict) -> dict | None:
    """text.format as chat's response_format."""
    fmt = get(get(body, "text", "object", {}), "format", "object")
    if fmt is None or fmt.get("type") in ("text", "json_object"):
        return fmt
    if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise BadRequest('text.format must be {"type": "text"}, {"type": "json_object"} or {"type": '
                         '"json_schema", "name": ..., "schema": {...}}', "text")
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"]}}


def chat_body(body, store: Store) -> tuple[dict, list[dict]]:
    """A Responses request as the chat request that asks the same, and the conversation to store with its answer
    (the previous response's, then this input; instructions are not carried on, as OpenAI's)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    history: list[dict] = []
    previous = get(body, "previous_response_id", "string")
    if previous is not None:
        stored = store.get(previous)
        if stored is None:
            raise BadRequest(f"previous_response_id {previous[:60]!r} is not stored here (responses are kept in "
                             f"memory, the latest {store.size}, while the server runs)", "previous_response_id")
        history = stored[1]
    if body.get("input") is None:
        raise BadRequest("input is required: a string or an array of items", "input")
    conversation = history + chat_messages(body["input"])
    instructions = get(body, "instructions", "string")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    chat = {"model": body.get("model"), "messages": messages, "max_tokens": get(body, "max_output_tokens", "integer"),
            "stream": body.get("stream"), "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "response_format": chat_format(body), **chat_tools(body)}
    effort = get(get(body, "reasoning", "object", {}), "effort", "string")
    if effort is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": effort not in ("none", "minimal")}
    return {k: v for k, v in chat.items() if v is not None}, conversation


def parse_responses(raw: bytes, tokenizer, store: Store, **limits) -> Call:
    """POST /v1/responses's raw body -> the Call (limits: protocol.parse_request's keyword arguments); the
    request's own settings travel in call.context, for the answer to echo and store."""
    body = parse_json(raw)
    chat, conversation = chat_body(body, store)
    call = parse_capped(chat, "max_output_tokens", tokenizer, **limits)
    call.ignored = tuple(sorted(set(body) - FIELDS))
    call.context = {"body": body, "conversation": conversation, "store": get(body, "store", "boolean", True)}
    return call


class ResponsesAnswer:
    """The answer to one /v1/responses Call: the response object (stream=False) or the stream's events. Output
    items follow the chat deltas (features.reasoning.Reader): reasoning -> a reasoning item, content -> a message
    item with one output_text part, each call -> a function_call item, whose arguments stream as deltas."""

    def __init__(self, call: Call, tokenizer, model: str, store: Store):
        self.call, self.model, self.store = call, model, store
        self.id, self.created = new_id("resp_"), int(time.time())
        self.answer = Answer(call, tokenizer, {})
        self.items: list[dict] = []  # the output items begun, complete once closed
        self.open = False  # the last item is still open
        self.sequence = 0
        self.event: Event | None = None

    def response(self, status: str) -> dict:
        body, e = self.call.context["body"], self.event
        cached = e.cached_tokens if e is not None else 0
        prompt, completion = len(self.call.requests[0].prompt), e.completion_tokens if e is not None else 0
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "model": self.model, "output": self.items if status != "in_progress" else [],
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"), "reasoning": body.get("reasoning"),
            "store": self.call.context["store"], "temperature": body.get("temperature"),
            "text": body.get("text") or {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [], "top_p": body.get("top_p"), "truncation": "disabled",
            "metadata": body.get("metadata") or {},
            "usage": {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                      "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": prompt + completion}}

    def status(self) -> str:
        return "incomplete" if self.answer.choices[0].ended == "length" else "completed"

    def opening(self) -> list[str]:
        return [self.sse("response.created", response=self.response("in_progress")),
                self.sse("response.in_progress", response=self.response("in_progress"))]

    def add(self, i: int, event: Event) -> list[str]:
        """Take one event; the stream's events it makes (the whole output is in items either way)."""
        self.event = event
        _, deltas, *_ = self.answer.take(i, event)
        out = [line for delta in deltas for line in self.delta_events(delta)]
        if not event.finished:
            return out if self.call.stream else []
        out += self.close_item()
        self.keep()
        out.append(self.sse(f"response.{self.status()}", response=self.response(self.status())))
        return out if self.call.stream else []

    def delta_events(self, delta: dict) -> list[str]:
        """The events of one chat delta: an item begun when the delta's kind changes (or a new call starts), then
        its delta event."""
        if "tool_calls" in delta:
            call = delta["tool_calls"][0]
            out = []
            if "id" in call:
                out += self.begin({"type": "function_call", "id": new_id("fc_"), "call_id": call["id"],
                                   "name": call["function"]["name"], "arguments": "", "status": "in_progress"})
            piece = call["function"].get("arguments", "")
            self.items[-1]["arguments"] += piece
            return out + ([self.sse("response.function_call_arguments.delta", item_id=self.items[-1]["id"],
                                    output_index=len(self.items) - 1, delta=piece)] if piece else [])
        if "reasoning_content" in delta:
            out = self.begin({"type": "reasoning", "id": new_id("rs_"), "summary": [], "content": [
                {"type": "reasoning_text", "text": ""}]}) if not self.current("reasoning") else []
            return out + [self.text_delta("response.reasoning_text.delta", delta["reasoning_content"])]
        out = [] if self.current("message") else self.begin(
            {"type": "message", "id": new_id("msg_"), "status": "in_progress", "role": "assistant",
             "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}, part=True)
        return out + [self.text_delta("response.output_text.delta", delta["content"], logprobs=[])]

    def current(self, kind: str) -> bool:
        return self.open and self.items[-1]["type"] == kind

    def begin(self, item: dict, part: bool = False) -> list[str]:
        out = self.close_item()
        self.items.append(item)
        self.open = True
        index = len(self.items) - 1
        shown = {**item, "content": []} if "content" in item else item
        out.append(self.sse("response.output_item.added", output_index=index, item=shown))
        if part:
            out.append(self.sse("response.content_part.added", item_id=item["id"], output_index=index,
                                content_index=0, part=item["content"][0]))
        return out

    def text_delta(self, kind: str, text: str, **more) -> str:
        item = self.items[-1]
        item["content"][0]["text"] += text
        return self.sse(kind, item_id=item["id"], output_index=len(self.items) - 1, content_index=0, delta=text,
                        **more)

    def close_item(self) -> list[str]:
        """The events that end the open item: its text's or arguments' done event, then output_item.done."""
        if not self.open:
            return []
        self.open = False
        item, index = self.items[-1], len(self.items) - 1
        if "status" in item:
            item["status"] = "completed"
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            out = [self.sse("response.function_call_arguments.done", **where, name=item["name"],
                            arguments=item["arguments"])]
        elif item["type"] == "reasoning":
            out = [self.sse("response.reasoning_text.done", **where, content_index=0,
                            text=item["content"][0]["text"])]
        else:
            part = item["content"][0]
            out = [self.sse("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[]),
                   self.sse("response.content_part.done", **where, content_index=0, part=part)]
        return out + [self.sse("response.output_item.done", output_index=index, item=item)]

    def keep(self) -> None:
        """Store the finished response with its conversation, for previous_response_id (unless store: false)."""
        if not self.call.context["store"]:
            return
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        said = {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}
        self.store.put(self.response(self.status()), [*self.call.context["conversation"], said])

    def sse(self, kind: str, **data) -> str:
        self.sequence += 1
        payload = {"type": kind, "sequence_number": self.sequence - 1, **data}
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def closing(self) -> list[str]:
        return []

    def done(self) -> list[str]:
        return []

    def error_event(self, message: str, status: int) -> str:
        return self.sse("error", code="server_error", message=message, param=None)

    def body(self) -> dict:
        return self.response(self.status())
