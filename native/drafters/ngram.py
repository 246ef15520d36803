"""N-gram (prompt-lookup) drafting: propose what followed the text's own ending where it occurred before. No
model: it pays when the answer repeats its input (code edits, summaries, JSON).

Statistics of the text, kept up to date as it grows (`NgramIndex`, as llama.cpp's `ngram-cache` keeps its context
level): for every n-gram of 1..ngram_max tokens, how often each token followed it, and which one followed it last.
Each drafted token comes from the longest ending of the text (drafts so far included) seen before: from n-grams of
at least --ngram-min tokens the token that followed it last (a copied passage continues as it went); from shorter
ones only a clear majority of enough occurrences (SHORT_MIN_SEEN, SHORT_MIN_SHARE), which drafts in text that
repeats words and phrases without whole passages. Drafting stops where no ending qualifies.

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

# An ending shorter than --ngram-min drafts its most frequent follower only if it was seen this often, the follower
# this share of the times (by length 1, 2: llama.cpp's lax thresholds for its context cache)
SHORT_MIN_SEEN = (2, 2)
SHORT_MIN_SHARE = (0.66, 0.5)


class NgramIndex:
    """For n = 1..n_max: n-gram → {following token: count} and the token that followed it last, over a text that
    grows at its end and is cut back (sync follows both)."""

    def __init__(self, n_max: int):
        self.n_max = n_max
        self.text: list[int] = []  # what the counts were made from
        self.counts: dict[tuple[int, ...], dict[int, int]] = {}
        self.last: dict[tuple[int, ...], int] = {}

    def sync(self, tokens: Sequence[int]) -> bool:
        """Make the statistics those of `tokens`: undo what no longer matches, count what is new. Whether anything
        changed."""
        text, n = self.text, len(self.text)
        if only_grew(tokens, text):  # the usual case
            keep = n
        else:
            keep = next((i for i, (a, b) in enumerate(zip(text, tokens)) if a != b), min(n, len(tokens)))
        if keep < len(text) // 2:
            self.counts, self.last, self.text = {}, {}, []
        while len(self.text) > keep:
            self._uncount()
        for tok in tokens[len(self.text):]:
            self._count(int(tok))
        return keep < n or len(tokens) > n

    def _count(self, tok: int) -> None:
        t = self.text
        for n in range(1, min(self.n_max, len(t)) + 1):
            key = tuple(t[len(t) - n:])
            part = self.counts.setdefault(key, {})
            part[tok] = part.get(tok, 0) + 1
            self.last[key] = tok
        t.append(tok)

    def _uncount(self) -> None:
        t = self.text
        tok = t.pop()
        for n in range(1, min(self.n_max, len(t)) + 1):
            key = tuple(t[len(t) - n:])
            part = self.counts[key]
            part[tok] -= 1
            if not part[tok]:
                del part[tok]
            if not part:
                del self.counts[key], self.last[key]
            elif self.last.get(key) == tok:  # which token followed it last is not kept: the most frequent left
                self.last[key] = max(part, key=part.__getitem__)

    def next_token(self, ending: Sequence[int], n_min: int) -> int | None:
        """The token to draft after `ending` (its last n_max tokens matter), or None."""
        for n in range(min(self.n_max, len(ending)), 0, -1):
            key = tuple(ending[len(ending) - n:])
            part = self.counts.get(key)
            if not part:
                continue
            if n >= n_min:
                return self.last[key]
            seen = sum(part.values())
            tok, most = max(part.items(), key=lambda kv: kv[1])
            i = min(n, len(SHORT_MIN_SEEN)) - 1
            if seen >= SHORT_MIN_SEEN[i] and most >= SHORT_MIN_SHARE[i] * seen:
                return tok
        return None

    def propose(self, n_min: int, k: int, after: Sequence[int] = ()) -> list[int]:
        """Up to k tokens to follow the text (followed by `after`, which is not counted)."""
        ending = (self.text[-self.n_max:] + list(after))[-self.n_max:]
        out: list[int] = []
        while len(out) < k:
            tok = self.next_token(ending, n_min)
            if tok is None:
                break
            out.append(tok)
            ending = (ending + [tok])[-self.n_max:]
        return out


def only_grew(tokens: Sequence[int], text: list[int]) -> bool:
    """Whether `tokens` is `text` grown at its end (their last 16 tokens compared: a history changes at its end)."""
    n = len(text)
    tail = max(0, n - 16)
    return len(tokens) >= n and list(tokens[tail:n]) == text[tail:]


def propose(tokens: Sequence[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Up to k tokens to follow `tokens` (a fresh index: NgramDrafter keeps one up to date instead)."""
    index = NgramIndex(n_max)
    index.sync(tokens)
    return index.propose(n_min, k)


def point_mass(token: int) -> SparseDist:
    """The n-gram drafter's proposal distribution for one token."""
    return SparseDist(np.array([token], np.int32), np.array([1.0]))


class NgramDrafter(Drafter):
    """--drafter ngram: lookup in the text so far (--ngram-min/--ngram-max); its drafting cost is not measured."""

    name = "ngram"
    on_match_only = True
    has_memory = False

    def __init__(self, session):
        super().__init__(session)
        self.index: NgramIndex | None = None
        self._cached: tuple[int, int, int, list[int]] | None = None  # (history length, n_min, k, proposal)

    def _propose(self, n_max: int, s: GenerationSettings) -> list[int]:
        hist = self.session.history
        if self.index is None or self.index.n_max != s.ngram_max:
            self.index = NgramIndex(s.ngram_max)
        if self.index.sync(hist):
            self._cached = None
        key = (len(hist), s.ngram_min, n_max)
        if self._cached is None or self._cached[:3] != key:
            self._cached = (*key, self.index.propose(s.ngram_min, n_max))
        return list(self._cached[3])

    def propose(self, n_max: int, s: GenerationSettings, samp: Sampling) -> Proposal:
        drafts = self._propose(n_max, s)
        return Proposal(drafts, [point_mass(t) for t in drafts] if samp.draft_tf else [])

    def limit(self, n_max: int, s: GenerationSettings) -> int:
        """A proposal exists only on a match, and is as long as what followed it."""
        return len(self._propose(n_max, s))

    def lookahead(self, drafts: list[int], n: int, s: GenerationSettings) -> int:
        """What it would propose (at most n tokens) after the history and `drafts`, from the index of the history
        (synced by this step's limit()): drafts extend the ending looked up, as its own proposals do."""
        return len(self.index.propose(s.ngram_min, n, drafts)) if self.index is not None and n > 0 else 0

    def clear(self) -> None:
        self.index, self._cached = None, None
