"""The prompt rows a prefill decodes apart on the target, and what it found there, for the drafter that reads the
prompt after it (Drafter.read_prompt): timed spans, and the agreement span's rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .accept import overlap
from .sampling import Transform, restrict
from .settings import GenerationSettings


@dataclass(frozen=True)
class Span:
    """Prompt rows prefill decodes apart: timed (the target's cost at that context, and the reader's for one
    token), or compared (agree: the reader's greedy choices against the target's, untimed)."""

    pos: int
    n: int
    agree: bool = False


class AgreeRows(NamedTuple):
    """The target's side of a prompt agreement: its greedy choices, and under rejection sampling its rows as
    distributions with the settings that made them (None otherwise)."""

    want: np.ndarray
    p: list | None
    sampled: GenerationSettings | None

    @classmethod
    def of(cls, logits, sampled: GenerationSettings | None) -> "AgreeRows":
        if sampled is None:
            return cls(logits.argmax(axis=1), None, None)
        tf = _transform(sampled)
        try:
            return cls(logits.argmax(axis=1), [tf(r) for r in logits], sampled)
        finally:
            tf.close()

    def expected(self, n_vocab: int):
        """None (greedy), or a function of a drafter's logits rows: each row's expected acceptance Σ min(p, q)
        against the target's (the draft restricted to ids the target has)."""
        if self.p is None:
            return None
        p_rows, sampled = self.p, self.sampled

        def expected(draft_rows) -> list[float]:
            tf, out = _transform(sampled), []
            try:
                for p_row, r in zip(p_rows, draft_rows):
                    q = restrict(tf(r), n_vocab)
                    out.append(0.0 if q is None else overlap(q, p_row))
            finally:
                tf.close()
            return out
        return expected


def _transform(s: GenerationSettings) -> Transform:
    return Transform(s.temp, s.top_k, s.top_p, s.min_p)
