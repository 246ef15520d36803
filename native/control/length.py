"""The draft length controller (--draft-max auto): each step's k, to maximise expected tokens per second."""

from __future__ import annotations

from dataclasses import dataclass

from .acceptance import Acceptance
from .costs import DraftCosts, TargetCosts, calibration_points, running_mean
from .expected import best_draft_length, expected_tokens
from .explore import DEFAULT_HORIZON, ExploreBudget, ProbeSchedule
from .step import StepOutcome

THIN_STEP_COST = 3.0  # while evidence is thin, a step may cost at most this many plain steps (LengthController.reach)
REACH_STEP = 2  # past the deepest position tried, a dear draft grows this many positions a step (LengthController.reach)
# A step drafts the shortest length whose rate is within this fraction of the best, one shorter at most: where the
# rate is flat, longer drafts rest on the least sure estimates (any shorter: the deep pair drafted 2 where 4 won).
NEAR_BEST = 0.03
# A new answer is new text: earlier answers' acceptance counts are kept at this weight (LengthController.new_answer).
NEW_ANSWER_KEEP = 0.25


@dataclass(frozen=True)
class AdaptiveSnapshot:
    """What the controller believes now (for `specq tune` and stats)."""

    alpha: tuple[float, ...]  # conditional acceptance at positions 1..cap
    draft_ms_per_token: float | None  # each drafted token after the first
    first_draft_ms: float | None  # the first drafted token of a step, the draft's catch-up included
    verify_ms: dict[int, float]  # measured batch size → mean ms
    overhead_ms: float
    n_ctx: int  # the context these costs are for
    n_calibrations: int
    best_k: int
    n_plain_steps: int
    n_probes: int


class Probing:
    """LengthController's exploration (explore.py): whether a probe may run now and what it costs, so that
    drafting can come back while plain decoding wins. Reads the controller's costs, acceptance, budget and
    schedule."""

    def could_pay(self, limit: int) -> bool:
        """Whether drafting could beat plain decoding even at perfect acceptance, with the measured costs."""
        return best_draft_length([1.0] * limit, self.draft_s(), self.verify_s, self.overhead, self.first_s())[0] > 0

    def may_probe(self, behind: int, pace_s: float | None = None) -> bool:
        """Whether the exploration budget has room for a probe now, `behind` tokens since this drafter last ran;
        `pace_s`: what a token costs on the way of decoding the probe displaces (None: plain decoding), which
        also prices the tokens still to come."""
        pace = self.verify_s(1) + self.overhead if pace_s is None else pace_s
        return self.budget.allows(self.probe_extra_s(behind, pace), pace, self.remaining)

    def probe_extra_s(self, behind: int, pace_s: float | None = None) -> float:
        """What a probe is expected to cost beyond the way of decoding it displaces (plain decoding, or a token
        every `pace_s`): catching up on the `behind` tokens decoded without this drafter, its probe_k tokens and
        their verify, less what its expected tokens would have taken. At long context a one-token probe loses
        even when accepted (a 2-token verify can cost 1.5 single ones)."""
        pace = self.verify_s(1) + self.overhead if pace_s is None else pace_s
        k = self.probe_k
        tokens = expected_tokens(self.alphas(), k)
        return (self.first_s() + (k - 1) * self.draft_s() + max(behind - 1, 0) * self.catchup_s()
                + self.verify_s(k + 1) + self.overhead - tokens * pace)

    def probe_gap(self, at_least: int = 0) -> int:
        """Plain steps before this drafter's next probe (explore.ProbeSchedule.gap)."""
        return self.schedule.gap(self.thin_evidence(), at_least)

    def mark_probe(self) -> None:
        """The next step observed is a probe: its measured cost spaces the next ones."""
        self.schedule.probing = True

    def chosen(self) -> None:
        """This drafter drafts on its merits (the drafter chooser's pick): its probe spacing starts over."""
        self.schedule.drafting()


class LengthController(Probing):
    """Chooses each step's draft length k (0: plain decoding) from online estimates of the running generation.

    Glossary:
      α_i (alphas)  the conditional acceptance at draft position i (given 1..i−1 accepted): decayed counts, each
                    position shrunk towards the one before it and never below the pooled rate.
      E(k)          expected tokens of a step drafting k: 1 + Σ_j Π_{i≤j} α_i (expected.py).
      t_first       the draft's first token of a step, which also pays its catch-up on the last step's tokens.
      t_draft       each further drafted token.
      V(b)          the target's verify pass of b = k+1 tokens (costs.TargetCosts: shared by every drafter's
                    controller under --drafter auto).
      overhead      a step's time outside drafting and verifying (running mean).
      T(k)          a step's time: t_first + (k−1)·t_draft + V(k+1) + overhead; k maximises E(k)/T(k).
      probe         a short draft (probe_k tokens) run while plain decoding wins, so that drafting can come back:
                    spaced by explore.ProbeSchedule, paid for from explore.ExploreBudget.
      thin evidence position 1 tried fewer than min_evidence times (decayed): plain decoding is no verdict yet.
      reach         the longest draft worth pricing now (reach()): a dear draft grows a few positions at a time.
    Costs are kept per context band (costs.py); the caller says where the generation is (at()).
    """

    def __init__(self, cap: int, cost_ratio_prior: float = 0.2, decay: float = 0.92, prior_weight: float = 4.0,
                 probe_min: int = 16, probe_max: int = 64, probe_k: int = 1, ema: float = 0.2,
                 probe_budget: float = 0.02, alpha_prior: float = 0.75, attention_prior: float = 0.0,
                 min_evidence: float = 6.0, target: TargetCosts | None = None, budget: ExploreBudget | None = None):
        """`attention_prior`: see costs.TargetCosts. `min_evidence`: until position 1 has been tried this many times
        (decayed counts), plain decoding is not a verdict: a one-token probe runs every other step (spaced out when
        the probes cost more than they gain), so that a few unlucky first drafts (or a noisy first reading of a
        cost) cannot stop drafting for a whole answer. `target`, `budget`: another controller's, shared (the
        drafter chooser's): that one records the verifies, the prefill's target timings and the steps' time."""
        self.cap = cap
        self.acceptance = Acceptance(cap, decay, prior_weight, alpha_prior)
        self.owns_target = target is None  # whether this controller records what the target costs
        self.target = TargetCosts(ema, attention_prior) if target is None else target
        self.draft = DraftCosts(self.target, cost_ratio_prior, ema)
        self.budget = ExploreBudget() if budget is None else budget  # what probes may cost in all
        self.schedule = ProbeSchedule(probe_min, probe_max, probe_budget)
        self.n_ctx = 0
        self.remaining = DEFAULT_HORIZON  # tokens the generation may still emit (at's)
        self.n_calibrations = 0
        self.n_batch_calibrations = 0
        self.draft_rows: dict[int, float] = {}  # a draft decode of n rows timed in a prefill (calibrate), by n
        self.overhead = 0.0
        self.ema = ema
        self.probe_k = probe_k
        self.min_evidence = min_evidence
        self.n_plain_steps = 0
        self.n_probes = 0
        self.n_catchups = 0  # long catch-ups measured (catchup_s)
        self.n_reach_limited = 0  # choices shortened by reach (thin evidence, a dear step)

    # -- context and costs ------------------------------------------------------------------------
    def at(self, n_ctx: int, remaining: int | None = None) -> None:
        """The next steps run at a context of n_ctx tokens, with `remaining` tokens left to generate (None: not
        known, DEFAULT_HORIZON)."""
        self.n_ctx = n_ctx
        self.remaining = DEFAULT_HORIZON if remaining is None else remaining
        self.target.at(n_ctx)
        self.draft.at(n_ctx)

    def calibration_points(self, first: int, last: int, with_draft: bool) -> list[tuple[int, int]]:
        """Spans (position, n_tokens) of a prefill over first..last-1 worth decoding alone and timing
        (costs.calibration_points)."""
        return calibration_points(self.target, self.draft if with_draft else None, first, last)

    def calibrate(self, n_ctx: int, target_s: float, draft_token_s: float | None, n_tokens: int = 1) -> None:
        """Seed n_ctx's band with a target decode of n_tokens (one token, or a batch priced as a verify of that
        size) and, for a single token, one draft token timed at that context. A draft decode of several tokens is
        kept in `draft_rows` (a sequence drafts one row a decode; a batch of sequences drafts one row each:
        runtime/batch.py seeds its planner with these)."""
        if self.owns_target:
            self.target.calibrate(n_ctx, target_s, n_tokens)
        if n_tokens > 1:
            self.n_batch_calibrations += 1
            if draft_token_s is not None:
                self.draft_rows[n_tokens] = draft_token_s
            return
        if draft_token_s is not None:
            self.draft.calibrate(n_ctx, draft_token_s)
        self.n_calibrations += 1

    # Views of the current band (tune, tests).
    @property
    def t_draft(self) -> float | None:
        return self.draft.band.t_draft

    @property
    def t_first(self) -> float | None:
        return self.draft.band.t_first

    @property
    def v_mean(self) -> dict[int, float]:
        return self.target.band.v_mean

    def verify_one_s(self) -> float:
        return self.target.verify_one_s()

    def verify_s(self, b: int) -> float:
        """V(b) at the current context (costs.TargetCosts)."""
        return self.target.verify_s(b)

    def draft_s(self) -> float:
        """Seconds per drafted token after the first."""
        return self.draft.draft_s()

    def first_s(self) -> float:
        """Seconds to the first drafted token of a step."""
        return self.draft.first_s()

    def catchup_s(self) -> float:
        """Seconds per token of a long catch-up (costs.DraftCosts.catchup_s)."""
        return self.draft.catchup_s()

    def draft_cost_changed(self, t_token: float) -> None:
        """The drafter now costs t_token a token at the current context (a draft window was taken): what was
        measured before, at every context, priced a draft that saw more."""
        self.draft.changed(t_token)

    def memory_replaced(self, t_token: float, agreement: tuple[int, int]) -> None:
        """The drafter drafts from another memory again (a draft window given up for the whole context): its
        cost is t_token a token at the current context (draft_cost_changed), and the acceptance measured since
        the change was the other memory's: it is forgotten, and `agreement` ((agreeing, rows) of the memory now
        used, on the target's choices) seeds the prior instead."""
        self.draft_cost_changed(t_token)
        self.acceptance.forget()
        self.seed_acceptance(*agreement)

    # -- acceptance -------------------------------------------------------------------------------
    def alphas(self) -> list[float]:
        """α_1..α_cap (acceptance.Acceptance)."""
        return self.acceptance.alphas()

    @property
    def trials(self) -> list[float]:
        return self.acceptance.trials

    @property
    def n_seeds(self) -> int:
        """Prompts whose agreement seeded the acceptance (seed_acceptance)."""
        return self.acceptance.n_seeds

    def wants_agreement(self) -> bool:
        """Whether prompt agreement would inform the next choice (seed_acceptance): while evidence is thin."""
        return self.thin_evidence()

    def seed_acceptance(self, n_agree: float, n: int) -> None:
        """Evidence from the prompt before a draft was tried: of n prompt positions, n_agree where the drafter's
        greedy choice equals the target's (teacher-forced acceptance; under rejection sampling the rows' summed
        Σ min(p, q)). It moves the acceptance prior and counts as a few observations of position 1
        (acceptance.SEED_WEIGHT), which the steps' own outcomes then outweigh; a pair that agrees drafts from the
        first step even where drafting pays only at high acceptance (long context, a draft nearly as dear as the
        target). Evidence stays thin until drafts are tried (thin_evidence)."""
        self.acceptance.seed(n_agree, n)

    def new_answer(self, copies: bool = False) -> None:
        """A generation starts: acceptance learnt on earlier answers at positions ≥ 2 counts for NEW_ANSWER_KEEP
        of itself. Carried over whole, one answer's near-perfect acceptance sends the next one's first drafts long,
        to fail early; weakened, the reach bounds the opening. Position 1 stays whole unless the drafter `copies`
        from the text (Acceptance.new_text)."""
        self.acceptance.new_text(NEW_ANSWER_KEEP, NEW_ANSWER_KEEP if copies else 1.0)

    def thin_evidence(self) -> bool:
        """Whether too few drafts were tried yet for plain decoding to be a verdict (see min_evidence)."""
        return self.acceptance.tried < self.min_evidence

    # -- decisions ------------------------------------------------------------------------------
    def expected(self, limit: int, overhead: float | None = None, per_token: float = 0.0, within: float = 0.0,
                 reach: int | None = None) -> tuple[int, float]:
        """(best k ≤ reach ≤ limit, its expected tokens per second); `overhead` defaults to this controller's,
        `per_token` is charged per emitted token, `within`: the shortest k that close to the best k ≤ limit
        (best_draft_length)."""
        return best_draft_length(self.alphas()[:limit], self.draft_s(), self.verify_s,
                                 self.overhead if overhead is None else overhead, self.first_s(), per_token, within,
                                 reach)

    def near_best(self, limit: int, overhead: float | None = None, per_token: float = 0.0) -> tuple[int, float]:
        """expected() within min(limit, cap): the shortest length within NEAR_BEST of the best, up to the reach."""
        most, overhead = min(limit, self.cap), self.overhead if overhead is None else overhead
        return self.expected(most, overhead, per_token, NEAR_BEST, self.reach(most, overhead))

    def choose(self, limit: int) -> int:
        """Draft length for the next step, at most `limit` (context / n_predict room)."""
        if limit <= 0:
            return 0
        k, _ = self.near_best(limit)
        sched = self.schedule
        if k > 0:
            sched.drafting()
            return k
        sched.plain_step()
        thin = self.thin_evidence()
        if sched.due(thin) and self.could_pay(min(limit, self.cap)) and self.may_probe(sched.plain_streak):
            sched.probe(thin)
            self.n_probes += 1
            self.mark_probe()
            return min(self.probe_k, limit, self.cap)
        self.n_plain_steps += 1
        return 0

    def reach(self, limit: int, overhead: float) -> int:
        """The longest draft worth considering now, at most `limit`: one whose step (drafting and verify) costs at
        most THIN_STEP_COST plain steps, or else one at most REACH_STEP positions past the deepest one tried yet
        (none while evidence is thin). A first draft or two fully accepted (an answer's opening is easy) put
        every position's estimate near 1, positions never tried included, and the best length on those estimates
        is the cap; at long context on a CPU a 17-token verify costs five single tokens, and one such step that
        fails early loses more than the whole answer could gain (an 11-token draft failing at its first token
        cost the demo pair at 2k nine plain tokens). So a dear draft grows a few positions at a time, as far as
        the outcomes carry it. Where batches are cheap (a GPU) the cost bound alone allows the cap."""
        if limit <= 1:
            return limit
        most = THIN_STEP_COST * (self.verify_s(1) + overhead)
        first, per = self.first_s(), self.draft_s()
        k = limit
        while k > 1 and first + (k - 1) * per + self.verify_s(k + 1) + overhead > most:
            k -= 1
        if not self.thin_evidence():
            k = max(k, min(limit, self.acceptance.deepest_tried() + REACH_STEP))
        if k < limit:
            self.n_reach_limited += 1
        return k

    # -- measurements ---------------------------------------------------------------------------
    def observe(self, step: StepOutcome) -> None:
        """Record one step (StepOutcome; its drafter is not read here). A long catch-up's first token's own cost is
        taken off its time. Of a step shared with other sequences only the acceptance (batch_plan.py prices the
        batch)."""
        if step.shared:
            self.schedule.probing = False
            self._count(step)
            return
        if step.catchup is not None and step.catchup[0] > 2:
            self.draft.observe_catchup(*step.catchup)
            self.n_catchups += 1
        if self.owns_target:
            self.budget.elapsed_s += step.step_s
        if self.schedule.probing:
            # A probe after a plain stretch also pays the draft's catch-up: space probes so that their
            # extra cost stays within the schedule's budgets of plain decoding.
            self.schedule.probing = False
            plain = self.verify_s(1) + self.overhead
            extra = step.step_s / plain - 1.0 - step.expected_accepted
            self.budget.spent_s += extra * plain
            self.schedule.measured(extra)
        self._count(step)
        self.draft.observe(step.draft_token_s, step.first_token_s)
        if self.owns_target:
            self.target.observe(step.n_drafted + 1, step.verify_s)
        self.overhead = running_mean(self.overhead, step.overhead_s, self.ema)

    def _count(self, step: StepOutcome) -> None:
        if step.n_drafted and step.acceptance is not None:
            self.acceptance.count_expected(step.acceptance)
        elif step.n_drafted:
            self.acceptance.count(step.n_drafted, step.n_accepted)
        else:
            self.acceptance.age()

    def snapshot(self, limit: int | None = None) -> AdaptiveSnapshot:
        k, _ = self.expected(self.cap if limit is None else limit)
        return AdaptiveSnapshot(
            alpha=tuple(self.alphas()), draft_ms_per_token=None if self.t_draft is None else self.t_draft * 1e3,
            first_draft_ms=None if self.t_first is None else self.t_first * 1e3,
            verify_ms={b: v * 1e3 for b, v in sorted(self.v_mean.items())}, overhead_ms=self.overhead * 1e3,
            n_ctx=self.n_ctx, n_calibrations=self.n_calibrations,
            best_k=k, n_plain_steps=self.n_plain_steps, n_probes=self.n_probes)
