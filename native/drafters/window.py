"""--ctx-draft auto: the draft model's window trial and probation.

At a long context a draft that sees only the last WINDOW_TRIAL tokens may draft nearly as well for far less. A
trial (after a prefill that compared the draft with the target) times both and may take the window, on probation:
the answer's first WINDOW_PROBATION rows then decide whether it is kept, while the whole context's memory waits
untouched, so that giving the window up costs no new prefill.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, TYPE_CHECKING

import numpy as np

from ..control.length import LengthController
from ..control.window import paired_acceptance, window_pays, window_pays_at
from ..core.memory import Memory
from ..core.settings import (AGREE_TOKENS, DRAFT_SINK, WINDOW_PROBATION, WINDOW_TIMINGS, WINDOW_TRIAL,
                             WINDOW_TRIAL_MIN)
from ..llama import ffi as _ffi
from .base import Agreement

if TYPE_CHECKING:
    from .model import ModelDrafter

log = logging.getLogger("specq.engine")


@dataclass
class _Probation:
    """A window a trial took on the prompt's rows and has not kept yet (DraftWindow.settle): the window drafts from
    a context of its own while the whole context's memory (the engine's draft context) waits as the trial left it."""

    whole: Memory  # the draft's whole-context memory, holding history[:start]
    start: int  # the history index of the trial's last token: the rows from here on are the answer's
    offset: int  # the window's offset when taken (a window that slid since cannot replay the answer's rows)
    t_whole: float  # a drafted token's cost, each memory, as the trial timed it
    t_window: float
    ctrl: LengthController  # the draft model's controller, told when the window is given up
    overhead: Callable[[], float]  # the step overhead the verdict is priced with
    whole_ok: np.ndarray  # the prompt's rows where each memory's greedy choice was the target's
    window_ok: np.ndarray


class DraftWindow:
    """The window trials of one session's draft model (`drafter.window` is the window they chose)."""

    def __init__(self, drafter: ModelDrafter):
        self.drafter = drafter
        self.n_trials = 0
        self.n_reverts = 0  # windows taken on the prompt's rows that the answer's rows gave up
        self.n_measures = 0  # settle's that caught the whole context up to compare on the answer
        self._trial_at = 0  # the history's length at the last trial
        self._probation: _Probation | None = None
        # the last settle's (agreeing, rows) of the whole context and of the window, prompt and answer rows
        self.evidence: tuple[Agreement, Agreement] | None = None
        self._scratch_decode_s = 0.0  # decode time of the window contexts closed so far

    @property
    def decode_s(self) -> float:
        """Time inside llama_decode on the trials' own contexts (a window on probation's)."""
        pb = self._probation
        return self._scratch_decode_s + (self.drafter.memory.ctx.decode_s if pb is not None else 0.0)

    def due(self, n_new: int) -> bool:
        """Whether the prefill of n_new more tokens should end in a trial."""
        d = self.drafter
        n = len(d.session.history) + n_new
        return d.session.engine.window_auto and d.window is None and n >= max(WINDOW_TRIAL_MIN, 2 * self._trial_at)

    def try_window(self, ctrl: LengthController, overhead: Callable[[], float]) -> Agreement | None:
        """After a prefill that compared the draft with the target (its agreement): decode the same prompt rows on
        a context of the draft's own that holds only the history's first DRAFT_SINK tokens and the
        WINDOW_TRIAL // 2 before the rows (what a window holds just after it slides), and time the next token
        there and on the whole-context draft (the fastest of WINDOW_TIMINGS decodes each). Where the window is
        expected to be faster (window_pays, on the controller's verify costs), the draft sees a window of
        WINDOW_TRIAL tokens from now on, drafting from that context (no catch-up to pay), on probation: the
        answer's first WINDOW_PROBATION rows decide whether it is kept (settle).
        `ctrl`: the draft model's controller, at this context (at()); `overhead()`: the step overhead it is priced
        with. Returns the window's agreement when it was taken, else None."""
        d = self.drafter
        dft, hist, eng, agreement = d.memory, d.session.history, d.session.engine, d.prompt_read.agreement
        last = len(hist) - 1
        if d.agree_rows is None or agreement is None or dft.next_index() != last or self._probation is not None:
            return None
        pos, want, whole_ok = d.agree_rows
        n = len(want)
        self._trial_at = len(hist)
        self.n_trials += 1
        t_whole = self._time_next(dft.ctx, hist[last], len(dft.tokens))
        start = max(DRAFT_SINK, pos - WINDOW_TRIAL // 2)
        tokens = hist[:DRAFT_SINK] + hist[start:last]
        c = _ffi.Context(eng.draft, max(WINDOW_TRIAL, len(tokens) + 2), eng.draft_threads,
                         n_batch=eng.dft_ctx.n_batch, n_outputs_max=AGREE_TOKENS, name="draft",
                         flash_attn=eng.draft_flash_attn)
        took = False
        try:
            c.on_decode = eng.dft_ctx.on_decode  # a simulated clock prices it as the draft
            c.warm_up()
            rows = DRAFT_SINK + pos - start  # where the agreement rows begin in the window's memory
            c.decode(tokens[:rows], 0, logits="none")
            c.decode(tokens[rows:rows + n], rows, logits="all")
            window_ok = c.logits(n).argmax(axis=1) == want
            agree = agreeing(window_ok)
            c.decode(tokens[rows + n:], rows + n, logits="none")
            t_window = self._time_next(c, hist[last], len(tokens))
            took = window_pays(agreement, agree, t_whole, t_window, ctrl.verify_s, overhead(), ctrl.cap)
            log.info("draft window trial at %d tokens: whole context %d/%d agree, %.1f ms a token; last %d tokens "
                     "%d/%d, %.1f ms: %s", len(hist), *agreement, t_whole * 1e3, WINDOW_TRIAL, *agree,
                     t_window * 1e3, "window" if took else "whole context")
        finally:
            if not took:
                c.close()
        if not took:
            return None
        self._probation = _Probation(dft, last, start, t_whole, t_window, ctrl, overhead, whole_ok, window_ok)
        d.memory = Memory(c, tokens=list(tokens), offset=start, sink=DRAFT_SINK)
        d.window = WINDOW_TRIAL
        ctrl.draft_cost_changed(t_window)
        return agree

    def on_probation(self) -> int | None:
        """The answer's rows a window on probation has drafted over so far (None: no window on probation)."""
        pb = self._probation
        return None if pb is None else len(self.drafter.session.history) - 1 - pb.start

    def settle_when_due(self, finished: bool) -> None:
        """Keep or give up a window on probation (settle) after WINDOW_PROBATION rows of the answer, or at its end
        (`finished`) where the answer is shorter."""
        rows = self.on_probation()
        if rows is not None and (finished or rows >= WINDOW_PROBATION):
            self.settle()

    def settle(self) -> bool:
        """Keep or give up the window on probation (try_window), on the answer's rows so far (at most
        AGREE_TOKENS; greedy decoding: each next token is the target's own choice) added to the prompt's. The
        window decodes them again with every row's logits (cheap: it reads a few hundred tokens) and its greedy
        agreement with the target there is counted. Both memories' acceptances come from their agreement row for
        row (paired_acceptance: a difference within its own noise counts as none), and window_pays_at decides.
        Where it gives the same verdict whether the whole context would have agreed on every one of those rows or
        on none, that is the verdict; otherwise the whole context's memory catches up on them with every row's
        logits (at long context the dear part: a row there reads everything) and both are compared row for row.
        Kept: the draft's context adopts the window's memory. Given up: the whole context's memory drafts again
        (catching up on what it has not seen), and the controller forgets the acceptance it measured on the window
        (memory_replaced). Returns whether the window was kept."""
        pb, win, hist = self._probation, self.drafter.memory, self.drafter.session.history
        whole, ctrl, overhead = pb.whole, pb.ctrl, pb.overhead()
        n = min(len(hist) - 1 - pb.start, AGREE_TOKENS)
        whole_ok, window_ok, keep = pb.whole_ok, pb.window_ok, False
        agree_whole = agreeing(whole_ok)

        def pays(whole_rows: np.ndarray) -> bool:
            a_whole, a_window = paired_acceptance(whole_rows, window_ok)
            return window_pays_at(a_whole, a_window, pb.t_whole, pb.t_window, ctrl.verify_s, overhead, ctrl.cap)

        try:
            if n > 0 and win.offset == pb.offset and whole.next_index() == pb.start:
                rows, want = hist[pb.start:pb.start + n], np.asarray(hist[pb.start + 1:pb.start + 1 + n])
                win.truncate(win.sink + pb.start - win.offset)
                win.extend(rows, logits="all")
                window_ok = np.concatenate([window_ok, win.ctx.logits(n).argmax(axis=1) == want])
                keep = pays(np.concatenate([whole_ok, np.ones(n, dtype=bool)]))
                if keep != pays(np.concatenate([whole_ok, np.zeros(n, dtype=bool)])):
                    # the verdict depends on the whole context's rows: measure them
                    whole.extend(rows, logits="all")
                    whole_ok = np.concatenate([whole_ok, whole.ctx.logits(n).argmax(axis=1) == want])
                    keep = pays(whole_ok)
                    self.n_measures += 1
            else:
                keep = pays(whole_ok)
            agree_whole, agree_window = agreeing(whole_ok), agreeing(window_ok)
            self.evidence = (agree_whole, agree_window)
            log.info("draft window after %d rows of the answer: whole context %d/%d agree, window %d/%d: %s", n,
                     *agree_whole, *agree_window, "kept" if keep else "given up")
            if keep:
                whole.adopt(win.ctx.state_get(partial=False), win.tokens, win.offset, win.sink)
        finally:
            self._end_probation(keep, agree_whole)
        return keep

    def abandon(self) -> None:
        """Give up a window on probation without deciding (an interrupted generation, a reset): the whole
        context's memory drafts again, catching up when it next drafts."""
        if self._probation is not None:
            self._end_probation(False, agreeing(self._probation.whole_ok))

    def _end_probation(self, keep: bool, agree_whole: Agreement) -> None:
        pb, win = self._probation, self.drafter.memory
        self._probation = None
        self.drafter.memory = pb.whole
        self._scratch_decode_s += win.ctx.decode_s
        win.ctx.close()
        if not keep:
            self.drafter.window = None
            self.n_reverts += 1
            pb.ctrl.memory_replaced(pb.t_whole, agree_whole)

    def _time_next(self, ctx: _ffi.Context, tok: int, at: int) -> float:
        """The fastest of WINDOW_TIMINGS single-token decodes of tok at position `at`, each removed again."""
        clock, best = self.drafter.session.engine.clock, float("inf")
        for _ in range(WINDOW_TIMINGS):
            t0 = clock()
            ctx.decode([tok], at, logits="last")
            best = min(best, clock() - t0)
            ctx.seq_rm(at, -1)
        return best

    def reset(self) -> None:
        """Forget what the trials chose (as a new session would); a draft holding a window starts again."""
        d = self.drafter
        self.abandon()
        d.window, self._trial_at = d.session.engine.draft_window, 0
        if d.window is None and d.memory.offset:
            d.memory.clear()


def agreeing(ok: np.ndarray) -> Agreement:
    """(rows where the draft's greedy choice was the target's, rows compared)."""
    return Agreement(int(np.count_nonzero(ok)), len(ok))
