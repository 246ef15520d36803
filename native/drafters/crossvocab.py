"""The draft model when its vocabulary differs from the target's (core/vocabmap.py): --drafter model translates.

The draft keeps its own token history (`DraftText`): the committed target tokens rendered to text, which the draft's
tokenizer reads again from a few tokens back each step; its memory is rolled back to the common prefix with that
and extended. Two translations (--vocab-map):
- tli: each drafted token is drawn from (or, greedy, the top of) the draft's distribution over the tokens both
  vocabularies share, carried to target ids and renormalised (VocabBridge.carry); that is the verify's q.
- string: the draft drafts greedily in its own vocabulary; the target's tokenizer reads a short tail of committed
  text and the draft's text, and the target tokens after the tail, less the last word, are the proposal (a point
  mass).
- auto: each step drafts with the translation the engine's TranslationChooser picks (control/translation.py: a
  trial of both, then the one whose steps emit more tokens per second); each step's outcome is recorded there.
Units: proposals are target ids; the controller, cost model and batch planner count target tokens. The prompt's
agreement rows and the draft-window trial compare draft rows with target ids: both are off for such a pair (the
controller starts from its priors and learns from the steps), and the draft sees the whole context.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import TYPE_CHECKING

import numpy as np

from ..core.accept import top_probability
from ..core.memory import common_prefix
from ..core.sampling import Sampling, SparseDist, sample
from ..core.vocabmap import SHARED_MIN, STRING, TLI, Tokenizer, VocabBridge, char_end
from .base import PromptRead, Proposal, Timing
from .model import ModelDrafter
from .ngram import point_mass

if TYPE_CHECKING:
    from ..core.prompt import AgreeRows, Span
    from ..runtime.session import Session
    from ..runtime.step import StepResult
    from ..core.settings import GenerationSettings

BACKOFF = 4  # draft tokens read again before the committed text's new part (their split may change)
TAIL = 4  # committed target tokens the target's tokenizer reads before the string path's draft text
TAIL_MAX = 16  # the string path proposes nothing where no good boundary lies this close
WHITESPACE = b" \t\n\r"


class DraftText:
    """The draft's tokens for the text of a target token history, kept up to date by reading again only the end.

    `text`: the rendered history (a target BOS at its start is the draft's own BOS, not text); `tokens`: the
    draft's tokens of text[:end], `end` the last whole character; `ends[i]`: the byte where tokens[i] ends."""

    def __init__(self, bridge: VocabBridge, draft_bos: int | None):
        self.bridge = bridge
        self.head = [] if draft_bos is None else [draft_bos]
        self.src: list[int] = []  # the target tokens rendered
        self.src_ends: list[int] = []
        self.text = bytearray()
        self.tokens: list[int] = []
        self.ends: list[int] = []

    @property
    def complete(self) -> bool:
        """Whether the draft's tokens cover the whole text (no partial character pending)."""
        return (self.ends[-1] if self.ends else 0) == len(self.text)

    def all(self) -> list[int]:
        """The draft's token history: its BOS where it adds one, then the text's tokens."""
        return self.head + self.tokens

    def sync(self, history: list[int]) -> list[int]:
        """Follow `history` (rolled back and extended as it was since the last call); the draft's token history."""
        tgt = self.bridge.target
        n = common_prefix(self.src, history)
        if n < len(self.src):
            cut = self.src_ends[n - 1] if n else 0
            del self.src[n:], self.src_ends[n:], self.text[cut:]
            k = bisect_right(self.ends, cut) if cut else 0  # (a space prefix's token ends at 0)
            del self.tokens[k:], self.ends[k:]
        for t in history[n:]:
            if not (len(self.src) == 0 and t == tgt.model.bos and not tgt.is_text[t]):
                self.text += tgt.pieces[t]
            self.src.append(t)
            self.src_ends.append(len(self.text))
        self._retokenize()
        return self.all()

    def _retokenize(self) -> None:
        dft, text = self.bridge.draft, self.text
        end = char_end(text)
        k = max(len(self.tokens) - BACKOFF, 0)
        while k > 0 and not dft.boundary_ok(text, self.ends[k - 1]):
            k -= 1
        start = self.ends[k - 1] if k else 0
        if start == 0:
            k = 0  # from the text's start, as a whole (a space prefix's token ends at 0 too)
        if end <= start or end == (self.ends[-1] if self.ends else 0):
            return  # nothing new to cover
        new = dft.tokenize(bytes(text[start:end]), at_start=start == 0)
        self.tokens[k:] = new
        self.ends[k:] = dft.ends(new, start, end - start)


class CrossVocabDrafter(ModelDrafter):
    """--drafter model with a draft of another vocabulary: the module's docstring."""

    def __init__(self, session: Session):
        super().__init__(session)
        eng = session.engine
        self.bridge: VocabBridge = eng.vocab_bridge
        self.translation: str = eng.vocab_map  # tli, string or auto (eng.vocab_chooser picks each step)
        self.chooser = eng.vocab_chooser
        draft = eng.draft
        self.text = DraftText(self.bridge, draft.bos if draft.add_bos else None)
        self.n_unaligned = 0  # string-path steps with nothing to propose: the tail's tokens changed
        self.n_full = 0  # steps with no proposal: the draft's context could not hold the text
        self.n_steps = {TLI: 0, STRING: 0}  # steps drafted with each translation
        self._ran: tuple[str, bool] | None = None  # this step's translation and whether it drafted greedily

    # ---- the draft's memory of the committed text -------------------------------------------------------
    def _catch_up(self, history: list[int], logits: str, room: int = 0) -> int | None:
        """Hold the draft's tokens for `history`'s text (`_behind`, then decode them). The tokens decoded; None
        where the text and `room` more tokens would not fit the draft's context."""
        todo = self._behind(history, logits == "last", room)
        if todo is not None:
            self.memory.extend(todo, logits=logits)
        return None if todo is None else len(todo)

    def _behind(self, history: list[int], last_row: bool, room: int) -> list[int] | None:
        """Roll the memory back to the common prefix with the draft's tokens for `history`'s text; the tokens to
        decode after it (where the last row's logits are wanted, at least that row, decoded again if held). None
        where the text and `room` more tokens would not fit the draft's context (its tokens may outnumber the
        target's): the memory is then only rolled back."""
        want, dft = self.text.sync(history), self.memory
        n = common_prefix(dft.tokens, want)
        if len(want) + room > dft.ctx.n_ctx:
            self.n_full += 1
            dft.truncate(n)
            return None
        if last_row and n == len(want):
            n -= 1
        dft.truncate(n)
        return want[n:]

    def rewind(self) -> None:
        self.memory.truncate(common_prefix(self.memory.tokens, self.text.sync(self.session.history)))

    def clear(self) -> None:
        super().clear()
        self.text = DraftText(self.bridge, self.text.head[0] if self.text.head else None)

    def behind(self) -> int:
        return max(len(self.text.head) + len(self.text.tokens) - len(self.memory.tokens), 1)

    def share_prefix(self, other, n: int, prompt: list[int]) -> None:
        """Nothing shared: its memory is in draft tokens, not the target's."""

    def fit(self, n_tokens: int) -> None:
        """The draft sees the whole context (no window for such a pair)."""

    def wants_prompt_rows(self, n_new: int) -> bool:
        return False

    def read_prompt(self, spans: list[tuple[Span, float | AgreeRows]], last: int) -> PromptRead:
        """Read the prompt's text up to `last`; nothing timed or compared (the module's docstring)."""
        self._catch_up(self.session.history[:last], logits="none")  # (a prompt too long for it: read when drafting)
        return PromptRead(timings=[Timing(span.pos, span.n, got, None) for span, got in spans if not span.agree])

    def read_to(self, pos: int) -> int:
        """Hold the draft's tokens for the history's text up to (not including) pos; the tokens decoded."""
        return self._catch_up(self.session.history[:pos], logits="none") or 0

    def counts(self) -> dict[str, int]:
        return {"n_vocab_unaligned": self.n_unaligned, "n_vocab_full": self.n_full,
                "n_vocab_tli_steps": self.n_steps[TLI], "n_vocab_string_steps": self.n_steps[STRING]}

    # ---- which translation drafts (--vocab-map; auto: control/translation.py) ----------------------------
    def _translation(self, samp: Sampling) -> str:
        """The translation to draft with now, noted for stepped()."""
        greedy = samp.draft_tf is None
        t = self.translation if self.chooser is None else self.chooser.scores(greedy).current
        self._ran = (t, greedy)
        return t

    def stepped(self, step: StepResult) -> None:
        """Count the step's translation; under auto, tell the chooser what it emitted and cost."""
        super().stepped(step)
        if self._ran is not None:
            t, greedy = self._ran
            self.n_steps[t] += 1
            if self.chooser is not None:
                self.chooser.scores(greedy).record(t, len(step.emitted), step.draft_s + step.verify_s)
        self._ran = None

    def attach(self, on: bool) -> None:
        super().attach(on)
        self._ran = None  # (a generation that ended between a proposal and its step)

    # ---- proposals: ModelDrafter.propose and propose_batch, through these --------------------------------
    @classmethod
    def propose_batch(cls, asks: list[tuple[CrossVocabDrafter, int, GenerationSettings, Sampling]]) -> list[Proposal]:
        """TLI drafts a batch's sequences together (ModelDrafter.propose_batch); the string path one at a time."""
        if any(d._translation(samp) == STRING for d, _, _, samp in asks):
            return [d.propose(n, s, samp) for d, n, s, samp in asks]
        return super().propose_batch(asks)

    def _to_decode(self, n_max: int) -> list[int] | None:
        """The draft's tokens for the history's text not yet decoded (_behind); None where they and a draft would
        not fit its context, or the history ends inside a character (the draft has no row for it)."""
        todo = self._behind(self.session.history, True, n_max + 2)
        if todo is None or not self.text.complete:
            self._ran = None  # no draft this step, whichever translation: nothing for auto to score
            return None
        return todo

    def _fed(self, tok: int) -> int:
        return self.bridge.t2d[tok]

    def _draft(self, n_max: int, s: GenerationSettings, samp: Sampling) -> tuple[list[int], list[SparseDist]]:
        if self._translation(samp) == STRING:
            return self._string(n_max, s, samp)
        return super()._draft(n_max, s, samp)

    def _row(self) -> np.ndarray:
        return self.memory.ctx.logits(1)[0]

    def _pick(self, drafts: list[int], s: GenerationSettings, samp: Sampling) -> tuple[int, SparseDist | None] | None:
        """TLI's next token in target ids and its q (None greedy), from the draft's distribution over shared tokens
        (greedy: its top), or None to stop: too little shared mass, a constraint that leaves nothing, or a top
        probability below p_min. The stops depend only on the draft's row."""
        bridge, row, p_min = self.bridge, self._row(), s.p_min
        if samp.draft_tf is None and samp.guide is None:
            tok, top, mass = bridge.greedy(row)
            return None if mass < SHARED_MIN or p_min > 0 and top < p_min else (tok, None)
        if samp.guide is not None:
            projected, mass = bridge.project(row)
            if mass < SHARED_MIN:
                return None
            masked = samp.draft_row(projected, drafts)
            if samp.draft_tf is None:
                tok = int(masked.argmax())
                if not np.isfinite(masked[tok]) or p_min > 0 and top_probability(masked) < p_min:
                    return None
                return tok, None
            q = samp.draft_tf(masked)  # under a constraint: masked in target ids, then transformed
        else:
            carried = bridge.carry(samp.draft_tf(row))  # transformed in the draft's vocabulary, then carried
            if carried is None:
                return None
            q = carried[0]
        if q.probs.sum() <= 0 or p_min > 0 and q.top_prob() < p_min:
            return None
        return sample(q, samp.rng), q

    def _string(self, n_max: int, s: GenerationSettings, samp: Sampling) -> tuple[list[int], list[SparseDist]]:
        """The string path: draft greedily in the draft's vocabulary (n_max + 1 tokens at most, stopping at a
        token that is not text or below p_min), then read the text with the target's tokenizer."""
        dft_tok, words = self.bridge.draft, []
        ended = False
        while len(words) <= n_max:
            row = self._row()
            tok = int(row.argmax())
            if not dft_tok.is_text[tok]:
                ended = self.session.engine.draft.is_eog(tok)
                break
            if s.p_min > 0 and top_probability(row) < s.p_min:
                break
            words.append(tok)
            if len(words) > n_max:
                break
            self.memory.extend([tok], logits="last")
        drafts = string_proposal(self.bridge.target, self.session.history, dft_tok.render(words), ended)
        if drafts is None:
            self.n_unaligned += 1
            drafts = []
        drafts = drafts[:n_max]
        return drafts, [point_mass(t) for t in drafts] if samp.draft_tf is not None else []


def string_proposal(tgt: Tokenizer, history: list[int], draft_text: bytes, ended: bool) -> list[int] | None:
    """The target tokens that `draft_text` adds after `history`: the history's last few tokens' text (TAIL, or
    further back to where the target's tokenizer can start: Tokenizer.starts_ok) and the draft text tokenized
    by the target, less the tail (where the tail's tokens come out otherwise, the draft text alone); the draft
    text's last word held back (held_back) unless the draft ended there (`ended`: it drafted an end of generation
    next). None where nothing can be proposed."""
    text = bytes(draft_text[:char_end(draft_text)]) if ended else held_back(draft_text)
    if not text:
        return []
    lo = max(len(history) - TAIL_MAX, 1 if history and not tgt.is_text[history[0]] else 0)
    for j in range(max(len(history) - TAIL, lo), lo - 1, -1):
        tail = tgt.render(history[j:])
        if j == 0 or tgt.starts_ok(tail):
            break
    else:
        return None
    got = tgt.tokenize(tail + text, at_start=False)  # (a tail from the start holds the tokenizer's own prefix)
    n = len(history) - j
    if got[:n] == history[j:]:
        return got[n:]
    # The draft's text would have merged into the history's last word (" ju" + "mps"): the target, whose " ju" is
    # committed, continues it as the text alone splits.
    return tgt.tokenize(text, at_start=False) if tgt.starts_ok(text) or not tgt.prefix_space else None


def held_back(text: bytes) -> bytes:
    """The draft text less its last word and the whitespace before it: more text could still change how the
    target splits that word (" jum" → " jumps"), never what came before (tokenizers split at whitespace first)."""
    i = len(text)
    while i > 0 and text[i - 1] not in WHITESPACE:
        i -= 1
    while i > 0 and text[i - 1] in WHITESPACE:
        i -= 1
    return bytes(text[:i])
