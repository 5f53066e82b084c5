"""Reasoning split out of a model's output: Qwen3, SmolLM3 and DeepSeek-R1 write their thinking between <think> and
</think> before the answer; gpt-oss writes harmony messages, its thinking on the `analysis` channel and its answer on
`final`. ReasoningParser reads the output as it streams into reasoning and content, as every peer server does (chat's
`reasoning_content`, Messages' thinking blocks, Responses' reasoning items); Reader then reads tool calls out of the
content."""
import re
from dataclasses import dataclass

from features.toolcalls import CallParser, merge_deltas
from features.tools import message

# --reasoning-parser names: the <think>...</think> convention (Qwen3, DeepSeek-R1, SmolLM3), gpt-oss's harmony
# messages (vLLM calls its parser openai_gptoss)
PARSERS = ("think", "harmony", "openai_gptoss")


@dataclass(frozen=True)
class Tags:
    start: str = "<think>"
    end: str = "</think>"
    harmony: bool = False  # messages, each "<|channel|>NAME<|message|>TEXT<|end|>": only the analysis is reasoning


# harmony: a prompt that ends with `start` leaves the model inside an analysis message
HARMONY = Tags("<|channel|>analysis<|message|>", "<|end|>", harmony=True)
HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>")  # what ends a message's text (the last two end the output)


def detect_tags(template: str | None) -> Tags | None:
    """The reasoning tags a chat template writes (it renders or strips <think> blocks, or harmony's channels); None
    for a model that does not reason in tags."""
    if template is None:
        return None
    return HARMONY if "<|channel|>" in template else Tags() if "</think>" in template else None


def tags_named(parser: str | None, template: str | None) -> Tags | None:
    """The tags a --reasoning-parser name asks for: "auto" (or None) detects them from the template, "none" turns
    the split off; ValueError for an unknown name."""
    if parser in (None, "auto"):
        return detect_tags(template)
    if parser == "none":
        return None
    if parser not in PARSERS:
        raise ValueError(f"unknown reasoning parser {parser!r}; expected auto, none or {', '.join(PARSERS)}")
    return Tags() if parser == "think" else HARMONY


def opens_thinking(prompt_text: str, tags: Tags) -> bool:
    """Whether a rendered prompt leaves the model inside its thinking: DeepSeek-R1's template ends with "<think>\\n",
    so the output has only the closing tag. (Qwen3 with enable_thinking false ends with an empty, closed block.)"""
    return re.search(re.escape(tags.start) + r"\s*$", prompt_text) is not None


class ReasoningParser:
    """A model's output, fed as it streams, split into ("reasoning", text) and ("content", text) pieces. A tag cut
    between two pieces is held back until resolved. <think> tags: the tags themselves and the whitespace right after
    the block are dropped; only a block at the start of the output is reasoning, a later <think> is content.
    Harmony (gpt-oss): each message's header (<|start|>assistant<|channel|>final<|message|>) and end are dropped, an
    analysis message's text is reasoning and any other's content; a message to a recipient (a tool call, which is
    not parsed) is content as written. Output that does not open with a header is all content."""

    def __init__(self, tags: Tags, thinking: bool = False):
        self.tags = tags
        # <think>: start -> thinking -> after -> content; harmony: start -> (header -> body)* or content
        self.state = ("body" if tags.harmony else "thinking") if thinking else "start"
        self.kind = "reasoning"  # harmony: what the current message's text is
        self.buffer = ""
        self.reasoning = ""  # all of the reasoning read so far
        self.content = ""  # all of the content read so far

    def feed(self, text: str, final: bool = False) -> list[tuple[str, str]]:
        """Read the next piece of the output (final: the output ended); the pieces it completes."""
        self.buffer += text
        out: list[tuple[str, str]] = []
        read = self._read_harmony if self.tags.harmony else self._read_think
        while self.buffer and read(out, final):
            pass
        return out

    def _read_think(self, out: list[tuple[str, str]], final: bool) -> bool:
        """Read the buffer on in the <think> convention; False to wait for more text."""
        if self.state == "start":
            stripped = self.buffer.lstrip()
            if self.tags.start.startswith(stripped) and not final:  # maybe the opening tag, not yet whole
                return False
            if stripped.startswith(self.tags.start):
                self.buffer, self.state = stripped[len(self.tags.start):], "thinking"
            else:
                self.state = "content"
        elif self.state == "thinking":
            head, found, rest = self.buffer.partition(self.tags.end)
            keep = 0 if found or final else held_back(head, self.tags.end)
            self._give(out, "reasoning", head[:len(head) - keep])
            self.buffer = rest if found else head[len(head) - keep:]
            if found:
                self.state = "after"
            elif keep:
                return False
        elif self.state == "after":  # the whitespace between the block and the answer
            self.buffer = self.buffer.lstrip()
            if self.buffer:
                self.state = "content"
        else:
            self._give(out, "content", self.buffer)
            self.buffer = ""
        return True

    def _read_harmony(self, out: list[tuple[str, str]], final: bool) -> bool:
        """Read the buffer on as harmony messages; False to wait for more text."""
        if self.state in ("start", "header"):
            head, found, rest = self.buffer.partition("<|message|>")
            opens = any(m.startswith(head) or head.startswith(m) for m in ("<|start|>", "<|channel|>"))
            if not opens or not found and final and self.state == "start":  # text as written: no harmony message
                self.state = "content"
                return True
            if not found:
                if final:  # cut off inside a later message's header: no text of it
                    self.buffer = ""
                return False
            recipient = " to=" in head or head.startswith("<|start|>assistant to=")
            channel = head.partition("<|channel|>")[2].split(" ")[0].split("<|")[0]
            self.kind = "call" if recipient else "reasoning" if channel == "analysis" else "content"
            if self.kind == "call":
                self._give(out, "content", head + found)
            self.buffer, self.state = rest, "body"
        elif self.state == "body":
            at = min((i for i in (self.buffer.find(e) for e in HARMONY_ENDS) if i >= 0), default=-1)
            text = self.buffer if at < 0 else self.buffer[:at]
            keep = 0 if at >= 0 or final else max(held_back(text, e) for e in HARMONY_ENDS)
            self._give(out, "content" if self.kind == "call" else self.kind, text[:len(text) - keep])
            if at < 0:
                self.buffer = text[len(text) - keep:]
                return not keep
            end = next(e for e in HARMONY_ENDS if self.buffer.startswith(e, at))
            if self.kind == "call":
                self._give(out, "content", end)
            self.buffer, self.state = self.buffer[at + len(end):], "header"
        else:
            self._give(out, "content", self.buffer)
            self.buffer = ""
        return True

    def _give(self, out: list[tuple[str, str]], kind: str, text: str) -> None:
        if not text:
            return
        if kind == "reasoning":
            self.reasoning += text
        else:
            self.content += text
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of text might be the start of tag (to hold until the next piece comes)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class Reader:
    """One choice's text, as it comes, -> chat deltas ({"reasoning_content"}, {"content"}, {"tool_calls"}): the
    reasoning block split off first (ReasoningParser), then tool calls read out of the content (toolcalls.py).
    Without either, the text is the content. Every API's answer, and generate.py's chat, is shaped from these."""

    def __init__(self, thinking: ReasoningParser | None = None, calls: CallParser | None = None):
        self.thinking, self.parser = thinking, calls
        self.content = ""
        self.reasoning = ""

    @property
    def plain(self) -> bool:
        return self.thinking is None and self.parser is None

    @property
    def calls(self) -> list[dict]:
        return self.parser.calls if self.parser is not None else []

    def feed(self, text: str, final: bool = False) -> list[dict]:
        """The deltas of the next piece of text (final: the choice ended; whatever was held back comes out)."""
        if self.plain:  # every chat answer without tools or reasoning: nothing to read out
            self.content += text
            return [{"content": text}] if text else []
        pieces = self.thinking.feed(text, final) if self.thinking is not None else [("content", text)]
        deltas = []
        for kind, piece in pieces:
            if kind == "reasoning":
                deltas.append({"reasoning_content": piece})
            elif self.parser is not None:
                deltas += self.parser.feed(piece)
            elif piece:
                deltas.append({"content": piece})
        if final and self.parser is not None:
            deltas += self.parser.finish()
        deltas = merge_deltas(deltas)
        for delta in deltas:
            self.content += delta.get("content", "")
            self.reasoning += delta.get("reasoning_content", "")
        return deltas

    def message(self) -> dict:
        """The assistant message of a chat answer: content, tool calls and reasoning (vLLM's reasoning_content)."""
        said = message(self.content, self.calls) if self.parser is not None else \
            {"role": "assistant", "content": self.content}
        return {**said, "reasoning_content": self.reasoning} if self.thinking is not None else said
