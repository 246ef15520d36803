"""Adaptive draft length: choose each step's k to maximise expected tokens per second.

Online estimates (all from the running generation): the conditional acceptance at each draft position
(decayed counts with the pooled rate as prior), the draft cost per token, and the verify cost as a
function of batch size (per-size running means, a least-squares line for sizes not yet seen).
Expected tokens of a step with k drafted = 1 + Σ_j Π_{i≤j} α_i (BRIEF.md's (1−α^(k+1))/(1−α) with one
α per position); its time = k·t_draft + V(k+1) + overhead. k = 0 is plain decoding; while it wins,
a short probe runs every `probe_interval` steps (doubling while probes keep failing) to come back.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdaptiveSnapshot:
    """What the controller believes now (for `specq tune` and stats)."""

    alpha: tuple[float, ...]  # conditional acceptance at positions 1..cap
    draft_ms_per_token: float | None
    verify_ms: dict[int, float]  # measured batch size → mean ms
    overhead_ms: float
    best_k: int
    n_plain_steps: int
    n_probes: int


def best_draft_length(alphas, t_draft: float, verify_s, overhead: float = 0.0) -> tuple[int, float]:
    """(k, tokens/s) maximising E(k)/T(k) over k = 0..len(alphas); alphas are conditional per position."""
    best_k, best = 0, 1.0 / (verify_s(1) + overhead)
    tokens, prod = 1.0, 1.0
    for k, a in enumerate(alphas, start=1):
        prod *= a
        if prod < 1e-4:
            break
        tokens += prod
        rate = tokens / (k * t_draft + verify_s(k + 1) + overhead)
        if rate > best:
            best_k, best = k, rate
    return best_k, best


class AdaptiveDraft:
    def __init__(self, cap: int, cost_ratio_prior: float = 0.2, decay: float = 0.92, prior_weight: float = 2.0,
                 probe_min: int = 16, probe_max: int = 64, probe_k: int = 1, ema: float = 0.2,
                 probe_budget: float = 0.02):
        self.cap = cap
        self.decay = decay
        self.w = prior_weight
        self.succ = [0.0] * cap
        self.trials = [0.0] * cap
        self.ratio_prior = cost_ratio_prior
        self.t_draft: float | None = None  # seconds per drafted token
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
        pooled = (sum(self.succ) + 1.0) / (sum(self.trials) + 2.0)
        return [(s + self.w * pooled) / (t + self.w) for s, t in zip(self.succ, self.trials)]

    def verify_s(self, b: int) -> float:
        # Verifying more tokens never costs less than one: a noisy reading must not make drafting look free.
        floor = self.v_mean.get(1, 0.0) if b > 1 else 0.0
        v = self.v_mean.get(b)
        if v is not None:
            return max(v, floor)
        if self._line is None:
            return max(next(iter(self.v_mean.values()), 1.0), floor)  # nothing or one size measured: flat
        a, s = self._line
        return max(a + s * b, floor, 1e-9)

    def draft_s(self) -> float:
        return self.t_draft if self.t_draft is not None else self.ratio_prior * self.verify_s(1)

    def expected(self, limit: int) -> tuple[int, float]:
        """(best k ≤ limit, its expected tokens per second)."""
        return best_draft_length(self.alphas()[:limit], self.draft_s(), self.verify_s, self.overhead)

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
        return best_draft_length([1.0] * limit, self.draft_s(), self.verify_s, self.overhead)[0] > 0

    def observe(self, n_drafted: int, n_accepted: int, draft_token_s: float | None, verify_s: float,
                overhead_s: float, draft_s: float | None = None) -> None:
        """Record one step: `draft_token_s` is the measured seconds per drafted token (None: not measured);
        `draft_s` the step's whole drafting time (with the draft's catch-up after plain steps)."""
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
            self.t_draft = draft_token_s if self.t_draft is None else \
                self.t_draft + self.ema * (draft_token_s - self.t_draft)
        b = n_drafted + 1
        old = self.v_mean.get(b)
        self.v_mean[b] = verify_s if old is None else old + self.ema * (verify_s - old)
        self.overhead += self.ema * (overhead_s - self.overhead)
        if old is None or len(self.v_mean) >= 2:
            self._refit()

    def _refit(self) -> None:
        if len(self.v_mean) < 2:
            self._line = None
            return
        xs, ys = list(self.v_mean), list(self.v_mean.values())
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx, 0.0)
        self._line = (my - slope * mx, slope)

    def snapshot(self, limit: int | None = None) -> AdaptiveSnapshot:
        k, _ = self.expected(self.cap if limit is None else limit)
        return AdaptiveSnapshot(
            alpha=tuple(self.alphas()), draft_ms_per_token=None if self.t_draft is None else self.t_draft * 1e3,
            verify_ms={b: v * 1e3 for b, v in sorted(self.v_mean.items())}, overhead_ms=self.overhead * 1e3,
            best_k=k, n_plain_steps=self.n_plain_steps, n_probes=self.n_probes)
