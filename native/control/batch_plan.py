"""The draft length of a step that carries several sequences (Engine(parallel=N), runtime/batch.py): one cost model for
the batch, each sequence's own acceptance.

A batched step runs a draft decode per draft position over the sequences still drafting and ONE target decode of
every sequence's rows, so its time is D + V(R): R = Σ (kᵢ + 1) rows in all, and V grows with R. Each sequence's
controller (length.LengthController, chooser.DrafterChooser) still says how far it would draft on its own (its
acceptance by position and its own costs, measured when it ran alone); the planner then caps every adaptive
sequence's draft at one length c, the c (0: no drafting at all) with the most expected tokens per second for the
whole batch:

    Σᵢ Eᵢ(min(kᵢ, c)) / (Σⱼ d(mⱼ) + V(Σᵢ (min(kᵢ, c) + 1)) + overhead)

— where that beats plain decoding by DRAFT_MARGIN, else 0 —

where Eᵢ is sequence i's E(k) (expected.py), d(m) one draft decode of m rows, and the first draft decode reads every
drafting sequence's catch-up (what its last step emitted) while the j-th (j ≥ 2) reads one row of each of the mⱼ
sequences drafting a j-th token. After a plain stretch the first draft decode reads every token since, for every
sequence (four sequences a hundred tokens behind each cost the demo draft as much as tens of plain steps): that
one-time extra is charged to the choice spread over SWITCH_STEPS steps, so the batch goes back to drafting only
where drafting pays the catch-up back within them. V and d are the batch's own measurements (costs.TargetCosts keyed
by rows), at the batch's mean context. Where a verify is cheap in its rows (a GPU) c stays at the sequences' own
lengths; where every extra row costs (a CPU) c falls as the batch grows, to 0. Sequences with a fixed draft length
keep it (they are counted, not capped). While c = 0 wins, a probe runs after `probe_gap` plain steps (doubling while
probes lose): one token drafted by ONE sequence, the one whose draft is least behind (a draft model that sat out a
plain stretch must read every token since, and eight such catch-ups at once cost seconds on a CPU), and only where
its predicted extra cost fits `probe_share` of the batch's time so far, so that the estimates for drafting stay
current at a bounded price.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .costs import TargetCosts, running_mean
from .expected import expected_tokens

SWITCH_STEPS = 16  # the steps over which a switch from plain decoding to drafting must pay its catch-ups back
# A batch drafts only where drafting promises at least this much more than plain decoding, tokens per second. On a
# CPU a batch's drafting is often a few percent either way, thinner than what the step model leaves out (the
# drafts' reads of joining prompts, the host's speed drifting between measurements): served on the deep pair at
# N = 4 (EPYC, docs/benchmarks.md), steps it predicted 2-7% faster made the load a tenth slower than plain
# decoding. Where a batch's rows are cheap (a GPU) drafting gains far more than this.
DRAFT_MARGIN = 0.10
LONE_PLAIN = 32  # steps run by one sequence alone after which the batch's plain verdict no longer holds (settled_plain)


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


def later_rows(ks: Sequence[int]) -> list[int]:
    """The rows of each draft decode after the first (positions 2.. of the longest draft) for drafts of ks tokens:
    the sequences drafting a j-th token."""
    return [sum(1 for k in ks if k >= j) for j in range(2, max(ks, default=0) + 1)]


class BatchPlanner:
    """Caps the adaptive sequences' drafts of a batched step (see the module's docstring)."""

    def __init__(self, ema: float = 0.2, probe_min: int = 16, probe_max: int = 256, probe_share: float = 0.03):
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
        self.probe_share = probe_share
        self.elapsed_s = 0.0  # every batched step's time
        self.spent_s = 0.0  # what probes cost beyond plain steps (measured)
        self.n_refused = 0  # probes not run: their predicted extra did not fit
        self._plain_s = 0.0  # the predicted plain step a probe replaced
        self.draft_ratio = 0.2  # until a draft decode was measured: it costs this share of a target decode as large
        self.last_c = 0  # the last choice (before any probe)
        self.lone_steps = 0  # steps run by one sequence alone since the last planned step
        self.plain_share: float | None = None  # the share of planned steps that chose plain decoding (running mean)

    def at(self, n_ctx: int) -> None:
        """The batch's mean context."""
        self.verify.at(n_ctx)
        self.draft.at(n_ctx)

    # -- the decision ------------------------------------------------------------------------------------------
    def step_s(self, wishes: Sequence[Wish], ks: Sequence[int], steady: bool = False) -> float:
        """The predicted time of a step drafting ks; `steady`: with every catch-up at most what one step emits (a
        long catch-up is paid once, not every step: `rate` spreads it, catchup_extra_s)."""
        drafting = [(w, k) for w, k in zip(wishes, ks) if w.decodes and k > 0]
        d = 0.0
        if drafting:
            d = self.draft_s(sum(min(w.behind, k + 1) if steady else w.behind for w, k in drafting))
            d += sum(self.draft_s(m) for m in later_rows([k for _, k in drafting]))
        return d + self.verify.verify_s(sum(k + 1 for k in ks)) + self.overhead

    def catchup_extra_s(self, wishes: Sequence[Wish], ks: Sequence[int]) -> float:
        """What a step drafting ks costs beyond its steady self: its first draft decode reads every drafting
        sequence's whole catch-up, not at most what one step emits."""
        drafting = [(w, k) for w, k in zip(wishes, ks) if w.decodes and k > 0]
        if not drafting:
            return 0.0
        return self.draft_s(sum(w.behind for w, _ in drafting)) \
            - self.draft_s(sum(min(w.behind, k + 1) for w, k in drafting))

    def draft_s(self, rows: int) -> float:
        """d(rows) at the current context: measured; between measured sizes on the line through the nearest two
        (beyond them on the last segment's, never falling); one size measured: that, grown as the target's decode
        grows from that many rows to `rows` (a draft model's batch grows like its target's); none: draft_ratio of
        the target's decode of as many rows."""
        band = self.draft.band if self.draft.band.v_mean else self.draft.nearest(lambda c: bool(c.v_mean))
        if band is None:
            return self.draft_ratio * self.verify.verify_s(rows)
        pts = sorted(band.v_mean.items())
        if rows in band.v_mean:
            return band.v_mean[rows]
        if len(pts) == 1:
            (b0, v0), = pts
            return v0 * self.verify.verify_s(rows) / self.verify.verify_s(b0)
        i = min(max(sum(1 for b, _ in pts if b < rows), 1), len(pts) - 1)
        (b0, v0), (b1, v1) = pts[i - 1], pts[i]
        return max(v0 + max(v1 - v0, 0.0) * (rows - b0) / (b1 - b0), 1e-9)

    @property
    def drafting(self) -> bool:
        """Whether the last choice drafted."""
        return self.last_c > 0

    @property
    def settled_plain(self) -> bool:
        """Whether the recent verdicts at two sequences or more were mostly plain decoding (plain_share: one step
        that drafted, say as the batch emptied, does not overturn them) and no sequence has run alone
        for LONE_PLAIN steps since: the load that made drafting not pay is likely still there (a server's clients
        send their next requests as the last ones end), so a sequence that joins an empty batch or is left alone
        in one need not get its draft ready."""
        return self.plain_share is not None and self.plain_share > 0.5 and self.lone_steps < LONE_PLAIN

    def alone(self) -> None:
        """A step ran with one sequence (the planner was not asked)."""
        self.lone_steps += 1

    @property
    def knows_draft(self) -> bool:
        """Whether a draft decode's cost was measured (or seeded from a sequence's timings)."""
        return any(c.v_mean for c in self.draft.bands.values())

    def rate(self, wishes: Sequence[Wish], c: int) -> float:
        """Expected tokens per second drafting at most c: a step as it will run once every draft has caught up,
        plus its first step's extra (the drafts that sat out a plain stretch read every token since) spread over
        SWITCH_STEPS steps."""
        ks = self.capped(wishes, c)
        spent = self.step_s(wishes, ks, steady=True) + self.catchup_extra_s(wishes, ks) / SWITCH_STEPS
        return sum(w.expected(k) for w, k in zip(wishes, ks)) / spent

    @staticmethod
    def capped(wishes: Sequence[Wish], c: int) -> list[int]:
        return [min(w.k, c) if w.adaptive else w.k for w in wishes]

    def plan(self, wishes: Sequence[Wish]) -> list[int]:
        """Each sequence's draft length this step."""
        top = max((w.k for w in wishes if w.adaptive), default=0)
        if top == 0:
            return [w.k for w in wishes]
        self.n_steps += 1
        self.lone_steps = 0
        plain = best = self.rate(wishes, 0)
        best_c = 0
        for c in range(1, top + 1):  # (the rate rises to its peak and falls: stop two lengths past it)
            r = self.rate(wishes, c)
            if r >= best:
                best_c, best = c, r
            elif c >= best_c + 2:
                break
        if best < plain * (1 + DRAFT_MARGIN):
            best_c = 0
        self.last_c = best_c
        self.plain_share = running_mean(self.plain_share, float(best_c == 0), self.ema)
        ks = self.capped(wishes, best_c)
        if best_c == 0:
            self.plain_streak += 1
            probe = self._probe(wishes) if self.plain_streak > self.probe_gap else None
            if probe is not None:
                ks = probe
            else:
                self.n_plain += 1
        else:
            self.plain_streak = 0
            self.probe_gap = self.probe_min
        if ks != [w.k for w in wishes]:
            self.n_capped += 1
        return ks

    def _probe(self, wishes: Sequence[Wish]) -> list[int] | None:
        """One drafted token for the adaptive sequence whose draft is least behind, where its predicted extra
        cost over a plain step fits the probe budget (None: no probe now)."""
        plain = self.capped(wishes, 0)
        who = [i for i, w in enumerate(wishes) if w.adaptive and w.k > 0]
        if not who:
            return None
        i = min(who, key=lambda i: (wishes[i].behind if wishes[i].decodes else 0, -expected_tokens(wishes[i].alphas, 1)))
        ks = list(plain)
        ks[i] = 1
        plain_s = self.step_s(wishes, plain)
        extra = self.step_s(wishes, ks) - plain_s
        self.plain_streak = 0
        if self.spent_s + extra > self.probe_share * self.elapsed_s:
            self.n_refused += 1
            self.probe_gap = min(2 * self.probe_gap, self.probe_max)
            return None
        self.probing, self._plain_s = True, plain_s
        self.n_probes += 1
        return ks

    # -- measurements ------------------------------------------------------------------------------------------
    def observe(self, wishes: Sequence[Wish], drafted: Sequence[int], emitted: Sequence[int], draft_s: float,
                verify_s: float, overhead_s: float, loop_s: float = 0.0, padding: int = 0) -> None:
        """A batched step: each sequence's drafted and emitted tokens, the draft decodes' time in all (`loop_s` of it
        after the first drafted token), the verify's (`padding`: rows it carried for idle sequences,
        ffi.padding_rows) and the rest of the step's."""
        self.verify.observe(sum(k + 1 for k in drafted) + padding, verify_s)
        drafting = [(w, k) for w, k in zip(wishes, drafted) if w.decodes and k > 0]
        if drafting:
            self.draft.observe(sum(w.behind for w, _ in drafting), max(draft_s - loop_s, 1e-9))
            later = later_rows([k for _, k in drafting])
            if later and loop_s > 0:
                self.draft.observe(round(sum(later) / len(later)), loop_s / len(later))
        self.overhead = running_mean(self.overhead, overhead_s, self.ema)
        step_s = draft_s + verify_s + overhead_s
        self.elapsed_s += step_s
        if self.probing:  # did the probe emit more per second than the plain step it replaced would have?
            self.probing = False
            extra = step_s - self._plain_s * sum(emitted) / len(wishes)
            self.spent_s += extra
            self.probe_gap = self.probe_min if extra < 0 else min(2 * self.probe_gap, self.probe_max)

    def seed(self, verify_s: dict[int, float], draft_ratio: float, draft_token_s: float | None, n_ctx: int,
             draft_rows: dict[int, float] | None = None) -> None:
        """Until the batch has measured them, price its decodes as a sequence measured them alone: verifies by
        size (a line through them extends to the batch's rows), a draft token as timed and draft decodes of
        several rows as timed in its prefill (`draft_rows`; without them a draft decode grows as the target's
        would: a quantized draft's does not, it grows faster), else a draft decode as `draft_ratio` of a target
        decode as large (the drafter's prior)."""
        for b, v in verify_s.items():
            self.verify.calibrate(n_ctx, v, b)
        self.draft_ratio = draft_ratio
        if draft_token_s is not None:
            self.draft.calibrate(n_ctx, draft_token_s)
            for b, d in (draft_rows or {}).items():
                self.draft.calibrate(n_ctx, d, b)
