"""Sampling probabilities for rejection sampling: the SAME transform on draft and target.

The logits → kept tokens step (top-k → top-p → min-p → temp) runs in llama.cpp's C sampler chain
(`_ffi.TransformChain`), the one the baseline's dist sampler uses; here the kept logits become a sparse
distribution (ids, probs) and are sampled with a seeded numpy Generator. Work per row is over the few
kept tokens, never a Python loop over the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..llama import ffi as _ffi
from .accept import draw_sparse

if TYPE_CHECKING:
    from .constraint import Guide
    from .settings import GenerationSettings


@dataclass(frozen=True)
class SparseDist:
    """A distribution over token ids: probs[j] is the probability of ids[j]; all other ids have 0."""

    ids: np.ndarray  # int32
    probs: np.ndarray  # float64, sums to 1

    def prob_of(self, token: int) -> float:
        hit = np.flatnonzero(self.ids == token)
        return float(self.probs[hit[0]]) if hit.size else 0.0

    def top_prob(self) -> float:
        return float(self.probs.max())


def restrict(dist: SparseDist, n_vocab: int) -> SparseDist | None:
    """`dist` conditioned on ids < n_vocab (None if it has no mass there): a draft whose vocabulary is larger
    than the target's must draft from this, since the target can never accept its extra ids."""
    keep = dist.ids < n_vocab
    if keep.all():
        return dist
    if not keep.any():
        return None
    probs = dist.probs[keep]
    return SparseDist(dist.ids[keep], probs / probs.sum())


def softmax_kept(ids: np.ndarray, logits: np.ndarray) -> SparseDist:
    """Softmax over the kept (already temperature-scaled) logits, as llama.cpp's dist sampler computes it."""
    e = np.exp(logits.astype(np.float64) - float(logits.max()))
    return SparseDist(ids, e / e.sum())


class Transform:
    """One model's logits → SparseDist transform for fixed settings (wraps a C chain; close() it)."""

    def __init__(self, temp: float, top_k: int, top_p: float, min_p: float):
        self._chain = _ffi.TransformChain(temp, top_k, top_p, min_p)

    def __call__(self, row: np.ndarray) -> SparseDist:
        return softmax_kept(*self._chain.apply(row))

    def rows(self, logits: np.ndarray) -> list[SparseDist]:
        return [self(r) for r in logits]

    def close(self) -> None:
        self._chain.close()


def sample(dist: SparseDist | tuple[np.ndarray, np.ndarray], rng: np.random.Generator) -> int:
    """Draw one token id from a (possibly unnormalised) sparse distribution."""
    ids, w = (dist.ids, dist.probs) if isinstance(dist, SparseDist) else dist
    return draw_sparse(ids, w, rng)


class Sampling:
    """How one generation verifies: the mode, llama.cpp's chain (greedy/match), transforms + rng (rejection)."""

    def __init__(self, s: GenerationSettings, speculative: bool, guide: Guide | None = None):
        # Without a draft, "match" is plain sampling with llama.cpp's chain: the baseline's reference.
        self.mode = s.accept_mode if speculative else ("greedy" if s.temp <= 0 else "match")
        # Under a constraint (`guide`) every row is masked first: llama.cpp's chain samples the raw logits, so
        # "match" becomes rejection sampling on the masked distributions (with no draft: a draw from the row).
        self.guide = guide
        if guide is not None and self.mode == "match":
            self.mode = "rejection"
        self.sampler = _ffi.Sampler(s.temp, s.top_k, s.top_p, s.min_p, s.seed)
        self.target_tf = self.draft_tf = None
        self.rng = None
        self.sample_s = 0.0
        if self.mode == "rejection" and (speculative or guide is not None):
            self.rng = np.random.default_rng(s.seed)
            self.target_tf = Transform(s.temp, s.top_k, s.top_p, s.min_p)
            self.draft_tf = Transform(s.temp, s.top_k, s.top_p, s.min_p)

    def draft_row(self, row: np.ndarray, drafts: list[int]) -> np.ndarray:
        """A drafter's logits row after `drafts`, masked where a constraint applies."""
        return row if self.guide is None else self.guide.row(row, drafts, len(drafts))

    def verify_rows(self, logits: np.ndarray, drafts: list[int]) -> np.ndarray:
        """The target's verify rows [last, d1..dn], each masked at its position where a constraint applies."""
        return logits if self.guide is None else self.guide.rows(logits, drafts)

    def allowed_prefix(self, drafts: list[int]) -> int:
        """How many of a proposal's tokens the constraint allows in a row (all without one)."""
        return len(drafts) if self.guide is None else self.guide.allowed_prefix(drafts)

    def close(self) -> None:
        self.sampler.close()
        for t in (self.target_tf, self.draft_tf):
            if t is not None:
                t.close()
