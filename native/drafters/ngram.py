"""N-gram (prompt-lookup) drafting: propose the tokens that followed the latest earlier occurrence of the
text's own ending. No model: it pays when the answer repeats its input (code edits, summaries, JSON).

As a proposal distribution it is a point mass on each token, so rejection sampling accepts token x with
probability p(x) and on rejection samples from p with x removed — exact, like any other drafter.
"""

from __future__ import annotations

from typing import Sequence, TYPE_CHECKING

import numpy as np

from ..core.sampling import Sampling, SparseDist
from .base import Drafter, Proposal

if TYPE_CHECKING:
    from ..core.settings import GenerationSettings


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


class NgramDrafter(Drafter):
    """--drafter ngram: lookup in the text so far (--ngram-min/--ngram-max); its drafting cost is not measured."""

    name = "ngram"
    on_match_only = True
    has_memory = False

    def propose(self, n_max: int, s: GenerationSettings, samp: Sampling) -> Proposal:
        drafts = propose(self.session.history, s.ngram_min, s.ngram_max, n_max)
        return Proposal(drafts, [point_mass(t) for t in drafts] if samp.draft_tf else [])

    def limit(self, n_max: int, s: GenerationSettings) -> int:
        """A proposal exists only on a match, and is as long as what followed it."""
        return len(propose(self.session.history, s.ngram_min, s.ngram_max, n_max))
