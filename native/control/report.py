"""The cost model that explains a measured run: the adaptive controller's own model (native/control/length.py,
expected.py) evaluated on what the run measured, with no fitted constants.

A step that drafts k tokens emits E(k) tokens on average (expected.py, on α_i: the conditional acceptance at
position i, measured) and takes T(k) = t_first + (k−1)·t_next + V(k+1) + o (the draft's first
token with its catch-up, each further drafted token, the verify pass of k+1 tokens by batch size, the
per-step overhead; all measured). Over the run's own mix of draft lengths H(k):
    predicted tokens/s = Σ H(k)·E(k) / Σ H(k)·T(k)
and the ideal (a verify pass as cheap as one target token: b, the baseline's ms per token, or this run's own
plain steps' if cheaper):
    ideal tokens/s = Σ H(k)·E(k) / Σ H(k)·(t_first·[k>0] + (k−1)·t_next + b).
"""

from __future__ import annotations

from dataclasses import dataclass

from .expected import expected_tokens


@dataclass(frozen=True)
class StepCosts:
    """What a run (or several) measured, pooled: the inputs of the model."""

    steps_by_k: dict[int, int]  # verified draft length → steps
    tried_per_pos: list[int]  # steps that verified position i+1 with positions 1..i accepted
    accepted_per_pos: list[int]  # steps that accepted position i+1
    draft_ms: float  # all drafting time (catch-ups included)
    draft_next_ms: float  # time of drafted tokens after a step's first, where measured
    n_draft_next: int  # how many such tokens
    verify_ms_by_size: dict[int, tuple[int, float]]  # batch size → (passes, total ms)
    overhead_ms: float  # generation time outside drafting and verifying

    @property
    def n_steps(self) -> int:
        return sum(self.steps_by_k.values())

    def alphas(self) -> list[float]:
        """Conditional acceptance per position (positions never tried end the list)."""
        out = []
        for tried, acc in zip(self.tried_per_pos, self.accepted_per_pos):
            if not tried:
                break
            out.append(acc / tried)
        return out

    def expected_tokens(self, k: int) -> float:
        """E(k) on the measured acceptance per position (expected.expected_tokens)."""
        return expected_tokens(self.alphas(), k)

    def t_next(self) -> float:
        return self.draft_next_ms / self.n_draft_next if self.n_draft_next else 0.0

    def t_first(self) -> float:
        """Mean time to a step's first drafted token, its catch-up included: all drafting time less the
        further tokens', over the steps that drafted."""
        drafting = sum(n for k, n in self.steps_by_k.items() if k > 0)
        further = sum((k - 1) * n for k, n in self.steps_by_k.items() if k > 0)
        return max(self.draft_ms - further * self.t_next(), 0.0) / drafting if drafting else 0.0

    def verify_ms(self, size: int) -> float:
        n, total = self.verify_ms_by_size[size]
        return total / n

    def step_ms(self, k: int, verify_ms: float) -> float:
        return (self.t_first() + (k - 1) * self.t_next() if k > 0 else 0.0) + verify_ms

    def predicted_tokens_per_s(self) -> float | None:
        if not self.n_steps:
            return None
        o = self.overhead_ms / self.n_steps
        tokens = sum(n * self.expected_tokens(k) for k, n in self.steps_by_k.items())
        ms = sum(n * (self.step_ms(k, self.verify_ms(k + 1)) + o) for k, n in self.steps_by_k.items())
        return tokens / (ms / 1000.0) if ms > 0 else None

    def ideal_tokens_per_s(self, baseline_ms_per_token: float | None) -> float | None:
        """Tokens/s with every verify (and its overhead) as cheap as one target token: the cheaper of the
        baseline's ms per token and this run's own plain steps (where it took any)."""
        if not self.n_steps or not baseline_ms_per_token:
            return None
        one = baseline_ms_per_token
        if 1 in self.verify_ms_by_size:
            one = min(one, self.verify_ms(1) + self.overhead_ms / self.n_steps)
        tokens = sum(n * self.expected_tokens(k) for k, n in self.steps_by_k.items())
        ms = sum(n * self.step_ms(k, one) for k, n in self.steps_by_k.items())
        return tokens / (ms / 1000.0)


def pool(rows: list[dict]) -> StepCosts | None:
    """Pool bench run rows (their cost fields) into one StepCosts; None when none has them."""
    rows = [r for r in rows if r.get("steps_by_k")]
    if not rows:
        return None
    steps: dict[int, int] = {}
    verify: dict[int, list] = {}
    width = max(len(r["tried_per_pos"]) for r in rows)
    tried, acc = [0] * width, [0] * width
    for r in rows:
        for k, n in r["steps_by_k"].items():
            steps[int(k)] = steps.get(int(k), 0) + n
        for b, (n, ms) in r["verify_ms_by_size"].items():
            v = verify.setdefault(int(b), [0, 0.0])
            v[0] += n
            v[1] += ms
        for i, (t, a) in enumerate(zip(r["tried_per_pos"], r["accepted_per_pos"])):
            tried[i] += t
            acc[i] += a
    return StepCosts(
        steps_by_k=steps, tried_per_pos=tried, accepted_per_pos=acc,
        draft_ms=sum(r["draft_ms"] for r in rows), draft_next_ms=sum(r["draft_next_ms"] for r in rows),
        n_draft_next=sum(r["n_draft_next"] for r in rows),
        verify_ms_by_size={b: (n, ms) for b, (n, ms) in verify.items()},
        overhead_ms=sum(r["gen_ms"] - r["draft_ms"] - r["verify_ms"] for r in rows))
