"""Acceptance rules as pure functions over numpy arrays (testable without a model)."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def n_accepted_greedy(target_choice: np.ndarray, draft: Sequence[int]) -> int:
    """How many draft tokens the target accepts: the length of the prefix where target_choice[i] == draft[i].

    target_choice has len(draft) + 1 entries: the target's token at every verified position.
    """
    n = len(draft)
    if len(target_choice) != n + 1:
        raise ValueError(f"need {n + 1} target choices for {n} draft tokens, got {len(target_choice)}")
    if n == 0:
        return 0
    mismatch = np.flatnonzero(np.asarray(target_choice[:n]) != np.asarray(draft))
    return int(mismatch[0]) if mismatch.size else n


def greedy_emit(target_logits: np.ndarray, draft: Sequence[int]) -> list[int]:
    """Greedy verification: the accepted draft prefix plus the target's own token after it."""
    choice = target_logits.argmax(axis=1)
    a = n_accepted_greedy(choice, draft)
    return [int(t) for t in draft[:a]] + [int(choice[a])]


def top_probability(logits_row: np.ndarray) -> float:
    """Softmax probability of the arg-max token (over the whole vocabulary)."""
    m = logits_row.max()
    return float(1.0 / np.exp(logits_row - m, dtype=np.float64).sum())


def accepted_per_position(accepted_counts: Sequence[int], draft_max: int) -> list[int]:
    """Entry i = number of steps that accepted at least i+1 draft tokens."""
    counts = np.bincount(np.asarray(accepted_counts, dtype=np.int64), minlength=draft_max + 1)
    at_least = np.cumsum(counts[::-1])[::-1]
    return [int(x) for x in at_least[1:draft_max + 1]]


def rejection_emit(draft: Sequence[int], q: Sequence, p: Sequence, rng: np.random.Generator) -> list[int]:
    """Exact speculative sampling (Leviathan et al., Chen et al.) over sparse distributions.

    q[i]: the draft's distribution the token draft[i] was sampled from; p[i] (len(draft) + 1 of them):
    the target's at the same positions. Each is an (ids, probs) pair (e.g. sampling.SparseDist).
    Accept draft[i] with probability min(1, p_i(x)/q_i(x)); at the first rejection sample from
    norm(max(0, p_i − q_i)); if all pass, sample a bonus token from p_n.
    """
    n = len(draft)
    if len(p) != n + 1 or len(q) != n:
        raise ValueError(f"need {n} draft and {n + 1} target distributions, got {len(q)} and {len(p)}")
    a = n
    if n:
        pt = np.array([_prob_of(p[i], draft[i]) for i in range(n)])
        qd = np.array([_prob_of(q[i], draft[i]) for i in range(n)])
        # u < pt/qd, written without the division (qd > 0: the draft sampled the token)
        reject = np.flatnonzero(rng.random(n) * qd >= pt)
        a = int(reject[0]) if reject.size else n
    if a == n:
        return [int(t) for t in draft] + [draw_sparse(*_pair(p[n]), rng)]
    ids, pp = _pair(p[a])
    residual = np.maximum(pp - _probs_at(q[a], ids), 0.0)
    if not residual.sum() > 0.0:  # p == q up to rounding: the residual is empty, p itself is exact
        residual = pp
    return [int(t) for t in draft[:a]] + [draw_sparse(ids, residual, rng)]


def expected_acceptance(draft: Sequence[int], q: Sequence, p: Sequence) -> list[tuple[float, float]]:
    """Per drafted position i: (the probability that rejection_emit reaches it given the drafts before it,
    Π_{j<i} min(1, p_j(d_j)/q_j(d_j)); its expected acceptance Σ_x min(p_i(x), q_i(x))).

    What the controller learns from at temperature > 0: the step's 0/1 outcomes are one draw of the same
    quantities, far noisier. reach·expected summed is the expected number accepted; over steps,
    Σ reach·expected / Σ reach estimates the conditional acceptance at position i without bias."""
    out, reach = [], 1.0
    for i in range(len(draft)):
        out.append((reach, overlap(q[i], p[i])))
        qd = _prob_of(q[i], draft[i])
        reach *= min(1.0, _prob_of(p[i], draft[i]) / qd) if qd > 0 else 0.0
    return out


def overlap(q, p) -> float:
    """Σ_x min(p(x), q(x)), scattered into a dense row (no sort of a vocabulary-wide distribution)."""
    qi, qp = _pair(q)
    pi, pp = _pair(p)
    if not len(qi) or not len(pi):
        return 0.0
    dense = np.zeros(int(max(qi.max(), pi.max())) + 1)
    dense[qi] = qp
    return float(np.minimum(pp, dense[pi]).sum())


def _pair(d) -> tuple[np.ndarray, np.ndarray]:
    return (d.ids, d.probs) if hasattr(d, "ids") else (np.asarray(d[0]), np.asarray(d[1]))


def _prob_of(d, token: int) -> float:
    ids, probs = _pair(d)
    hit = np.flatnonzero(ids == token)
    return float(probs[hit[0]]) if hit.size else 0.0


def _probs_at(d, ids: np.ndarray) -> np.ndarray:
    """The probabilities distribution d gives to each of `ids` (0 where it has none)."""
    qi, qp = _pair(d)
    order = np.argsort(qi, kind="stable")
    sq = qi[order]
    j = np.clip(np.searchsorted(sq, ids), 0, max(len(sq) - 1, 0))
    found = sq[j] == ids if len(sq) else np.zeros(len(ids), bool)
    return np.where(found, qp[order][j], 0.0)


def draw_sparse(ids: np.ndarray, weights: np.ndarray, rng: np.random.Generator) -> int:
    """One id drawn with probability proportional to its weight (zero weights are never drawn)."""
    c = np.cumsum(weights)
    j = int(np.searchsorted(c, rng.random() * c[-1], side="right"))
    return int(ids[min(j, len(ids) - 1)])
