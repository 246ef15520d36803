"""The loop that drives the engine, for every --parallel N: continuous batching over N sequences of one engine (a
Session each), stepped together (runtime/step.py: one target decode verifies every running sequence's drafts). The
server with one sequence is this loop with N = 1.

It runs on the thread that loaded the models (the server's main thread): llama.cpp's CPU backend computes with GNU
OpenMP, whose thread team belongs to the thread that first used it, and driven from any other thread every decode runs
slower (docs/benchmarks.md, "The engine driven from another thread"). Between two steps the loop ends the generations
whose clients left, gives waiting requests the idle sequences (pick_session: the one whose cache the prompt continues,
else the one whose cache loses least), evaluates up to one chunk of joining prompts, then steps
every running generation once and sends each its text. A request that ends (end of generation, its token limit, a stop
string, a full context, a client gone) leaves at once; a stop string rolls back its own sequence only.

Each request's prompt replaces its sequence's history; the prefill keeps the cached prefix the sequence's memories
share with it (system prompt, earlier turns) and evaluates only the rest.

PREFILL_CHUNK: while other generations run, joining prompts are evaluated up to PREFILL_CHUNK tokens between two
steps, so a long prompt delays the running sequences' next token by one chunk's prefill (docs/benchmarks.md, "serve
--parallel on an AMX Xeon"), not by the whole prompt; a prompt up to one chunk beyond its cached prefix joins in
one go, and several short ones that fit one chunk together join before the same step, evaluated in one decode
(eight clients arriving at once all get their first token from one step, not the eighth after seven). With nothing
running, the first joining prompt is evaluated whole (its prefill timings price the first steps).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from dataclasses import replace
from typing import TYPE_CHECKING

from ..runtime.batch import Batch
from ..core.memory import common_prefix
from ..drafters.registry import speculates
from .api import Outcome
from .request import Job, QueueFull, Running, reused_prefix

if TYPE_CHECKING:
    from ..runtime.engine import Engine
    from ..runtime.session import Session
    from .metrics import ServerMetrics

PREFILL_CHUNK = 256
SHARE_MIN = 32  # prompt tokens another sequence must hold beyond this one's cached prefix to be copied
KEEP_MIN = 0.5  # the share of an idle sequence's cached tokens a prompt must keep to take it over an emptier one


def pick_session(idle: list[Session], prompt: list[int]) -> Session:
    """The idle sequence a prompt takes: one whose cache the prompt keeps at least KEEP_MIN of (an earlier turn of
    this conversation, a repeated prompt; the longest such prefix), else the one whose cache loses least (an empty
    one first, then the longest shared prefix), so that another conversation's cached turns stay for its next
    request; a long shared start such as a system prompt is copied from its holder (Scheduler._share), not taken.
    (llama-server: the slot most similar to the prompt, and the cache it overwrites saved to its RAM prompt cache.)"""
    shared = {id(s): common_prefix(s.tgt.tokens, prompt) for s in idle}
    keeping = [s for s in idle if s.tgt.tokens and shared[id(s)] >= KEEP_MIN * len(s.tgt.tokens)]
    if keeping:
        return max(keeping, key=lambda s: shared[id(s)])
    return min(idle, key=lambda s: (len(s.tgt.tokens) - shared[id(s)], -shared[id(s)]))


class Scheduler:
    """Runs up to engine.parallel Jobs at once, one sequence each; at most `max_queue` wait for a free one.
    `run()` is the loop, on the thread that loaded the engine; `submit` and `stop` may come from any thread."""

    def __init__(self, engine: Engine, metrics: ServerMetrics, max_queue: int):
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self.n_slots = engine.parallel  # generations that run at once
        self.sessions = [engine.session(i) for i in range(self.n_slots)]
        self.session = self.sessions[0]
        self.idle: list[Session] = list(self.sessions)
        self.running: list[Running] = []
        self.batch = Batch()
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._in_system = 0  # waiting + running
        self._stopping = False
        self._stop_seen = False

    @property
    def busy(self) -> int:
        """Sequences running a job."""
        return self.n_slots - len(self.idle)

    @property
    def waiting(self) -> int:
        """Jobs waiting for a free sequence."""
        with self._lock:
            return max(0, self._in_system - self.n_slots)

    def submit(self, job: Job) -> None:
        """Queue a job, or QueueFull when max_queue jobs already wait for a free sequence."""
        with self._lock:
            if self._in_system >= self.max_queue + self.n_slots:
                self.metrics.rejected.inc()
                raise QueueFull(self.max_queue)
            self._in_system += 1
            self.metrics.deferred.set(max(0, self._in_system - self.n_slots))
        self._jobs.put(job)

    def stop(self) -> None:
        """End run() once the HTTP server has drained: whatever still runs or waits has no client left. Returns at
        once; run() returns after the running generations' current step."""
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
                job.refuse_cancelled()
                self._left()
                continue
            ses = pick_session(self.idle, job.prompt)
            self.idle.remove(ses)
            del ses.history[:]  # the prompt replaces the history; prefill keeps the shared cached prefix
            if not job.cache_prompt:
                ses.reset()
            else:
                self._share(ses, job.prompt)
            self.running.append(Running(job, ses, reused_prefix(ses.tgt.tokens, job.prompt), list(job.prompt),
                                        job.speculative and speculates(self.engine, job.settings.drafters)))
            self.metrics.processing.set(len(self.running))

    def _share(self, ses: Session, prompt: list[int]) -> None:
        """Copy a longer start of the prompt (a system prompt) that another sequence holds, running or idle: in
        the unified cache a copy shares cells and costs nothing, evaluating them again costs a prefill."""
        donor = max((s for s in self.sessions if s is not ses), key=lambda s: common_prefix(s.tgt.tokens, prompt),
                    default=None)
        n = ses.share_prefix(donor, prompt, least=SHARE_MIN) if donor is not None else 0
        if n:
            self.metrics.prefix_copied.inc(n)

    def _prefill_joining(self) -> None:
        """Up to PREFILL_CHUNK tokens of the joining prompts, in their order: every prompt whose rest fits starts
        its generation in the batch (their ends evaluated in one decode); the first one that does not fit gets a
        chunk of its own if nothing was evaluated yet. With nothing running, the first prompt fits whole."""
        budget, starting, whole = PREFILL_CHUNK, [], not self.batch.live
        for run in [r for r in self.running if r.gen is None]:
            n = len(run.todo) - (0 if run.session.history else run.n_reused)
            if n > budget and budget < PREFILL_CHUNK:
                break
            budget -= min(n, budget)
            if whole or self._prefill_chunk(run):
                starting.append(run)
            whole = False
            if budget <= 0:
                break
        if starting:
            self._start(starting)

    def _prefill_chunk(self, run: Running) -> bool:
        """One chunk of a joining prompt, on the target only; whether its rest fits, so that it starts its
        generation now. The draft reads the chunks later with the rest (the generation's prompt read, after its
        first token) or when it first drafts, and not at all for a request that does not draft: read here it cost
        more than the target's own evaluation of the chunk (a Q4_1 draft's prompt pass beside an F32 target's,
        docs/benchmarks.md) and sat on the path to the request's first token."""
        ses = run.session
        cut = PREFILL_CHUNK + (0 if ses.history else run.n_reused)
        if len(run.todo) <= cut:
            return True
        try:
            ses.prefill_target(run.todo[:cut])
            ses.drop_reader_prefill()
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
            try:
                pairs.append((run, run.generation()))
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
        """One step of every running generation; each one's text to its client; then the drafts' reads of the
        prompts that just had their first token (off the path to it)."""
        try:
            results = self.batch.step(read_now=False)
        except Exception as e:  # noqa: BLE001 - every generation of the batch shares the failed decode
            self._fail_batch(e)
            return
        by_gen = {id(r.gen): r for r in self.running if r.gen is not None}
        with contextlib.ExitStack() as held:  # the step's events wake the HTTP loop once, at the end
            for box in {id(r.job.outbox): r.job.outbox for r in self.running if r.job.outbox is not None}.values():
                held.enter_context(box.held())
            for gen, events in results:
                run = by_gen[id(gen)]
                if run.send(events, self.engine.target) and gen in self.batch.live:
                    self.batch.cancel(gen)
                if gen.stats is not None:
                    self._done(run)
        try:
            self.batch.delivered(defer=self._joining_soon())
        except Exception as e:  # noqa: BLE001 - a draft's read failed: the generations it served fail
            self._fail_batch(e)

    def _joining_soon(self) -> bool:
        """Whether a request waits to join the batch (queued for an idle sequence, or its prompt evaluating)."""
        return bool(self.idle) and not self._jobs.empty() or any(r.gen is None for r in self.running)

    def _drop_cancelled(self) -> None:
        """End the generations whose clients left (between steps: the others' memories are untouched)."""
        for run in [r for r in self.running if r.job.cancelled.is_set()]:
            if run.gen is None:
                self.metrics.cancelled.inc()
                run.job.refuse_cancelled()
                self._release(run)
                continue
            if run.gen in self.batch.live:
                self.batch.cancel(run.gen)
            self._done(run)

    # ---- leaving -------------------------------------------------------------------------------------------
    def _done(self, run: Running) -> None:
        """A request's generation has ended: its outcome to its client."""
        outcome: Outcome = run.outcome()
        if self.n_slots > 1:
            outcome = replace(outcome, shared_time="whole")
        if outcome.finish == "interrupted":
            self.metrics.cancelled.inc()
        self.metrics.observe(outcome, slot=run.session.seq if self.n_slots > 1 else None)
        run.job.emit(("done", outcome))
        self._release(run)

    def _fail_batch(self, e: Exception) -> None:
        """A decode of the batch failed: every running generation fails, and a new batch keeps the planner."""
        self._fail([r for r in self.running if r.gen is not None], e)
        self.batch = Batch(self.batch.planner)

    def _fail(self, runs: list[Running], e: Exception) -> None:
        for run in runs:
            if run.gen is not None and run.gen in self.batch.live:
                self.batch.live.remove(run.gen)
            run.fail(e)
            self._release(run)

    def _release(self, run: Running) -> None:
        self.running.remove(run)
        self.idle.append(run.session)
        self.metrics.processing.set(len(self.running))
        self._left()

    def _left(self) -> None:
        """A job has ended: one fewer in the system."""
        with self._lock:
            self._in_system -= 1
            self.metrics.deferred.set(max(0, self._in_system - self.n_slots))
