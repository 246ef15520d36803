"""The draft model as a drafter: a small model of the target's vocabulary with a memory of its own, which may see
only a window of recent tokens (--ctx-draft; with auto, window.py's trial decides)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...errors import UsageError
from ..core.memory import Memory, common_prefix, extend_many
from ..core.sampling import Sampling, SparseDist
from ..core.settings import AGREE_TOKENS, DRAFT_SINK
from ..llama import ffi as _ffi
from .base import (CATCHUP_SHORT, Agreement, Drafter, PromptRead, Proposal, Timing, pick, pick_loop,
                   proposal_with_costs)
from .window import DraftWindow, agreeing

if TYPE_CHECKING:
    from ..control.length import LengthController
    from ..core.prompt import AgreeRows, Span
    from ..runtime.engine import Engine
    from ..runtime.session import Session
    from ..runtime.step import StepResult
    from ..core.settings import GenerationSettings

READ_TIMED_MIN = 16  # a read of the prompt this long or longer prices its catch-up (PromptRead.longest)


class ModelDrafter(Drafter):
    """--drafter model: drafts greedily (or samples, under rejection) from the draft model's memory of the history,
    which prefill fills, times and compares with the target (reads_prompt)."""

    name = "model"
    needs_draft_model = True
    reads_prompt = True

    def __init__(self, session: Session):
        super().__init__(session)
        eng = session.engine
        ctx = self.shared if eng.parallel == 1 else self.shared.seq(session.seq)
        self.memory = Memory(ctx, partial_rm=not eng.draft.is_recurrent_or_hybrid)
        self.n_slides = 0  # times the window moved on (a smaller --ctx-draft)
        # the window: --ctx-draft's, or with --ctx-draft auto what the window trials chose (None: all)
        self.window = eng.draft_window
        self.trial = DraftWindow(self)
        # the last agreement's (position, the target's choices, the rows where the draft's were the same)
        self.agree_rows: tuple[int, np.ndarray, np.ndarray] | None = None
        self.prompt_read = PromptRead()  # what the last read of a prompt found
        self.n_batched = 0  # proposals drafted beside other sequences' (propose_batch)

    @classmethod
    def provide(cls, engine: Engine) -> _ffi.Context | None:
        """The draft model's context (engine.dft_ctx), where the engine loaded one (Engine(draft=...)): --ctx-draft
        tokens (the target's context where none), a sequence per --parallel, warmed up."""
        if engine.draft is None:
            return None
        c = _ffi.Context(engine.draft, engine.draft_n_ctx, engine.draft_threads, n_batch=engine.draft_n_batch,
                         n_outputs_max=max(AGREE_TOKENS, engine.parallel), name="draft",
                         flash_attn=engine.draft_flash_attn, n_seq=engine.parallel)
        try:
            c.warm_up()
        except BaseException:
            c.close()
            raise
        return c

    @classmethod
    def available(cls, engine: Engine) -> bool:
        return engine.dft_ctx is not None

    @classmethod
    def for_engine(cls, engine: Engine) -> type[Drafter]:
        """A draft of another vocabulary translates (crossvocab.py)."""
        if getattr(engine, "vocab_bridge", None) is None:
            return cls
        from .crossvocab import CrossVocabDrafter  # it builds on this module
        return CrossVocabDrafter

    @classmethod
    def check(cls, engine: Engine) -> None:
        if engine.draft is None:
            raise UsageError("speculative decoding needs a draft model; "
                             "pass --draft (or --drafter ngram, suffix or mtp)")

    @classmethod
    def cost_prior(cls, engine: Engine) -> float:
        """About its share of the target's bytes."""
        return engine.draft.size_bytes / max(engine.target.size_bytes, 1)

    @property
    def n_restores(self) -> int:
        return self.memory.n_restores

    @property
    def n_rollbacks(self) -> int:
        return self.memory.n_rollbacks

    @property
    def decode_s(self) -> float:
        return self.trial.decode_s

    def propose(self, n_max: int, s: GenerationSettings, samp: Sampling) -> Proposal:
        """Draft up to n_max tokens: greedy, or sampled from the draft's transformed distribution (rejection);
        stops early where the draft's top probability < p_min. The catch-up decode yields the first token."""
        clock = self.session.engine.clock
        t_start = clock()
        todo = self._to_decode(n_max)
        if todo is None:
            return Proposal()
        self.memory.extend(todo, logits="last")  # catch up, incl. the last token
        self.memory.save_checkpoint()
        t_loop = clock()
        drafts, dists = self._draft(n_max, s, samp)
        return proposal_with_costs(drafts, dists, len(todo), t_start,
                                   t_start if len(todo) <= CATCHUP_SHORT else None, t_loop, clock())

    @classmethod
    def propose_batch(cls, asks: list[tuple[ModelDrafter, int, GenerationSettings, Sampling]]) -> list[Proposal]:
        """propose() for several sequences of one draft context: each draft position is one decode over the
        sequences still drafting (the catch-ups too, where they fit one batch); each picks from its own rows
        with its own sampling state. The drafting time is the batch's, counted whole for each."""
        if len(asks) <= 1:
            return [d.propose(n, s, samp) for d, n, s, samp in asks]
        clock = asks[0][0].session.engine.clock
        t_start = clock()
        behind = [d._to_decode(n_max) for d, n_max, _, _ in asks]
        live = [i for i, todo in enumerate(behind) if todo is not None]
        catchup = [len(todo or ()) for todo in behind]
        parts = [(asks[i][0].memory, behind[i], "last") for i in live]
        if sum(len(todo) for _, todo, _ in parts) > asks[0][0].memory.ctx.n_batch:  # long catch-ups first, alone
            for m, todo, _ in parts:
                m.extend(todo[:-1], logits="none")
            parts = [(m, todo[-1:], "last") for m, todo, _ in parts]
        extend_many(parts)
        for i in live:
            asks[i][0].memory.save_checkpoint()
            asks[i][0].n_batched += 1
        t_loop = clock()
        drafts: list[list] = [[] for _ in asks]
        dists: list[list] = [[] for _ in asks]
        active = live
        while active:
            more = []
            for i in active:
                d, n_max, s, samp = asks[i]
                got = d._pick(drafts[i], s, samp)
                if got is not None:
                    drafts[i].append(got[0])
                    if got[1] is not None:
                        dists[i].append(got[1])
                    until = d.session.until
                    if len(drafts[i]) < n_max and (until is None or not until(drafts[i])):
                        more.append(i)
            extend_many([(asks[i][0].memory, [asks[i][0]._fed(drafts[i][-1])], "last") for i in more])
            active = more
        t_end = clock()
        return [proposal_with_costs(drafts[i], dists[i], catchup[i], t_start,
                                    t_start if catchup[i] <= CATCHUP_SHORT else None, t_loop, t_end)
                if i in live else Proposal() for i in range(len(asks))]

    # ---- what propose and propose_batch ask of a draft model (crossvocab.py answers them for another vocabulary)
    def _to_decode(self, n_max: int) -> list[int] | None:
        """The tokens to decode before drafting up to n_max (the last one's row gives the first draft), the memory
        rolled back as needed; None: nothing can be drafted now."""
        self.fit(len(self.session.history) + n_max)
        return self.session.history[self.memory.next_index():]

    def _pick(self, drafts: list[int], s: GenerationSettings, samp: Sampling) -> tuple[int, SparseDist | None] | None:
        """The next draft token after `drafts` (and its q under rejection), from the memory's last row; None: stop."""
        row = samp.draft_row(self.memory.ctx.logits(1)[0], drafts)
        return pick(row, s.p_min, samp, self.session.engine.target.n_vocab, self.session.engine.clock)

    def _fed(self, tok: int) -> int:
        """The draft's own token for drafted target token `tok` (the same id here)."""
        return tok

    def _draft(self, n_max: int, s: GenerationSettings, samp: Sampling) -> tuple[list[int], list[SparseDist]]:
        """Draft token by token after the catch-up (pick_loop over _pick, feeding _fed)."""
        return pick_loop(lambda drafts: self._pick(drafts, s, samp),
                         lambda tok, i: self.memory.extend([self._fed(tok)], logits="last"), n_max, self.session.until)

    def fit(self, n_tokens: int) -> None:
        """Move the window on, if there is one, so that it can hold the history's first n_tokens tokens: it
        restarts from the last half-window of the history (evaluated again at the next catch-up), after the
        history's first DRAFT_SINK tokens. A model attends heavily to the first tokens of its context (attention
        sinks): a window without them predicts far worse than one with them."""
        window, dft = self.window, self.memory
        if window is None or n_tokens - dft.offset + dft.sink <= window:
            return
        dft.clear()
        dft.offset = min(n_tokens - window // 2, len(self.session.history) - 1)
        dft.sink = min(DRAFT_SINK, dft.offset)
        dft.extend(self.session.history[:dft.sink], logits="none")
        self.n_slides += 1

    def rewind(self) -> None:
        hist, dft = self.session.history, self.memory
        if len(hist) <= dft.offset:
            dft.clear()  # rolled back past the window: it starts again from the beginning
        dft.truncate(common_prefix(dft.tokens, dft.view(hist)))

    def clear(self) -> None:
        self.trial.abandon()
        self.memory.clear()

    def behind(self) -> int:
        return len(self.session.history) - self.memory.next_index()

    def share_prefix(self, other: Drafter, n: int, prompt: list[int]) -> None:
        self.memory.copy_prefix(other.memory, min(n, common_prefix(other.memory.tokens, prompt)))

    def counts(self) -> dict[str, int]:
        return {"n_draft_slides": self.n_slides, "n_window_trials": self.trial.n_trials,
                "n_window_reverts": self.trial.n_reverts}

    # ---- the window trial (--ctx-draft auto: window.py) --------------------------------------------------
    def wants_prompt_rows(self, n_new: int) -> bool:
        return self.trial.due(n_new)

    def prompt_compared(self, ctrl: LengthController, overhead) -> Agreement | None:
        return self.trial.try_window(ctrl, overhead)

    def stepped(self, step: StepResult) -> None:
        self.trial.settle_when_due(finished=False)

    def ended(self, prompt: list[int], output: list[int], interrupted: bool) -> None:
        if not interrupted:
            self.trial.settle_when_due(finished=True)
        self.trial.abandon()  # interrupted on probation: the whole context's memory again

    # ---- prefill: the prompt on the draft's memory (Session.prefill_reader) -------------------------------
    def read_prompt(self, spans: list[tuple[Span, float | AgreeRows]], last: int) -> PromptRead:
        """Read the prompt up to `last`: each timed span's tokens decoded alone and timed, the agreement span's
        rows compared with the target's (teacher-forced greedy acceptance; under rejection sampling each row's
        expected acceptance Σ min(p, q)), the longest read in between timed (a catch-up's cost)."""
        out = PromptRead()
        self.agree_rows = None
        n_vocab = self.session.engine.target.n_vocab
        for span, got in spans:
            self._read(span.pos, out)
            if span.agree:
                self.before_agreement(span.pos, len(got.want))
                agreement = self.agreement(span.pos, got.want, got.expected(n_vocab))
                if agreement is not None:
                    out.agreement = agreement
            else:
                out.timings.append(Timing(span.pos, span.n, got, self.time_span(span.pos, span.n)))
        self._read(last, out)
        self.prompt_read = out
        return out

    def _read(self, pos: int, out: PromptRead) -> None:
        """Read the prompt up to pos; the longest such read is timed (out.longest)."""
        clock = self.session.engine.clock
        t0 = clock()
        n = self.read_to(pos)
        if n >= READ_TIMED_MIN and (out.longest is None or n > out.longest[1]):
            out.longest = (pos, n, clock() - t0)

    def read_to(self, pos: int) -> int:
        """Evaluate the history up to (not including) pos; the tokens decoded."""
        self.fit(pos + 1)
        todo = self.session.history[self.memory.next_index():pos]
        self.memory.extend(todo, logits="none")
        return len(todo)

    def time_span(self, pos: int, n: int = 1) -> float | None:
        """Decode history[pos:pos+n] as one batch and time it, where the memory stands there (None otherwise)."""
        if self.memory.next_index() != pos:
            return None
        clock = self.session.engine.clock
        t0 = clock()
        self.memory.extend(self.session.history[pos:pos + n], logits="last")
        return clock() - t0

    def before_agreement(self, pos: int, n: int) -> None:
        """Get ready to compare history[pos:pos+n] (before the target decodes them)."""
        self.fit(pos + n)
        dft = self.memory
        if dft.next_index() > pos >= dft.offset:
            # The draft holds rows the target lacks (the history's last token, evaluated by a drafting step or an
            # earlier prefill): drop them, or the rows to compare would be missing on the draft's side.
            dft.truncate(dft.sink + pos - dft.offset)

    def agreement(self, pos: int, want: np.ndarray, expected=None) -> Agreement | None:
        """Decode history[pos:pos+len(want)] with every row's logits and count the rows where the greedy choice is
        the target's (`want`), or with `expected` (a function of the rows' logits: each row's expected acceptance
        under rejection sampling) sum that; None where the window moved on (the rows are then decoded plainly)."""
        n, dft, hist = len(want), self.memory, self.session.history
        if dft.next_index() != pos:
            dft.extend(hist[dft.next_index():pos + n], logits="none")
            return None
        dft.extend(hist[pos:pos + n], logits="all")
        logits = dft.ctx.logits(n)
        ok = logits.argmax(axis=1) == want
        self.agree_rows = (pos, want, ok)
        return agreeing(ok) if expected is None else Agreement(float(sum(expected(logits))), n)
