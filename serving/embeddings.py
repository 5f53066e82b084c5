"""OpenAI's /v1/embeddings, without a server or torch: a body -> the token sequences to embed (EmbeddingCall), and
the vectors -> the answer ({"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
"usage"}), a vector as floats or, with encoding_format base64, its little-endian float32 bytes in base64 (as
OpenAI's, which its SDK decodes). app.py runs the forwards (features/embed.py) as engine jobs."""
import base64
import struct
from dataclasses import dataclass

from serving.protocol import BadRequest, check_chars, get, is_token_list

MAX_INPUTS = 2048  # inputs per request at most (OpenAI's limit)
FIELDS = {"input", "model", "encoding_format", "dimensions", "user"}


@dataclass
class EmbeddingCall:
    inputs: list[list[int]]  # token ids, one sequence per input
    base64: bool = False
    model: str | None = None  # the name asked for, echoed
    ignored: tuple[str, ...] = ()  # unknown fields (the server logs them)


def parse_embeddings(body, tokenizer, *, max_len: int, max_chars: int, dim: int,
                     special: bool = True) -> EmbeddingCall:
    """A body -> EmbeddingCall; BadRequest names the field at fault. input: a string, an array of strings, token
    ids, or an array of token id arrays (texts encoded as a completions prompt is: BOS when the tokenizer adds it,
    special tokens' names as those tokens unless special is False); dimensions: only the model's own, dim."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    value = body.get("input")
    value = [value] if isinstance(value, str) or is_token_list(value) else value
    if not isinstance(value, list) or not value or len(value) > MAX_INPUTS:
        raise BadRequest(f"input must be a string, an array of up to {MAX_INPUTS} strings, an array of token ids, or "
                         "an array of such arrays", "input")
    inputs = []
    for i, one in enumerate(value):
        if isinstance(one, str):
            check_chars(one, max_chars, "input")
            one = tokenizer.encode(one, special=special)
        elif not is_token_list(one):
            raise BadRequest(f"input[{i}] must be a string or a non-empty array of token ids", "input")
        elif not all(0 <= t < tokenizer.vocab_size for t in one):
            raise BadRequest(f"input[{i}] has a token id outside the vocabulary [0, {tokenizer.vocab_size})", "input")
        if not one or len(one) > max_len:
            raise BadRequest(f"input[{i}] is {len(one)} tokens; an input must have 1 to {max_len}", "input")
        inputs.append(one)
    encoding = get(body, "encoding_format", "string", "float")
    if encoding not in ("float", "base64"):
        raise BadRequest(f"encoding_format must be float or base64, got {encoding[:50]!r}", "encoding_format")
    dimensions = get(body, "dimensions", "integer")
    if dimensions is not None and dimensions != dim:
        raise BadRequest(f"dimensions {dimensions} is not served: this model's embeddings have {dim}", "dimensions")
    get(body, "user", "string")
    return EmbeddingCall(inputs, encoding == "base64", get(body, "model", "string"),
                         tuple(sorted(set(body) - FIELDS)))


def embeddings_body(call: EmbeddingCall, vectors: list[list[float]], model: str) -> dict:
    """The answer to call: one entry per input, in order; usage counts the inputs' tokens."""
    def encoded(v: list[float]):
        return base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode("ascii") if call.base64 else v

    tokens = sum(map(len, call.inputs))
    return {"object": "list", "model": call.model or model,
            "data": [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
