"""Exploration: when a controller that found plain decoding (or another drafter) better tries a draft again, and
what those tries may cost. Both controllers (length.LengthController, chooser.DrafterChooser) use these."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_HORIZON = 128  # tokens a generation is taken to have left when it has no n_predict (ExploreBudget)


@dataclass
class ExploreBudget:
    """What probes may cost: at most `share` of the decoding time (what went so far, and what plain decoding
    would take for the tokens still to come), beyond what plain decoding would have taken for the tokens the
    probes emitted. A probe runs only where its predicted extra fits what is left, and its measured extra is then
    booked (a probe that gains pays back). So exploring for a better draft makes a generation at most about
    `share` slower than plain decoding, whatever the pair and the context."""

    share: float = 0.03
    elapsed_s: float = 0.0  # every step's time
    spent_s: float = 0.0  # the probes' measured extra over plain decoding (negative: they gained)
    n_refused: int = 0  # probes not run because their predicted extra did not fit

    def allows(self, predicted_extra_s: float, plain_s: float, remaining: int) -> bool:
        """Whether a probe expected to cost predicted_extra_s more than plain decoding fits, with `remaining`
        tokens still to generate at plain_s each."""
        if predicted_extra_s <= 0 or \
                self.spent_s + predicted_extra_s <= self.share * (self.elapsed_s + remaining * plain_s):
            return True
        self.n_refused += 1
        return False


class ProbeSchedule:
    """When a probe is due while plain decoding wins: after more than `interval` plain steps, an interval that
    starts at probe_min, doubles (up to probe_max) while probes keep failing and starts over once drafting wins;
    while evidence is thin (LengthController.min_evidence), after `thin_gap` plain steps instead: every other step
    as long as probes pay for themselves, spaced within thin_budget of plain decoding when they cost. A probe that
    gained (it emitted more than its time in plain steps) makes the next one due as soon, whatever the evidence: the
    draft may have turned good (the text changed), and the probes that show it cost nothing. A probe's measured
    extra cost also stretches `interval` so that probes stay within probe_budget of plain decoding."""

    def __init__(self, probe_min: int, probe_max: int, probe_budget: float, thin_budget: float = 0.05):
        self.probe_min, self.probe_max = probe_min, probe_max
        self.probe_budget = probe_budget  # probes may cost at most this share of plain decoding time
        self.thin_budget = thin_budget  # what the frequent probes of thin evidence may cost, the same way
        self.interval = probe_min
        self.thin_gap = 1  # plain steps between probes while evidence is thin
        self.plain_streak = 0
        self.probing = False  # the next step observed is a probe (its cost is measured)
        self.gained = False  # the last probe emitted more than plain decoding would have in its time
        self.n_gained = 0

    def drafting(self) -> None:
        """A step drafts on its merits: plain decoding stopped winning, the spacing starts over."""
        self.plain_streak = 0
        self.interval = self.probe_min

    def plain_step(self) -> None:
        """Plain decoding won this step."""
        self.plain_streak += 1

    def gap(self, thin: bool, at_least: int = 0) -> int:
        """Plain steps that must pass before the next probe (`at_least`: another schedule's interval)."""
        return self.thin_gap if thin or self.gained else max(self.interval, at_least)

    def due(self, thin: bool) -> bool:
        """Whether the plain steps so far make a probe due."""
        return self.plain_streak > self.gap(thin)

    def probe(self, thin: bool) -> None:
        """A probe runs now: the streak starts over and, evidence not thin, the next one waits twice as long."""
        self.plain_streak = 0
        if not thin:
            self.interval = doubled(self.interval, self.probe_max)

    def measured(self, extra: float) -> None:
        """A probe cost `extra` plain steps more than plain decoding would have (negative: it gained)."""
        if extra > 0:
            self.interval = max(self.interval, int(extra / self.probe_budget))
        self.thin_gap = max(1, int(extra / self.thin_budget)) if extra > 0 else 1
        self.gained = extra < 0
        self.n_gained += self.gained


def doubled(interval: int, most: int) -> int:
    """The next interval of a spacing that doubles while tries keep losing."""
    return min(2 * interval, most)
