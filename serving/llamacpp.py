"""llama.cpp's /infill, without a server: a body (input_prefix, input_suffix, input_extra, prompt, n_predict, its
sampling fields) -> a protocol.Call over the fill-in-the-middle prompt (features/fim.py), and engine Events ->
llama.cpp's /completion answer ({"content", "stop", "tokens_predicted", ...}) or its stream (`data: {"content",
"stop": false}` lines, the last with stop true, no [DONE]). Pure: app.py does the HTTP."""
import json

from features.fim import infill_prompt
from serving.contract import Event, Request
from serving.protocol import (BadRequest, Call, check_chars, fim_tokens_of, get, sampling_params, stop_of,
                              stream_of)

# llama.cpp's sampling defaults (its server's), and its names for the fields OpenAI's API names otherwise
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
RENAMED = {"repeat_penalty": "repetition_penalty"}
SAMPLED = ("presence_penalty", "frequency_penalty")  # and these under OpenAI's names
FIELDS = {"input_prefix", "input_suffix", "input_extra", "prompt", "n_predict", "max_tokens", "seed", "stop",
          "stream", "return_tokens", "model", *DEFAULTS, *RENAMED, *SAMPLED}
STOP_TYPES = {"eos": "eos", "stop": "word", "length": "limit"}  # engine finish_reason -> llama.cpp's stop_type


def extra_of(body: dict) -> list[tuple[str, str]]:
    """input_extra: [{"filename": ..., "text": ...}] -> (filename, text) pairs (llama.cpp's default name "tmp")."""
    extra = get(body, "input_extra", "array", [])
    chunks = []
    for chunk in extra:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str) or \
                not isinstance(chunk.get("filename", ""), str):
            raise BadRequest('input_extra must be an array of {"filename": string, "text": string}', "input_extra")
        chunks.append((chunk.get("filename", "tmp"), chunk["text"]))
    return chunks


def parse_infill(body, tokenizer, *, max_len: int, max_chars: int) -> tuple[Call, bool]:
    """POST /infill's body -> (a Call of one request over the PSM prompt, return_tokens); BadRequest names the field
    at fault (a model without FIM tokens: input_prefix). n_predict -1 (the default) fills the context."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for name in ("input_prefix", "input_suffix"):
        if not isinstance(body.get(name), str):
            raise BadRequest(f"{name} is required: a string (it may be empty)", name)
    fim = fim_tokens_of(tokenizer, "input_prefix")
    extra, prompt = extra_of(body), get(body, "prompt", "string", "")
    check_chars(body["input_prefix"] + prompt + body["input_suffix"] + "".join(t for _, t in extra), max_chars,
                "input_prefix")
    ids = infill_prompt(tokenizer, fim, body["input_prefix"], body["input_suffix"], extra, prompt)
    name = "n_predict" if body.get("n_predict") is not None else "max_tokens"
    n_predict, room = get(body, name, "integer", -1), max_len - len(ids)
    if n_predict == 0 or n_predict < -1:
        raise BadRequest(f"{name} must be -1 (until the context is full) or >= 1, got {n_predict}", name)
    if room < 1:
        raise BadRequest(f"the infill prompt takes {len(ids)} tokens, which leaves no room in the context of "
                         f"{max_len}", "input_prefix")
    sampling = {**DEFAULTS, **{k: v for k, v in body.items() if (k in DEFAULTS or k in SAMPLED) and v is not None}}
    sampling.update({new: body[old] for old, new in RENAMED.items() if body.get(old) is not None})
    seed = get(body, "seed", "integer")
    seed = None if seed is None or seed == -1 else seed  # llama.cpp's -1: a random seed
    if seed is not None and not 0 <= seed < 2 ** 64:
        raise BadRequest(f"seed must be -1 or in [0, 2**64), got {seed}", "seed")
    stream, _, _ = stream_of({"stream": body.get("stream")})
    try:
        params = sampling_params(sampling, tokenizer.vocab_size)
    except BadRequest as e:  # named as llama.cpp names the field
        old = next((old for old, new in RENAMED.items() if new == e.param), None)
        raise (e if old is None else BadRequest(str(e).replace(e.param, old), old)) from None
    request = Request(ids, params, room if n_predict == -1 else min(n_predict, room),
                      stop_of(body, fim.stops(tokenizer)), seed)
    call = Call(False, [request], [""], stream=stream, ignored=tuple(sorted(set(body) - FIELDS)))
    return call, get(body, "return_tokens", "boolean", False)


class InfillAnswer:
    """llama.cpp's answer to one /infill Call from its engine events: the body, or the stream's data lines (each
    piece of text as it comes, then a last one with stop true and the counts). Answer's interface (app.py)."""

    def __init__(self, call: Call, tokenizer, model: str, return_tokens: bool = False):
        self.call, self.tokenizer, self.model, self.return_tokens = call, tokenizer, model, return_tokens
        self.content, self.ids, self.last = "", [], None

    def opening(self) -> list[str]:
        return []

    def closing(self) -> list[str]:
        return []

    def done(self) -> list[str]:
        return []  # llama.cpp's streams end with the stop: true line, no [DONE]

    def error_event(self, message: str, status: int) -> str:
        return self.line({"error": {"code": status, "message": message, "type": "server_error"}})

    def add(self, i: int, event: Event) -> list[str]:
        """Take one event; the stream's lines it makes when streaming."""
        self.content += event.text
        self.ids += event.token_ids
        self.last = event
        if not self.call.stream:
            return []
        lines = []
        if event.text or event.token_ids:
            lines.append(self.line({"index": 0, "content": event.text, "tokens": self.tokens(event.token_ids),
                                    "stop": False, "id_slot": -1, "tokens_predicted": event.completion_tokens,
                                    "tokens_evaluated": event.prompt_tokens}))
        if event.finished:
            lines.append(self.line({**self.body(), "content": "", "tokens": []}))
        return lines

    def tokens(self, ids: list[int]) -> list[int]:
        return list(ids) if self.return_tokens else []

    @staticmethod
    def line(data: dict) -> str:
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    def body(self) -> dict:
        """llama.cpp's /completion result: the text, the counts, why it stopped and the prompt as text (its FIM
        tokens by name)."""
        last, prompt = self.last, self.call.requests[0].prompt
        return {"index": 0, "content": self.content, "tokens": self.tokens(self.ids), "id_slot": -1, "stop": True,
                "model": self.model, "tokens_predicted": last.completion_tokens if last else 0,
                "tokens_evaluated": len(prompt), "tokens_cached": last.cached_tokens if last else 0,
                "prompt": self.tokenizer.decode(prompt), "has_new_line": "\n" in self.content, "truncated": False,
                "stop_type": STOP_TYPES.get(last.finish_reason, "none") if last else "none", "stopping_word": ""}
