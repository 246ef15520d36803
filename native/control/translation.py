"""--vocab-map auto: which translation a draft of another vocabulary drafts with, chosen by measurement.

Each translation (core/vocabmap.py: TLI, the string path) is scored by what its steps gave: the tokens a step
emitted (the drafts accepted and the target's own) per second of drafting and verifying it. That is acceptance
and cost together: the string path's drafts are surer but each costs more draft tokens (it drafts in the draft's
own units and holds back the text's last word), TLI's are cheaper but meet the target's longer tokens less often.

The text moves the rate more than the translation does (a Chinese answer runs at half a code answer's pace), so
the two are compared in adjacent blocks of BLOCK steps, never across texts: each block's rate against the other
translation's block just before it, and the median ratio of the latest PAIRS such pairs decides (a pair that
straddles a change of text is an outlier). A trial first runs the two in alternating blocks until each has TRIAL
steps; then the faster drafts, and the other gets a block in every EXPLORE steps so that a change of text (prose,
then code) can turn the choice. The choice is engine-wide (every sequence's steps count, and every request's). Greedy and sampled drafting keep apart scores: at T > 0
TLI's drafts are sampled with their law and the string path's are point masses.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from ..core.vocabmap import STRING, TLI

TRANSLATIONS = (TLI, STRING)
TRIAL = 8  # steps of each translation before the first choice
BLOCK = 4  # steps a translation runs in a row while tried; rates are compared block against adjacent block
EXPLORE = 32  # the translation not chosen runs one BLOCK in every EXPLORE steps
PAIRS = 5  # the latest adjacent-block comparisons the choice is made on (their median)


@dataclass
class Block:
    """Consecutive steps of one translation: what they emitted and took."""

    translation: str
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0


class TranslationScores:
    """Adjacent blocks of the two translations compared, and the choice they make."""

    def __init__(self) -> None:
        self.n = 0  # steps recorded, both translations
        self.ran = {t: 0 for t in TRANSLATIONS}  # steps each drafted, all time
        self.block: Block | None = None  # the open block
        self.last: tuple[str, float] | None = None  # the last closed block: translation, its rate
        self.pairs: deque[float] = deque(maxlen=PAIRS)  # log(string's rate / TLI's) in adjacent blocks

    def record(self, translation: str, n_emitted: int, seconds: float) -> None:
        """A step drafted by `translation` emitted n_emitted tokens (accepted drafts and the target's own) and took
        `seconds` to draft and verify."""
        if self.block is not None and self.block.translation != translation:
            self._close()
        b = self.block = self.block or Block(translation)
        b.tokens, b.seconds, b.steps = b.tokens + n_emitted, b.seconds + seconds, b.steps + 1
        if b.steps >= BLOCK:
            self._close()
        self.ran[translation] += 1
        self.n += 1

    def _close(self) -> None:
        b, self.block = self.block, None
        t = b.translation
        if b.seconds <= 0 or b.tokens <= 0:
            return
        rate = b.tokens / b.seconds
        if self.last is not None and self.last[0] != t:
            ratio = math.log(rate / self.last[1])
            self.pairs.append(ratio if t == STRING else -ratio)
        self.last = (t, rate)

    def ratio(self) -> float | None:
        """The string path's rate over TLI's in adjacent blocks, the median of the latest pairs (None: none)."""
        return math.exp(statistics.median(self.pairs)) if self.pairs else None

    @property
    def best(self) -> str:
        """The faster translation as measured (TLI until compared)."""
        r = self.ratio()
        return STRING if r is not None and r > 1 else TLI

    @property
    def current(self) -> str:
        """The translation the next step drafts with: the trial's block, an exploration's, or the best."""
        if min(self.ran.values()) < TRIAL:
            return TRANSLATIONS[(self.n // BLOCK) % 2]
        best = self.best
        if self.n % EXPLORE < BLOCK:
            return STRING if best == TLI else TLI
        return best


class TranslationChooser:
    """The engine's --vocab-map auto: a TranslationScores for greedy drafting and one for sampled."""

    def __init__(self) -> None:
        self.greedy, self.sampled = TranslationScores(), TranslationScores()

    def scores(self, greedy: bool) -> TranslationScores:
        return self.greedy if greedy else self.sampled

    @property
    def leading(self) -> str:
        """What to report as the pair's translation: the one that has drafted more steps so far."""
        ran = self.steps
        return STRING if ran[STRING] > ran[TLI] else TLI

    @property
    def steps(self) -> dict[str, int]:
        """The steps each translation has drafted so far, greedy and sampled."""
        return {t: self.greedy.ran[t] + self.sampled.ran[t] for t in TRANSLATIONS}
