"""Tool calling (OpenAI function calling): rendering tools into the prompt, constraining the calls, parsing them.

A model calls a tool by writing it in the syntax it was trained on: a Format (Hermes/Qwen `<tool_call>{...}
</tool_call>`, Llama 3.x JSON `{"name": ..., "parameters": ...}`, Mistral `[TOOL_CALLS][{...}]`), chosen from the
chat template's text or by name. One ToolRequest per request holds the checked tools and tool_choice and gives:
- render(messages): the messages and the template's `tools` variable (a template that does not read `tools` gets
  them described in its system message instead, with the call syntax: never a silent drop);
- constraint: an llguidance Lark grammar (grammar.py) the output must follow. Named or "required": only calls,
  whose arguments are valid under the function's JSON Schema, by construction whatever the model. "auto": any text,
  and once the format's opening appears (a lazy lexeme triggered by it), a valid call. "none": text that never
  opens a call;
- parser(): a CallParser, fed the text as it streams, giving OpenAI's `delta` objects (content, tool_calls);
  parse(text): the same for a whole output.
A server calls tool_request (ValueError: a 400 whose param is field_of(error)), render, encode_chat, constraint,
then parser() (merge_deltas: one chunk per run) or parse(), and answers with message() and finish_reason().
"""
import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from grammar import JSON_OPTIONS, Constraint, check_constraint
from tokenizer import template_variables

CHOICES = ("none", "auto", "required")
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
NO_PARAMETERS = {"type": "object", "properties": {}}
# The call object's opening up to its arguments' "{", as the parser reads it (either key, any whitespace).
HEADER = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
WS = "/[ \\t\\r\\n]{0,8}/"  # whitespace between and after calls, bounded: no run for a sampler to wander into
PYTHON_TAG = "<|python_tag|>"  # Llama 3.x may open a JSON call with it


@dataclass(frozen=True)
class Format:
    """A model family's call syntax. trigger: the text that opens calls (None: a call is the whole output,
    starting with its "{"); arguments: the key of a call's arguments; array: the calls are one JSON array after the
    trigger (Mistral); close: what ends each call (Hermes); separator: between calls."""
    name: str
    trigger: str | None
    arguments: str
    separator: str
    close: str = ""
    array: bool = False

    def call_text(self, name: str, arguments: str) -> str:
        """One call's JSON as this format writes it (json.dumps's separators)."""
        return f'{{"name": {json.dumps(name)}, "{self.arguments}": {arguments}}}'

    def calls_text(self, calls: list[tuple[str, str]]) -> str:
        """Calls (name, arguments as JSON text) as the model writes them: how a template without tool support
        gets an assistant's tool_calls, and the example in the fallback's description."""
        texts = [self.call_text(name, arguments) for name, arguments in calls]
        if self.array:
            return f"{self.trigger}[{self.separator.join(texts)}]"
        if self.trigger is None:
            return self.separator.join(texts)
        return self.separator.join(f"{self.trigger}\n{t}\n{self.close}" for t in texts)


FORMATS = {
    "hermes": Format("hermes", "<tool_call>", "arguments", "\n", close="</tool_call>"),  # Qwen 2.5/3, Hermes, SmolLM3
    "llama3_json": Format("llama3_json", None, "parameters", "; "),  # Llama 3.1-3.3's JSON tool calling
    "mistral": Format("mistral", "[TOOL_CALLS]", "arguments", ", ", array=True),
}


def detect_format(template: str | None) -> Format | None:
    """The call syntax a chat template writes an assistant's tool calls in, read from its text: Hermes for a
    template that shows none (the fallback's syntax); None for one this module does not parse (Qwen3-Coder's XML
    `<function=name><parameter=...>`)."""
    template = template or ""
    if "<function=" in template:
        return None
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral"]
    if "<tool_call>" in template:
        return FORMATS["hermes"]
    if PYTHON_TAG in template or '"parameters": ' in template:
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]


def format_named(parser: str | None, template: str | None) -> Format | None:
    """The format a `--tool-call-parser` name asks for (None: detect_format); ValueError for an unknown name."""
    if parser is None:
        return detect_format(template)
    if parser not in FORMATS:
        raise ValueError(f"unknown tool call parser {parser!r}; expected one of {', '.join(FORMATS)}")
    return FORMATS[parser]


# ---- checking the request ----

def check_tools(tools) -> list[dict]:
    """OpenAI tool definitions, checked: each {"type": "function", "function": {"name", "description"?,
    "parameters"?}} with parameters an object schema llguidance compiles (default: no parameters). ValueError
    naming the field (`tools[1].function.name`)."""
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"tools must be a non-empty array of tool definitions, got {json.dumps(tools)[:50]}")
    out, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ValueError(f"{where} must be an object {{\"type\": \"function\", \"function\": {{...}}}}, got "
                             f"{json.dumps(tool)[:50]}")
        if tool.get("type", "function") != "function":
            raise ValueError(f"{where}.type must be 'function', got {json.dumps(tool.get('type'))[:50]}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"{where}.function must be an object with the function's name")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ValueError(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got "
                             f"{json.dumps(name)[:70]}")
        if name in names:
            raise ValueError(f"{where}.function.name {name!r} is already the name of an earlier tool")
        names.add(name)
        if not isinstance(function.get("description", ""), str):
            raise ValueError(f"{where}.function.description must be a string")
        parameters = function.get("parameters", NO_PARAMETERS)
        if not isinstance(parameters, dict):
            raise ValueError(f"{where}.function.parameters must be a JSON Schema object, got "
                             f"{json.dumps(parameters)[:50]}")
        if parameters.get("type", "object") != "object":
            raise ValueError(f"{where}.function.parameters must describe an object (a call's arguments are one), "
                             f"got type {json.dumps(parameters['type'])[:50]}")
        try:
            check_constraint(Constraint("json_schema", json.dumps(parameters)))
        except ValueError as e:
            raise ValueError(f"{where}.function.parameters: {e}") from None
        out.append({"type": "function", "function": {**function, "parameters": parameters}})
    return out


def check_tool_choice(tool_choice, tools: list[dict] | None) -> tuple[str, tuple[str, ...]]:
    """(mode, names): "none", "auto" or "required", and the functions a call may name. A named choice
    ({"type": "function", "function": {"name": N}}) is "required" with N alone. Default: "auto" with tools, "none"
    without. ValueError naming the field."""
    names = tuple(t["function"]["name"] for t in tools or [])
    if tool_choice is None:
        return ("auto" if names else "none"), names
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise ValueError(f"tool_choice must be one of {', '.join(CHOICES)} or {{\"type\": \"function\", "
                             f"\"function\": {{\"name\": ...}}}}, got {tool_choice[:50]!r}")
        if tool_choice != "none" and not names:
            raise ValueError(f"tool_choice {tool_choice!r} needs tools")
        return tool_choice, names
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(function, dict) or tool_choice.get("type", "function") != "function":
        raise ValueError(f"tool_choice must be one of {', '.join(CHOICES)} or {{\"type\": \"function\", "
                         f"\"function\": {{\"name\": ...}}}}, got {json.dumps(tool_choice)[:50]}")
    name = function.get("name")
    if name not in names:
        raise ValueError(f"tool_choice.function.name {json.dumps(name)[:70]} is not one of the tools' names"
                         + (f" ({', '.join(names)})" if names else " (no tools were given)"))
    return "required", (name,)


def check_messages(messages: list[dict]) -> None:
    """The tool fields of chat messages: an assistant's tool_calls ({id, type: "function", function: {name,
    arguments: JSON text of an object}}) and each role "tool" message's tool_call_id, which must name an earlier
    call. ValueError naming the field (`messages[3].tool_call_id`)."""
    ids = set()
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and calls is not None:
            if not isinstance(calls, list):
                raise ValueError(f"messages[{i}].tool_calls must be an array of tool calls")
            for j, call in enumerate(calls):
                where = f"messages[{i}].tool_calls[{j}]"
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict):
                    raise ValueError(f"{where} must be an object {{\"id\", \"type\": \"function\", \"function\": "
                                     f"{{\"name\", \"arguments\"}}}}")
                if not isinstance(call.get("id"), str) or not call["id"]:
                    raise ValueError(f"{where}.id must be a non-empty string")
                if not isinstance(function.get("name"), str) or not function["name"]:
                    raise ValueError(f"{where}.function.name must be a non-empty string")
                arguments_of(function.get("arguments", "{}"), f"{where}.function.arguments")
                ids.add(call["id"])
        elif calls is not None:
            raise ValueError(f"messages[{i}].tool_calls is only for assistant messages, not {m.get('role')!r}")
        if m.get("role") == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise ValueError(f"messages[{i}].tool_call_id must be the id of the call this message answers")
            if call_id not in ids:
                raise ValueError(f"messages[{i}].tool_call_id {call_id[:70]!r} matches no tool call of an earlier "
                                 "assistant message")


def arguments_of(arguments, where: str) -> dict:
    """A call's arguments, given as JSON text (OpenAI's way) or as an object, as a dict."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise ValueError(f"{where} must be the JSON text of an object, got {arguments[:50]!r}") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"{where} must be a JSON object, got {json.dumps(arguments)[:50]}")
    return arguments


# ---- rendering ----

def render_messages(messages: list[dict], tools: list[dict] | None, template: str | None,
                    fmt: Format) -> tuple[list[dict], list[dict] | None]:
    """(messages, the template's `tools` variable), the messages checked. A template that reads `tools` gets them,
    calls' arguments as objects (HF templates write them with `tojson`) and tool messages their function's name.
    Else the fallback: the tools described in the system message, calls written out, results as user turns."""
    check_messages(messages)
    names = {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls") or []}
    if "tools" in template_variables(template or ""):
        out = []
        for m in messages:
            if m.get("tool_calls"):
                calls = [{**c, "type": "function",
                          "function": {**c["function"], "arguments": arguments_of(c["function"].get("arguments", "{}"),
                                                                                  "arguments")}}
                         for c in m["tool_calls"]]
                m = {**m, "tool_calls": calls}
            elif m.get("role") == "tool":
                m = {"name": names[m["tool_call_id"]], **m}
            out.append(m)
        return out, tools
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = fmt.calls_text([(c["function"]["name"],
                                     json.dumps(arguments_of(c["function"].get("arguments", "{}"), "arguments"),
                                                ensure_ascii=False)) for c in m["tool_calls"]])
            out.append({"role": "assistant", "content": "\n".join(filter(None, [m.get("content"), calls]))})
        elif m.get("role") == "tool":
            result = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("tool_results"):  # one user turn for consecutive results
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + result}
            else:
                out.append({"role": "user", "content": result, "tool_results": True})
        else:
            out.append(m)
    out = [{k: v for k, v in m.items() if k != "tool_results"} for m in out]
    if tools:
        description = describe_tools(tools, fmt)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{description}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": description})
    return out, None


def describe_tools(tools: list[dict], fmt: Format) -> str:
    """The fallback's system-prompt text: each tool's definition as JSON and how to call one, in the format's
    syntax with placeholders (as Qwen's template writes it: example values would be copied into calls)."""
    syntax = fmt.calls_text([("NAME", "ARGUMENTS")]).replace('"NAME"', "<function-name>")
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (f"You can call these functions (tools), given as JSON Schemas:\n<tools>\n{listing}\n</tools>\n"
            f"To call one, reply with its name and arguments as JSON, in this form:\n"
            f"{syntax.replace('ARGUMENTS', '<arguments-json-object>')}\n"
            f"A function's result comes back in <tool_response></tool_response>. Otherwise, answer in text.")


# ---- the grammar of calls ----

def calls_lark(fmt: Format, tools: list[dict], mode: str, names: tuple[str, ...], parallel: bool,
               special_trigger: int | None = None) -> str:
    """The Lark grammar (llguidance's dialect) of an output under tool_choice `mode`. Each allowed function's call
    is its literal opening then `%json` of its parameters' schema (a root of its own, so its `$ref`s resolve), with
    grammar.py's one-line JSON. special_trigger: the trigger's token id where the vocabulary has it as one special
    token (Mistral's [TOOL_CALLS]); else the trigger is text, found by a lazy lexeme in auto mode."""
    rules = []
    for k, name in enumerate(names):
        parameters = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)
        schema = {"type": "object", **parameters, "x-guidance": JSON_OPTIONS}
        opening = json.dumps(f'{{"name": {json.dumps(name)}, "{fmt.arguments}": ')
        rules.append(f"fn_{k}: {opening} %json {json.dumps(schema)} \"}}\"")
    rules.append("call: " + " | ".join(f"fn_{k}" for k in range(len(names))))
    sep = json.dumps(fmt.separator)
    trigger = None if fmt.trigger is None else f"<[{special_trigger}]>" if special_trigger is not None \
        else json.dumps(fmt.trigger)
    if fmt.array:  # Mistral: the trigger, then one JSON array of calls
        rules.append(f"calls: / ?/ \"[\" call {f'({sep} call)*' if parallel else ''} \"]\" {WS}")
    elif fmt.trigger is None:  # Llama 3: the output is the calls
        rules.append(f"calls: call {f'({sep} call)*' if parallel else ''} {WS}")
    else:  # Hermes: each call in trigger ... close
        body = f"\"\\n\" call {json.dumps(chr(10) + fmt.close)}"
        rules.append(f"calls: {body} {f'({WS} {trigger} {body})*' if parallel else ''} {WS}")
    if fmt.trigger is None:
        text = "TEXT: /([^{](.|\\n)*)?/"  # text never starts with "{": that is a call
        start = {"auto": "start: TEXT | calls", "none": "start: TEXT"}.get(mode, "start: calls")
    elif mode == "none":
        # Text that never writes the trigger (a special-token trigger is no text anyway)
        text = "TEXT: /(?s:.*)/" if special_trigger is not None else \
            f"TEXT: /(?s:.*)/ & ~/(?s:.*){re.escape(fmt.trigger)}(?s:.*)/"
        start = "start: TEXT"
    else:
        text = "TEXT: /(.|\\n)*/"
        if mode == "auto":  # any text; from the trigger on, calls (the lazy lexeme ends at the trigger's first match)
            opening = f"open: TEXT {trigger}" if special_trigger is not None else f"open[lazy]: TEXT {trigger}"
            start = f"start: TEXT | open calls\n{opening}"
        else:
            start = f"start: {trigger} calls"
    return "\n".join(["%llguidance {}", start, text, *rules]) + "\n"


# ---- the request ----

class ToolRequest:
    """One request's tools, tool_choice and parallel_tool_calls, checked, with the format of its model's
    template; built by tool_request."""

    def __init__(self, tools: list[dict] | None, mode: str, names: tuple[str, ...], parallel: bool, fmt: Format,
                 template: str | None, special_trigger: int | None):
        self.tools, self.mode, self.names, self.parallel = tools, mode, names, parallel
        self.format, self.template, self.special_trigger = fmt, template, special_trigger

    def render(self, messages: list[dict]) -> tuple[list[dict], list[dict] | None]:
        """(messages, tools) for tokenizer.encode_chat(messages, tools=tools): see render_messages."""
        return render_messages(messages, self.tools, self.template, self.format)

    @property
    def constraint(self) -> Constraint | None:
        """The grammar the output follows (see calls_lark); None without tools."""
        if not self.tools:
            return None
        return Constraint("lark", calls_lark(self.format, self.tools, self.mode, self.names, self.parallel,
                                             self.special_trigger))

    def parser(self, new_id: Callable[[], str] | None = None) -> "CallParser":
        """A parser of this request's output, streamed (for "none": one that reads every text as content)."""
        return CallParser(self.format if self.mode != "none" else None, new_id)

    def parse(self, text: str) -> tuple[str, list[dict]]:
        """(content, tool calls) of this request's whole output: what parser() gives streamed."""
        parser = self.parser()
        parser.feed(text)
        parser.finish()
        return parser.content, parser.calls


def tool_request(tools, tool_choice, parallel_tool_calls, tokenizer, parser: str | None = None) -> ToolRequest:
    """Check a request's tool fields (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`: None where absent)
    against the model's tokenizer (its chat template picks the format unless `parser` names one). ValueError naming
    the field; the schemas are checked by llguidance, so a request that passes compiles."""
    fmt = format_named(parser, tokenizer.chat_template)
    if fmt is None and tools is not None:
        raise ValueError("tools: this model's chat template writes calls in a syntax not supported here "
                         f"(<function=...> XML); a tool call parser ({', '.join(FORMATS)}) can be named instead")
    fmt = fmt or FORMATS["hermes"]  # no tools: only the history's calls to render, in the fallback's syntax
    checked = None if tools is None else check_tools(tools)
    mode, names = check_tool_choice(tool_choice, checked)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ValueError(f"parallel_tool_calls must be a boolean, got {json.dumps(parallel_tool_calls)[:50]}")
    special = None
    if fmt.trigger is not None and tokenizer.specials is not None and tokenizer.specials.fullmatch(fmt.trigger):
        special = tokenizer.backend.token_to_id(fmt.trigger)
    parallel = parallel_tool_calls is not False and not isinstance(tool_choice, dict)  # a named choice: one call
    request = ToolRequest(checked, mode, names, parallel, fmt, tokenizer.chat_template, special)
    if request.constraint is not None:
        try:
            check_constraint(request.constraint)
        except ValueError as e:  # each schema compiled alone; together they passed a limit of llguidance's
            raise ValueError(f"tools: {e}") from None
    return request


def field_of(error: ValueError) -> str | None:
    """The request field a ValueError of this module names (its message starts with it: `tools[1].function.name`,
    `messages[3].tool_call_id`), for the error body's `param`; None for one that names none."""
    match = re.match(r"(tools|tool_choice|parallel_tool_calls|messages)(\[[0-9]+\]|\.[a-z_]+)*", str(error))
    return match.group() if match else None


def finish_reason(reason: str, calls: list[dict]) -> str:
    """OpenAI's finish_reason: "tool_calls" when the output made calls and ended by itself (not cut by length)."""
    return "tool_calls" if calls and reason != "length" else reason


def message(content: str, calls: list[dict]) -> dict:
    """The assistant message of a response: content None when it only called tools, as OpenAI sends it."""
    return {"role": "assistant", "content": content or (None if calls else ""),
            **({"tool_calls": calls} if calls else {})}


# ---- parsing ----

def new_call_id(fmt: Format | None = None) -> str:
    """A fresh call id: OpenAI's "call_" and 24 characters; Mistral's templates want 9 letters and digits."""
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    n = 9 if fmt is not None and fmt.array else 24
    return ("" if n == 9 else "call_") + "".join(secrets.choice(alphabet) for _ in range(n))


class CallParser:
    """A model's output read as it streams: feed() text pieces (then finish()), get OpenAI `delta` objects back:
    {"content": ...} outside calls (whitespace next to a call dropped), {"tool_calls": [...]} for a call (index, id,
    type, name once its name and arguments' "{" are read, then its arguments' JSON in fragments as they come).

    A call is committed at that point: cut short after it (max_tokens), it stays a call with its arguments as far
    as they came. Text that opens a call but is none is content, as written. fmt None: all text is content."""

    def __init__(self, fmt: Format | None, new_id: Callable[[], str] | None = None):
        self.format = fmt
        self.new_id = new_id or (lambda: new_call_id(fmt))
        self.calls: list[dict] = []  # OpenAI's tool_calls, arguments as far as they came
        self.content = ""  # the content given out so far
        self.state = "text" if fmt is not None else "plain"  # text, plain, open, object, after
        self.buffer = ""  # text fed and not yet read
        self.raw = ""  # the text read since the trigger (content again if no call follows)
        self.held = ""  # trailing whitespace of the content, given out once more content follows
        self.strip = False  # drop the next content's leading whitespace (it follows a call)
        self.started = False  # a non-whitespace character was read (Llama 3's call must come first)
        self.out: list[dict] = []
        self._reset_object()

    def _reset_object(self) -> None:
        self.obj = ""  # the current call object's text
        self.depth, self.in_string, self.escaped = 0, False, False
        self.args_start = self.args_end = None  # where its arguments' object starts and ends in obj
        self.given = 0  # how much of the arguments has been given out

    def feed(self, text: str) -> list[dict]:
        """Read the next piece of the output; the deltas it completes (maybe none)."""
        self.buffer += text
        self._read(final=False)
        out, self.out = self.out, []
        return out

    def finish(self) -> list[dict]:
        """The output ended: the deltas of whatever was held back."""
        self._read(final=True)
        if self.state in ("open", "object") and self.args_start is None:  # opened, never a call: its text
            self._content(self.raw + self.obj)
        if not self.calls and self.held:
            self._give({"content": self.held})
        self.held = ""
        out, self.out = self.out, []
        return out

    def _give(self, delta: dict) -> None:
        self.out.append(delta)
        self.content += delta.get("content", "")

    def _content(self, text: str) -> None:
        if self.strip:
            text = text.lstrip()
            self.strip = not text
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body):]
        if body:
            self._give({"content": body})

    def _malformed(self) -> None:
        """What was read since the trigger is no call: it is content; read on after it."""
        self._content(self.raw + self.obj)
        self.raw = ""
        self._reset_object()
        self.state = "text"

    def _read(self, final: bool) -> None:
        fmt = self.format
        while True:
            if self.state == "plain":
                self._content(self.buffer)
                self.buffer = ""
                return
            if self.state == "text" and fmt.trigger is None:  # Llama 3: a call is the output's start
                if self.started:
                    self.state = "plain"
                    continue
                stripped = self.buffer.lstrip()
                if stripped.startswith(PYTHON_TAG) or stripped.startswith("{"):
                    self.raw = self.buffer[:len(self.buffer) - len(stripped)]
                    if stripped.startswith(PYTHON_TAG):
                        self.raw += PYTHON_TAG
                        stripped = stripped[len(PYTHON_TAG):]
                    self.buffer, self.state, self.started = stripped, "object", True
                    continue
                if not stripped or (PYTHON_TAG.startswith(stripped) and not final):
                    return
                self.started, self.state = True, "plain"
                continue
            if self.state == "text":
                at = self.buffer.find(fmt.trigger)
                if at < 0:
                    keep = 0 if final else next((k for k in range(min(len(fmt.trigger) - 1, len(self.buffer)), 0, -1)
                                                 if fmt.trigger.startswith(self.buffer[-k:])), 0)
                    self._content(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return
                self._content(self.buffer[:at])
                self.raw, self.buffer, self.state = fmt.trigger, self.buffer[at + len(fmt.trigger):], "open"
                continue
            # open, object or after: whitespace first
            stripped = self.buffer.lstrip()
            if self.state != "object" or not self.obj:
                self.raw += self.buffer[:len(self.buffer) - len(stripped)]
                self.buffer = stripped
                if not stripped:
                    return
            if self.state == "open":
                if fmt.array and stripped[0] == "[":
                    self.raw += "["
                    self.buffer = stripped[1:]
                self.state = "object"
                continue
            if self.state == "object":
                if not self.obj and self.buffer[0] != "{":
                    self._malformed()
                    continue
                if not self._scan():
                    return
                self._object_done()
                continue
            # after a call object: the close, the next call, or text
            if fmt.close and self.buffer.startswith(fmt.close):
                self.buffer, self.state, self.strip = self.buffer[len(fmt.close):], "text", True
            elif fmt.close and fmt.close.startswith(self.buffer):  # the close, coming (or cut short: dropped)
                if not final:
                    return
                self.buffer, self.state = "", "text"
            elif fmt.trigger is None and self.buffer[0] == fmt.separator.strip():
                self.buffer, self.state = self.buffer[1:], "object"
            elif fmt.array and self.buffer[0] == ",":
                self.buffer, self.state = self.buffer[1:], "object"
            elif fmt.array and self.buffer[0] == "]":
                self.buffer, self.state, self.strip = self.buffer[1:], "text", True
            else:
                self.state, self.strip = ("text" if fmt.trigger is not None else "plain"), True
            self.raw = ""

    def _scan(self) -> bool:
        """Read the buffer into the call object, as far as it goes; give out the call's name and arguments as they
        become known. True when the object is complete."""
        done = False
        for n, ch in enumerate(self.buffer):
            i = len(self.obj) + n  # ch's index in the object
            if self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else (ch == "\\", ch != '"')
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
                if self.depth == 2 and ch == "{" and self.args_start is None:
                    header = HEADER.fullmatch(self.obj + self.buffer[:n])
                    if header:
                        self.args_start = i
                        self._start_call(json.loads(f'"{header.group(1)}"'))
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 1 and self.args_start is not None and self.args_end is None:
                    self.args_end = i + 1
                if self.depth == 0:
                    done = True
                    self.obj += self.buffer[:n + 1]
                    self.buffer = self.buffer[n + 1:]
                    break
        if not done:
            self.obj += self.buffer
            self.buffer = ""
        if self.args_start is not None:
            end = self.args_end if self.args_end is not None else len(self.obj)
            fragment = self.obj[self.args_start + self.given:end]
            if fragment:
                self.given += len(fragment)
                self.calls[-1]["function"]["arguments"] += fragment
                self._give({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": fragment}}]})
        return done

    def _start_call(self, name: str) -> None:
        self.held = ""  # whitespace before a call is not content
        self.calls.append({"id": self.new_id(), "type": "function", "function": {"name": name, "arguments": ""}})
        self._give({"tool_calls": [{"index": len(self.calls) - 1, **self.calls[-1],
                                    "function": {"name": name, "arguments": ""}}]})

    def _object_done(self) -> None:
        """A call object ended: a call if its name and arguments were read (or it parses as one, keys in any
        order), else text."""
        if self.args_start is None:
            try:
                value = json.loads(self.obj)
            except ValueError:
                value = None
            arguments = value.get("arguments", value.get("parameters")) if isinstance(value, dict) else None
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    arguments = None
            if not isinstance(value.get("name") if isinstance(value, dict) else None, str) or \
                    not isinstance(arguments, dict):
                self._malformed()
                return
            self._start_call(value["name"])
            text = json.dumps(arguments, ensure_ascii=False)
            self.calls[-1]["function"]["arguments"] = text
            self._give({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": text}}]})
        self.raw = ""
        self._reset_object()
        self.state = "after"


def merge_deltas(deltas: list[dict]) -> list[dict]:
    """Consecutive deltas of one kind as one: content joined, a call's start and fragments joined. What one feed
    gives can go out as one chunk per entry (OpenAI's chunks carry one kind each)."""
    out: list[dict] = []
    for delta in deltas:
        last = out[-1] if out else {}
        if "content" in delta and "content" in last:
            last["content"] += delta["content"]
        elif "tool_calls" in delta and "tool_calls" in last and \
                last["tool_calls"][-1]["index"] == delta["tool_calls"][0]["index"]:
            function = last["tool_calls"][-1]["function"]
            function["arguments"] = function.get("arguments", "") + delta["tool_calls"][0]["function"]["arguments"]
        else:
            out.append(json.loads(json.dumps(delta)))  # a copy: merging must not change the parser's deltas
    return out


def parse_calls(text: str, fmt: Format | None, new_id: Callable[[], str] | None = None) -> tuple[str, list[dict]]:
    """(content, tool calls) of a complete output: what CallParser gives streamed, at once."""
    parser = CallParser(fmt, new_id)
    parser.feed(text)
    parser.finish()
    return parser.content, parser.calls
