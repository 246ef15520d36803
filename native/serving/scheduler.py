"""`specq serve --parallel N`: continuous batching over N sequences of one engine (a Session each), stepped
together (core/batch.py: one target decode verifies every running sequence's drafts).

It runs on the thread that loaded the models, as Worker does. Between two steps the loop ends the generations whose
clients left, gives waiting requests the idle sequences (each the one whose cached tokens share the longest prefix
with its prompt, as llama-server's slot-prompt similarity), evaluates up to one chunk of joining prompts, then steps
every running generation once and sends each its text. A request that ends (end of generation, its token limit, a
stop string, a full context, a client gone) leaves at once; a stop string rolls back its own sequence only.

PREFILL_CHUNK: joining prompts are evaluated up to PREFILL_CHUNK tokens between two steps, so a long prompt delays
the running sequences' next token by one chunk's prefill (256 tokens: ~0.1-0.3 s for the demo pair on 2 CPU cores),
not by the whole prompt; a prompt up to one chunk beyond its cached prefix joins in one go, and several short ones
that fit one chunk together join before the same step, evaluated in one decode (eight clients arriving at once all
get their first token from one step, not the eighth after seven).
"""

from __future__ import annotations

import contextlib
import logging
import queue
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ...errors import SpecqError
from ..core.batch import Batch
from ..core.memory import common_prefix
from ..drafters.registry import drafts_without_model
from .api import ApiError, Outcome
from .worker import Job, StopMatcher, Worker, emit_logprobs, final_outcome, reused_prefix

if TYPE_CHECKING:
    from ..core.engine import Engine
    from ..core.generation import Generation
    from ..core.session import Session
    from .metrics import ServerMetrics

log = logging.getLogger("specq.serve")

PREFILL_CHUNK = 256
SHARE_MIN = 32  # prompt tokens another sequence must hold beyond this one's cached prefix to be copied


@dataclass
class Running:
    """A request on its sequence: its prompt still to evaluate, then its generation and what it sent."""

    job: Job
    session: Session
    n_reused: int
    todo: list[int]  # prompt tokens not handed to the session yet (a chunked prefill)
    matcher: StopMatcher
    gen: Generation | None = None
    n_kept: int = 0
    sent_chars: int = 0


class Scheduler(Worker):
    """Runs up to engine.parallel Jobs at once, one sequence each; at most `max_queue` wait for a free one."""

    def __init__(self, engine: Engine, metrics: ServerMetrics, max_queue: int):
        super().__init__(engine, metrics, max_queue)
        self.n_slots = engine.parallel
        self.sessions = [self.session] + [engine.session(i) for i in range(1, self.n_slots)]
        self.idle: list[Session] = list(self.sessions)
        self.running: list[Running] = []
        self.batch = Batch()
        self._stop_seen = False

    @property
    def busy(self) -> int:
        return self.n_slots - len(self.idle)

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            for run in list(self.running):
                run.job.cancel()
        self._jobs.put(None)

    def run(self) -> None:
        """Serve jobs until stop(), on the calling thread (the one that loaded the engine)."""
        while not (self._stop_seen and not self.running):
            self._admit(block=not self.running)
            self._drop_cancelled()
            self._prefill_joining()
            if self.batch.live:
                self._step()

    # ---- joining -------------------------------------------------------------------------------------------
    def _admit(self, block: bool) -> None:
        """Give waiting jobs the idle sequences; wait (bounded: signals run between waits) only when idle."""
        while self.idle and not self._stop_seen:
            try:
                job = self._jobs.get(timeout=0.5) if block else self._jobs.get_nowait()
            except queue.Empty:
                return
            block = False
            if job is None:
                self._stop_seen = True
                return
            if job.cancelled.is_set() or self._stopping:
                self.metrics.cancelled.inc()
                job.emit(("error", ApiError(499, "the request was cancelled", "cancelled")))
                self._left()
                continue
            ses = max(self.idle, key=lambda s: common_prefix(s.tgt.tokens, job.prompt))
            self.idle.remove(ses)
            del ses.history[:]  # the prompt replaces the history; prefill keeps the shared cached prefix
            if not job.cache_prompt:
                ses.reset()
            else:
                self._share(ses, job.prompt)
            n_reused = reused_prefix(ses.tgt.tokens, job.prompt)
            self.running.append(Running(job, ses, n_reused, list(job.prompt), StopMatcher(job.stops)))
            self.metrics.processing.set(len(self.running))

    def _share(self, ses: Session, prompt: list[int]) -> None:
        """Copy a longer start of the prompt (a system prompt) that another sequence holds, running or idle: in
        the unified cache a copy shares cells and costs nothing, evaluating them again costs a prefill."""
        donor = max((s for s in self.sessions if s is not ses), key=lambda s: common_prefix(s.tgt.tokens, prompt))
        n = ses.share_prefix(donor, prompt, least=SHARE_MIN)
        if n:
            self.metrics.prefix_copied.inc(n)

    def _prefill_joining(self) -> None:
        """Up to PREFILL_CHUNK tokens of the joining prompts, in their order: every prompt whose rest fits starts
        its generation in the batch (their ends evaluated in one decode); the first one that does not fit gets a
        chunk of its own if nothing was evaluated yet."""
        budget, starting = PREFILL_CHUNK, []
        for run in [r for r in self.running if r.gen is None]:
            n = len(run.todo) - (0 if run.session.history else run.n_reused)
            if n > budget and budget < PREFILL_CHUNK:
                break
            budget -= min(n, budget)
            if self._prefill_chunk(run):
                starting.append(run)
            if budget <= 0:
                break
        if starting:
            self._start(starting)

    def _prefill_chunk(self, run: Running) -> bool:
        """One chunk of a joining prompt; whether its rest fits, so that it starts its generation now."""
        ses = run.session
        cut = PREFILL_CHUNK + (0 if ses.history else run.n_reused)
        if len(run.todo) <= cut:
            return True
        try:
            ses.prefill(run.todo[:cut])
        except Exception as e:  # noqa: BLE001 - the request fails, the server goes on
            self._fail([run], e)
            return False
        del run.todo[:cut]
        self.metrics.prefill_chunks.inc()
        return False

    def _start(self, runs: list[Running]) -> None:
        """The joining prompts' last parts start their generations in the batch (Batch.add_all)."""
        pairs = []
        for run in runs:
            job = run.job
            speculative = job.speculative and (self.engine.draft is not None
                                               or drafts_without_model(job.settings.drafters))
            try:
                pairs.append((run, run.session.generate(run.todo, job.settings, speculative=speculative)))
            except Exception as e:  # noqa: BLE001 - the request fails, the server goes on
                self._fail([run], e)
        try:
            failed = {id(g): e for g, e in self.batch.add_all([g for _, g in pairs])}
        except Exception as e:  # noqa: BLE001 - the requests that shared the failed decode fail, the server goes on
            self._fail([r for r, _ in pairs], e)
            return
        for run, gen in pairs:
            if id(gen) in failed:
                self._fail([run], failed[id(gen)])
            else:
                run.gen = gen

    # ---- stepping ------------------------------------------------------------------------------------------
    def _step(self) -> None:
        try:
            results = self.batch.step()
        except Exception as e:  # noqa: BLE001 - every generation of the batch shares the failed decode
            self._fail([r for r in self.running if r.gen is not None], e)
            self.batch = Batch(self.batch.planner)
            return
        by_gen = {id(r.gen): r for r in self.running if r.gen is not None}
        with contextlib.ExitStack() as held:  # the step's events wake the HTTP loop once, at the end
            for box in {id(r.job.outbox): r.job.outbox for r in self.running if r.job.outbox is not None}.values():
                held.enter_context(box.held())
            self._send(results, by_gen)

    def _send(self, results: list, by_gen: dict) -> None:
        """Each generation's new text to its client; one that hit a stop string or its end leaves now."""
        for gen, events in results:
            run = by_gen[id(gen)]
            for j, ev in enumerate(events):
                run.n_kept += 1
                emit_logprobs(run.job, ev, self.engine.target)
                run.sent_chars += len(ev.text)
                out = run.matcher.feed(ev.text)
                if out:
                    run.job.emit(("text", out))
                if run.matcher.hit:
                    gen.keep(j + 1)
                    break
            if run.matcher.hit:
                if gen in self.batch.live:
                    self.batch.cancel(gen)
                run.session.rollback(len(run.job.prompt) + run.n_kept)
                self._done(run, Outcome("stop", len(run.job.prompt), run.n_reused, run.n_kept, gen.stats))
            elif gen.stats is not None:
                self._done(run, final_outcome(run.job, gen, run.matcher, run.sent_chars, run.n_reused))

    def _drop_cancelled(self) -> None:
        """End the generations whose clients left (between steps: the others' memories are untouched)."""
        for run in [r for r in self.running if r.job.cancelled.is_set()]:
            if run.gen is None:
                self.metrics.cancelled.inc()
                run.job.emit(("error", ApiError(499, "the request was cancelled", "cancelled")))
                self._release(run)
                continue
            if run.gen in self.batch.live:
                self.batch.cancel(run.gen)
            self._done(run, Outcome("interrupted", len(run.job.prompt), run.n_reused, len(run.gen.tokens),
                                    run.gen.stats))

    # ---- leaving -------------------------------------------------------------------------------------------
    def _done(self, run: Running, outcome: Outcome) -> None:
        outcome = replace(outcome, shared_time="whole")
        if outcome.finish == "interrupted":
            self.metrics.cancelled.inc()
        self.metrics.observe(outcome, slot=run.session.seq)
        run.job.emit(("done", outcome))
        self._release(run)

    def _fail(self, runs: list[Running], e: Exception) -> None:
        if isinstance(e, SpecqError):
            log.warning("generation failed: %s", e)
            err = ApiError(500, f"generation failed: {e}", "generation_failed", "server_error")
        else:
            log.warning("generation failed (%s: %s); -v shows where", type(e).__name__, e)
            log.debug("the traceback", exc_info=True)
            err = ApiError(500, "internal error during generation; run the server with -v for details",
                           "internal_error", "server_error")
        for run in runs:
            if run.gen is not None and run.gen in self.batch.live:
                self.batch.live.remove(run.gen)
            run.session.reset()  # the memory's state after a failed decode is unknown: start clean
            run.job.emit(("error", err))
            self._release(run)

    def _release(self, run: Running) -> None:
        self.running.remove(run)
        self.idle.append(run.session)
        self.metrics.processing.set(len(self.running))
        self._left()
