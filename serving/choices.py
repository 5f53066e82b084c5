"""A request's choices, on the engine's thread: what each one samples with (its generator, grammar matcher and
penalty state), the forks of parallel sampling (n, best_of), and the events they send. engine.py runs the forwards;
Outputs turns their logits into tokens, text and events.

Parallel sampling: the prompt is prefilled once; when it is in, best_of choices fork from it, sharing its blocks
(scheduler.BlockManager counts references; the prompt's last partial block is copied on a fork's first write into
it), and all draw their first token from its logits. Choice i has its own generator (seeded seed + i: choice 0 is
the request with n = 1), matcher and penalty state, and is preempted and recomputed alone. Events are per choice
(Event.index): a request has ended once each of its n choices has sent finished=True. With best_of > n the events
are held, and at the end the n choices with the highest cumulative logprob go out, one event each, re-indexed.
"""
import sys
import traceback
from dataclasses import dataclass, field, replace

import torch

from decode import end_reason
from features.constraint import Matcher
from model import Transformer
from params import Token
from sample import penalty_state, sample_tokens
from serving.contract import Event, Request
from serving.scheduler import Scheduler, Seq
from text import TextStream, finish_reason, push_token


@dataclass(eq=False)
class Group:
    """A request being served: its choices (one sequence until the prompt is in, then best_of of them) and the
    events they have ended with. With best_of > n, every event is held and the n best choices go out at the end."""
    id: int
    request: Request
    choices: list["Choice"] = field(default_factory=list)
    prompt_logprobs: list[Token | None] | None = None  # filled in while the prompt is prefilled
    finals: list[tuple[float, Event]] = field(default_factory=list)  # (cumulative logprob, last event) per choice

    @property
    def best_of(self) -> int:
        return self.request.best_of or self.request.n

    @property
    def holds(self) -> bool:
        return self.best_of > self.request.n

    @property
    def done(self) -> bool:
        return len(self.finals) == self.best_of

    def send(self, choice: "Choice | None", event: Event) -> list[Event]:
        """What goes out for choice's event (choice None: an index the request ended before forking): the event
        itself; or, while events are held, nothing until the last choice ends, then the n best choices, each as one
        merged event, re-indexed 0..n-1."""
        held = [] if choice is None else choice.held
        if self.holds:
            held.append(event)
        if event.finished:
            logprob = float("-inf") if choice is None else choice.logprob
            self.finals.append((logprob, merged(held) if self.holds else event))
        if not self.holds:
            return [event]
        if not self.done:
            return []
        best = sorted(self.finals, key=lambda f: (-f[0], f[1].index))[:self.request.n]
        return [replace(e, index=rank) for rank, (_, e) in enumerate(best)]


def merged(events: list[Event]) -> Event:
    """One choice's events as one: its whole text and tokens, its end."""
    first, last = events[0], events[-1]
    return replace(last, text="".join(e.text for e in events), token_ids=[t for e in events for t in e.token_ids],
                   tokens=None if last.tokens is None else [t for e in events for t in e.tokens],
                   prompt_logprobs=first.prompt_logprobs)


@dataclass(eq=False, kw_only=True)
class Choice(Seq):
    """One of a request's sequences with its sampling state: the text so far, its generator, penalty state and
    grammar matcher (kept across preemption, like its tokens)."""
    group: Group
    index: int
    text: TextStream
    generator: torch.Generator
    seen: torch.Tensor | None  # penalty state, as sample.sample_tokens keeps it
    generated: torch.Tensor | None
    matcher: Matcher | None
    logprob: float = 0.0  # cumulative, of the sampled tokens (ranks best_of)
    finished: bool = False
    sent: bool = False  # its first event went out (the one with the prompt's logprobs)
    held: list[Event] = field(default_factory=list)  # its events, while its group holds them


def score_prompt(out: list[Token | None], prompt: list[int], start: int, logits: torch.Tensor, top: int) -> None:
    """Fill out[i] for each prompt position i that logits (n, V), computed at positions start..start+n-1, predict:
    Token(prompt[i], its logprob under the model's log_softmax (unfiltered, no temperature), the top `top`)."""
    m = min(logits.shape[0], len(prompt) - 1 - start)  # the prompt's last position predicts no prompt token
    if m <= 0:
        return
    lp = torch.log_softmax(logits[:m].float(), dim=-1)  # (m, V)
    targets = torch.tensor(prompt[start + 1:start + 1 + m], device=lp.device)  # (m,)
    chosen = lp.gather(-1, targets[:, None])[:, 0].tolist()
    top_lp, top_ids = lp.topk(min(top, lp.shape[-1]), dim=-1)  # (m, top)
    for j in range(m):
        out[start + 1 + j] = Token(prompt[start + 1 + j], chosen[j], list(zip(top_ids[j].tolist(),
                                                                                  top_lp[j].tolist())))


class Outputs:
    """The requests taken in and not ended (groups), and what happens to a choice after a forward."""

    def __init__(self, model: Transformer, tokenizer, scheduler: Scheduler):
        self.model, self.tokenizer, self.scheduler = model, tokenizer, scheduler
        self.device = model.embed_tokens.weight.device
        self.groups: dict[int, Group] = {}
        self.outbox: list[tuple[Group, Event]] = []  # sent, not yet handed to the callbacks (emit)
        self.finished = 0  # requests ended

    def first(self, request: Request) -> Choice:
        """A new request's group and its first choice, which prefills the prompt (its id is set when queued)."""
        group = Group(-1, request, prompt_logprobs=None if request.prompt_logprobs is None else
                      [None] * len(request.prompt))
        first = self._choice(group, 0, *penalty_state(request.params, [request.prompt], self.model))
        first.width, first.reuse = group.best_of, request.prompt_logprobs is None  # forks when its prompt is in
        group.choices.append(first)
        return first

    def _choice(self, group: Group, index: int, seen: torch.Tensor | None, generated: torch.Tensor | None) -> Choice:
        request = group.request
        generator = torch.Generator(device=self.device)
        if request.seed is None:
            generator.seed()  # a nondeterministic seed for this generator alone
        else:
            generator.manual_seed((request.seed + index) % 2 ** 64)
        return Choice(tokens=list(request.prompt), n_prompt=len(request.prompt), group=group, index=index,
                      text=TextStream(self.tokenizer, request.stop), generator=generator, seen=seen,
                      generated=generated, matcher=None if request.grammar is None else request.grammar.matcher())

    def sample(self, seq: Choice, logits: torch.Tensor) -> None:
        """seq's tokens are all in: draw its next token from its (1, V) logits. A prompt that is in forks its
        request's choices first, and each draws its first token from these logits."""
        if seq.finished:  # its request ended in this step (a sibling's forward failed)
            return
        for choice in self._fork(seq) if len(seq.tokens) == seq.n_prompt else [seq]:
            if not choice.finished:
                self._draw(choice, logits)

    def _fork(self, first: Choice) -> list[Choice]:
        """first's prompt is in: the request's best_of choices, first and forks of it that share its blocks, each
        with its own generator, matcher and penalty state; none for an echo (max_new_tokens 0: the prefill only)."""
        group = first.group
        first.width, first.reuse = 1, True
        if group.request.max_new_tokens == 0:
            self.end(group, "length")
            return []
        for i in range(1, group.best_of):
            state = (None, None) if first.seen is None else (first.seen.clone(), first.generated.clone())
            fork = self._choice(group, i, *state)
            self.scheduler.blocks.fork(first, fork)
            self.scheduler.start(fork)
            group.choices.append(fork)
        return group.choices

    def _draw(self, choice: Choice, logits: torch.Tensor) -> None:
        """Draw choice's next token from (1, V) logits (as decode.generate does), stream it, maybe finish."""
        request = choice.group.request
        logprobs = 0 if request.logprobs is None and choice.group.holds else request.logprobs  # ranking needs them
        try:
            _, (token,) = sample_tokens(logits, request.params, choice.generator, choice.seen, choice.generated,
                                        logprobs, None if choice.matcher is None else [choice.matcher],
                                        n_generated=[len(choice.tokens) - choice.n_prompt],
                                        stop_ids=self.tokenizer.eos_ids)
        except Exception as e:  # this request fails alone
            self.fail(choice, e)
            return
        choice.tokens.append(token.id)
        choice.logprob += token.logprob or 0.0
        token.end = end_reason(token.id, len(choice.tokens) - choice.n_prompt, len(choice.tokens),
                               request.max_new_tokens, self.scheduler.config.max_len(self.model.args.max_seq_len),
                               self.tokenizer.eos_ids, choice.matcher,
                               ignore_eos=request.params.ignore_eos)
        piece = push_token(choice.text, token)
        reason = finish_reason(token.end, choice.text)
        if reason is None:
            self._send(choice.group, choice, self._event(choice, piece, [token], None))
        else:
            self._finish(choice, reason, piece, [token])

    def fail(self, choice: Choice, e: Exception) -> None:
        """End choice's request with finish_reason "error": one line on stderr, the error in the last events."""
        if choice.finished:
            return
        message = f"{type(e).__name__}: {e}"
        print(f"engine: request {choice.group.id} failed: {message}", file=sys.stderr)
        self.end(choice.group, "error", message)

    def end(self, group: Group, reason: str, error: str | None = None) -> None:
        """End every choice of group still running, with reason."""
        for choice in group.choices:
            if not choice.finished:
                self._finish(choice, reason, error=error)
        for i in range(len(group.choices), group.best_of):  # not forked yet: they end with nothing generated
            self._send(group, None, Event(group.id, "", [], True, reason, len(group.request.prompt), 0,
                                          group.choices[0].cached, error, i,
                                          None if group.request.logprobs is None else [], group.prompt_logprobs))

    def _finish(self, choice: Choice, reason: str, piece: str = "", tokens: list[Token] = (),
                error: str | None = None) -> None:
        choice.finished = True
        self.scheduler.remove(choice)
        self._send(choice.group, choice, self._event(choice, piece + choice.text.flush(), tokens, reason, error))

    def _event(self, choice: Choice, text: str, tokens: list[Token], reason: str | None,
               error: str | None = None) -> Event:
        group, first = choice.group, not choice.sent
        choice.sent = True
        return Event(group.id, text, [t.id for t in tokens], reason is not None, reason, choice.n_prompt,
                     len(choice.tokens) - choice.n_prompt, choice.cached, error, choice.index,
                     None if group.request.logprobs is None else list(tokens),
                     group.prompt_logprobs if first else None, choice.text.matched if reason == "stop" else None)

    def _send(self, group: Group, choice: Choice | None, event: Event) -> None:
        """Queue event for the request's on_event, or hold it (Group.send)."""
        self.outbox += [(group, e) for e in group.send(choice, event)]
        if group.done:
            del self.groups[group.id]
            self.finished += 1

    def emit(self) -> list[int]:
        """Hand the step's events to their callbacks; returns the ids of the requests to abort. A callback that raises
        is the caller's bug: it is reported on stderr, it gets no more events, and its request (if not ended) is
        returned for the engine to abort."""
        outbox, self.outbox = self.outbox, []
        failed = []
        for group, event in outbox:
            if group.request.on_event is None:
                continue
            try:
                group.request.on_event(event)
            except Exception:
                traceback.print_exc()
                if not group.done:
                    group.request.on_event = None
                    failed.append(group.id)
        return failed
