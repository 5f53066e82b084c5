"""What generate.py prints, and its chat: a reply streamed to the terminal (with tools, the content, then the calls
as one JSON line) or one JSON object, the logprobs table and the summary line on stderr (Output); the multi-turn chat
over stdin (chat), where `/tool ID RESULT` answers a tool call; a tools file read and checked (load_tools). The
command passes plain values: no flags here."""
import itertools
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from decode import Session
from features.reasoning import ReasoningParser, Reader, Tags
from features.tools import CHOICES, ToolRequest, message as tool_message, tool_calls_reason, tool_request
from params import Token
from step import COMPILE_PAYS_AFTER, Step
from text import Completion, complete, completion_json


def chat_tokens(tokenizer, messages: list[dict], tools: ToolRequest | None = None) -> list[int]:
    """The prompt tokens of messages rendered with the chat template (which has BOS), with the tools' definitions;
    a template that fails on them (a syntax error, or raise_exception, e.g. for a system message it does not
    take) is a ValueError."""
    import jinja2

    messages, definitions = (messages, None) if tools is None else tools.render(messages)
    try:
        return tokenizer.encode_chat(messages, tools=definitions)  # contents as text, the template's markers special
    except jinja2.TemplateError as e:
        raise ValueError(f"the model's chat template failed on the messages: {e}") from None


def load_tools(path: str, choice: str | None, parser: str | None, tokenizer) -> ToolRequest:
    """The tools of a JSON file of OpenAI tool definitions, with a tool choice (auto, none, required or a function's
    name) and call syntax (None: the chat template's), checked against the model's chat template."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tools file {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            definitions = json.load(f)
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON
        raise ValueError(f"cannot read tools file {path!r}: {e}") from None
    if choice is not None and choice not in CHOICES:
        choice = {"type": "function", "function": {"name": choice}}
    try:
        return tool_request(definitions, choice, None, tokenizer, parser)
    except ValueError as e:
        raise ValueError(f"--tools {path}: {e}") from None


def summary(c: Completion, compiled: bool = False) -> str:
    """Token counts and speed of one completion, for the stats line on stderr. Compiled, the first decode step
    is the compile (reported as such; a second process reuses Inductor's cache) and the rate counts the rest."""
    first = 1 + compiled  # tokens before the timed decode steps
    start = c.second_s if compiled else c.ttft_s
    decode_tps = (len(c.tokens) - first) / (c.total_s - start) if len(c.tokens) > first else float("nan")
    line = (f"prompt tokens {c.prompt_tokens} | prefilled {c.prefilled} | generated tokens {len(c.tokens)} | "
            f"TTFT {c.ttft_s * 1000:.0f} ms | decode {decode_tps:.1f} tokens/s")
    return line + (f" | first decode step (compile) {c.second_s - c.ttft_s:.1f} s" if compiled else "")


def print_logprobs(c: Completion, tokenizer, n: int | None) -> None:
    """With logprobs asked for (n alternatives) and text output: one line per generated token on stderr."""
    if n is None:
        return
    for s in c.steps:
        alternatives = "  ".join(f"{tokenizer.decode([i])!r} {v:.4f}" for i, v in s.top)
        print(f"{s.logprob:9.4f}  {tokenizer.decode([s.id])!r}  |  {alternatives}", file=sys.stderr)


def step_label(step: Step, compile: str, compile_prefill: bool) -> str:
    """What ran, for the summary line, read from the step after the run: 'compiled: blocks (auto)', 'eager', or
    'eager (compile failed)' when auto's compile fell back (compile: the mode asked for)."""
    if step.mode == "none":
        auto = f" (auto: a compile pays after {COMPILE_PAYS_AFTER} new tokens)" if compile == "auto" else ""
        auto = f" (auto: blocks once the chat has decoded {COMPILE_PAYS_AFTER} tokens)" if step.deferred else auto
        return "eager (compile failed)" if step.failed else "eager, deterministic" if step.deterministic else \
            "eager" + auto
    return f"compiled: {step.mode}" + (" (+prefill)" if compile_prefill else " (auto)" if compile == "auto" else "")


@dataclass(frozen=True)
class Output:
    """How replies are printed: the text streamed to stdout (with tools, the content, then the calls as one JSON
    line {"tool_calls": [...]}) with a logprobs table of `logprobs` alternatives on stderr, or as_json one object per
    reply; then, unless quiet, a summary line on stderr ending with setup(), read when it is printed."""
    tokenizer: Any
    stop: Sequence[str] = ()
    as_json: bool = False
    logprobs: int | None = None
    quiet: bool = False
    tools: ToolRequest | None = None
    setup: Callable[[], str] = str
    reasoning: Tags | None = None  # the model's reasoning tags: its thinking goes to stderr, apart from the answer
    show_thinking: bool = True  # False: the thinking is not printed at all

    def reply(self, tokens: Iterator[Token], prompt_tokens: int,
              prefilled: int | None = None) -> tuple[Completion, str, list[dict]]:
        """Run a reply to its end, printing it (as_json: with tools, its content, tool_calls and finish_reason
        "tool_calls"; with reasoning tags, its reasoning). Returns (the completion, its content, its calls)."""
        reader = Reader(ReasoningParser(self.reasoning) if self.reasoning is not None else None,
                        self.tools.parser() if self.tools is not None else None)

        def show(deltas: list[dict]) -> None:
            for delta in deltas:
                if "reasoning_content" in delta and self.show_thinking:
                    print(delta["reasoning_content"], end="", file=sys.stderr, flush=True)
                print(delta.get("content", ""), end="", flush=True)

        c = complete(tokens, self.tokenizer, prompt_tokens, prefilled, stop=self.stop,
                     on_text=None if self.as_json else lambda piece: show(reader.feed(piece)))
        deltas = reader.feed(c.text if self.as_json else "", final=True)
        if not self.as_json:
            show(deltas)
        content, calls = reader.content, reader.calls
        if self.as_json:
            out = completion_json(c, self.tokenizer)
            if self.reasoning is not None:
                out.update(content=content, reasoning=reader.reasoning)
            if self.tools is not None:
                out.update(content=content, tool_calls=calls, finish_reason=tool_calls_reason(c.finish_reason, calls))
            print(json.dumps(out, ensure_ascii=False), flush=True)
        else:
            print("" if not calls else ("\n" if content else "") + json.dumps({"tool_calls": calls},
                                                                              ensure_ascii=False), flush=True)
            print_logprobs(c, self.tokenizer, self.logprobs)
        return c, content, calls

    def report(self, c: Completion, compiled: bool, prefix: str = "") -> None:
        """One reply's summary line (summary), compiled: its first decode step was the compile."""
        if not self.quiet:
            print(f"{prefix}{summary(c, compiled)} | {self.setup()}", file=sys.stderr)

    def batch(self, completions: list[Completion]) -> None:
        """A batch's replies in order, each after a '=== N ===' line (or one JSON line each), then one summary line
        for the batch."""
        for n, c in enumerate(completions, 1):
            if self.as_json:
                print(json.dumps(completion_json(c, self.tokenizer), ensure_ascii=False), flush=True)
            else:
                print(f"=== {n} ===\n{c.text}", flush=True)
                print_logprobs(c, self.tokenizer, self.logprobs)
        if self.quiet:
            return
        first, n_new = completions[0], sum(len(c.tokens) for c in completions)
        decode_tps = (n_new - len(completions)) / (first.total_s - first.ttft_s) if n_new > len(completions) \
            else float("nan")
        print(f"prompts {len(completions)} | prompt tokens {sum(c.prompt_tokens for c in completions)} | "
              f"generated tokens {n_new} | TTFT {first.ttft_s * 1000:.0f} ms | decode {decode_tps:.1f} tokens/s "
              f"(all rows) | {self.setup()}", file=sys.stderr)


def tool_result(messages: list[dict], line: str) -> bool:
    """`/tool ID RESULT` in a chat: the result of call ID (the rest of the line, usually JSON) as a tool message;
    True while a call of the last reply still waits for its result."""
    _, call_id, result = (line.split(maxsplit=2) + ["", ""])[:3]
    last = next((m for m in reversed(messages) if m["role"] == "assistant"), {})
    calls = [c["id"] for c in last.get("tool_calls") or []]
    if call_id not in calls:
        raise ValueError(f"/tool takes the id of a call of the last reply ({', '.join(calls) or 'it made none'}) "
                         f"and the result: /tool ID RESULT; got {line[:60]!r}")
    messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
    answered = {m["tool_call_id"] for m in messages[messages.index(last):] if m["role"] == "tool"}
    return not set(calls) <= answered


@dataclass
class Turns:
    """The user's turns from stdin, a line each (a prompt on a terminal), read as bytes: bytes that are not UTF-8
    are a ValueError naming their offset in the stream."""
    offset: int = 0  # bytes of stdin read so far

    def read(self) -> str | None:
        """The next turn; None at their end: an empty line, /exit or EOF."""
        if sys.stdin.isatty():
            print("> ", end="", file=sys.stderr, flush=True)
        raw = sys.stdin.buffer.readline() if hasattr(sys.stdin, "buffer") else \
            sys.stdin.readline().encode("utf-8", "surrogateescape")  # a text stream (a test's): bad bytes escaped
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"stdin is not UTF-8 text ({e.reason} at byte {self.offset + e.start})") from None
        self.offset += len(raw)
        turn = line.rstrip("\r\n")
        return None if not line or turn.strip() in ("", "/exit") else turn


def chat(out: Output, step: Step, session: Session, messages: list[dict], turn: str | None,
         reply_tokens: Callable[[list[int]], Iterator[Token]]) -> None:
    """The REPL: user turns from stdin (after `turn`, the first, if given), each reply generated in one Session (its
    KV cache kept: a turn prefills only its new tokens) by reply_tokens(prompt) and printed by out, with a summary
    line "turn N | ...". With tools, `/tool ID RESULT` answers the call ID; the model replies once every call of its
    last reply has its result."""
    compiles = step.mode != "none"  # this turn's first decode step compiles (the first turn's, or after account)
    turns = Turns()
    for n in itertools.count(1):
        while turn is None or (out.tools is not None and turn.startswith("/tool") and waits(messages, turn)):
            if (turn := turns.read()) is None:
                return
        if out.tools is None or not turn.startswith("/tool"):
            messages.append({"role": "user", "content": turn})
        prompt = chat_tokens(out.tokenizer, messages, out.tools)
        prefilled = len(prompt) - session.reusable(prompt)
        c, content, calls = out.reply(reply_tokens(prompt), len(prompt), prefilled)
        # a compile that failed during this answer fell back to eager: its first decode step was no compile
        out.report(c, compiles and step.mode != "none", f"turn {n} | ")
        compiles = step.account(len(c.tokens))  # auto in a chat: eager until the decoded tokens pay for a compile
        # with reasoning, the answer alone: harmony's template refuses a content holding its channels
        messages.append({"role": "assistant", "content": c.text if out.reasoning is None else content}
                        if out.tools is None else tool_message(content, calls))
        turn = None


def waits(messages: list[dict], line: str) -> bool:
    """tool_result, with a mistyped /tool line reported and waited past: a typo is no reason to end a chat."""
    try:
        return tool_result(messages, line)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return True
