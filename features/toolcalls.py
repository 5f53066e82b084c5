"""Tool calls as models write them: the call syntaxes (Format: Hermes/Qwen `<tool_call>{...}</tool_call>`, Llama 3.x
JSON `{"name": ..., "parameters": ...}`, Mistral `[TOOL_CALLS][{...}]`) and CallParser, which reads calls out of an
output as it streams into OpenAI's `delta` objects. tools.py checks, renders and constrains them."""
import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass

# The call object's opening up to its arguments' "{", as the parser reads it (either key, any whitespace).
HEADER = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
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
    as they came. Text that opens a call but is none is content, as written. fmt None: all text is content.

    A call of a function an earlier call named is held until its object ends: if it repeats an earlier call (same
    name and arguments) it is dropped and the output ends there (`repeated`; the rest is ignored), as a model caught
    in a loop would write it again and again; otherwise it goes out whole, as one delta."""

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
        self.holding = False  # the last call is held back: it may repeat an earlier one
        self.repeated = False  # a call repeated an earlier one: the output ended there
        self.out: list[dict] = []
        self._reset_object()

    def _reset_object(self) -> None:
        self.obj = ""  # the current call object's text
        self.depth, self.in_string, self.escaped = 0, False, False
        self.args_start = self.args_end = None  # where its arguments' object starts and ends in obj
        self.given = 0  # how much of the arguments has been given out

    def feed(self, text: str) -> list[dict]:
        """Read the next piece of the output; the deltas it completes (maybe none)."""
        if self.repeated:
            return []
        self.buffer += text
        self._read(final=False)
        out, self.out = self.out, []
        return out

    def finish(self) -> list[dict]:
        """The output ended: the deltas of whatever was held back."""
        self._read(final=True)
        if self.holding:  # cut short: a call as far as it came, as any call is once named
            self.holding = False
            self._give_call(self.calls[-1])
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
        """Read the buffer as far as it goes, state by state (each reader: True to read on)."""
        while not self.repeated:
            if self.state == "plain":
                self._content(self.buffer)
                self.buffer = ""
                return
            if self.state == "text":
                more = self._read_start(final) if self.format.trigger is None else self._read_text(final)
            else:
                more = self._read_call(final)
            if not more:
                return

    def _read_start(self, final: bool) -> bool:
        """Llama 3: a call is the output's start, or all of it is text."""
        if self.started:
            self.state = "plain"
            return True
        stripped = self.buffer.lstrip()
        if stripped.startswith(PYTHON_TAG) or stripped.startswith("{"):
            self.raw = self.buffer[:len(self.buffer) - len(stripped)]
            if stripped.startswith(PYTHON_TAG):
                self.raw += PYTHON_TAG
                stripped = stripped[len(PYTHON_TAG):]
            self.buffer, self.state, self.started = stripped, "object", True
            return True
        if not stripped or (PYTHON_TAG.startswith(stripped) and not final):
            return False
        self.started, self.state = True, "plain"
        return True

    def _read_text(self, final: bool) -> bool:
        """Content up to the trigger (a trigger's possible start held back until more comes)."""
        trigger = self.format.trigger
        at = self.buffer.find(trigger)
        if at < 0:
            keep = 0 if final else next((k for k in range(min(len(trigger) - 1, len(self.buffer)), 0, -1)
                                         if trigger.startswith(self.buffer[-k:])), 0)
            self._content(self.buffer[:len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep:]
            return False
        self._content(self.buffer[:at])
        self.raw, self.buffer, self.state = trigger, self.buffer[at + len(trigger):], "open"
        return True

    def _read_call(self, final: bool) -> bool:
        """The states open, object and after: whitespace first, then a call object, or what follows one."""
        stripped = self.buffer.lstrip()
        if self.state != "object" or not self.obj:
            self.raw += self.buffer[:len(self.buffer) - len(stripped)]
            self.buffer = stripped
            if not stripped:
                return False
        if self.state == "open":
            if self.format.array and stripped[0] == "[":
                self.raw += "["
                self.buffer = stripped[1:]
            self.state = "object"
            return True
        if self.state == "object":
            if not self.obj and self.buffer[0] != "{":
                self._malformed()
                return True
            if not self._scan():
                return False
            self._object_done()
            return True
        return self._read_after(final)

    def _read_after(self, final: bool) -> bool:
        """After a call object: the close, the next call, or text."""
        fmt = self.format
        if fmt.close and self.buffer.startswith(fmt.close):
            self.buffer, self.state, self.strip = self.buffer[len(fmt.close):], "text", True
        elif fmt.close and fmt.close.startswith(self.buffer):  # the close, coming (or cut short: dropped)
            if not final:
                return False
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
        return True

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
                if not self.holding:
                    self._give({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": fragment}}]})
        return done

    def _start_call(self, name: str) -> None:
        self.held = ""  # whitespace before a call is not content
        self.holding = any(c["function"]["name"] == name for c in self.calls)
        self.calls.append({"id": self.new_id(), "type": "function", "function": {"name": name, "arguments": ""}})
        if not self.holding:
            self._give_call(self.calls[-1])

    def _give_call(self, call: dict) -> None:
        """The delta that starts a call (a copy: the parser goes on adding to its arguments)."""
        self._give({"tool_calls": [{"index": len(self.calls) - 1, **call, "function": dict(call["function"])}]})

    def _call_ended(self) -> None:
        """The last call's object ended: a held call repeating an earlier one is dropped and ends the output; any
        other held call goes out whole."""
        if not self.holding:
            return
        self.holding = False
        last = self.calls[-1]
        if any(same_call(c, last) for c in self.calls[:-1]):
            self.calls.pop()
            self.repeated = True
        else:
            self._give_call(last)

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
            if not self.holding:
                self._give({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": text}}]})
        self._call_ended()
        self.raw = ""
        self._reset_object()
        self.state = "after"


def same_call(a: dict, b: dict) -> bool:
    """Whether two calls (OpenAI's tool_calls entries) name one function with equal arguments (as JSON values: key
    order and spacing aside)."""
    if a["function"]["name"] != b["function"]["name"]:
        return False
    try:
        return json.loads(a["function"]["arguments"]) == json.loads(b["function"]["arguments"])
    except ValueError:
        return a["function"]["arguments"] == b["function"]["arguments"]


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
