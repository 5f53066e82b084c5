"""The serving contract, without torch: a Request to the engine and the Events it sends back. The request parser
(protocol.py) builds Requests and the answer (answer.py) reads Events without loading the engine or the model."""
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from features.constraint import Grammar
from params import SamplingParams, Token


@dataclass
class Event:
    """What a request's on_event callback receives, on the engine's thread. Events are per choice (`index`):
    `finished` ends that choice, and the request has ended once n events with finished=True have arrived, one per
    index. With best_of > n, each of the n best choices sends one event, at the request's end."""
    request_id: int
    text: str  # text that became final since the choice's previous event (may be "")
    token_ids: list[int]  # tokens sampled since the choice's previous event
    finished: bool
    finish_reason: str | None  # "stop" (a stop string), "eos", "length" (max_new_tokens or the context), "abort",
    # or "error" (serving this request failed; `error` says why, and the engine serves on)
    prompt_tokens: int
    completion_tokens: int  # so far, this choice's
    cached_tokens: int  # prompt tokens whose keys/values came from the prefix cache
    error: str | None = None
    index: int = 0  # which choice, 0..n-1
    tokens: list[Token] | None = None  # with Request.logprobs: a Token (id, logprob, top N) per token_id
    # with Request.prompt_logprobs, on each choice's first event: per prompt position i, Token(prompt[i], its
    # logprob under the model's unfiltered log_softmax at i - 1, the top N there); position 0 is None
    prompt_logprobs: list[Token | None] | None = None
    stop_string: str | None = None  # with finish_reason "stop": the stop string that ended the choice


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 16  # may be 0 only when prompt_logprobs is not None (echo: the prefill only)
    stop: Sequence[str] = ()
    seed: int | None = None  # choice i draws from a generator seeded seed + i
    on_event: Callable[[Event], None] | None = None
    grammar: Grammar | None = None  # structured output: the text follows it (each choice has its own matcher)
    n: int = 1  # choices returned
    best_of: int | None = None  # sequences sampled (>= n, default n); the n with the highest cumulative logprob
    # of their sampled tokens are returned
    logprobs: int | None = None  # with it, Event.tokens gives a params.Token (id, logprob, top N) per token_id
    prompt_logprobs: int | None = None  # with it, each choice's first event has Event.prompt_logprobs


class Unavailable(RuntimeError):
    """The engine cannot take a request now, and may later: a decode worker with no prefill worker connected
    (serving/disagg.py). HTTP 503 with Retry-After."""
