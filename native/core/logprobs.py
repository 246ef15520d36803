"""Log-probabilities of emitted tokens, as OpenAI and vLLM report them: the log-softmax of the target's raw
logits on the row that chose the token (before temperature, truncation and any mask), and the row's most likely
tokens. Read from the target's own rows of the verify decode, so drafting adds no pass."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

TOP_LOGPROBS_MAX = 20  # OpenAI's bound on top_logprobs


class TokenLogprob(NamedTuple):
    logprob: float  # of the emitted token
    top: tuple[tuple[int, float], ...]  # the row's n most likely tokens, most likely first


def log_softmax(row: np.ndarray) -> np.ndarray:
    x = row.astype(np.float64)
    m = float(x.max())
    return x - (m + float(np.log(np.exp(x - m).sum())))


def token_logprobs(rows: np.ndarray, emitted: Sequence[int], n_top: int) -> list[TokenLogprob]:
    """Row i chose emitted[i]: its log-probability and the row's n_top most likely tokens."""
    out = []
    for row, tok in zip(rows, emitted):
        lp = log_softmax(row)
        top: tuple[tuple[int, float], ...] = ()
        if n_top > 0:
            ids = np.argpartition(-lp, n_top - 1)[:n_top]
            ids = ids[np.argsort(-lp[ids], kind="stable")]
            top = tuple((int(i), float(lp[i])) for i in ids)
        out.append(TokenLogprob(float(lp[tok]), top))
    return out
