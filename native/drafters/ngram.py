"""N-gram (prompt-lookup) drafting: propose the tokens that followed the latest earlier occurrence of the
text's own ending. No model: it pays when the answer repeats its input (code edits, summaries, JSON).

As a proposal distribution it is a point mass on each token, so rejection sampling accepts token x with
probability p(x) and on rejection samples from p with x removed — exact, like any other drafter.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..core.sampling import SparseDist

DRAFTERS = ("model", "ngram", "mtp")  # --drafter takes one of these, a comma list (n-gram first), or auto


def parse_drafter(text: str) -> tuple[str, ...]:
    """--drafter model | ngram | mtp | a comma list | auto → the drafters in the order they are tried
    (("auto",) for auto: the adaptive controller chooses among the available ones each step)."""
    from ...errors import UsageError

    names = tuple(x.strip() for x in str(text).split(",") if x.strip())
    if names == ("auto",):
        return names
    if not names or any(n not in DRAFTERS for n in names) or len(set(names)) != len(names):
        raise UsageError(f"--drafter must be model, ngram, mtp, a comma list of them, or auto ({text})")
    # A model's (or MTP head's) proposal always exists, an n-gram one only on a match: the n-gram goes first.
    return tuple(sorted(names, key=lambda n: n != "ngram"))


def needs_draft_model(drafters: tuple[str, ...]) -> bool:
    return "model" in drafters


def drafts_without_model(drafters: tuple[str, ...]) -> bool:
    """Whether these drafters can speculate with no draft model loaded (n-gram lookup, the MTP head, auto)."""
    return any(n in ("ngram", "mtp", "auto") for n in drafters)


def propose(tokens: Sequence[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix of `tokens` of
    n_max down to n_min tokens; [] when none occurs."""
    n_tok = len(tokens)
    if k <= 0 or n_tok < n_min + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, n_tok - 1), n_min - 1, -1):
        suffix = arr[n_tok - n:]
        # candidate starts i < n_tok - n with arr[i:i+n] == suffix, latest first
        starts = np.flatnonzero(arr[:n_tok - n] == suffix[0])
        for i in starts[::-1]:
            if i + n < n_tok and np.array_equal(arr[i:i + n], suffix):
                follow = arr[i + n:min(i + n + k, n_tok)]
                if follow.size:
                    return [int(t) for t in follow]
    return []


def point_mass(token: int) -> SparseDist:
    """The n-gram drafter's proposal distribution for one token."""
    return SparseDist(np.array([token], np.int32), np.array([1.0]))
