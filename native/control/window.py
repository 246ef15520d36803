"""Whether a draft that sees a window of recent tokens beats one that sees the whole context (--ctx-draft auto)."""

from __future__ import annotations

import numpy as np

from .expected import best_draft_length

WINDOW_MARGIN = 0.05  # a draft window is taken only where it is expected to be this much faster (window_pays)


def window_pays(agree_whole: tuple[int, int], agree_window: tuple[int, int], t_whole: float, t_window: float,
                verify_s, overhead: float, cap: int, margin: float = WINDOW_MARGIN) -> bool:
    """Whether a draft that sees a window of recent tokens beats one that sees the whole context: each side's
    acceptance from its greedy agreement with the target on the same prompt rows ((agreeing, rows), smoothed
    towards 1/2), its cost per drafted token as timed at the context it would see, and the best draft length on
    those (best_draft_length, one verify model for both). The window must win by `margin`: it is a change of
    drafter on thin evidence, and acceptance lost to a window shows only later."""
    return window_pays_at((agree_whole[0] + 1.0) / (agree_whole[1] + 2.0),
                          (agree_window[0] + 1.0) / (agree_window[1] + 2.0), t_whole, t_window, verify_s, overhead,
                          cap, margin)


def window_pays_at(alpha_whole: float, alpha_window: float, t_whole: float, t_window: float, verify_s,
                   overhead: float, cap: int, margin: float = WINDOW_MARGIN) -> bool:
    """window_pays on acceptances already estimated (paired_acceptance)."""
    def rate(alpha: float, t: float) -> float:
        return best_draft_length([alpha] * cap, t, verify_s, overhead)[1]
    return rate(alpha_window, t_window) > (1.0 + margin) * rate(alpha_whole, t_whole)


def paired_acceptance(whole_ok, window_ok) -> tuple[float, float]:
    """(whole context's, window's) acceptance from their greedy agreement with the target on the same rows
    (boolean arrays, row for row): the rate both share (smoothed towards 1/2), split by the difference between
    them as far as it stands above its own noise. Of b rows only the whole context got right and c only the
    window did, the difference (b - c)/n has a variance of about (b + c)/n², so it is scaled by
    max(0, 1 - (b + c)/(b - c)²) (positive-part James-Stein): 27 against 25 agreeing rows of 32 is mostly noise,
    and the i.i.d. model of acceptance would otherwise turn those two rows into a verdict."""
    whole_ok, window_ok = np.asarray(whole_ok, dtype=bool), np.asarray(window_ok, dtype=bool)
    n = len(whole_ok)
    shared = (int(whole_ok.sum()) + int(window_ok.sum()) + 2.0) / (2.0 * n + 4.0)
    b = int(np.count_nonzero(whole_ok & ~window_ok))
    c = int(np.count_nonzero(window_ok & ~whole_ok))
    if b == c:
        return shared, shared
    diff = (b - c) / n * max(0.0, 1.0 - (b + c) / (b - c) ** 2)
    return min(shared + diff / 2, 1.0), max(shared - diff / 2, 0.0)
