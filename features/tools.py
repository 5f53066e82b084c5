"""Tool calling (OpenAI function calling): rendering tools into the prompt, constraining the calls, parsing them.

A model calls a tool by writing it in the syntax it was trained on: a Format (Hermes/Qwen `<tool_call>{...}
</tool_call>`, Llama 3.x JSON `{"name": ..., "parameters": ...}`, Mistral `[TOOL_CALLS][{...}]`), chosen from the
chat template's text or by name. One ToolRequest per request holds the checked tools and tool_choice and gives:
- render(messages): the messages and the template's `tools` variable (a template that does not read `tools` gets
  them described in its system message instead, with the call syntax: never a silent drop);
- constraint: an llguidance Lark grammar (grammar.py) the output must follow. Named or "required": only calls,
  whose arguments are valid under the function's JSON Schema, by construction whatever the model. "auto": any text,
  and once the format's opening appears (a lazy lexeme triggered by it), a valid call. "none": text that never
  opens a call. One call unless parallel calls are allowed (by default where the template renders several), and
  after the calls the end. constraint_with(a response format): the same, the text answer in that format;
- grammar(compiled): the compiled constraint whose matchers, with parallel calls, end the output at a call that
  repeats an earlier one (RepeatGuard);
- parser(): a toolcalls.CallParser, fed the text as it streams, giving OpenAI's `delta` objects (content,
  tool_calls); parse(text): the same for a whole output.
A server calls tool_request (ValueError: a 400 whose param is field_of(error)), render, encode_chat, constraint (or
constraint_with), grammar, then parser() (merge_deltas: one chunk per run) or parse(), and answers with message()
and tool_calls_reason().
"""
import json
import re
from collections.abc import Callable

from features.constraint import JSON_OPTIONS, Constraint, Grammar, Matcher, check_constraint
from tokenizer import template_variables
from features.toolcalls import FORMATS, CallParser, Format, format_named

CHOICES = ("none", "auto", "required")
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
NO_PARAMETERS = {"type": "object", "properties": {}}
# A tool's schema keywords llguidance does not implement (propertyNames, ...) are ignored, not refused: agents send
# their tools as they are (Claude Code's), and the arguments still follow the rest of the schema.
TOOL_JSON_OPTIONS = {**JSON_OPTIONS, "lenient": True}
WS = "/[ \\t\\r\\n]{0,8}/"  # whitespace between and after calls, bounded: no run for a sampler to wander into
# A template that renders an assistant message's several calls: `{% for call in message.tool_calls %}` (Qwen,
# Hermes, Mistral, DeepSeek), or the list whole with tojson. Llama 3.1's writes tool_calls[0] alone.
PARALLEL = re.compile(r"\{%-?\s*for\s+\w+\s+in\s+[\w.\[\]'\"]*tool_calls\b|tool_calls\s*\|\s*tojson")


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
            check_constraint(Constraint("json_schema", json.dumps({**parameters, "x-guidance": TOOL_JSON_OPTIONS})))
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

def closed(schema):
    """The schema with `additionalProperties: false` on every object that lists its properties and leaves extra
    ones open (as OpenAI's strict function calling makes them): a call then has the function's arguments only. Open,
    a sampler wandered into invented keys ("population_millions_per_year_per_year", ...) until max_tokens. What
    the closed schema accepts, the schema given accepts too."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("properties", "patternProperties", "$defs", "definitions") and isinstance(value, dict):
            out[key] = {name: closed(s) for name, s in value.items()}  # names -> schemas
        elif key in ("enum", "const", "default", "examples"):  # values, not schemas
            out[key] = value
        else:
            out[key] = closed(value)
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out \
            and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def calls_lark(fmt: Format, tools: list[dict], mode: str, names: tuple[str, ...], parallel: bool,
               special_trigger: int | None = None, answer: str | None = None) -> str:
    """The Lark grammar (llguidance's dialect) of an output under tool_choice `mode`. Each allowed function's call
    is its literal opening then `%json` of its parameters' schema (a root of its own, so its `$ref`s resolve), with
    grammar.py's one-line JSON. special_trigger: the trigger's token id where the vocabulary has it as one special
    token (Mistral's [TOOL_CALLS]); else the trigger is text, found by a lazy lexeme in auto mode. answer: a
    response format (format_lark) the text follows: in auto mode the output is the calls or an answer in it, with
    none the answer alone; required and named calls ignore it. One call unless parallel; after the calls, the end."""
    # Without a trigger, an answer may start with "{" as a call does: each call is then one %json object, so that
    # the two share llguidance's JSON lexer (a literal opening would make it pick the call's at the first "{").
    whole = answer is not None and mode == "auto" and fmt.trigger is None
    rules = []
    for k, name in enumerate(names):
        parameters = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)
        if whole:
            rules.append(f"fn_{k}: %json {json.dumps(call_schema(fmt, name, parameters))}")
            continue
        schema = {"type": "object", **closed(parameters), "x-guidance": TOOL_JSON_OPTIONS}
        opening = json.dumps(f'{{"name": {json.dumps(name)}, "{fmt.arguments}": ')
        rules.append(f"fn_{k}: {opening} %json {json.dumps(schema)} \"}}\"")
    rules.append("call: " + " | ".join(f"fn_{k}" for k in range(len(names))))
    sep = json.dumps(fmt.separator)
    trigger = None if fmt.trigger is None else f"<[{special_trigger}]>" if special_trigger is not None \
        else json.dumps(fmt.trigger)
    end = f" {WS}" if parallel else ""  # one call: nothing may follow it
    if fmt.array:  # Mistral: the trigger, then one JSON array of calls
        rules.append(f"calls: / ?/ \"[\" call {f'({sep} call)*' if parallel else ''} \"]\"{end}")
    elif fmt.trigger is None:  # Llama 3: the output is the calls
        rules.append(f"calls: call {f'({sep} call)*' if parallel else ''}{end}")
    else:  # Hermes: each call in trigger ... close
        body = f"\"\\n\" call {json.dumps(chr(10) + fmt.close)}"
        rules.append(f"calls: {body} {f'({WS} {trigger} {body})*' if parallel else ''}{end}")
    if answer is not None and mode in ("auto", "none"):
        start = ["start: answer" + (f" | {trigger or ''} calls" if mode == "auto" else ""), f"answer: {answer}"]
    else:
        start = text_rules(fmt, mode, trigger, special_trigger)
    return "\n".join(["%llguidance {}", *start, *rules]) + "\n"


def text_rules(fmt: Format, mode: str, trigger: str | None, special_trigger: int | None) -> list[str]:
    """calls_lark's start rule and free text (TEXT) without a response format."""
    if fmt.trigger is None:
        start = {"auto": "start: TEXT | calls", "none": "start: TEXT"}.get(mode, "start: calls")
        return [start, "TEXT: /([^{](.|\\n)*)?/"]  # text never starts with "{": that is a call
    if mode == "none":
        # Text that never writes the trigger (a special-token trigger is no text anyway)
        text = "TEXT: /(?s:.*)/" if special_trigger is not None else \
            f"TEXT: /(?s:.*)/ & ~/(?s:.*){re.escape(fmt.trigger)}(?s:.*)/"
        return ["start: TEXT", text]
    if mode == "auto":  # any text; from the trigger on, calls (the lazy lexeme ends at the trigger's first match)
        opening = f"open: TEXT {trigger}" if special_trigger is not None else f"open[lazy]: TEXT {trigger}"
        return ["start: TEXT | open calls", opening, "TEXT: /(.|\\n)*/"]
    return [f"start: {trigger} calls", "TEXT: /(.|\\n)*/"]


def call_schema(fmt: Format, name: str, parameters: dict) -> dict:
    """A whole call as one JSON Schema: its name a constant, its arguments the function's parameters (closed), their
    `$defs` moved to the root so that their `$ref`s resolve; grammar.py's one-line JSON, keys in the call's order."""
    parameters = closed(parameters)
    defs = {key: parameters.pop(key) for key in ("$defs", "definitions") if key in parameters}
    return {"type": "object", "properties": {"name": {"const": name}, fmt.arguments: {"type": "object", **parameters}},
            "required": ["name", fmt.arguments], "additionalProperties": False, **defs,
            "x-guidance": TOOL_JSON_OPTIONS}


def format_lark(answer: Constraint) -> str:
    """A response format (structured output's Constraint) as a Lark expression that can stand in a rule of
    calls_lark's grammar: a JSON Schema (or any JSON object) as `%json`, a regex, Lark or GBNF grammar as a nested
    `%lark {...}`. ValueError for a grammar that does not convert."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if answer.kind in ("json_schema", "json_object"):
        schema = json.loads(answer.spec) if answer.kind == "json_schema" else {"type": "object"}
        schema = schema if isinstance(schema, dict) else {"allOf": [schema]}  # true or false
        options = schema.get("x-guidance")
        return f"%json {json.dumps({**schema, 'x-guidance': {**JSON_OPTIONS, **(options or {})}})}"
    if answer.kind == "regex":  # llguidance's own Lark for it (a `start:` rule with the regex, "/" escaped)
        lark = json.loads(LLMatcher.grammar_from_regex(answer.spec))["grammars"][0]["lark_grammar"]
    elif answer.kind == "lark":
        lark = answer.spec
    else:
        try:  # Lark as it is; GBNF converted, as constraint.to_llguidance does
            lark = any_to_lark(answer.spec)
        except Exception as e:  # the converter raises GbnfToLarkError, or a plain Exception for an unknown rule
            raise ValueError(f"invalid GBNF grammar: {' '.join(str(e).split())[:300]}") from None
    return f"%lark {{\n{lark}\n}}"


# ---- the request ----

class ToolRequest:
    """One request's tools, tool_choice and parallel_tool_calls, checked, with the format of its model's
    template; built by tool_request."""

    def __init__(self, tools: list[dict] | None, mode: str, names: tuple[str, ...], parallel: bool, fmt: Format,
                 tokenizer, special_trigger: int | None):
        self.tools, self.mode, self.names, self.parallel = tools, mode, names, parallel
        self.format, self.tokenizer, self.special_trigger = fmt, tokenizer, special_trigger
        self.template = tokenizer.chat_template

    def render(self, messages: list[dict]) -> tuple[list[dict], list[dict] | None]:
        """(messages, tools) for tokenizer.encode_chat(messages, tools=tools): see render_messages."""
        return render_messages(messages, self.tools, self.template, self.format)

    @property
    def constraint(self) -> Constraint | None:
        """The grammar the output follows (see calls_lark); None without tools."""
        return self.constraint_with(None)

    def constraint_with(self, answer: Constraint | None) -> Constraint | None:
        """The grammar of an output that may also answer in a response format (structured output's Constraint;
        None: free text): see calls_lark. None without tools. ValueError for a format that does not convert."""
        if not self.tools:
            return None
        return Constraint("lark", calls_lark(self.format, self.tools, self.mode, self.names, self.parallel,
                                             self.special_trigger, None if answer is None else format_lark(answer)))

    def grammar(self, compiled: Grammar) -> Grammar:
        """The compiled constraint as the decode loops take it: with parallel calls, each sequence's matcher ends
        the output at a call that repeats an earlier one (RepeatGuard)."""
        if not self.tools or not self.parallel or self.mode == "none":
            return compiled
        return GuardedGrammar(compiled, self.tokenizer, self.format)

    def parser(self, new_id: Callable[[], str] | None = None) -> "CallParser":
        """A parser of this request's output, streamed (for "none": one that reads every text as content)."""
        return CallParser(self.format if self.mode != "none" else None, new_id)

    def parse(self, text: str) -> tuple[str, list[dict]]:
        """(content, tool calls) of this request's whole output: what parser() gives streamed."""
        parser = self.parser()
        parser.feed(text)
        parser.finish()
        return parser.content, parser.calls


class RepeatGuard(Matcher):
    """A tool grammar's matcher that also reads the calls as they are written (a CallParser over the decoded
    tokens): a call that repeats an earlier one (same name and arguments) ends the output there (`done`: the engine
    ends it with "stop"), where a model caught in a loop would write it again until max_tokens."""

    def __init__(self, matcher: Matcher, tokenizer, fmt: Format):
        super().__init__(matcher.matcher)
        self.tokenizer, self.format = tokenizer, fmt
        self.ids: list[int] = []  # the tokens taken
        self._reread()

    def _reread(self) -> None:
        self.decoder, self.parser = self.tokenizer.stream(), CallParser(self.format, lambda: "")
        for token in self.ids:
            self._read(token)

    def _read(self, token: int) -> None:
        if token not in self.tokenizer.eos_ids:
            self.parser.feed(self.decoder.push(token))

    def advance(self, token: int) -> None:
        super().advance(token)
        self.ids.append(token)
        self._read(token)

    def rollback(self, n: int) -> None:
        super().rollback(n)
        del self.ids[len(self.ids) - n:]
        self._reread()

    @property
    def done(self) -> bool:
        return self.parser.repeated or super().done


class GuardedGrammar(Grammar):
    """A compiled tool grammar whose matchers are RepeatGuards."""

    def __init__(self, grammar: Grammar, tokenizer, fmt: Format):
        super().__init__(grammar.constraint, grammar.template)
        self.tokenizer, self.format = tokenizer, fmt

    def matcher(self) -> Matcher:
        return RepeatGuard(super().matcher(), self.tokenizer, self.format)


def parallel_native(template: str | None) -> bool:
    """Whether a chat template renders several calls in one assistant message (it loops over `tool_calls`, or
    writes them whole with `tojson`): a model trained on it may make parallel calls. llama.cpp decides so too."""
    return bool(PARALLEL.search(template or ""))


def tool_request(tools, tool_choice, parallel_tool_calls, tokenizer, parser: str | None = None) -> ToolRequest:
    """Check a request's tool fields (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`: None where absent)
    against the model's tokenizer (its chat template picks the format unless `parser` names one). ValueError naming
    the field; the schemas are checked by llguidance, so a request that passes compiles. parallel_tool_calls
    defaults to the template's support (parallel_native); a named choice is one call."""
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
    if parallel_tool_calls is None:
        parallel_tool_calls = parallel_native(tokenizer.chat_template)
    parallel = parallel_tool_calls and not isinstance(tool_choice, dict)  # a named choice: one call
    request = ToolRequest(checked, mode, names, parallel, fmt, tokenizer, special)
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


def tool_calls_reason(reason: str, calls: list[dict]) -> str:
    """OpenAI's finish_reason: "tool_calls" when the output made calls and ended by itself (not cut by length)."""
    return "tool_calls" if calls and reason != "length" else reason


def message(content: str, calls: list[dict]) -> dict:
    """The assistant message of a response: content None when it only called tools, as OpenAI sends it."""
    return {"role": "assistant", "content": content or (None if calls else ""),
            **({"tool_calls": calls} if calls else {})}


# ---- parsing ----

