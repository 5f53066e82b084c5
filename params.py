"""What a generation asks for, without torch: the sampling knobs (SamplingParams, checked when built), how many
tokens to generate after a prompt, and the Token each step gives back. The serving contract and the request parser
import these; sample.py acts on them."""
import math
from collections.abc import Sequence
from dataclasses import dataclass


MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 in effect bans a token, +100 in effect forces it


def check_sampling(temperature: float, top_k: int, top_p: float, min_p: float = 0.0,
                   repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                   frequency_penalty: float = 0.0, logit_bias: Sequence[tuple[int, float]] = (),
                   min_tokens: int = 0) -> None:
    """Raise a ValueError naming the first invalid sampling parameter."""
    if not 0 <= temperature < math.inf:  # also rejects NaN
        raise ValueError(f"temperature must be >= 0 and finite (0 means greedy), got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {top_p}")
    if not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {min_p}")
    if not (repetition_penalty > 0 and math.isfinite(repetition_penalty)):
        raise ValueError(f"repetition_penalty must be > 0 (1 disables it), got {repetition_penalty}")
    if not -2 <= presence_penalty <= 2:
        raise ValueError(f"presence_penalty must be in [-2, 2] (0 disables it), got {presence_penalty}")
    if not -2 <= frequency_penalty <= 2:
        raise ValueError(f"frequency_penalty must be in [-2, 2] (0 disables it), got {frequency_penalty}")
    check_logit_bias(logit_bias)
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise ValueError(f"min_tokens must be an integer >= 0 (0 disables it), got {min_tokens!r}")


def check_logit_bias(logit_bias: Sequence[tuple[int, float]], vocab_size: int | None = None) -> None:
    """Raise a ValueError for a logit_bias entry that is not (token id >= 0, bias in [-100, 100]), a token given twice,
    or, with vocab_size (the width of the model's logits) known, a token id past the vocabulary."""
    tokens = set()
    for entry in logit_bias:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
            raise ValueError(f"logit_bias entries must be (token id, bias) pairs, got {entry!r}")
        token, bias = entry
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias token ids must be integers >= 0, got {token!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not abs(bias) <= MAX_LOGIT_BIAS:  # NaN too
            raise ValueError(f"logit_bias of token {token} must be a number in [-100, 100], got {bias!r}")
        if token in tokens:
            raise ValueError(f"logit_bias gives token {token} twice")
        if vocab_size is not None and token >= vocab_size:
            raise ValueError(f"logit_bias token {token} is outside the vocabulary (ids 0 to {vocab_size - 1})")
        tokens.add(token)


@dataclass(frozen=True)
class SamplingParams:
    """Every sampling knob, checked when built. The defaults are plain greedy decoding."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs added to the logits (OpenAI)
    min_tokens: int = 0  # the stop ids (EOS, end of turn) cannot be sampled before this many tokens (vLLM)
    ignore_eos: bool = False  # a stop id does not end the generation: it is emitted and generation goes on (vLLM)

    def __post_init__(self):
        if isinstance(self.logit_bias, dict):  # as OpenAI's requests write it: {token id: bias}
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        check_sampling(self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty,
                       self.presence_penalty, self.frequency_penalty, self.logit_bias, self.min_tokens)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        # One order (by token id), whatever the caller's: equal biases compare and hash equal.
        object.__setattr__(self, "logit_bias", tuple(sorted((token, float(bias)) for token, bias in self.logit_bias)))

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass
class Token:
    """One generated token; with logprobs asked for, its log-probability and the top alternatives. The last token
    of a generation carries why it ended (decode.end_reason)."""
    id: int
    logprob: float | None = None  # under the distribution it was drawn from (sample.sampled_logprobs)
    top: list[tuple[int, float]] | None = None  # up to N (id, logprob) of that distribution, most likely first
    end: str | None = None  # "eos", "length" or "stop" (a grammar completed) on the last token, else None


def fit_new_tokens(asked: int | None, default: int | None, prompt_tokens: int, context: int, name: str,
                   what: str = "the model's context") -> int:
    """How many tokens to generate after a prompt of prompt_tokens: `asked`, which must fit in the context with the
    prompt (else a ValueError naming `name`, as OpenAI and vLLM refuse such a max_tokens), or `default` cut to what
    the prompt leaves (None: all of it), at least 1. A prompt that leaves no room is refused by check_request."""
    room = context - prompt_tokens
    if asked is None:
        return max(1, room if default is None else min(default, room))
    if asked > room >= 1:
        raise ValueError(f"{name} {asked} does not fit: {what} holds {context} tokens and the prompt takes "
                         f"{prompt_tokens}, so {name} can be at most {room}")
    return asked
