"""Adaptive draft length: choose each step's k to maximise expected tokens per second.

Online estimates (all from the running generation): the conditional acceptance at each draft position
(decayed counts, each position shrunk towards the one before it and never below the pooled rate), the
draft's cost (its first token, which also pays the catch-up on the last step's accepted tokens, and each
further token), and the verify cost as a function of batch size (per-size running means; for sizes not
yet seen a least-squares line through the measured batches, b = 1 apart: a single-token decode runs other
kernels, so its cost says little about a batch's slope).
Expected tokens of a step with k drafted = 1 + Σ_j Π_{i≤j} α_i (BRIEF.md's (1−α^(k+1))/(1−α) with one
α per position); its time = t_first + (k−1)·t_draft + V(k+1) + overhead. k = 0 is plain decoding; while
it wins, a short probe runs every `probe_interval` steps (doubling while probes keep failing) to come back.

Costs depend on the context: at thousands of tokens attention dominates, a draft of the target's architecture
costs nearly what the target does, and a batched verify grows with the batch (each row attends to the whole
context). So the cost estimates are kept per context band (`ctx_band`: bands √2 apart), the caller says where
the generation is (`at(n)`), and a band with no measurement yet is priced from a calibration at the start of
the generation (`calibrate`: one target and one draft token, and target batches of 2 and 5 tokens, timed at that
context) and from the nearest band
that has measurements, its batch verifies shifted by the extra attention of each row. Acceptance is shared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

DEFAULT_HORIZON = 128  # tokens a generation is taken to have left when it has no n_predict (ExploreBudget)
SHORT_CTX = 384  # contexts below this share one band: attention is a small part of a step there
CALIBRATION_BATCHES = (5, 2)  # verify sizes timed in a prefill at a new context: two points give V(b)'s line
THIN_STEP_COST = 3.0  # while evidence is thin, a step may cost at most this many plain steps (AdaptiveDraft.reach)
REACH_STEP = 2  # past the deepest position tried, a dear draft grows this many positions a step (AdaptiveDraft.reach)
WINDOW_MARGIN = 0.05  # a draft window is taken only where it is expected to be this much faster (window_pays)


def ctx_band(n_ctx: int) -> int:
    """The context band of a step at `n_ctx` tokens: 0 below SHORT_CTX, then one band per factor √2."""
    return 0 if n_ctx < SHORT_CTX else 1 + int(2 * math.log2(n_ctx / SHORT_CTX))


@dataclass
class _Costs:
    """Measured costs in one context band (running means, seconds)."""

    t_draft: float | None = None  # per drafted token after the first
    t_first: float | None = None  # to the first drafted token (catch-up included)
    v_mean: dict[int, float] = field(default_factory=dict)  # verify batch size → running mean
    line: tuple[float, float] | None = None  # (intercept, slope) of V(b) over the measured batches
    ctx_one: float = 0.0  # the mean context of the single-token verifies measured
    t_catchup: float | None = None  # per token of a long catch-up (tokens decoded while another drafted)


@dataclass
class ExploreBudget:
    """What probes may cost: at most `share` of the decoding time (what went so far, and what plain decoding
    would take for the tokens still to come), beyond what plain decoding would have taken for the tokens the
    probes emitted. A probe runs only where its predicted extra fits what is left, and its measured extra is then
    booked (a probe that gains pays back). So exploring for a better draft makes a generation at most about
    `share` slower than plain decoding, whatever the pair and the context."""

    share: float = 0.03
    elapsed_s: float = 0.0  # every step's time
    spent_s: float = 0.0  # the probes' measured extra over plain decoding (negative: they gained)
    n_refused: int = 0  # probes not run because their predicted extra did not fit

    def allows(self, predicted_extra_s: float, plain_s: float, remaining: int) -> bool:
        """Whether a probe expected to cost predicted_extra_s more than plain decoding fits, with `remaining`
        tokens still to generate at plain_s each."""
        if predicted_extra_s <= 0 or \
                self.spent_s + predicted_extra_s <= self.share * (self.elapsed_s + remaining * plain_s):
            return True
        self.n_refused += 1
        return False


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


def best_draft_length(alphas, t_draft: float, verify_s, overhead: float = 0.0,
                      t_first: float | None = None, per_token: float = 0.0) -> tuple[int, float]:
    """(k, tokens/s) maximising E(k)/T(k) over k = 0..len(alphas); alphas are conditional per position.

    A step drafting k tokens costs t_first + (k-1)·t_draft of drafting (t_first defaults to t_draft), and
    per_token for each token it emits (what another drafter will pay to catch up on them)."""
    first = t_draft if t_first is None else t_first
    best_k, best = 0, 1.0 / (verify_s(1) + overhead + per_token)
    tokens, prod = 1.0, 1.0
    for k, a in enumerate(alphas, start=1):
        prod *= a
        if prod < 1e-4:
            break
        tokens += prod
        rate = tokens / (first + (k - 1) * t_draft + verify_s(k + 1) + overhead + per_token * tokens)
        if rate > best:
            best_k, best = k, rate
    return best_k, best


def window_pays(agree_whole: tuple[int, int], agree_window: tuple[int, int], t_whole: float, t_window: float,
                verify_s, overhead: float, cap: int, margin: float = WINDOW_MARGIN) -> bool:
    """Whether a draft that sees a window of recent tokens beats one that sees the whole context: each side's
    acceptance from its greedy agreement with the target on the same prompt rows ((agreeing, rows), smoothed
    towards 1/2), its cost per drafted token as timed at the context it would see, and the best draft length on
    those (best_draft_length, one verify model for both). The window must win by `margin`: it is a change of
    drafter on thin evidence, and acceptance lost to a window shows only later."""
    return window_pays_at((agree_whole[0] + 1.0) / (agree_whole[1] + 2.0),
                          (agree_window[0] + 1.0) / (agree_window[1] + 2.0), t_whole, t_window, verify_s, overhead,
                          cap, margin)


def window_pays_at(alpha_whole: float, alpha_window: float, t_whole: float, t_window: float, verify_s,
                   overhead: float, cap: int, margin: float = WINDOW_MARGIN) -> bool:
    """window_pays on acceptances already estimated (paired_acceptance)."""
    def rate(alpha: float, t: float) -> float:
        return best_draft_length([alpha] * cap, t, verify_s, overhead)[1]
    return rate(alpha_window, t_window) > (1.0 + margin) * rate(alpha_whole, t_whole)


def paired_acceptance(whole_ok, window_ok) -> tuple[float, float]:
    """(whole context's, window's) acceptance from their greedy agreement with the target on the same rows
    (boolean arrays, row for row): the rate both share (smoothed towards 1/2), split by the difference between
    them as far as it stands above its own noise. Of b rows only the whole context got right and c only the
    window did, the difference (b - c)/n has a variance of about (b + c)/n², so it is scaled by
    max(0, 1 - (b + c)/(b - c)²) (positive-part James-Stein): 27 against 25 agreeing rows of 32 is mostly noise,
    and the i.i.d. model of acceptance would otherwise turn those two rows into a verdict."""
    whole_ok, window_ok = np.asarray(whole_ok, dtype=bool), np.asarray(window_ok, dtype=bool)
    n = len(whole_ok)
    shared = (int(whole_ok.sum()) + int(window_ok.sum()) + 2.0) / (2.0 * n + 4.0)
    b = int(np.count_nonzero(whole_ok & ~window_ok))
    c = int(np.count_nonzero(window_ok & ~whole_ok))
    if b == c:
        return shared, shared
    diff = (b - c) / n * max(0.0, 1.0 - (b + c) / (b - c) ** 2)
    return min(shared + diff / 2, 1.0), max(shared - diff / 2, 0.0)


class AdaptiveDraft:
    def __init__(self, cap: int, cost_ratio_prior: float = 0.2, decay: float = 0.92, prior_weight: float = 4.0,
                 probe_min: int = 16, probe_max: int = 64, probe_k: int = 1, ema: float = 0.2,
                 probe_budget: float = 0.02, alpha_prior: float = 0.75, attention_prior: float = 0.0,
                 min_evidence: float = 6.0):
        """`attention_prior`: the target's attention arithmetic per token of context as a share of its weights'
        (_ffi.Model.attention_per_context_token): what a step's cost grows by with the context, until measured.
        `min_evidence`: until position 1 has been tried this many times (decayed counts), plain decoding is not
        a verdict: a one-token probe runs every other step (spaced out when the probes cost more than they
        gain), so that a few unlucky first drafts (or a noisy first reading of a cost) cannot stop drafting for
        a whole answer."""
        self.cap = cap
        self.attention_prior = attention_prior
        self.decay = decay
        self.w = prior_weight
        # Before any step: a vocabulary-aligned draft usually agrees on most tokens, so start drafting a
        # few; two pseudo-observations, so the first steps' outcomes take over at once.
        self.alpha_prior = alpha_prior
        self.succ = [0.0] * cap
        self.trials = [0.0] * cap
        self.ratio_prior = cost_ratio_prior
        self.bands: dict[int, _Costs] = {}
        self.n_ctx = 0
        self.remaining = DEFAULT_HORIZON  # tokens the generation may still emit (at's)
        self._c = self._band(0)  # the costs of the current context band
        self.n_calibrations = 0
        self.n_batch_calibrations = 0
        self.overhead = 0.0
        self.ema = ema
        self.probe_min, self.probe_max, self.probe_k = probe_min, probe_max, probe_k
        self.probe_interval = probe_min
        self.probe_budget = probe_budget  # probes may cost at most this share of plain decoding time
        self.min_evidence = min_evidence
        self.thin_budget = 0.05  # what the frequent probes of thin evidence may cost, a share of plain decoding
        self.thin_gap = 1  # plain steps between them
        self.budget = ExploreBudget()  # what probes may cost in all
        self.books_time = True  # whether observe books each step's time in `budget` (not where it is shared)
        self._probing = False
        self.plain_streak = 0
        self.n_plain_steps = 0
        self.n_probes = 0
        self.n_catchups = 0  # long catch-ups measured (catchup_s)
        self.n_seeds = 0  # prompts whose agreement seeded the acceptance prior (seed_acceptance)
        self.n_reach_limited = 0  # choices shortened by reach (thin evidence, a dear step)

    # -- context ----------------------------------------------------------------------------------
    def _band(self, band: int) -> _Costs:
        return self.bands.setdefault(band, _Costs())

    def at(self, n_ctx: int, remaining: int | None = None) -> None:
        """The next steps run at a context of n_ctx tokens, with `remaining` tokens left to generate (None: not
        known, DEFAULT_HORIZON)."""
        self.n_ctx = n_ctx
        self.remaining = DEFAULT_HORIZON if remaining is None else remaining
        self._c = self._band(ctx_band(n_ctx))

    def _measured(self, n_ctx: int, with_draft: bool) -> bool:
        c = self.bands.get(ctx_band(n_ctx))
        return c is not None and 1 in c.v_mean and (not with_draft or c.t_first is not None)

    def calibration_points(self, first: int, last: int, with_draft: bool) -> list[tuple[int, int]]:
        """Spans (position, n_tokens) of a prefill over first..last-1 worth decoding alone and timing, when the
        context band of last-1 has no measurement yet: the last-but-one token alone, and just before it the
        batches of CALIBRATION_BATCHES tokens (what a verify of that size costs at this context: a batch pays
        attention once per row, which the single token cannot tell); then the first token as well when it lies
        in another unmeasured band (two contexts give attention's share of a token's cost)."""
        if last - first < 2 or self._measured(last - 1, with_draft):
            return []
        spans, start = [(last - 1, 1)], last - 1
        for b in CALIBRATION_BATCHES:
            if start - b > first:
                start -= b
                spans.append((start, b))
        if ctx_band(first) != ctx_band(last - 1) and not self._measured(first, with_draft) and \
                not any(1 in c.v_mean for c in self.bands.values()) and first < start:
            spans.append((first, 1))
        return sorted(spans)

    def calibrate(self, n_ctx: int, target_s: float, draft_token_s: float | None, n_tokens: int = 1) -> None:
        """Seed n_ctx's band with a target decode of n_tokens (one token, or a batch priced as a verify of that
        size) and, for a single token, one draft token timed at that context."""
        c = self._band(ctx_band(n_ctx))
        if n_tokens > 1:
            if n_tokens not in c.v_mean:
                c.v_mean[n_tokens] = target_s
                self._refit(c)
            self.n_batch_calibrations += 1
            return
        if 1 not in c.v_mean:
            c.v_mean[1], c.ctx_one = target_s, n_ctx
        if draft_token_s is not None and c.t_first is None:
            c.t_first = draft_token_s
        self.n_calibrations += 1

    def _nearest(self, has) -> _Costs | None:
        """The band closest to the current one with `has(costs)` true (the lower one on a tie)."""
        here = ctx_band(self.n_ctx)
        found = sorted((abs(b - here), b) for b, c in self.bands.items() if has(c))
        return self.bands[found[0][1]] if found else None

    # Backwards-compatible views of the current band (tune, tests).
    @property
    def t_draft(self) -> float | None:
        return self._c.t_draft

    @property
    def t_first(self) -> float | None:
        return self._c.t_first

    @property
    def v_mean(self) -> dict[int, float]:
        return self._c.v_mean

    # -- estimates ------------------------------------------------------------------------------
    def alphas(self) -> list[float]:
        # Position 1 shrinks to the pooled rate; each later one to its predecessor's estimate (the
        # conditional rate after j accepted tokens rarely falls with j), so positions never tried inherit it,
        # but never to less than the pooled rate: one early rejection far out must not keep drafts short.
        pooled = (sum(self.succ) + 2.0 * self.alpha_prior) / (sum(self.trials) + 2.0)
        prev, out = pooled, []
        for s, t in zip(self.succ, self.trials):
            prev = (s + self.w * max(prev, pooled)) / (t + self.w)
            out.append(prev)
        return out

    def verify_one_s(self) -> float:
        """A single-token decode at the current context: measured here, else in the nearest band."""
        c = self._c if 1 in self._c.v_mean else self._nearest(lambda c: 1 in c.v_mean)
        if c is not None:
            return c.v_mean[1]
        c = self._nearest(lambda c: bool(c.v_mean))
        return min(c.v_mean.values()) if c is not None else 1.0

    def verify_s(self, b: int) -> float:
        # A single-token decode runs other kernels than a batch, so b = 1 stands alone; sizes not measured
        # yet come from a line through the measured batches (flat from one: optimistic, so it gets tried).
        # Verifying more tokens never costs less than one: a noisy reading must not make drafting look free.
        one = self.verify_one_s()
        if b == 1:
            return one
        c = self._c
        if any(bb > 1 for bb in c.v_mean):
            return max(self._batch_s(c, b), one)
        near = self._nearest(lambda c: any(bb > 1 for bb in c.v_mean))
        if near is not None:
            # Another context band: each of the b rows attends to the context, so a batch grows by b times
            # the single token's change between the two contexts (an upper bound: rows share the reads).
            shift = b * (one - near.v_mean[1]) if 1 in near.v_mean else 0.0
            return max(self._batch_s(near, b) + shift, one)
        # No batch measured anywhere: flat from one token (optimistic, so that drafting gets tried), plus the
        # attention of each extra row, from single tokens timed at two contexts.
        return one + (b - 1) * self._attention_s()

    def _attention_s(self) -> float:
        """Attention's share of a single-token decode at the current context: from the change in its cost since
        the nearest band measured at a different context (linear in the context), else from the arithmetic
        (attention_prior)."""
        c = self._c
        one = self.verify_one_s()
        other = self._nearest(lambda o: o is not c and 1 in o.v_mean and abs(o.ctx_one - c.ctx_one) >= 1)
        if 1 not in c.v_mean or other is None:
            grow = self.attention_prior * self.n_ctx
            return one * grow / (1.0 + grow)
        slope = (c.v_mean[1] - other.v_mean[1]) / (c.ctx_one - other.ctx_one)
        return min(max(slope, 0.0) * self.n_ctx, one)

    @staticmethod
    def _batch_s(c: _Costs, b: int) -> float:
        v = c.v_mean.get(b)
        if v is not None:
            return v
        if c.line is None:
            return min(x for bb, x in c.v_mean.items() if bb > 1)
        a, s = c.line
        return max(a + s * b, 1e-9)

    def draft_s(self) -> float:
        """Seconds per drafted token after the first."""
        c = self._c
        if c.t_draft is None and c.t_first is None:
            c = self._nearest(lambda c: c.t_draft is not None or c.t_first is not None)
            if c is None:
                return self.ratio_prior * self.verify_one_s()
        return c.t_draft if c.t_draft is not None else c.t_first

    def first_s(self) -> float:
        """Seconds to the first drafted token of a step."""
        c = self._c if self._c.t_first is not None else self._nearest(lambda c: c.t_first is not None)
        if c is None or (c is not self._c and self._c.t_draft is not None):
            return self.draft_s()
        return c.t_first

    def catchup_s(self) -> float:
        """Seconds per token of a long catch-up: what each token emitted while another drafter (or plain
        decoding) ran costs this drafter when it drafts next. Measured at this context (else the nearest), else
        the first token's cost scaled as the target's batches grow: one more row's share of a single token."""
        c = self._c if self._c.t_catchup is not None else self._nearest(lambda c: c.t_catchup is not None)
        if c is not None:
            return c.t_catchup
        one = self.verify_one_s()
        row = (self.verify_s(5) - self.verify_s(2)) / 3.0
        return self.first_s() * min(max(row / one, 0.0), 1.0)

    def draft_cost_changed(self, t_token: float) -> None:
        """The drafter now costs t_token a token at the current context (a draft window was taken): what was
        measured before, at every context, priced a draft that saw more."""
        for c in self.bands.values():
            c.t_draft = c.t_first = c.t_catchup = None
        self._c.t_first = self._c.t_draft = t_token

    def memory_replaced(self, t_token: float, agreement: tuple[int, int]) -> None:
        """The drafter drafts from another memory again (a draft window given up for the whole context): its
        cost is t_token a token at the current context (draft_cost_changed), and the acceptance measured since
        the change was the other memory's: it is forgotten, and `agreement` ((agreeing, rows) of the memory now
        used, on the target's choices) seeds the prior instead."""
        self.draft_cost_changed(t_token)
        self.succ = [0.0] * self.cap
        self.trials = [0.0] * self.cap
        self.seed_acceptance(*agreement)

    def wants_agreement(self) -> bool:
        """Whether prompt agreement would inform the next choice (seed_acceptance): while evidence is thin."""
        return self.thin_evidence()

    def seed_acceptance(self, n_agree: int, n: int) -> None:
        """Evidence from the prompt before a draft was tried: of n prompt positions, n_agree where the drafter's
        greedy choice equals the target's (teacher-forced acceptance). It moves the acceptance prior, which
        the steps' own outcomes then outweigh; a pair that agrees drafts from the first step even where
        drafting pays only at high acceptance (long context, a draft nearly as dear as the target)."""
        if n > 0:
            self.alpha_prior = (n_agree + 2.0 * self.alpha_prior) / (n + 2.0)
            self.n_seeds += 1

    def expected(self, limit: int) -> tuple[int, float]:
        """(best k ≤ limit, its expected tokens per second)."""
        return best_draft_length(self.alphas()[:limit], self.draft_s(), self.verify_s, self.overhead,
                                 self.first_s())

    # -- decisions ------------------------------------------------------------------------------
    def choose(self, limit: int) -> int:
        """Draft length for the next step, at most `limit` (context / n_predict room)."""
        if limit <= 0:
            return 0
        k, _ = self.expected(self.reach(min(limit, self.cap), self.overhead))
        if k > 0:
            self.plain_streak = 0
            self.probe_interval = self.probe_min
            return k
        self.plain_streak += 1
        thin = self.thin_evidence()
        if self.plain_streak > (self.thin_gap if thin else self.probe_interval) and \
                self._could_pay(min(limit, self.cap)) and self._may_probe(self.plain_streak):
            self.plain_streak = 0
            if not thin:
                self.probe_interval = min(2 * self.probe_interval, self.probe_max)
            self.n_probes += 1
            self._probing = True
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
            tried = max((i + 1 for i, t in enumerate(self.trials) if t >= 0.5), default=0)
            k = max(k, min(limit, tried + REACH_STEP))
        if k < limit:
            self.n_reach_limited += 1
        return k

    def thin_evidence(self) -> bool:
        """Whether too few drafts were tried yet for plain decoding to be a verdict (see min_evidence)."""
        return self.trials[0] < self.min_evidence

    def _could_pay(self, limit: int) -> bool:
        """Whether drafting could beat plain decoding even at perfect acceptance, with the measured costs."""
        return best_draft_length([1.0] * limit, self.draft_s(), self.verify_s, self.overhead, self.first_s())[0] > 0

    def _may_probe(self, behind: int) -> bool:
        """Whether the exploration budget has room for a probe now (ExploreBudget)."""
        return self.budget.allows(self.probe_extra_s(behind), self.verify_s(1) + self.overhead, self.remaining)

    def probe_extra_s(self, behind: int) -> float:
        """What a probe is expected to cost beyond plain decoding: catching up on the `behind` tokens decoded
        without this drafter, its probe_k tokens and their verify, less the plain steps its expected tokens save.
        At long context a one-token probe loses even when accepted (a 2-token verify can cost 1.5 single ones)."""
        plain = self.verify_s(1) + self.overhead
        k = self.probe_k
        tokens, prod = 1.0, 1.0
        for a in self.alphas()[:k]:
            prod *= a
            tokens += prod
        return (self.first_s() + (k - 1) * self.draft_s() + max(behind - 1, 0) * self.catchup_s()
                + self.verify_s(k + 1) + self.overhead - tokens * plain)

    def observe(self, n_drafted: int, n_accepted: int, draft_token_s: float | None, verify_s: float,
                overhead_s: float, draft_s: float | None = None, first_token_s: float | None = None,
                catchup: tuple[int, float] | None = None) -> None:
        """Record one step: `draft_token_s` is the measured seconds per drafted token after the first and
        `first_token_s` the seconds to the first (None: not measured cleanly); `draft_s` the step's whole
        drafting time (with the draft's catch-up after plain steps); `catchup`: (n tokens, seconds) of a long
        catch-up and the first drafted token together (the first token's own cost is taken off)."""
        if catchup is not None and catchup[0] > 2:
            n, sec = catchup
            c = self._c
            c.t_catchup = self._mean(c.t_catchup, max(sec - self.first_s(), 0.0) / (n - 1))
            self.n_catchups += 1
        if self.books_time:
            self.budget.elapsed_s += (draft_s or 0.0) + verify_s + overhead_s
        if self._probing:
            # A probe after a plain stretch also pays the draft's catch-up: space probes so that their
            # extra cost stays within probe_budget of plain decoding.
            self._probing = False
            plain = self.verify_s(1) + self.overhead
            extra = ((draft_s or 0.0) + verify_s + overhead_s) / plain - 1.0 - n_accepted
            self.budget.spent_s += extra * plain
            if extra > 0:
                self.probe_interval = max(self.probe_interval, int(extra / self.probe_budget))
            # while evidence is thin, probes come every other step as long as they pay for themselves, and are
            # spaced within thin_budget of plain decoding when they cost (a dear draft at long context)
            self.thin_gap = max(1, int(extra / self.thin_budget)) if extra > 0 else 1
        if n_drafted:
            d = self.decay
            self.succ = [x * d for x in self.succ]
            self.trials = [x * d for x in self.trials]
            for i in range(min(n_accepted, self.cap)):
                self.succ[i] += 1.0
                self.trials[i] += 1.0
            if n_accepted < n_drafted:
                self.trials[n_accepted] += 1.0
        c = self._c
        if draft_token_s is not None:
            c.t_draft = self._mean(c.t_draft, draft_token_s)
        if first_token_s is not None:
            c.t_first = self._mean(c.t_first, first_token_s)
        b = n_drafted + 1
        if b == 1:
            c.ctx_one = self._mean(c.ctx_one if 1 in c.v_mean else None, float(self.n_ctx))
        c.v_mean[b] = self._mean(c.v_mean.get(b), verify_s)
        self.overhead += self.ema * (overhead_s - self.overhead)
        if b > 1:
            self._refit(c)

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.ema * (new - old)

    @staticmethod
    def _refit(c: _Costs) -> None:
        pts = [(b, v) for b, v in c.v_mean.items() if b > 1]
        if len(pts) < 2:
            c.line = None
            return
        mx, my = sum(b for b, _ in pts) / len(pts), sum(v for _, v in pts) / len(pts)
        sxx = sum((b - mx) ** 2 for b, _ in pts)
        slope = max(sum((b - mx) * (v - my) for b, v in pts) / sxx, 0.0)
        c.line = (my - slope * mx, slope)

    def snapshot(self, limit: int | None = None) -> AdaptiveSnapshot:
        k, _ = self.expected(self.cap if limit is None else limit)
        return AdaptiveSnapshot(
            alpha=tuple(self.alphas()), draft_ms_per_token=None if self.t_draft is None else self.t_draft * 1e3,
            first_draft_ms=None if self.t_first is None else self.t_first * 1e3,
            verify_ms={b: v * 1e3 for b, v in sorted(self.v_mean.items())}, overhead_ms=self.overhead * 1e3,
            n_ctx=self.n_ctx, n_calibrations=self.n_calibrations,
            best_k=k, n_plain_steps=self.n_plain_steps, n_probes=self.n_probes)


class AdaptiveDrafters:
    """--drafter auto: each step, the drafter (or plain decoding) and the length with the most expected tokens
    per second. One AdaptiveDraft per drafter holds its acceptance by position and its drafting costs; a shared
    one holds what every step measures alike, the verify cost by batch size and the per-step overhead. While
    plain decoding wins, a short probe of the drafter tried least recently runs every `probe_interval` steps
    (doubling while probes keep failing), so that a drafter whose estimate went stale can come back."""

    def __init__(self, cap: int, cost_ratio_priors: dict[str, float], probe_min: int = 16, probe_max: int = 64,
                 probe_k: int = 1, **kw):
        self.cap = cap
        self.shared = AdaptiveDraft(cap, **kw)
        self.per: dict[str, AdaptiveDraft] = {}
        for name, ratio in cost_ratio_priors.items():
            c = AdaptiveDraft(cap, cost_ratio_prior=ratio, **kw)
            # one verify model: the target's cost does not depend on the drafter
            c.verify_s, c.verify_one_s = self.shared.verify_s, self.shared.verify_one_s
            c.budget, c.books_time = self.shared.budget, False  # one account for all probes; shared books time
            self.per[name] = c
        self.probe_min, self.probe_max, self.probe_k = probe_min, probe_max, probe_k
        self.probe_interval = probe_min
        self.plain_streak = 0
        self.n_plain_steps = 0
        self.n_probes = 0
        self.last_used = {name: 0 for name in self.per}
        self.explore_interval = {name: probe_min for name in self.per}  # see _explore
        self.n_steps = 0
        self.n_chosen = {name: 0 for name in self.per}
        self.n_charged = 0  # steps chosen with a drafter's catch-up charged to the others (see choose)

    def at(self, n_ctx: int, remaining: int | None = None) -> None:
        """The next steps run at a context of n_ctx tokens (AdaptiveDraft.at, for every drafter)."""
        for c in (self.shared, *self.per.values()):
            c.at(n_ctx, remaining)

    def calibration_points(self, first: int, last: int, with_draft: bool) -> list[tuple[int, int]]:
        return self.shared.calibration_points(first, last, with_draft)

    def calibrate(self, n_ctx: int, target_s: float, draft_token_s: float | None, n_tokens: int = 1) -> None:
        """A prefill's timing at n_ctx: the target's for all, the draft model's for its drafter."""
        self.shared.calibrate(n_ctx, target_s, None, n_tokens)
        if draft_token_s is not None and "model" in self.per:
            self.per["model"].calibrate(n_ctx, target_s, draft_token_s)

    def wants_agreement(self) -> bool:
        """Whether the draft model's prompt agreement would inform the next choice (AdaptiveDraft's)."""
        return "model" in self.per and self.per["model"].wants_agreement()

    def seed_acceptance(self, n_agree: int, n: int) -> None:
        """The draft model's prompt agreement (AdaptiveDraft.seed_acceptance)."""
        self.per["model"].seed_acceptance(n_agree, n)

    @property
    def n_seeds(self) -> int:
        return self.per["model"].n_seeds if "model" in self.per else 0

    @property
    def n_calibrations(self) -> int:
        return self.shared.n_calibrations

    @property
    def n_batch_calibrations(self) -> int:
        return self.shared.n_batch_calibrations

    def choose(self, limits: dict[str, int]) -> tuple[str | None, int]:
        """(drafter, draft length) for the next step, or (None, 0) for plain decoding; limits: the most each
        available drafter may draft now (an n-gram proposal is only as long as what followed its match).

        A drafter with a memory of the text (a draft model, an MTP head) must later decode every token emitted
        without it: while it would beat plain decoding, each token another drafter or plain decoding emits is
        charged its catch-up cost (catchup_s), so that a cheap n-gram step is not taken for free when it only
        moves work to the model's next step."""
        self.n_steps += 1
        sh = self.shared
        own = {}  # each drafter's best (k, rate) on its own costs
        for name, limit in limits.items():
            if limit > 0:
                c = self.per[name]
                own[name] = best_draft_length(c.alphas()[:c.reach(min(limit, self.cap), sh.overhead)],
                                              c.draft_s(), sh.verify_s, sh.overhead, c.first_s())
        plain = 1.0 / (sh.verify_s(1) + sh.overhead)
        # the drafters that would be used (they beat plain decoding) and keep a memory to catch up
        keep = {n: self.per[n].catchup_s() for n, (k, r) in own.items() if k > 0 and r > plain and n != "ngram"}
        best, best_k, best_rate = None, 0, 1.0 / (sh.verify_s(1) + sh.overhead + sum(keep.values()))
        for name, (k, rate) in own.items():
            charge = sum(v for n, v in keep.items() if n != name)
            if charge > 0 and k > 0:
                c = self.per[name]
                k, rate = best_draft_length(c.alphas()[:c.reach(min(limits[name], self.cap), sh.overhead)],
                                            c.draft_s(), sh.verify_s, sh.overhead, c.first_s(), per_token=charge)
            if k > 0 and rate > best_rate:
                best, best_k, best_rate = name, k, rate
        if keep:
            self.n_charged += 1
        if best is not None:
            self.plain_streak = 0
            self.probe_interval = self.probe_min
            self.explore_interval[best] = self.probe_min
            self.per[best].probe_interval = self.probe_min
            other = self._explore(best, limits)
            if other is not None:
                c = self.per[other]
                lim = min(limits[other], self.cap)
                k, _ = best_draft_length(c.alphas()[:c.reach(lim, sh.overhead)], c.draft_s(), sh.verify_s,
                                         sh.overhead, c.first_s())
                self.n_probes += 1
                return self._use(other), max(k, min(self.probe_k, lim))
            return self._use(best), best_k
        self.plain_streak += 1
        # a drafter tried too few times yet is probed every other step while the probes pay for themselves, and
        # spaced by their measured cost when they do not (AdaptiveDraft.min_evidence, thin_gap); the others every
        # probe_interval steps (or the drafter's own, longer when its probes cost more than probe_budget)
        due = [n for n, lim in limits.items() if lim > 0 and self.per[n]._could_pay(min(lim, self.cap))
               and self.plain_streak > (self.per[n].thin_gap if self.per[n].thin_evidence()
                                        else max(self.probe_interval, self.per[n].probe_interval))
               and self.per[n]._may_probe(self.n_steps - self.last_used[n])]
        if due:
            self.plain_streak = 0
            name = min(due, key=lambda n: self.last_used[n])
            if not self.per[name].thin_evidence():
                self.probe_interval = min(2 * self.probe_interval, self.probe_max)
            self.per[name]._probing = True
            self.n_probes += 1
            return self._use(name), min(self.probe_k, limits[name], self.cap)
        self.n_plain_steps += 1
        return None, 0

    def _explore(self, best: str, limits: dict[str, int]) -> str | None:
        """Another drafter to try this step instead of the best one, so that a drafter's estimate is not
        frozen by one unlucky try while another wins every step (the text may change: a prompt to copy from
        makes n-grams pay): one with a proposal now that was tried too few times yet (every other step), or
        one not used for its exploration interval, which doubles up to probe_max while it keeps losing."""
        for name, lim in limits.items():
            if name == best or lim <= 0:
                continue
            c = self.per[name]
            since = self.n_steps - self.last_used[name]
            due = since >= 2 if c.thin_evidence() else since > self.explore_interval[name]
            if due and c._could_pay(min(lim, self.cap)):
                if not c.thin_evidence():
                    self.explore_interval[name] = min(2 * self.explore_interval[name], self.probe_max)
                return name
        return None

    def _use(self, name: str) -> str:
        self.last_used[name] = self.n_steps
        self.n_chosen[name] += 1
        return name

    def observe(self, drafter: str | None, n_drafted: int, n_accepted: int, draft_token_s: float | None,
                verify_s: float, overhead_s: float, draft_s: float | None = None,
                first_token_s: float | None = None, catchup: tuple[int, float] | None = None) -> None:
        """Record one step (drafter None: plain decoding); the arguments as AdaptiveDraft.observe's."""
        self.shared.observe(n_drafted, n_accepted, None, verify_s, overhead_s, draft_s)
        if drafter is not None and n_drafted:
            self.per[drafter].observe(n_drafted, n_accepted, draft_token_s, verify_s, overhead_s, draft_s,
                                      first_token_s, catchup)

    def snapshot(self, limit: int | None = None) -> AdaptiveSnapshot:
        """The snapshot of the drafter chosen most often (costs and plain steps as measured for all)."""
        name = max(self.n_chosen, key=lambda n: self.n_chosen[n]) if self.per else None
        snap = (self.per[name] if name else self.shared).snapshot(limit)
        return replace(snap, verify_ms={b: v * 1e3 for b, v in sorted(self.shared.v_mean.items())},
                       overhead_ms=self.shared.overhead * 1e3, n_calibrations=self.shared.n_calibrations,
                       n_plain_steps=self.n_plain_steps, n_probes=self.n_probes)
