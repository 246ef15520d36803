"""The draft length of a step that carries several sequences (Engine(parallel=N), core/batch.py): one cost model for
the batch, each sequence's own acceptance.

A batched step runs a draft decode per draft position over the sequences still drafting and ONE target decode of
every sequence's rows, so its time is D + V(R): R = Σ (kᵢ + 1) rows in all, and V grows with R. Each sequence's
controller (length.AdaptiveDraft, chooser.AdaptiveDrafters) still says how far it would draft on its own (its
acceptance by position and its own costs, measured when it ran alone); the planner then caps every adaptive
sequence's draft at one length c, the c (0: no drafting at all) with the most expected tokens per second for the
whole batch:

    Σᵢ Eᵢ(min(kᵢ, c)) / (Σⱼ d(mⱼ) + V(Σᵢ (min(kᵢ, c) + 1)) + overhead)

where Eᵢ is sequence i's E(k) (expected.py), d(m) one draft decode of m rows, and the first draft decode reads
every drafting sequence's catch-up (the tokens it has not seen: what its last step emitted, or a plain stretch)
while the j-th (j ≥ 2) reads one row of each of the mⱼ sequences drafting a j-th token. V and d are the batch's own measurements (costs.TargetCosts keyed by rows), at the batch's mean
context. Where a verify is cheap in its rows (a GPU) c stays at the sequences' own lengths; where every extra row
costs (a CPU) c falls as the batch grows, to 0. Sequences with a fixed draft length keep it (they are counted,
not capped). While c = 0 wins, a probe of one token runs after `probe_gap` plain steps (doubling while probes
lose) so that the estimates for drafting stay current.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .costs import TargetCosts, running_mean
from .expected import expected_tokens


@dataclass(frozen=True)
class Wish:
    """One sequence's part of a batched step: how far it would draft (k), whether the planner may shorten that
    (`adaptive`), whether its drafts cost a draft decode (`decodes`: a draft model, not an n-gram lookup), and its
    acceptance by position (alphas) — or, without a controller, its mean tokens per step (`tokens`)."""

    k: int
    adaptive: bool
    decodes: bool
    alphas: Sequence[float] = ()
    tokens: float = 1.0
    behind: int = 1  # tokens its draft model must read before its first drafted token (the catch-up)

    def expected(self, k: int) -> float:
        return expected_tokens(self.alphas, k) if self.adaptive else self.tokens


class BatchPlanner:
    """Caps the adaptive sequences' drafts of a batched step (see the module's docstring)."""

    def __init__(self, ema: float = 0.2, probe_min: int = 16, probe_max: int = 256):
        self.verify = TargetCosts(ema)  # V(R): one target decode of R rows, all sequences together
        self.draft = TargetCosts(ema)  # d(m): one draft decode of m rows (a draft position of m sequences)
        self.overhead = 0.0
        self.ema = ema
        self.probe_min, self.probe_max = probe_min, probe_max
        self.probe_gap = probe_min
        self.plain_streak = 0
        self.probing = False
        self.n_steps = 0  # batched steps planned (two sequences or more)
        self.n_capped = 0  # steps where some sequence drafted less than it wished
        self.n_plain = 0  # steps where the batch stopped all drafting that the sequences wished
        self.n_probes = 0

    def at(self, n_ctx: int) -> None:
        """The batch's mean context."""
        self.verify.at(n_ctx)
        self.draft.at(n_ctx)

    # -- the decision ------------------------------------------------------------------------------------------
    def step_s(self, wishes: Sequence[Wish], ks: Sequence[int]) -> float:
        """The predicted time of a step drafting ks."""
        drafting = sorted((k for w, k in zip(wishes, ks) if w.decodes and k > 0), reverse=True)
        d = 0.0
        if drafting:
            d = self.draft.verify_s(sum(w.behind for w, k in zip(wishes, ks) if w.decodes and k > 0))
            d += sum(self.draft.verify_s(sum(1 for k in drafting if k >= j)) for j in range(2, drafting[0] + 1))
        return d + self.verify.verify_s(sum(k + 1 for k in ks)) + self.overhead

    def rate(self, wishes: Sequence[Wish], c: int) -> float:
        ks = self.capped(wishes, c)
        return sum(w.expected(k) for w, k in zip(wishes, ks)) / self.step_s(wishes, ks)

    @staticmethod
    def capped(wishes: Sequence[Wish], c: int) -> list[int]:
        return [min(w.k, c) if w.adaptive else w.k for w in wishes]

    def plan(self, wishes: Sequence[Wish]) -> list[int]:
        """Each sequence's draft length this step."""
        top = max((w.k for w in wishes if w.adaptive), default=0)
        if top == 0:
            return [w.k for w in wishes]
        self.n_steps += 1
        best_c = max(range(top + 1), key=lambda c: (self.rate(wishes, c), c))
        if best_c == 0:
            self.plain_streak += 1
            if self.plain_streak > self.probe_gap:
                self.plain_streak, self.probing = 0, True
                self.n_probes += 1
                best_c = 1
            else:
                self.n_plain += 1
        else:
            self.plain_streak = 0
            self.probe_gap = self.probe_min
        ks = self.capped(wishes, best_c)
        if ks != [w.k for w in wishes]:
            self.n_capped += 1
        return ks

    # -- measurements ------------------------------------------------------------------------------------------
    def observe(self, wishes: Sequence[Wish], drafted: Sequence[int], emitted: Sequence[int], draft_s: float,
                verify_s: float, overhead_s: float, loop_s: float = 0.0) -> None:
        """A batched step: each sequence's drafted and emitted tokens, the draft decodes' time in all (`loop_s` of it
        after the first drafted token), the verify's and the rest of the step's."""
        self.verify.observe(sum(k + 1 for k in drafted), verify_s)
        ks = [k for w, k in zip(wishes, drafted) if w.decodes and k > 0]
        if ks:
            first_rows = sum(w.behind for w, k in zip(wishes, drafted) if w.decodes and k > 0)
            self.draft.observe(first_rows, max(draft_s - loop_s, 1e-9))
            later = [sum(1 for k in ks if k >= j) for j in range(2, max(ks) + 1)]
            if later and loop_s > 0:
                self.draft.observe(round(sum(later) / len(later)), loop_s / len(later))
        self.overhead = running_mean(self.overhead, overhead_s, self.ema)
        if self.probing:  # did the probe emit more per second than a plain step of the batch would?
            self.probing = False
            plain_rate = len(wishes) / self.step_s(wishes, [0] * len(wishes))
            gained = sum(emitted) / (draft_s + verify_s + overhead_s) > plain_rate
            self.probe_gap = self.probe_min if gained else min(2 * self.probe_gap, self.probe_max)

    def seed(self, verify_s: dict[int, float], draft_s: float | None, n_ctx: int) -> None:
        """Until the batch has measured them, price its decodes as a sequence measured them alone: verifies by
        size (a line through them extends to the batch's rows) and one drafted token (any m rows)."""
        for b, v in verify_s.items():
            self.verify.calibrate(n_ctx, v, b)
        if draft_s is not None:
            self.draft.calibrate(n_ctx, draft_s)
