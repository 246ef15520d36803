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


def expected_tokens_per_pass(alpha: float, k: int) -> float:
    """(1 − α^(k+1)) / (1 − α): expected tokens per target pass with k drafted tokens."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def ideal_speedup(alpha: float, k: int, c: float) -> float:
    """(1 − α^(k+1)) / ((1 − α)(k·c + 1)): the best speed-up a draft of cost ratio c can give."""
    return expected_tokens_per_pass(alpha, k) / (k * c + 1.0)
