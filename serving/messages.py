"""Anthropic's Messages API (POST /v1/messages), without a server: a Messages body -> the equivalent chat body, parsed
by protocol.py into the same Call (so tools, grammars and sampling are chat's), and the engine's Events -> a message
or its stream of named events. What Claude Code and the `anthropic` SDK call. Pure: app.py does the HTTP."""
import json
import secrets

from serving.answer import Answer
from serving.contract import Event
from serving.protocol import BadRequest, Call, get, parse_capped, parse_json

# The fields read; others (metadata, service_tier, cache_control on blocks, ...) are ignored with a log line.
FIELDS = {"model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature", "top_p", "top_k",
          "tools", "tool_choice", "thinking", "output_config", "output_format", "metadata"}
STOP_REASONS = {"eos": "end_turn", "stop": "stop_sequence", "length": "max_tokens"}  # from the engine's reasons
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 415: "invalid_request_error",
               429: "rate_limit_error", 431: "request_too_large", 500: "api_error", 503: "overloaded_error"}


def error_body(status: int, message: str) -> dict:
    """An error in Anthropic's shape: its type follows the HTTP status."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def text_of(content, where: str) -> str:
    """A string, or an array of text blocks, as one string; BadRequest for other blocks (images, documents)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or an array of content blocks", "messages")
    kinds = [b.get("type") if isinstance(b, dict) else None for b in content]
    bad = [k for k in kinds if k != "text"]
    if bad:
        raise BadRequest(f"{where} has a {json.dumps(bad[0])} block; here only text blocks are served", "messages")
    texts = [b.get("text") for b in content]
    if not all(isinstance(t, str) for t in texts):
        raise BadRequest(f"{where}: a text block's text must be a string", "messages")
    return "".join(texts)


def chat_messages(body: dict) -> list[dict]:
    """Anthropic's system and messages as chat messages: tool_use blocks become an assistant's tool_calls,
    tool_result blocks tool messages; thinking blocks of earlier turns are dropped (a template renders none)."""
    out = [{"role": "system", "content": text_of(body["system"], "system")}] if body.get("system") else []
    messages = get(body, "messages", "array")
    if not messages:
        raise BadRequest("messages must be a non-empty array", "messages")
    for i, m in enumerate(messages):
        role, content = (m.get("role"), m.get("content")) if isinstance(m, dict) else (None, None)
        if role not in ("user", "assistant", "system"):  # system: the mid-conversation system messages beta
            raise BadRequest(f"messages[{i}].role must be user, assistant or system, got {json.dumps(role)[:50]}",
                             "messages")
        if role == "system":
            out.append({"role": "system", "content": text_of(content, f"messages[{i}].content")})
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
            raise BadRequest(f"messages[{i}].content must be a string or an array of content blocks", "messages")
        out += turn_messages(role, content, f"messages[{i}]")
    return out


def turn_messages(role: str, blocks: list[dict], where: str) -> list[dict]:
    """One turn's blocks as chat messages: tool results first (each a tool message), then the text and calls."""
    results = [b for b in blocks if b.get("type") == "tool_result"]
    calls = [b for b in blocks if b.get("type") == "tool_use"]
    texts = [b for b in blocks if b.get("type") not in ("tool_result", "tool_use", "thinking", "redacted_thinking")]
    if (results and role != "user") or (calls and role != "assistant"):
        raise BadRequest(f"{where}: tool_use blocks belong to assistant turns, tool_result blocks to user turns",
                         "messages")
    out = []
    for b in results:
        if not isinstance(b.get("tool_use_id"), str):
            raise BadRequest(f"{where}: a tool_result block needs its tool_use_id", "messages")
        content = text_of(b.get("content") or "", f"{where} tool_result content")
        out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                    "content": f"Error: {content}" if b.get("is_error") else content})
    tool_calls = []
    for b in calls:
        if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) or \
                not isinstance(b.get("input"), dict):
            raise BadRequest(f"{where}: a tool_use block needs an id, a name and an input object", "messages")
        tool_calls.append({"id": b["id"], "type": "function",
                           "function": {"name": b["name"], "arguments": json.dumps(b["input"])}})
    if texts or tool_calls or not results:
        text = text_of(texts, f"{where}.content")
        out.append({"role": role, "content": text if text or not tool_calls else None,
                    **({"tool_calls": tool_calls} if tool_calls else {})})
    return out


def chat_tools(body: dict) -> dict:
    """tools and tool_choice in chat's shape: {name, description, input_schema} -> a function tool."""
    out = {}
    tools = get(body, "tools", "array")
    if tools:  # [] is no tools, as Anthropic takes it (Claude Code --tools "")
        if not all(isinstance(t, dict) for t in tools):
            raise BadRequest("tools must be an array of tool objects", "tools")
        if any(t.get("type") not in (None, "custom") for t in tools):
            kind = next(t.get("type") for t in tools if t.get("type") not in (None, "custom"))
            raise BadRequest(f"tools: the server tool {json.dumps(kind)[:50]} is not served here; define "
                             "client tools (name, description, input_schema)", "tools")
        out["tools"] = [{"type": "function", "function": {
            "name": t.get("name"), "description": t.get("description", ""),
            "parameters": t.get("input_schema", {"type": "object"})}} for t in tools]
    choice = get(body, "tool_choice", "object")
    if choice is not None:
        kind = choice.get("type")
        if kind not in ("auto", "any", "tool", "none"):
            raise BadRequest(f"tool_choice.type must be auto, any, tool or none, got {json.dumps(kind)[:50]}",
                             "tool_choice")
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or \
            {"type": "function", "function": {"name": choice.get("name")}}
        if choice.get("disable_parallel_tool_use"):
            out["parallel_tool_calls"] = False
    return out


def chat_body(body) -> dict:
    """A Messages request as the chat request that asks the same; BadRequest names the field at fault."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if body.get("max_tokens") is None:
        raise BadRequest("max_tokens: Field required", "max_tokens")
    chat = {"model": body.get("model"), "messages": chat_messages(body), "max_tokens": body["max_tokens"],
            "stream": body.get("stream"), **chat_tools(body)}
    for name in ("temperature", "top_p", "top_k"):
        chat[name] = body.get(name)
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    thinking = get(body, "thinking", "object")
    if thinking is not None:  # enabled, adaptive, between_tools: the template's thinking on; disabled: off
        if not isinstance(thinking.get("type"), str):
            raise BadRequest("thinking.type must be a string (enabled, adaptive, disabled, ...)", "thinking")
        chat["chat_template_kwargs"] = {"enable_thinking": thinking["type"] != "disabled"}
    name, output = "output_format", get(body, "output_format", "object")  # the structured outputs beta's field
    if output is None:
        name, output = "output_config", get(get(body, "output_config", "object", {}), "format", "object")
    if output is not None:  # structured outputs: {"type": "json_schema", "schema": {...}}
        if output.get("type") != "json_schema" or not isinstance(output.get("schema"), dict):
            raise BadRequest(f'{name} format must be {{"type": "json_schema", "schema": {{...}}}}', name)
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                          "schema": output["schema"]}}
    return {k: v for k, v in chat.items() if v is not None}


def parse_messages(raw: bytes, tokenizer, **limits) -> Call:
    """POST /v1/messages's raw body -> the Call (limits: protocol.parse_request's keyword arguments)."""
    body = parse_json(raw)
    call = parse_capped(chat_body(body), "max_tokens", tokenizer, **limits)
    call.ignored = tuple(sorted(set(body) - FIELDS))
    return call


def count_tokens(raw: bytes, tokenizer, **limits) -> int:
    """POST /v1/messages/count_tokens: the prompt's tokens as /v1/messages would render it (max_tokens not
    needed)."""
    body = parse_json(raw)
    if isinstance(body, dict):
        body = {**body, "max_tokens": 1, "stream": False}
    return len(parse_capped(chat_body(body), "max_tokens", tokenizer, **limits).requests[0].prompt)


def tool_input(arguments: str) -> dict:
    """A call's arguments as the input object; {} for arguments cut short (max_tokens) before they closed."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessagesAnswer:
    """The answer to one /v1/messages Call: the message (stream=False) or the stream's events. Content blocks
    follow the chat deltas (features.reasoning.Reader): reasoning -> a thinking block, content -> a text block,
    each call -> a tool_use block, whose input streams as input_json_delta."""

    def __init__(self, call: Call, tokenizer, model: str):
        self.call, self.model, self.id = call, model, new_id("msg_")
        self.answer = Answer(call, tokenizer, {}, call_id=lambda: new_id("toolu_"))
        self.blocks: list[str] = []  # the kind of each content block begun: thinking, text, tool_use
        self.open = False  # the last block is still open
        self.event: Event | None = None

    def opening(self) -> list[str]:
        message = {**self.message([]), "stop_reason": None}
        message["usage"]["output_tokens"] = 0
        return [sse("message_start", {"type": "message_start", "message": message}), sse("ping", {"type": "ping"})]

    def add(self, i: int, event: Event) -> list[str]:
        """Take one event; the stream's events it makes."""
        self.event = event
        _, deltas, *_ = self.answer.take(i, event)
        if not self.call.stream:
            return []
        out = [line for delta in deltas for line in self.delta_events(delta)]
        if event.finished:
            out += self.close_block()
            choice = self.answer.choices[0]
            out += [sse("message_delta", {"type": "message_delta", "delta": {
                "stop_reason": self.stop_reason(), "stop_sequence": choice.stop_string},
                "usage": self.usage()}), sse("message_stop", {"type": "message_stop"})]
        return out

    def delta_events(self, delta: dict) -> list[str]:
        """The events of one chat delta: a block begun when its kind changes (or a new call starts), then its
        delta."""
        if "tool_calls" in delta:
            call = delta["tool_calls"][0]
            out = []
            if "id" in call:
                out += self.begin("tool_use", {"type": "tool_use", "id": call["id"],
                                               "name": call["function"]["name"], "input": {}})
            piece = call["function"].get("arguments", "")
            return out + ([self.delta({"type": "input_json_delta", "partial_json": piece})] if piece else [])
        kind, key = ("thinking", "reasoning_content") if "reasoning_content" in delta else ("text", "content")
        block = {"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})}
        out = [] if self.open and self.blocks[-1] == kind else self.begin(kind, block)
        piece = {"type": f"{kind}_delta", kind: delta[key]}
        return out + [self.delta(piece)]

    def begin(self, kind: str, block: dict) -> list[str]:
        out = self.close_block()
        self.blocks.append(kind)
        self.open = True
        return out + [sse("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                                  "content_block": block})]

    def delta(self, piece: dict) -> str:
        return sse("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                           "delta": piece})

    def close_block(self) -> list[str]:
        if not self.open:
            return []
        self.open = False
        out = []
        if self.blocks[-1] == "thinking":  # no signature: nothing here signs reasoning; clients pass it back as is
            out.append(self.delta({"type": "signature_delta", "signature": ""}))
        return out + [sse("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})]

    def closing(self) -> list[str]:
        return []

    def done(self) -> list[str]:
        return []

    def error_event(self, message: str, status: int) -> str:
        return sse("error", error_body(status, message))

    def stop_reason(self) -> str | None:
        choice = self.answer.choices[0]
        if choice.finish_reason == "tool_calls":
            return "tool_use"
        return STOP_REASONS.get(choice.ended, choice.ended)

    def usage(self) -> dict:
        """Anthropic counts prompt tokens read from the cache apart from input_tokens."""
        e = self.event
        cached = e.cached_tokens if e is not None else 0
        prompt = len(self.call.requests[0].prompt)
        return {"input_tokens": prompt - cached, "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": 0, "output_tokens": e.completion_tokens if e is not None else 0}

    def message(self, content: list[dict]) -> dict:
        choice = self.answer.choices[0]
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": self.stop_reason(), "stop_sequence": choice.stop_string, "usage": self.usage()}

    def body(self) -> dict:
        reader = self.answer.choices[0].reader
        content = [{"type": "thinking", "thinking": reader.reasoning, "signature": ""}] if reader.reasoning else []
        content += [{"type": "text", "text": reader.content}] if reader.content or not reader.calls else []
        content += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                     "input": tool_input(c["function"]["arguments"])} for c in reader.calls]
        return self.message(content)


def sse(name: str, data: dict) -> str:
    """One server-sent event with its name, as Anthropic's streams carry them."""
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

