"""OpenAI's answers, without a server: engine Events -> the response body (stream=False) or the stream's chunks
(stream=True) of one call (protocol.Call): choices indexed prompt x n, logprobs in chat's and completions' shapes,
echo, tool calls read out of each choice's text, usage. Pure: app.py does the HTTP."""
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from features.reasoning import ReasoningParser, Reader
from features.tools import tool_calls_reason
from params import Token
from serving.contract import Event
from serving.protocol import Call, error_body


def openai_reason(event: Event) -> str:
    return "stop" if event.finish_reason == "eos" else event.finish_reason  # OpenAI says "stop" for both


def token_entry(tokenizer, token_id: int, logprob: float) -> dict:
    """A token in chat's logprobs: its text, log-probability and UTF-8 bytes (a token may be part of a character:
    its text is then U+FFFD, its bytes the truth)."""
    raw = tokenizer.token_bytes(token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


def chat_logprobs(tokens: list[Token], tokenizer) -> dict:
    """choices[i].logprobs of chat: logprobs.content, one entry per token with its top alternatives."""
    return {"content": [{**token_entry(tokenizer, t.id, t.logprob),
                         "top_logprobs": [token_entry(tokenizer, i, lp) for i, lp in t.top]} for t in tokens],
            "refusal": None}


def completion_logprobs(ids: list[int], tokens: list[Token | None], tokenizer, offset: int) -> dict:
    """choices[i].logprobs of completions (the legacy shape): token texts, their log-probabilities (None for a
    prompt's first token, which nothing predicts), a {text: logprob} of alternatives each (the token's own
    included, as vLLM does) and each token's character offset in prompt + completion, from `offset`."""
    texts = [tokenizer.token_text(i) for i in ids]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    tops = [None if t is None else {**{tokenizer.token_text(i): lp for i, lp in t.top}, text: t.logprob}
            for t, text in zip(tokens, texts)]
    return {"tokens": texts, "token_logprobs": [None if t is None else t.logprob for t in tokens],
            "top_logprobs": tops, "text_offset": offsets}


def reader_of(call: Call, call_id: Callable[[], str] | None = None) -> Reader:
    """A Reader of one choice's text for `call`: its reasoning tags and tools (call_id: a new call's id)."""
    thinking = ReasoningParser(call.reasoning, call.thinking) if call.reasoning is not None else None
    return Reader(thinking, call.tools.parser(call_id) if call.tools is not None else None)


@dataclass
class ResponseChoice:
    """One choice of an answer as its events arrive."""
    index: int
    prompt: int  # which of the call's prompts
    reader: Reader
    text: str = ""
    ids: list[int] = field(default_factory=list)
    tokens: list[Token] = field(default_factory=list)
    finish_reason: str | None = None  # OpenAI's: stop, length or tool_calls
    ended: str | None = None  # the engine's reason (contract.Event.finish_reason): eos, stop, length, ...
    stop_string: str | None = None  # the stop string that ended it
    offset: int = 0  # where the latest event's text starts in text
    started: bool = False  # an event arrived
    announced: bool = False  # a chat stream sent its role


class Answer:
    """The answer to one Call, built from its engine events: the whole body (stream=False) or the stream's chunks
    (stream=True). i in add(i, event) is the prompt's index in call.requests."""

    def __init__(self, call: Call, tokenizer, head: dict, call_id: Callable[[], str] | None = None):
        self.call, self.tokenizer, self.head = call, tokenizer, head
        self.choices = [ResponseChoice(p * call.n + k, p, reader_of(call, call_id))
                        for p in range(len(call.requests)) for k in range(call.n)]
        self.last: dict[tuple[int, int], Event] = {}  # (prompt, engine choice) -> its latest event: usage

    def take(self, i: int, event: Event) -> tuple[ResponseChoice, list[dict], str, list[int], list]:
        """Record one event (of the call's i-th prompt) in its choice: (the choice, the chat deltas of its new text,
        that text, its token ids and their Tokens; echo puts the prompt's first)."""
        self.last[i, event.index] = event
        c = self.choices[i * self.call.n + event.index]
        new_ids, new_tokens, text = list(event.token_ids), list(event.tokens or []), event.text
        if self.call.echo and not c.started:  # the prompt comes first, with its logprobs when asked
            text = self.call.texts[i] + text
            prompt = self.call.requests[i].prompt
            new_ids = [*prompt, *new_ids]
            if event.prompt_logprobs is not None:
                new_tokens = [*event.prompt_logprobs, *new_tokens]
        offset = len(c.text)
        c.started, c.text = True, c.text + text
        c.ids += new_ids
        c.tokens += new_tokens
        c.offset = offset
        deltas = c.reader.feed(text, event.finished)
        if event.finished:
            c.finish_reason = tool_calls_reason(openai_reason(event), c.reader.calls)
            c.ended, c.stop_string = event.finish_reason, event.stop_string
        return c, deltas, text, new_ids, new_tokens

    def add(self, i: int, event: Event) -> list[str]:
        """Take one event; the SSE data lines it makes when streaming."""
        c, deltas, text, new_ids, new_tokens = self.take(i, event)
        if not self.call.stream or not (text or new_ids or event.finished):
            return []
        chunks = []
        if self.call.chat and not c.announced:  # the role goes out with the first token, not before the prefill
            c.announced = True
            chunks.append(self.chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}]))
        if not c.reader.plain:
            return chunks + self.delta_chunks(c, deltas, new_tokens, event.finished)
        reason = c.finish_reason if event.finished else None
        return chunks + [self.chunk([self.choice_body(c, text, new_ids, new_tokens, c.offset, reason, True)])]

    def delta_chunks(self, c: ResponseChoice, deltas: list[dict], tokens: list[Token], finished: bool) -> list[str]:
        """A chat stream's chunks when tools were given or reasoning is split: one per content, reasoning or call
        piece (OpenAI's delta shapes), the tokens' logprobs on the first, the finish_reason on a last chunk of its
        own."""
        logprobs = chat_logprobs(tokens, self.tokenizer) if self.call.logprobs is not None and tokens else None
        if logprobs is not None and not deltas:
            deltas = [{}]
        chunks = [self.chunk([{"index": c.index, "delta": d, "logprobs": logprobs if k == 0 else None,
                               "finish_reason": None}]) for k, d in enumerate(deltas)]
        if finished:
            chunks.append(self.chunk([{"index": c.index, "delta": {}, "logprobs": None,
                                       "finish_reason": c.finish_reason}]))
        return chunks

    def opening(self) -> list[str]:
        return []  # chat's role goes out with each choice's first token (add)

    def closing(self) -> list[str]:
        return [self.chunk([], self.usage(), final=True)] if self.call.include_usage else []

    def error_event(self, message: str, status: int) -> str:
        return f"data: {json.dumps(error_body(message, 'server_error'))}\n\n"

    def done(self) -> list[str]:
        return ["data: [DONE]\n\n"]

    def chunk(self, choices: list[dict], used: dict | None = None, final: bool = False) -> str:
        data = {**self.head, "choices": choices}
        if final or self.call.continuous_usage:
            data["usage"] = used or self.usage()
        elif self.call.include_usage:
            data["usage"] = None  # OpenAI: null in every chunk but the last
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    def body(self) -> dict:
        return {**self.head, "choices": [self.choice_body(c, c.text, c.ids, c.tokens, 0, c.finish_reason, False)
                                         for c in self.choices], "usage": self.usage()}

    def choice_body(self, c: ResponseChoice, text: str, ids: list[int], tokens: list, offset: int, reason: str | None,
                    stream: bool) -> dict:
        """A choice of the body (stream=False) or of a chunk (its text, ids and tokens since the last chunk)."""
        logprobs = None
        if self.call.logprobs is not None and self.call.chat:
            logprobs = chat_logprobs(tokens, self.tokenizer)
        elif self.call.logprobs is not None:
            # echo asks for the prompt's logprobs too, so every id has its Token (the first prompt token's is None)
            assert len(tokens) == len(ids), f"{len(tokens)} logprobs for {len(ids)} tokens"
            if not self.call.echo:
                offset += len(self.call.texts[c.prompt])  # offsets count from the prompt's start, as OpenAI's
            logprobs = completion_logprobs(ids, tokens, self.tokenizer, offset)
        if not self.call.chat:
            return {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        if not stream:
            return {"index": c.index, "message": c.reader.message(), "logprobs": logprobs, "finish_reason": reason}
        return {"index": c.index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                "finish_reason": reason}

    def usage(self) -> dict:
        """Tokens of the whole call: each prompt counted once, every choice's completion."""
        prompts = {i: e for (i, _), e in self.last.items()}
        prompt_tokens = sum(len(r.prompt) for r in self.call.requests)
        completion = sum(e.completion_tokens for e in self.last.values())
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": sum(e.cached_tokens for e in prompts.values())}}
