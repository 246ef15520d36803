"""Conditional acceptance by draft position, as one controller (length.LengthController) estimates it."""

from __future__ import annotations

from typing import Sequence

# Prompt rows compared before a draft was tried (seed) count as this many observations each of position 1 (32 rows
# make 8): a few steps' own outcomes (they decay the seed like any other count) outweigh it. They are not drafts
# tried (`tried`): a first reading of the draft's cost may be noisy, and only drafting steps correct it.
SEED_WEIGHT = 0.25
# The pair's long-run rate (all positions pooled) forgets this much a drafting step: a memory of ~100 steps, a few
# answers, that plain decoding does not age (Acceptance.age). The counts' estimates shrink towards it.
LONG_DECAY = 0.99


class Acceptance:
    """α_i, the acceptance at draft position i given 1..i−1 accepted, from decayed counts: each step multiplies
    the counts by `decay`, then adds its own. A step observes a position with a weight (trials) and a success
    (succ): 1 and 0/1 under greedy verification; under rejection sampling the probability that the step reaches the
    position given its drafts and that times Σ min(p, q), the expected acceptance there (StepOutcome.acceptance):
    the same law without the noise of one draw, so that a few unlucky rejections at temperature > 0 do not read as a
    bad draft. Estimates shrink towards the pair's long-run rate (`alphas`, `centre`)."""

    def __init__(self, cap: int, decay: float, prior_weight: float, alpha_prior: float):
        self.cap = cap
        self.decay = decay
        self.w = prior_weight
        # Before any step: a vocabulary-aligned draft usually agrees on most tokens, so start drafting a few; two
        # pseudo-observations, so the first steps' outcomes take over at once.
        self.alpha_prior = alpha_prior
        self.succ = [0.0] * cap
        self.trials = [0.0] * cap
        self.tried = 0.0  # drafting steps (decayed as the counts are): what LengthController.thin_evidence reads
        self.long = (0.0, 0.0)  # (successes, trials) of every position, decayed by LONG_DECAY a drafting step
        self.n_seeds = 0
        self.n_aged = 0  # plain steps that aged the counts (age)

    def centre(self) -> float:
        """The pair's long-run rate, shrunk towards the prior: where the counts' estimates go as they age."""
        s, t = self.long
        return (s + 2.0 * self.alpha_prior) / (t + 2.0)

    def alphas(self) -> list[float]:
        # Position 1 shrinks to the pooled rate; each later one to its predecessor's estimate (the
        # conditional rate after j accepted tokens rarely falls with j), so positions never tried inherit it,
        # but never to less than the pooled rate: one early rejection far out must not keep drafts short.
        pooled = (sum(self.succ) + 2.0 * self.centre()) / (sum(self.trials) + 2.0)
        prev, out = pooled, []
        for s, t in zip(self.succ, self.trials):
            prev = (s + self.w * max(prev, pooled)) / (t + self.w)
            out.append(prev)
        return out

    def seed(self, n_agree: float, n: int) -> None:
        """Of n prompt rows, n_agree where the drafter's choice was the target's (greedy; or the summed expected
        acceptance Σ min(p, q) of each row under rejection sampling): teacher-forced acceptance at position 1. It
        moves the prior and counts as SEED_WEIGHT observations a row."""
        if n > 0:
            self.alpha_prior = (n_agree + 2.0 * self.alpha_prior) / (n + 2.0)
            self.trials[0] += SEED_WEIGHT * n
            self.succ[0] += SEED_WEIGHT * n_agree
            self.n_seeds += 1

    def new_text(self, keep: float, first: float = 1.0) -> None:
        """A new answer: what earlier answers taught of positions ≥ 2 weighs `keep` of what it did, position 1
        `first` of it (their rate stays the prior's centre). `tried` stays whole: one answer's bad opening must not
        read as a useless draft. A draft model keeps position 1 whole (its agreement with the target is the
        pair's); a drafter that copies from the text weakens it (a new prompt is a new text to copy from)."""
        self.succ[0] *= first
        self.trials[0] *= first
        self.succ[1:] = [x * keep for x in self.succ[1:]]
        self.trials[1:] = [x * keep for x in self.trials[1:]]

    def age(self) -> None:
        """A step decoded without drafting: the text moved on, so what was counted weighs `decay` less and the
        estimates move towards the long-run rate (`tried` stays: the drafts tried are still that many). Else a hard
        stretch read before plain decoding took over would stand for all that follows, and a probe's outcome
        could hardly move it."""
        self.succ = [x * self.decay for x in self.succ]
        self.trials = [x * self.decay for x in self.trials]
        self.n_aged += 1

    def forget(self) -> None:
        """Drop every count (the drafter drafts from another memory now); the prior stays."""
        self.succ = [0.0] * self.cap
        self.trials = [0.0] * self.cap
        self.tried = 0.0
        self.long = (0.0, 0.0)

    def _decayed(self) -> None:
        d = self.decay
        self.succ = [x * d for x in self.succ]
        self.trials = [x * d for x in self.trials]
        self.tried = self.tried * d + 1.0

    def _long(self, succ: float, trials: float) -> None:
        s, t = self.long
        self.long = (s * LONG_DECAY + succ, t * LONG_DECAY + trials)

    def count(self, n_drafted: int, n_accepted: int) -> None:
        """A step's 0/1 outcomes: positions 1..n_accepted accepted, the next one (if drafted) rejected."""
        self._decayed()
        for i in range(min(n_accepted, self.cap)):
            self.succ[i] += 1.0
            self.trials[i] += 1.0
        rejected = n_accepted < min(n_drafted, self.cap)
        if rejected:
            self.trials[n_accepted] += 1.0
        self._long(min(n_accepted, self.cap), min(n_accepted, self.cap) + rejected)

    def count_expected(self, acceptance: Sequence[tuple[float, float]]) -> None:
        """A step's (reach, expected acceptance) per drafted position (core/accept.expected_acceptance)."""
        self._decayed()
        for i, (reach, a) in enumerate(acceptance[:self.cap]):
            self.trials[i] += reach
            self.succ[i] += reach * a
        rows = acceptance[:self.cap]
        self._long(sum(r * a for r, a in rows), sum(r for r, _ in rows))

    def deepest_tried(self) -> int:
        """The deepest position observed at least half a time (decayed), 0 if none."""
        return max((i + 1 for i, t in enumerate(self.trials) if t >= 0.5), default=0)
