"""--vocab-map auto: which translation a draft of another vocabulary drafts with, chosen by measurement.

Each translation (core/vocabmap.py: TLI, the string path) is scored by what its steps gave: the tokens a step
emitted (the drafts accepted and the target's own) per second of drafting and verifying it. That is acceptance
and cost together: the string path's drafts are surer but each costs more draft tokens (it drafts in the draft's
own units and holds back the text's last word), TLI's are cheaper but meet the target's longer tokens less often.

The choice is engine-wide (every sequence's steps count, and every request's): a trial first runs the two in
alternating blocks until each has TRIAL steps, then the faster drafts, and the other gets a block of BLOCK steps
in every EXPLORE so that a change of text (prose, then code) can turn the choice. Greedy and sampled drafting
keep apart scores: at T > 0 TLI's drafts are sampled with their law and the string path's are point masses.
"""

from __future__ import annotations

from collections import deque

from ..core.vocabmap import STRING, TLI

TRANSLATIONS = (TLI, STRING)
TRIAL = 8  # steps of each translation before the first choice
BLOCK = 4  # steps a translation runs in a row while tried (the trial's blocks, the loser's explorations)
EXPLORE = 64  # the translation not chosen runs one BLOCK in every EXPLORE steps
WINDOW = 64  # the steps of each translation its score is measured over (the latest)


class TranslationScores:
    """The recent steps of each translation: tokens emitted and seconds, and the choice they make."""

    def __init__(self) -> None:
        self.steps = {t: deque(maxlen=WINDOW) for t in TRANSLATIONS}
        self.n = 0  # steps recorded, both translations
        self.ran = {t: 0 for t in TRANSLATIONS}  # steps each drafted, all time

    def record(self, translation: str, n_emitted: int, seconds: float) -> None:
        """A step drafted by `translation` emitted n_emitted tokens (accepted drafts and the target's own) and took
        `seconds` to draft and verify."""
        self.steps[translation].append((n_emitted, seconds))
        self.ran[translation] += 1
        self.n += 1

    def rate(self, translation: str) -> float | None:
        """Tokens per second over its recent steps (None: none measured)."""
        steps = self.steps[translation]
        secs = sum(s for _, s in steps)
        return sum(n for n, _ in steps) / secs if steps and secs > 0 else None

    @property
    def best(self) -> str:
        """The faster translation as measured (TLI until both are)."""
        r_tli, r_str = self.rate(TLI), self.rate(STRING)
        return STRING if r_tli is not None and r_str is not None and r_str > r_tli else TLI

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
