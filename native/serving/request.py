"""A served request: the job a client submits (Job), and while it runs on a sequence the one object that holds
its stop matching, counts, emitted text, cancellation and error mapping (Running), whatever --parallel is."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from ...errors import SpecqError
from ..core.settings import GenerationSettings
from .api import ApiError, Outcome
from .logprob_wire import entry as logprob_entry
from .outbox import Outbox

if TYPE_CHECKING:
    from ..runtime.generation import Generation
    from ..runtime.session import Session
    from ..core.stats import TokenEvent

log = logging.getLogger("specq.serve")


class StopMatcher:
    """Text in, text safe to send out: holds back a tail that may still become a stop string."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.text = ""
        self.sent = 0
        self.hit = False

    def feed(self, piece: str) -> str:
        """Add a token's text; returns what can be sent now. After a hit, `text` ends where the stop began."""
        self.text += piece
        if not self.stops:
            return self._send(len(self.text))
        found = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
        if found:
            self.hit = True
            self.text = self.text[:min(found)]
            return self._send(len(self.text))
        return self._send(len(self.text) - self._partial_tail())

    def flush(self) -> str:
        return self._send(len(self.text))

    def _partial_tail(self) -> int:
        """The longest end of the unsent text that is the start of a stop string."""
        tail = self.text[self.sent:]
        for n in range(min(len(tail), max(len(s) for s in self.stops) - 1), 0, -1):
            if any(s.startswith(tail[-n:]) for s in self.stops):
                return n
        return 0

    def _send(self, upto: int) -> str:
        out = self.text[self.sent:upto]
        self.sent = max(self.sent, upto)
        return out


def reused_prefix(held: list[int], prompt: list[int]) -> int:
    """Prompt tokens the target's cache already holds: the common prefix, less the last prompt token (which
    every generation decodes)."""
    n = 0
    for a, b in zip(held, prompt):
        if a != b:
            break
        n += 1
    return min(n, len(prompt) - 1)


@dataclass
class Job:
    prompt: list[int]
    settings: GenerationSettings
    stops: tuple[str, ...]
    emit: Callable[[tuple], None]  # ("text", str) … then ("done", Outcome) or ("error", ApiError); thread-safe
    # False: evaluate the prompt from an empty cache. A kept prefix was computed inside another request's batch,
    # whose shape changes the last bits of its values, so a seeded sample reproduces only without it.
    cache_prompt: bool = True
    speculative: bool = True  # False: the target alone (draft_max 0)
    cancelled: threading.Event = field(default_factory=threading.Event)
    outbox: Outbox | None = None  # what `emit` sends through (held() gathers a step's events), if anything

    def cancel(self) -> None:
        self.cancelled.set()

    def refuse_cancelled(self) -> None:
        """The client left before the request ran: its one answer."""
        self.emit(("error", ApiError(499, "the request was cancelled", "cancelled")))


class QueueFull(ApiError):
    def __init__(self, max_queue: int):
        super().__init__(503, f"the server is busy ({max_queue} requests already waiting); retry shortly",
                         "server_busy", "server_error", headers={"Retry-After": "1"})


def failure(e: Exception) -> ApiError:
    """What a client is told of a generation that failed (logged here; -v adds the traceback)."""
    if isinstance(e, SpecqError):
        log.warning("generation failed: %s", e)
        return ApiError(500, f"generation failed: {e}", "generation_failed", "server_error")
    log.warning("generation failed (%s: %s); -v shows where", type(e).__name__, e)
    log.debug("the traceback", exc_info=True)
    return ApiError(500, "internal error during generation; run the server with -v for details",
                    "internal_error", "server_error")


@dataclass
class Running:
    """A request on its sequence: its prompt still to evaluate, then its generation and what it sent.
    `speculative`: whether it may draft (the job's wish, where the engine has something to draft with)."""

    job: Job
    session: Session
    n_reused: int
    todo: list[int]  # prompt tokens not handed to the session yet (a chunked prefill)
    speculative: bool
    matcher: StopMatcher = field(init=False)
    gen: Generation | None = None
    n_kept: int = 0
    sent_chars: int = 0

    def __post_init__(self) -> None:
        self.matcher = StopMatcher(self.job.stops)

    def generation(self) -> Generation:
        """Its generation over the prompt's part not yet evaluated (Session.generate)."""
        return self.session.generate(self.todo, self.job.settings, speculative=self.speculative)

    def send(self, events: list[TokenEvent], target) -> bool:
        """A step's tokens to the client, up to a stop string; whether one was hit (the generation then counts
        only the tokens up to it, and is to end)."""
        for j, ev in enumerate(events):
            self.n_kept += 1
            if ev.logprob is not None and not target.is_eog(ev.token):  # before its text: the stream attaches it
                self.job.emit(("logprobs", logprob_entry(ev, target.piece)))
            self.sent_chars += len(ev.text)
            out = self.matcher.feed(ev.text)
            if out:
                self.job.emit(("text", out))
            if self.matcher.hit:
                self.gen.keep(j + 1)
                return True
        return False

    def outcome(self) -> Outcome:
        """How the request ended, once its generation has (a stop string rolls its sequence back to it); the
        text still held back is sent first."""
        gen, n_prompt = self.gen, len(self.job.prompt)
        if self.matcher.hit:
            self.session.rollback(n_prompt + self.n_kept)
            return Outcome("stop", n_prompt, self.n_reused, self.n_kept, gen.stats)
        if gen.stats.stop_reason == "interrupted":
            return Outcome("interrupted", n_prompt, self.n_reused, len(gen.tokens), gen.stats)
        # A UTF-8 sequence cut by the end of the generation is completed in gen.text, not in an event.
        out = self.matcher.feed(gen.text[self.sent_chars:]) + self.matcher.flush()
        if out:
            self.job.emit(("text", out))
        finish = "stop" if self.matcher.hit else gen.stats.stop_reason
        return Outcome(finish, n_prompt, self.n_reused, len(gen.tokens), gen.stats)

    def fail(self, e: Exception) -> None:
        """The generation failed: the memory's state after a failed decode is unknown, so the sequence starts
        clean; the client is told why."""
        self.session.reset()
        self.job.emit(("error", failure(e)))
