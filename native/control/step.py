"""What a controller is told after each step (StepOutcome) and what the drafter chooser answers (Choice)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple


@dataclass(frozen=True)
class StepOutcome:
    """What a controller learns from one step (runtime/step.py's StepResult is what the step did: its tokens,
    drafter and times; Generation._observe makes this from it, with the step's overhead). In seconds:
    `draft_token_s`: per drafted token after the first, `first_token_s`: to the first (None: not measured
    cleanly); `draft_s`: the whole drafting time, the draft's catch-up after plain steps included; `overhead_s`: the step's time outside drafting and verifying; `catchup`: (n tokens, seconds)
    of a long catch-up and the first drafted token together; `drafter`: whose draft it was (None: plain decoding;
    only the drafter chooser reads it); `acceptance`: under rejection sampling, per drafted position (the
    probability of reaching it given the drafts before, its expected acceptance Σ min(p, q)): the same law as
    the 0/1 outcomes without their noise (core/accept.expected_acceptance); None: count n_accepted."""

    n_drafted: int
    n_accepted: int
    draft_token_s: float | None
    verify_s: float
    overhead_s: float
    draft_s: float | None = None
    first_token_s: float | None = None
    catchup: tuple[int, float] | None = None
    drafter: str | None = None
    acceptance: tuple[tuple[float, float], ...] | None = None
    # the step shared its decodes with other sequences (--parallel): its times are the batch's, which the batch's
    # own cost model (batch_plan.py) records; a sequence's controller takes only its acceptance from it
    shared: bool = False

    @property
    def expected_accepted(self) -> float:
        """The draft tokens the step was expected to accept (n_accepted where nothing finer was measured)."""
        if self.acceptance is None:
            return float(self.n_accepted)
        return sum(reach * a for reach, a in self.acceptance)

    @property
    def step_s(self) -> float:
        """The step's whole time."""
        return (self.draft_s or 0.0) + self.verify_s + self.overhead_s


class Handover(NamedTuple):
    """Stop a drafter with a memory (a draft model) drafting once `to`, a drafter that drafts only on a match
    (n-gram lookup), would propose at least `least` tokens after its drafts so far: from there `to` is expected
    to emit faster (Drafter.lookahead)."""

    to: str
    least: int


class Choice(NamedTuple):
    """The drafter chooser's answer: which drafter drafts the next step (None: plain decoding), at most how
    many tokens, and where it hands over to another drafter (`handover`, None: nowhere). The handover is priced
    only where the step drafts (`find_handover`, called by the drafts' stop rule): a batch's planner steps plain
    in most steps at N ≥ 4 on a CPU, and pricing it for every sequence of every step was most of the chooser's
    time (docs/benchmarks.md, "The same EPYC: passes counted, and auto beside plain at N ≥ 4")."""

    drafter: str | None
    k: int
    find_handover: Callable[[], Handover | None] | None = None

    @property
    def handover(self) -> Handover | None:
        return self.find_handover() if self.find_handover is not None else None
