"""The controllers' cost model, by context band: the target's (a verify pass by batch size; TargetCosts, shared
by reference by every drafter's controller: the target's cost does not depend on the drafter) and a drafter's
own (its first drafted token, each further one, and a long catch-up; DraftCosts, one per drafter).

Costs depend on the context: at thousands of tokens attention dominates, a draft of the target's architecture
costs nearly what the target does, and a batched verify grows with the batch (each row attends to the whole
context). So the estimates are kept per context band (`ctx_band`: bands √2 apart), the caller says where the
generation is (`at(n)`), and a band with no measurement yet is priced from a calibration at the start of the
generation (one target and one draft token, and target batches of CALIBRATION_BATCHES tokens, timed at that
context) and from the nearest band that has measurements, its batch verifies shifted by the extra attention of
each row. All estimates are running means (weight `ema` on each new reading).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Generic, TypeVar

SHORT_CTX = 384  # contexts below this share one band: attention is a small part of a step there
CALIBRATION_BATCHES = (5, 2)  # verify sizes timed in a prefill at a new context: two points give V(b)'s line
VERIFY_DECAY = 0.95  # each verify measured in a band decays the weight of every batch size measured before it
RESIDUAL_WEIGHT = 4.0  # a batch size measured this much (decayed) is priced halfway between the line and its mean

B = TypeVar("B")


def ctx_band(n_ctx: int) -> int:
    """The context band of a step at `n_ctx` tokens: 0 below SHORT_CTX, then one band per factor √2."""
    return 0 if n_ctx < SHORT_CTX else 1 + int(2 * math.log2(n_ctx / SHORT_CTX))


def running_mean(old: float | None, new: float, ema: float) -> float:
    return new if old is None else old + ema * (new - old)


class Banded(Generic[B]):
    """Costs kept per context band: the current context's band (`at`) and every band measured so far."""

    def __init__(self, new_band: Callable[[], B]):
        self._new_band = new_band
        self.bands: dict[int, B] = {}
        self.n_ctx = 0
        self.band = self._band(0)  # the current context band's

    def _band(self, band: int) -> B:
        return self.bands.setdefault(band, self._new_band())

    def at(self, n_ctx: int) -> None:
        """The next steps run at a context of n_ctx tokens."""
        self.n_ctx = n_ctx
        self.band = self._band(ctx_band(n_ctx))

    def band_of(self, n_ctx: int) -> B | None:
        """n_ctx's band, where anything was recorded in it."""
        return self.bands.get(ctx_band(n_ctx))

    def nearest(self, has: Callable[[B], bool]) -> B | None:
        """The band closest to the current context's with `has(costs)` true (the lower one on a tie)."""
        here = ctx_band(self.n_ctx)
        found = sorted((abs(b - here), b) for b, c in self.bands.items() if has(c))
        return self.bands[found[0][1]] if found else None


@dataclass
class VerifyBand:
    """The target's measured costs in one context band (running means, seconds). A verify of b > 1 tokens is priced
    on a line through the measured sizes, weighted by how much and how recently each was measured (`weight`), and
    moved towards b's own mean only as far as b's weight carries it: by per-size means alone, one noisy reading of
    a size not chosen again stays, and the sizes that happened to read low keep being chosen."""

    v_mean: dict[int, float] = field(default_factory=dict)  # verify batch size → running mean
    weight: dict[int, float] = field(default_factory=dict)  # batch size → decayed count of its measurements
    line: tuple[float, float] | None = None  # (intercept, slope) of V(b) over the measured batches
    ctx_one: float = 0.0  # the mean context of the single-token verifies measured

    def count(self, b: int) -> None:
        """One more measurement of size b: every size's weight decays, b's grows by one."""
        for size in self.weight:
            self.weight[size] *= VERIFY_DECAY
        self.weight[b] = self.weight.get(b, 0.0) + 1.0

    def refit(self) -> None:
        """The weighted least-squares line through the measured batches (b = 1 apart: other kernels), slope ≥ 0."""
        pts = [(b, v, self.weight.get(b, 1.0)) for b, v in self.v_mean.items() if b > 1]
        if len(pts) < 2:
            self.line = None
            return
        w = sum(x for _, _, x in pts)
        mx, my = sum(b * x for b, _, x in pts) / w, sum(v * x for _, v, x in pts) / w
        sxx = sum(x * (b - mx) ** 2 for b, _, x in pts)
        slope = max(sum(x * (b - mx) * (v - my) for b, v, x in pts) / sxx, 0.0)
        self.line = (my - slope * mx, slope)

    def batch_s(self, b: int) -> float:
        """A verify of b > 1 tokens in this band: on the line, moved towards b's own mean by its weight (else the
        cheapest batch seen, while fewer than two sizes were measured)."""
        v = self.v_mean.get(b)
        if self.line is None:
            return v if v is not None else min(x for bb, x in self.v_mean.items() if bb > 1)
        a, s = self.line
        on_line = max(a + s * b, 1e-9)
        if v is None:
            return on_line
        w = self.weight.get(b, 1.0)
        return on_line + w / (w + RESIDUAL_WEIGHT) * (v - on_line)


class TargetCosts(Banded[VerifyBand]):
    """V(b): what the target's verify pass of b tokens costs at the current context. Per-size running means; for
    sizes not yet seen a least-squares line through the measured batches, b = 1 apart (a single-token decode runs
    other kernels, so its cost says little about a batch's slope). `attention_prior`: the target's attention
    arithmetic per token of context as a share of its weights' (ffi.Model.attention_per_context_token): what a
    step's cost grows by with the context, until measured."""

    def __init__(self, ema: float = 0.2, attention_prior: float = 0.0):
        super().__init__(VerifyBand)
        self.ema = ema
        self.attention_prior = attention_prior
        self._v: dict[int, float] = {}  # V(b) at this context, until the next measurement or context

    def at(self, n_ctx: int) -> None:
        super().at(n_ctx)
        self._v.clear()

    def measured(self, n_ctx: int) -> bool:
        """Whether a single-token decode was measured in n_ctx's band."""
        c = self.band_of(n_ctx)
        return c is not None and 1 in c.v_mean

    def measured_anywhere(self) -> bool:
        return any(1 in c.v_mean for c in self.bands.values())

    def calibrate(self, n_ctx: int, target_s: float, n_tokens: int = 1) -> None:
        """Seed n_ctx's band with a target decode of n_tokens (one token, or a batch priced as a verify of that
        size), where that size was not measured there yet."""
        c = self._band(ctx_band(n_ctx))
        self._v.clear()
        if n_tokens > 1:
            if n_tokens not in c.v_mean:
                c.v_mean[n_tokens] = target_s
                c.count(n_tokens)
                c.refit()
        elif 1 not in c.v_mean:
            c.v_mean[1], c.ctx_one = target_s, n_ctx

    def observe(self, b: int, verify_s: float) -> None:
        """A verify of b tokens took verify_s at the current context."""
        c = self.band
        self._v.clear()
        if b == 1:
            c.ctx_one = running_mean(c.ctx_one if 1 in c.v_mean else None, float(self.n_ctx), self.ema)
        c.v_mean[b] = running_mean(c.v_mean.get(b), verify_s, self.ema)
        if b > 1:
            c.count(b)
            c.refit()

    def verify_one_s(self) -> float:
        """A single-token decode at the current context: measured here, else in the nearest band (computed once
        until the next measurement or context, as verify_s: V(1))."""
        v = self._v.get(1)
        if v is None:
            v = self._v[1] = self._one_s()
        return v

    def _one_s(self) -> float:
        c = self.band if 1 in self.band.v_mean else self.nearest(lambda c: 1 in c.v_mean)
        if c is not None:
            return c.v_mean[1]
        c = self.nearest(lambda c: bool(c.v_mean))
        return min(c.v_mean.values()) if c is not None else 1.0

    def verify_s(self, b: int) -> float:
        """V(b) at the current context (a length choice prices each size many times: computed once)."""
        v = self._v.get(b)
        if v is None:
            v = self._v[b] = self._verify_s(b)
        return v

    def _verify_s(self, b: int) -> float:
        # A single-token decode runs other kernels than a batch, so b = 1 stands alone; sizes not measured
        # yet come from a line through the measured batches (flat from one: optimistic, so it gets tried).
        # Verifying more tokens never costs less than one: a noisy reading must not make drafting look free.
        one = self.verify_one_s()
        if b == 1:
            return one
        c = self.band
        if any(bb > 1 for bb in c.v_mean):
            return max(c.batch_s(b), one)
        near = self.nearest(lambda c: any(bb > 1 for bb in c.v_mean))
        if near is not None:
            # Another context band: each of the b rows attends to the context, so a batch grows by b times
            # the single token's change between the two contexts (an upper bound: rows share the reads).
            shift = b * (one - near.v_mean[1]) if 1 in near.v_mean else 0.0
            return max(near.batch_s(b) + shift, one)
        # No batch measured anywhere: flat from one token (optimistic, so that drafting gets tried), plus the
        # attention of each extra row, from single tokens timed at two contexts.
        return one + (b - 1) * self._attention_s()

    def _attention_s(self) -> float:
        """Attention's share of a single-token decode at the current context: from the change in its cost since
        the nearest band measured at a different context (linear in the context), else from the arithmetic
        (attention_prior)."""
        c = self.band
        one = self.verify_one_s()
        other = self.nearest(lambda o: o is not c and 1 in o.v_mean and abs(o.ctx_one - c.ctx_one) >= 1)
        if 1 not in c.v_mean or other is None:
            grow = self.attention_prior * self.n_ctx
            return one * grow / (1.0 + grow)
        slope = (c.v_mean[1] - other.v_mean[1]) / (c.ctx_one - other.ctx_one)
        return min(max(slope, 0.0) * self.n_ctx, one)


@dataclass
class DraftBand:
    """A drafter's measured costs in one context band (running means, seconds)."""

    t_draft: float | None = None  # per drafted token after the first
    t_first: float | None = None  # to the first drafted token (catch-up included)
    t_catchup: float | None = None  # per token of a long catch-up (tokens decoded while another drafted)


class DraftCosts(Banded[DraftBand]):
    """One drafter's own costs at the current context: its first drafted token (which also pays the catch-up on the
    last step's accepted tokens), each further token, and a long catch-up's per token. Until measured, a token
    costs `ratio_prior` of a target token (`target`: the shared TargetCosts)."""

    def __init__(self, target: TargetCosts, ratio_prior: float, ema: float = 0.2):
        super().__init__(DraftBand)
        self.target = target
        self.ratio_prior = ratio_prior
        self.ema = ema

    def measured(self, n_ctx: int) -> bool:
        """Whether a first drafted token was measured in n_ctx's band."""
        c = self.band_of(n_ctx)
        return c is not None and c.t_first is not None

    def calibrate(self, n_ctx: int, draft_token_s: float) -> None:
        """Seed n_ctx's band with one draft token timed at that context (where none was measured there yet)."""
        c = self._band(ctx_band(n_ctx))
        if c.t_first is None:
            c.t_first = draft_token_s

    def observe(self, draft_token_s: float | None, first_token_s: float | None) -> None:
        """A step's drafting as measured at the current context (None: not measured cleanly)."""
        c = self.band
        if draft_token_s is not None:
            c.t_draft = running_mean(c.t_draft, draft_token_s, self.ema)
        if first_token_s is not None:
            c.t_first = running_mean(c.t_first, first_token_s, self.ema)

    def calibrate_catchup(self, n_ctx: int, n: int, seconds: float) -> None:
        """Seed n_ctx's band with a read of n tokens that took `seconds` (a prompt read: a catch-up without a first
        drafted token), where no catch-up was measured there yet: until then the prior above, scaled from the
        target's batches, missed the demo draft's catch-up by 5x."""
        c = self._band(ctx_band(n_ctx))
        if c.t_catchup is None:
            c.t_catchup = seconds / n

    def observe_catchup(self, n: int, seconds: float) -> None:
        """A long catch-up of n tokens and the first drafted token together took `seconds`."""
        c = self.band
        c.t_catchup = running_mean(c.t_catchup, max(seconds - self.first_s(), 0.0) / (n - 1), self.ema)

    def draft_s(self) -> float:
        """Seconds per drafted token after the first."""
        c = self.band
        if c.t_draft is None and c.t_first is None:
            c = self.nearest(lambda c: c.t_draft is not None or c.t_first is not None)
            if c is None:
                return self.ratio_prior * self.target.verify_one_s()
        return c.t_draft if c.t_draft is not None else c.t_first

    def first_s(self) -> float:
        """Seconds to the first drafted token of a step."""
        here = self.band
        c = here if here.t_first is not None else self.nearest(lambda c: c.t_first is not None)
        if c is None or (c is not here and here.t_draft is not None):
            return self.draft_s()
        return c.t_first

    def catchup_s(self) -> float:
        """Seconds per token of a long catch-up: what each token emitted while another drafter (or plain
        decoding) ran costs this drafter when it drafts next. Measured at this context (else the nearest), else
        the first token's cost scaled as the target's batches grow: one more row's share of a single token."""
        here = self.band
        c = here if here.t_catchup is not None else self.nearest(lambda c: c.t_catchup is not None)
        if c is not None:
            return c.t_catchup
        one = self.target.verify_one_s()
        row = (self.target.verify_s(5) - self.target.verify_s(2)) / 3.0
        return self.first_s() * min(max(row / one, 0.0), 1.0)

    def changed(self, t_token: float) -> None:
        """The drafter now costs t_token a token at the current context: what was measured before, at every
        context, priced another draft."""
        for c in self.bands.values():
            c.t_draft = c.t_first = c.t_catchup = None
        self.band.t_first = self.band.t_draft = t_token


def calibration_points(target: TargetCosts, draft: DraftCosts | None, first: int, last: int) -> list[tuple[int, int]]:
    """Spans (position, n_tokens) of a prefill over first..last-1 worth decoding alone and timing, when the
    context band of last-1 has no measurement yet (of the target, and of `draft` unless None): the last-but-one
    token alone, and just before it the batches of CALIBRATION_BATCHES tokens (what a verify of that size costs at
    this context: a batch pays attention once per row, which the single token cannot tell); then the first token
    as well when it lies in another unmeasured band (two contexts give attention's share of a token's cost)."""
    def measured(n_ctx: int) -> bool:
        return target.measured(n_ctx) and (draft is None or draft.measured(n_ctx))

    if last - first < 2 or measured(last - 1):
        return []
    spans, start = [(last - 1, 1)], last - 1
    for b in CALIBRATION_BATCHES:
        if start - b > first:
            start -= b
            spans.append((start, b))
    if ctx_band(first) != ctx_band(last - 1) and not measured(first) and not target.measured_anywhere() and \
            first < start:
        spans.append((first, 1))
    return sorted(spans)
