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
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdaptiveSnapshot:
    """What the controller believes now (for `specq tune` and stats)."""

    alpha: tuple[float, ...]  # conditional acceptance at positions 1..cap
    draft_ms_per_token: float | None  # each drafted token after the first
    first_draft_ms: float | None  # the first drafted token of a step, the draft's catch-up included
    verify_ms: dict[int, float]  # measured batch size → mean ms
    overhead_ms: float
    best_k: int
    n_plain_steps: int
    n_probes: int


def best_draft_length(alphas, t_draft: float, verify_s, overhead: float = 0.0,
                      t_first: float | None = None) -> tuple[int, float]:
    """(k, tokens/s) maximising E(k)/T(k) over k = 0..len(alphas); alphas are conditional per position.

    A step drafting k tokens costs t_first + (k-1)·t_draft of drafting (t_first defaults to t_draft)."""
    first = t_draft if t_first is None else t_first
    best_k, best = 0, 1.0 / (verify_s(1) + overhead)
    tokens, prod = 1.0, 1.0
    for k, a in enumerate(alphas, start=1):
        prod *= a
        if prod < 1e-4:
            break
        tokens += prod
        rate = tokens / (first + (k - 1) * t_draft + verify_s(k + 1) + overhead)
        if rate > best:
            best_k, best = k, rate
    return best_k, best


class AdaptiveDraft:
    def __init__(self, cap: int, cost_ratio_prior: float = 0.2, decay: float = 0.92, prior_weight: float = 4.0,
                 probe_min: int = 16, probe_max: int = 64, probe_k: int = 1, ema: float = 0.2,
                 probe_budget: float = 0.02, alpha_prior: float = 0.75):
        self.cap = cap
        self.decay = decay
        self.w = prior_weight
        # Before any step: a vocabulary-aligned draft usually agrees on most tokens, so start drafting a
        # few; two pseudo-observations, so the first steps' outcomes take over at once.
        self.alpha_prior = alpha_prior
        self.succ = [0.0] * cap
        self.trials = [0.0] * cap
        self.ratio_prior = cost_ratio_prior
        self.t_draft: float | None = None  # seconds per drafted token after the first
        self.t_first: float | None = None  # seconds to the first drafted token (catch-up included)
        self.v_mean: dict[int, float] = {}  # batch size → running mean of verify seconds
        self.overhead = 0.0
        self.ema = ema
        self.probe_min, self.probe_max, self.probe_k = probe_min, probe_max, probe_k
        self.probe_interval = probe_min
        self.probe_budget = probe_budget  # probes may cost at most this share of plain decoding time
        self._probing = False
        self.plain_streak = 0
        self.n_plain_steps = 0
        self.n_probes = 0
        self._line: tuple[float, float] | None = None  # (intercept, slope) of V(b), refreshed on new data

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

    def verify_s(self, b: int) -> float:
        # A single-token decode runs other kernels than a batch, so b = 1 stands alone; sizes not measured
        # yet come from a line through the measured batches (flat from one: optimistic, so it gets tried).
        # Verifying more tokens never costs less than one: a noisy reading must not make drafting look free.
        one = self.v_mean.get(1)
        floor = one if one is not None and b > 1 else 0.0
        v = self.v_mean.get(b)
        if v is not None:
            return max(v, floor)
        if b == 1:
            return min(self.v_mean.values()) if self.v_mean else 1.0
        if self._line is None:
            batches = [x for bb, x in self.v_mean.items() if bb > 1]
            return max(min(batches) if batches else (one or 1.0), floor)
        a, s = self._line
        return max(a + s * b, floor, 1e-9)

    def draft_s(self) -> float:
        """Seconds per drafted token after the first."""
        if self.t_draft is not None:
            return self.t_draft
        return self.t_first if self.t_first is not None else self.ratio_prior * self.verify_s(1)

    def first_s(self) -> float:
        """Seconds to the first drafted token of a step."""
        return self.t_first if self.t_first is not None else self.draft_s()

    def expected(self, limit: int) -> tuple[int, float]:
        """(best k ≤ limit, its expected tokens per second)."""
        return best_draft_length(self.alphas()[:limit], self.draft_s(), self.verify_s, self.overhead,
                                 self.first_s())

    # -- decisions ------------------------------------------------------------------------------
    def choose(self, limit: int) -> int:
        """Draft length for the next step, at most `limit` (context / n_predict room)."""
        if limit <= 0:
            return 0
        k, _ = self.expected(min(limit, self.cap))
        if k > 0:
            self.plain_streak = 0
            self.probe_interval = self.probe_min
            return k
        self.plain_streak += 1
        if self.plain_streak > self.probe_interval and self._could_pay(min(limit, self.cap)):
            self.plain_streak = 0
            self.probe_interval = min(2 * self.probe_interval, self.probe_max)
            self.n_probes += 1
            self._probing = True
            return min(self.probe_k, limit, self.cap)
        self.n_plain_steps += 1
        return 0

    def _could_pay(self, limit: int) -> bool:
        """Whether drafting could beat plain decoding even at perfect acceptance, with the measured costs."""
        return best_draft_length([1.0] * limit, self.draft_s(), self.verify_s, self.overhead, self.first_s())[0] > 0

    def observe(self, n_drafted: int, n_accepted: int, draft_token_s: float | None, verify_s: float,
                overhead_s: float, draft_s: float | None = None, first_token_s: float | None = None) -> None:
        """Record one step: `draft_token_s` is the measured seconds per drafted token after the first and
        `first_token_s` the seconds to the first (None: not measured cleanly); `draft_s` the step's whole
        drafting time (with the draft's catch-up after plain steps)."""
        if self._probing:
            # A probe after a plain stretch also pays the draft's catch-up: space probes so that their
            # extra cost stays within probe_budget of plain decoding.
            self._probing = False
            plain = self.verify_s(1) + self.overhead
            extra = ((draft_s or 0.0) + verify_s + overhead_s) / plain - 1.0 - n_accepted
            if extra > 0:
                self.probe_interval = max(self.probe_interval, int(extra / self.probe_budget))
        if n_drafted:
            d = self.decay
            self.succ = [x * d for x in self.succ]
            self.trials = [x * d for x in self.trials]
            for i in range(min(n_accepted, self.cap)):
                self.succ[i] += 1.0
                self.trials[i] += 1.0
            if n_accepted < n_drafted:
                self.trials[n_accepted] += 1.0
        if draft_token_s is not None:
            self.t_draft = self._mean(self.t_draft, draft_token_s)
        if first_token_s is not None:
            self.t_first = self._mean(self.t_first, first_token_s)
        b = n_drafted + 1
        old = self.v_mean.get(b)
        self.v_mean[b] = self._mean(old, verify_s)
        self.overhead += self.ema * (overhead_s - self.overhead)
        if b > 1:
            self._refit()

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.ema * (new - old)

    def _refit(self) -> None:
        pts = [(b, v) for b, v in self.v_mean.items() if b > 1]
        if len(pts) < 2:
            self._line = None
            return
        mx, my = sum(b for b, _ in pts) / len(pts), sum(v for _, v in pts) / len(pts)
        sxx = sum((b - mx) ** 2 for b, _ in pts)
        slope = max(sum((b - mx) * (v - my) for b, v in pts) / sxx, 0.0)
        self._line = (my - slope * mx, slope)

    def snapshot(self, limit: int | None = None) -> AdaptiveSnapshot:
        k, _ = self.expected(self.cap if limit is None else limit)
        return AdaptiveSnapshot(
            alpha=tuple(self.alphas()), draft_ms_per_token=None if self.t_draft is None else self.t_draft * 1e3,
            first_draft_ms=None if self.t_first is None else self.t_first * 1e3,
            verify_ms={b: v * 1e3 for b, v in sorted(self.v_mean.items())}, overhead_ms=self.overhead * 1e3,
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
            c.verify_s = self.shared.verify_s  # one verify model: the target's cost does not depend on the drafter
            self.per[name] = c
        self.probe_min, self.probe_max, self.probe_k = probe_min, probe_max, probe_k
        self.probe_interval = probe_min
        self.plain_streak = 0
        self.n_plain_steps = 0
        self.n_probes = 0
        self.last_used = {name: 0 for name in self.per}
        self.n_steps = 0
        self.n_chosen = {name: 0 for name in self.per}

    def choose(self, limits: dict[str, int]) -> tuple[str | None, int]:
        """(drafter, draft length) for the next step, or (None, 0) for plain decoding; limits: the most each
        available drafter may draft now (an n-gram proposal is only as long as what followed its match)."""
        self.n_steps += 1
        sh = self.shared
        best, best_k, best_rate = None, 0, 1.0 / (sh.verify_s(1) + sh.overhead)
        for name, limit in limits.items():
            if limit <= 0:
                continue
            c = self.per[name]
            k, rate = best_draft_length(c.alphas()[:min(limit, self.cap)], c.draft_s(), sh.verify_s, sh.overhead,
                                        c.first_s())
            if k > 0 and rate > best_rate:
                best, best_k, best_rate = name, k, rate
        if best is not None:
            self.plain_streak = 0
            self.probe_interval = self.probe_min
            return self._use(best), best_k
        self.plain_streak += 1
        if self.plain_streak > self.probe_interval:
            due = [n for n, lim in limits.items() if lim > 0 and self.per[n]._could_pay(min(lim, self.cap))]
            if due:
                self.plain_streak = 0
                self.probe_interval = min(2 * self.probe_interval, self.probe_max)
                self.n_probes += 1
                name = min(due, key=lambda n: self.last_used[n])
                return self._use(name), min(self.probe_k, limits[name], self.cap)
        self.n_plain_steps += 1
        return None, 0

    def _use(self, name: str) -> str:
        self.last_used[name] = self.n_steps
        self.n_chosen[name] += 1
        return name

    def observe(self, drafter: str | None, n_drafted: int, n_accepted: int, draft_token_s: float | None,
                verify_s: float, overhead_s: float, draft_s: float | None = None,
                first_token_s: float | None = None) -> None:
        """Record one step (drafter None: plain decoding); the arguments as AdaptiveDraft.observe's."""
        self.shared.observe(n_drafted, n_accepted, None, verify_s, overhead_s)
        if drafter is not None and n_drafted:
            self.per[drafter].observe(n_drafted, n_accepted, draft_token_s, verify_s, overhead_s, draft_s,
                                      first_token_s)

    def snapshot(self, limit: int | None = None) -> AdaptiveSnapshot:
        """The snapshot of the drafter chosen most often (costs and plain steps as measured for all)."""
        name = max(self.n_chosen, key=lambda n: self.n_chosen[n]) if self.per else None
        snap = (self.per[name] if name else self.shared).snapshot(limit)
        return AdaptiveSnapshot(alpha=snap.alpha, draft_ms_per_token=snap.draft_ms_per_token,
                                first_draft_ms=snap.first_draft_ms,
                                verify_ms={b: v * 1e3 for b, v in sorted(self.shared.v_mean.items())},
                                overhead_ms=self.shared.overhead * 1e3, best_k=snap.best_k,
                                n_plain_steps=self.n_plain_steps, n_probes=self.n_probes)
