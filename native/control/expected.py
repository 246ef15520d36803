"""Expected tokens per step E(k), the best draft length, and the ideal speed-up: the one place they are written.

A step that drafts k tokens emits E(k) = 1 + Σ_{j=1..k} Π_{i≤j} α_i tokens on average (α_i: the conditional
acceptance at position i, given positions 1..i−1 were accepted). With one α for every position the sum is
BRIEF.md's closed form (1 − α^(k+1)) / (1 − α).
"""

from __future__ import annotations

from itertools import islice
from typing import Callable, Iterable, Iterator

# Past this probability of reaching a position, longer drafts add nothing worth pricing (best_draft_length).
NEGLIGIBLE_REACH = 1e-4


def expected_tokens_each(alphas: Iterable[float]) -> Iterator[tuple[float, float]]:
    """For k = 1, 2, … len(alphas): (Π_{i≤k} α_i, E(k)), the probability that all k drafted tokens are accepted
    and the expected tokens of a step drafting k."""
    tokens, prod = 1.0, 1.0
    for a in alphas:
        prod *= a
        tokens += prod
        yield prod, tokens


def expected_tokens(alphas: Iterable[float], k: int | None = None) -> float:
    """E(k) on conditional acceptances per position (k None: all of them; positions past the list add nothing)."""
    tokens = 1.0
    for _, tokens in islice(expected_tokens_each(alphas), k):
        pass
    return tokens


def expected_tokens_per_pass(alpha: float, k: int) -> float:
    """(1 − α^(k+1)) / (1 − α): E(k) with one α at every position (expected_tokens' closed form)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def ideal_speedup(alpha: float, k: int, c: float) -> float:
    """(1 − α^(k+1)) / ((1 − α)(k·c + 1)): the best speed-up a draft of cost ratio c can give (a verify pass as
    cheap as one target token)."""
    return expected_tokens_per_pass(alpha, k) / (k * c + 1.0)


def best_draft_length(alphas, t_draft: float, verify_s: Callable[[int], float], overhead: float = 0.0,
                      t_first: float | None = None, per_token: float = 0.0, within: float = 0.0,
                      reach: int | None = None) -> tuple[int, float]:
    """(k, tokens/s) maximising E(k)/T(k) over k = 0..reach (default len(alphas)); alphas are conditional per
    position.

    A step drafting k tokens costs t_first + (k-1)·t_draft of drafting (t_first defaults to t_draft), the verify of
    k+1 tokens, the overhead, and per_token for each token it emits (what another drafter will pay to catch up on
    them). `within`: the shortest k ≤ reach whose rate is within this fraction of the best over all of alphas, one
    shorter than the best at most (else the best k ≤ reach, so that a reach grows towards it); plain decoding only
    where it beats every k ≤ reach."""
    first = t_draft if t_first is None else t_first
    plain = 1.0 / (verify_s(1) + overhead + per_token)
    rates = []
    for k, (prod, tokens) in enumerate(expected_tokens_each(alphas), start=1):
        if prod < NEGLIGIBLE_REACH:
            break
        rates.append(tokens / (first + (k - 1) * t_draft + verify_s(k + 1) + overhead + per_token * tokens))
    near = rates[:len(rates) if reach is None else reach]
    if max(near, default=0.0) <= plain:
        return 0, plain
    enough = (1.0 - within) * max(rates)
    floor = max(range(1, len(rates) + 1), key=lambda k: rates[k - 1]) - 1  # a flat curve: 2 within 3% of 4
    k = next((k for k, rate in enumerate(near, start=1) if rate >= enough and k >= floor), None)
    if k is None:
        k = max(range(1, len(near) + 1), key=lambda k: (near[k - 1], -k))
    return k, rates[k - 1]
