"""The text layer over any stream of generated tokens (decode.generate, generate_batch, speculative.generate):
incremental detokenization, stop strings with hold-back, and the Completion a caller gets back."""
import bisect
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from params import Token


# Stop strings, per generation. OpenAI takes 4 and TGI 4 by default, vLLM any number; these are generous, and they
# bound what a request makes the engine thread do per token (StopStrings) and how long text is held back.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024  # characters per stop string: a delimiter, not a document


def check_stop(stop: Sequence[str]) -> None:
    """Raise a ValueError for an empty stop string, more than MAX_STOP_STRINGS of them, or one longer than
    MAX_STOP_CHARS."""
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    for s in stop:
        if not s:
            raise ValueError(f"stop strings must be non-empty, got {s!r}")
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters, got one of {len(s)}")


class StopStrings:
    """Stop strings indexed so that scanning text costs a bounded number of lookups per character, however many
    strings there are: a set looked up once per distinct length (does the text end with one?), and a sorted list
    bisected (is this end of the text the start of one?)."""

    def __init__(self, stop: Sequence[str]):
        check_stop(stop)
        self.strings = sorted(set(stop))
        self.whole = set(stop)
        self.lengths = sorted({len(s) for s in stop}, reverse=True)  # the longest first: it wins a tie
        self.longest = self.lengths[0] if stop else 0

    def ending(self, text: str, end: int) -> int:
        """The length of the longest stop string that text[:end] ends with; 0 for none."""
        return next((n for n in self.lengths if n <= end and text[end - n:end] in self.whole), 0)

    def held_back(self, text: str) -> int:
        """Length of the longest end of `text` (shorter than the longest stop string) that is the start of a stop
        string: it may yet complete one. The loop stops at the first hit from the longest end down, so over a
        stream it runs about once per new character: what was held back bounds what can be next time."""
        for k in range(min(self.longest - 1, len(text)), 0, -1):
            end = text[-k:]
            i = bisect.bisect_left(self.strings, end)  # the strings starting with `end` sort right there
            if i < len(self.strings) and self.strings[i].startswith(end):
                return k
        return 0


class TextStream:
    """Incremental text of one generation, cut before the first stop string: generation stops at the first
    character that completes one, and the text is cut before the longest one ending there. Text that might be the
    start of a stop string is held back until resolved, so the stop string itself is never returned."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.decoder = tokenizer.stream()
        self.stop = StopStrings(stop)  # checks the stop strings
        self.pending = ""  # decoded, not yet returned: it might start a stop string
        self.text = ""  # everything returned so far
        self.stopped = False
        self.matched: str | None = None  # the stop string found

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now final (maybe "")."""
        return self._scan(self.decoder.push(token_id), final=False)

    def flush(self) -> str:
        """The generation ended: return everything still held back (up to a stop string)."""
        return self._scan(self.decoder.flush(), final=True)

    def _scan(self, new: str, final: bool) -> str:
        if self.stopped:
            return ""
        self.pending += new
        # Returned text never holds the start of a stop string, so a match starts inside `pending`, and it can only
        # end at a new character.
        for end in range(len(self.pending) - len(new) + 1, len(self.pending) + 1):
            n = self.stop.ending(self.pending, end)
            if n:
                self.matched = self.pending[end - n:end]
                out, self.pending, self.stopped = self.pending[:end - n], "", True
                self.text += out
                return out
        keep = 0 if final else self.stop.held_back(self.pending)
        out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        self.text += out
        return out


def finish_reason(end: str | None, text: TextStream) -> str | None:
    """The finish reason of a generation: "stop" once a stop string matched, else the decode loop's ("eos",
    "length"; None while it runs)."""
    return "stop" if text.stopped else end


def push_token(text: TextStream, token: Token) -> str:
    """The text `token` makes final; EOS adds none (its text is not part of the output)."""
    return "" if token.end == "eos" else text.push(token.id)


@dataclass
class Completion:
    """One prompt's result: the text (cut before a stop string, without EOS) and every sampled token."""
    text: str
    tokens: list[int]  # every sampled id, including a final EOS and the tokens that completed a stop string
    finish_reason: str  # "stop" (a stop string), "eos" (an EOS id) or "length" (max_new_tokens or the context)
    prompt_tokens: int
    prefilled: int  # prompt tokens run through the model: fewer than prompt_tokens when a session's cache is reused
    steps: list[Token] = field(default_factory=list)  # per token, with logprobs when asked for
    ttft_s: float = 0.0  # prefill plus the first sample
    total_s: float = 0.0
    second_s: float = 0.0  # until the second token: the first decode step, which compiles it with --compile


def complete(tokens: Iterator[Token], tokenizer, prompt_tokens: int, prefilled: int | None = None, *,
             stop: Sequence[str] = (), on_text: Callable[[str], None] | None = None) -> Completion:
    """Run a stream of generated tokens to its end or to a stop string (then the stream is closed: no more tokens
    are computed); on_text gets the text as it becomes final. Streamed pieces concatenate to the returned text."""
    text = TextStream(tokenizer, stop)
    steps, end = [], None
    t_start, t_first, t_second = time.perf_counter(), None, None
    for token in tokens:
        t_first = t_first or time.perf_counter()
        t_second = t_second or (time.perf_counter() if steps else None)
        steps.append(token)
        end = token.end
        piece = push_token(text, token)
        if on_text and piece:
            on_text(piece)
        if text.stopped:
            break
    if hasattr(tokens, "close"):
        tokens.close()
    piece = text.flush()
    if on_text and piece:
        on_text(piece)
    t_end = time.perf_counter()
    return Completion(text.text, [s.id for s in steps], finish_reason(end, text) or "length", prompt_tokens,
                      prompt_tokens if prefilled is None else prefilled, steps, t_first - t_start, t_end - t_start,
                      (t_second or t_end) - t_start)


def complete_batch(rows: Iterator[list[Token | None]], tokenizer, prompt_tokens: list[int], *,
                   stop: Sequence[str] = ()) -> list[Completion]:
    """complete() for a batch's stream (decode.generate_batch); one Completion per row, in order."""
    texts = [TextStream(tokenizer, stop) for _ in prompt_tokens]
    steps: list[list[Token]] = [[] for _ in prompt_tokens]
    ends: list[str | None] = [None] * len(prompt_tokens)
    t_start, t_first = time.perf_counter(), None
    for row_tokens in rows:
        t_first = t_first or time.perf_counter()
        for b, token in enumerate(row_tokens):
            if token is None or texts[b].stopped:
                continue  # this row's output is frozen
            steps[b].append(token)
            ends[b] = token.end
            push_token(texts[b], token)
        if all(t.stopped or e is not None for t, e in zip(texts, ends)):
            break  # every row ended or hit a stop string: stop computing
    if hasattr(rows, "close"):
        rows.close()
    t_end = time.perf_counter()
    out = []
    for b, n in enumerate(prompt_tokens):
        texts[b].flush()
        out.append(Completion(texts[b].text, [s.id for s in steps[b]], finish_reason(ends[b], texts[b]) or "length",
                              n, n, steps[b], t_first - t_start, t_end - t_start))
    return out


def completion_json(c: Completion, tokenizer) -> dict:
    """A Completion as the JSON object `generate.py --json` prints (logprobs only when they were asked for)."""
    decode_s = c.total_s - c.ttft_s
    out = {"text": c.text, "finish_reason": c.finish_reason, "tokens": c.tokens, "prompt_tokens": c.prompt_tokens,
           "prefilled_tokens": c.prefilled,
           "timings": {"ttft_ms": round(c.ttft_s * 1000, 3), "total_ms": round(c.total_s * 1000, 3),
                       "decode_tokens_per_s": round((len(c.tokens) - 1) / decode_s, 3)
                       if len(c.tokens) > 1 and decode_s > 0 else None}}
    if c.steps and c.steps[0].logprob is not None:
        out["logprobs"] = [{"token": s.id, "text": tokenizer.decode([s.id]), "logprob": s.logprob,
                            "top": [{"token": i, "text": tokenizer.decode([i]), "logprob": v} for i, v in s.top]}
                           for s in c.steps]
    return out
