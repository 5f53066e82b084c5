"""Reasoning split out of a model's output: Qwen3, SmolLM3 and DeepSeek-R1 write their thinking between <think> and
</think> before the answer. ReasoningParser reads the output as it streams into reasoning and content, as every
peer server does (chat's `reasoning_content`, Messages' thinking blocks, Responses' reasoning items); Reader then
reads tool calls out of the content."""
import re
from dataclasses import dataclass

from features.toolcalls import CallParser, merge_deltas
from features.tools import message

PARSERS = ("think",)  # --reasoning-parser names: the <think>...</think> convention (Qwen3, DeepSeek-R1, SmolLM3)


@dataclass(frozen=True)
class Tags:
    start: str = "<think>"
    end: str = "</think>"


def detect_tags(template: str | None) -> Tags | None:
    """The reasoning tags a chat template writes (it renders or strips <think> blocks); None for a model that does
    not reason in tags."""
    return Tags() if template is not None and "</think>" in template else None


def tags_named(parser: str | None, template: str | None) -> Tags | None:
    """The tags a --reasoning-parser name asks for: "auto" (or None) detects them from the template, "none" turns
    the split off; ValueError for an unknown name."""
    if parser in (None, "auto"):
        return detect_tags(template)
    if parser == "none":
        return None
    if parser not in PARSERS:
        raise ValueError(f"unknown reasoning parser {parser!r}; expected auto, none or {', '.join(PARSERS)}")
    return Tags()


def opens_thinking(prompt_text: str, tags: Tags) -> bool:
    """Whether a rendered prompt leaves the model inside its thinking: DeepSeek-R1's template ends with "<think>\\n",
    so the output has only the closing tag. (Qwen3 with enable_thinking false ends with an empty, closed block.)"""
    return re.search(re.escape(tags.start) + r"\s*$", prompt_text) is not None


class ReasoningParser:
    """A model's output, fed as it streams, split into ("reasoning", text) and ("content", text) pieces. A tag cut
    between two pieces is held back until resolved; the tags themselves and the whitespace right after the block
    are dropped. Only a block at the start of the output is reasoning: a later <think> is content."""

    def __init__(self, tags: Tags, thinking: bool = False):
        self.tags = tags
        self.state = "thinking" if thinking else "start"  # start -> thinking -> after -> content
        self.buffer = ""
        self.reasoning = ""  # all of the reasoning read so far
        self.content = ""  # all of the content read so far

    def feed(self, text: str, final: bool = False) -> list[tuple[str, str]]:
        """Read the next piece of the output (final: the output ended); the pieces it completes."""
        self.buffer += text
        out: list[tuple[str, str]] = []
        while self.buffer:
            if self.state == "start":
                stripped = self.buffer.lstrip()
                if self.tags.start.startswith(stripped) and not final:  # maybe the opening tag, not yet whole
                    break
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
                    break
            elif self.state == "after":  # the whitespace between the block and the answer
                self.buffer = self.buffer.lstrip()
                if self.buffer:
                    self.state = "content"
            else:
                self._give(out, "content", self.buffer)
                self.buffer = ""
        return out

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
