"""The loop that drives the engine: requests run one at a time, in arrival order, on one Session.

It runs on the thread that loaded the models (the server's main thread): llama.cpp's CPU backend computes with
GNU OpenMP, whose thread team belongs to the thread that first used it, and driven from any other thread every
decode ran about half as fast (docs/architecture.md).

Each request's prompt replaces the session's history; the engine's prefill keeps the cached prefix both
models share with the previous request (system prompt, earlier turns) and evaluates only the rest.
Stop strings end a generation where their text ends, rolling both caches back to that token; a cancelled
request stops after the current step, and the engine's own rewind leaves both caches consistent.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from ...errors import SpecqError
from ..core.engine import Engine
from ..core.settings import GenerationSettings
from ..drafters.registry import drafts_without_model
from .api import ApiError, Outcome
from .logprob_wire import entry as logprob_entry
from .outbox import Outbox

if TYPE_CHECKING:
    from .metrics import ServerMetrics

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


class QueueFull(ApiError):
    def __init__(self, max_queue: int):
        super().__init__(503, f"the server is busy ({max_queue} requests already waiting); retry shortly",
                         "server_busy", "server_error", headers={"Retry-After": "1"})


class Worker:
    """Runs Jobs one at a time on one engine session; at most `max_queue` wait behind the running one.
    `run()` is the loop, on the thread that loaded the engine; `submit` and `stop` may come from any thread."""

    n_slots = 1  # generations that run at once (Scheduler: --parallel)
    batch = None  # the Scheduler's core.batch.Batch

    def __init__(self, engine: Engine, metrics: "ServerMetrics", max_queue: int):
        self.engine = engine
        self.session = engine.session()
        self.metrics = metrics
        self.max_queue = max_queue
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._in_system = 0  # waiting + running
        self._current: Job | None = None
        self._stopping = False

    @property
    def busy(self) -> int:
        """Slots running a job."""
        return 1 if self._current is not None else 0

    @property
    def waiting(self) -> int:
        """Jobs waiting for a free slot (behind the running one, with one slot)."""
        with self._lock:
            return max(0, self._in_system - self.n_slots)

    def submit(self, job: Job) -> None:
        """Queue a job, or QueueFull when max_queue jobs already wait for a free slot."""
        with self._lock:
            if self._in_system >= self.max_queue + self.n_slots:
                self.metrics.rejected.inc()
                raise QueueFull(self.max_queue)
            self._in_system += 1
            self.metrics.deferred.set(max(0, self._in_system - self.n_slots))
        self._jobs.put(job)

    def stop(self) -> None:
        """End run() once the HTTP server has drained: whatever still runs or waits has no client left. Returns at
        once; run() returns after the running job's current step."""
        with self._lock:
            self._stopping = True
            if self._current is not None:
                self._current.cancel()
        self._jobs.put(None)

    def run(self) -> None:
        """Serve jobs until stop(), on the calling thread (the one that loaded the engine)."""
        while (job := self._next()) is not None:
            with self._lock:
                self._current = job
                if self._stopping:
                    job.cancel()
            self.metrics.processing.set(1)
            try:
                self._serve(job)
            finally:
                self._left()
                with self._lock:
                    self._current = None
                self.metrics.processing.set(0)

    def _left(self) -> None:
        """A job has ended: one fewer in the system."""
        with self._lock:
            self._in_system -= 1
            self.metrics.deferred.set(max(0, self._in_system - self.n_slots))

    def _next(self) -> Job | None:
        # A bounded wait: the main thread runs Python signal handlers (Ctrl-C, SIGTERM) between waits.
        while True:
            try:
                return self._jobs.get(timeout=0.5)
            except queue.Empty:
                continue

    def _serve(self, job: Job) -> None:
        if job.cancelled.is_set():  # the client left while waiting
            self.metrics.cancelled.inc()
            job.emit(("error", ApiError(499, "the request was cancelled", "cancelled")))
            return
        try:
            outcome = self._generate(job)
        except SpecqError as e:
            log.warning("generation failed: %s", e)
            self.session.reset()  # the caches' state after a failed decode is unknown: start clean
            job.emit(("error", ApiError(500, f"generation failed: {e}", "generation_failed", "server_error")))
            return
        except Exception as e:
            log.warning("generation failed (%s: %s); -v shows where", type(e).__name__, e)
            log.debug("the traceback", exc_info=True)
            self.session.reset()
            job.emit(("error", ApiError(500, "internal error during generation; run the server with -v "
                                             "for details", "internal_error", "server_error")))
            return
        if outcome.finish == "interrupted":
            self.metrics.cancelled.inc()
        self.metrics.observe(outcome)
        job.emit(("done", outcome))

    def _generate(self, job: Job) -> Outcome:
        ses = self.session
        if not job.cache_prompt:
            ses.reset()
        n_reused = reused_prefix(ses.tgt.tokens, job.prompt)  # what prefill will keep of the target's cache
        del ses.history[:]  # the prompt replaces the history; prefill keeps the shared cached prefix
        speculative = job.speculative and (self.engine.draft is not None
                                           or drafts_without_model(job.settings.drafters))
        gen = ses.generate(job.prompt, job.settings, speculative=speculative)
        matcher = StopMatcher(job.stops)
        n_kept = 0
        sent_chars = 0
        it = iter(gen)
        try:
            for ev in it:
                n_kept += 1
                emit_logprobs(job, ev, self.engine.target)
                sent_chars += len(ev.text)
                out = matcher.feed(ev.text)
                if out:
                    job.emit(("text", out))
                if matcher.hit or job.cancelled.is_set():
                    break
        finally:
            it.close()  # the engine rewinds both caches to the history in its `finally`
        if matcher.hit:
            ses.rollback(len(job.prompt) + n_kept)
            return Outcome("stop", len(job.prompt), n_reused, n_kept, gen.stats)
        return final_outcome(job, gen, matcher, sent_chars, n_reused)


def emit_logprobs(job: Job, ev, target) -> None:
    """A kept token's logprobs entry, before its text (the stream attaches it to the next text chunk)."""
    if ev.logprob is not None and not target.is_eog(ev.token):
        job.emit(("logprobs", logprob_entry(ev, target.piece)))


def final_outcome(job: Job, gen, matcher: StopMatcher, sent_chars: int, n_reused: int) -> Outcome:
    """The text still held back, sent, and the Outcome of a generation that ended by itself."""
    # A UTF-8 sequence cut by the end of the generation is completed in gen.text, not in an event.
    out = matcher.feed(gen.text[sent_chars:]) + matcher.flush()
    if out:
        job.emit(("text", out))
    finish = "stop" if matcher.hit else gen.stats.stop_reason
    return Outcome(finish, len(job.prompt), n_reused, len(gen.tokens), gen.stats)
