"""One conversation: the token history, the models' memories, prefill and the speculative step."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, TYPE_CHECKING

import numpy as np

from ...errors import ContextFullError, UsageError
from ..control.chooser import AdaptiveDrafters
from ..control.length import AdaptiveDraft
from ..control.window import paired_acceptance, window_pays, window_pays_at
from ..drafters.mtp import MtpDrafter
from ..drafters.ngram import point_mass, propose
from ..llama import ffi as _ffi
from .accept import greedy_emit, rejection_emit, top_probability
from .generation import Generation
from .memory import Memory, common_prefix
from .sampling import Sampling, SparseDist, restrict, sample
from .settings import (AGREE_MIN, AGREE_TOKENS, DRAFT_SINK, GenerationSettings, WINDOW_TIMINGS, WINDOW_TRIAL,
                       WINDOW_TRIAL_MIN)

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("specq.engine")


@dataclass
class StepResult:
    emitted: list[int]
    n_drafted: int
    draft_s: float
    verify_s: float
    first_token_s: float | None = None  # seconds to the first drafted token (catch-up included), where clean
    draft_token_s: float | None = None  # seconds per further drafted token, where measured
    drafter: str | None = None  # who proposed this step's drafts ("model", "ngram", "mtp")
    catchup: tuple[int, float] | None = None  # a long catch-up: (tokens, seconds with the first drafted token)


def _agreeing(ok: np.ndarray) -> tuple[int, int]:
    """(rows where the draft's greedy choice was the target's, rows compared)."""
    return int(np.count_nonzero(ok)), len(ok)


@dataclass
class _Probation:
    """A draft window a trial took on the prompt's rows and has not kept yet (Session.settle_window): the window
    drafts from a context of its own while the whole context's memory (the engine's draft context) waits as the
    trial left it."""

    whole: Memory  # the draft's whole-context memory, holding history[:start]
    start: int  # the history index of the trial's last token: the rows from here on are the answer's
    offset: int  # the window's offset when taken (a window that slid since cannot replay the answer's rows)
    t_whole: float  # a drafted token's cost, each memory, as the trial timed it
    t_window: float
    ctrl: AdaptiveDraft  # the draft model's controller, told when the window is given up
    whole_ok: np.ndarray  # the prompt's rows where each memory's greedy choice was the target's
    window_ok: np.ndarray


class Session:
    """One conversation: the token history and both caches, kept consistent across generations."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.history: list[int] = []
        self._controllers: dict[tuple, AdaptiveDraft | AdaptiveDrafters] = {}
        self.n_draft_slides = 0  # times the draft's window moved on (a smaller --ctx-draft)
        # the draft's window: --ctx-draft's, or with --ctx-draft auto what the window trials chose (None: all)
        self.window = engine.draft_window
        self.n_window_trials = 0
        self.n_window_reverts = 0  # windows taken on the prompt's rows that the answer's rows gave up
        self.n_window_measures = 0  # settle_window's that caught the whole context up to compare on the answer
        self._trial_at = 0  # the history's length at the last window trial
        self._probation: _Probation | None = None  # a window taken and not kept yet (settle_window)
        # the last settle_window's (agreeing, rows) of the whole context and of the window, prompt and answer rows
        self.window_evidence: tuple[tuple[int, int], tuple[int, int]] | None = None
        self._scratch_decode_s = 0.0  # decode time of the window contexts closed so far (decode_s)
        # the last agreement's (position, the target's choices, the rows where the draft's were the same)
        self._agree_rows: tuple[int, np.ndarray, np.ndarray] | None = None
        self.tgt = Memory(engine.tgt_ctx, partial_rm=not engine.target.is_recurrent_or_hybrid)
        self.dft = (Memory(engine.dft_ctx, partial_rm=not engine.draft.is_recurrent_or_hybrid)
                    if engine.dft_ctx is not None else None)
        self.mtp = MtpDrafter(engine.mtp_ctx, self.history) if engine.mtp_ctx is not None else None
        self.agreement: tuple[int, int] | None = None  # the last prefill's (see prefill's agree)
        self.reset()

    def reset(self) -> None:
        self.abandon_window()
        self.history.clear()  # cleared in place: the MTP drafter reads the same list
        for c in (self.tgt, self.dft, self.mtp):
            if c is not None:
                c.clear()

    def _attach_mtp(self, on: bool) -> None:
        """Route the target's hidden states to this session's MTP drafter (the engine's contexts are shared), or
        stop them where no step can draft with it (the target alone pays nothing for the head). Rows missed
        meanwhile are evaluated again when the head next drafts (MtpDrafter.missing_from)."""
        want = self.mtp.on_hidden if on and self.mtp is not None else None
        if self.engine.tgt_ctx.on_hidden != want:
            self.engine.tgt_ctx.output_hidden(want)

    def available_drafters(self, s: GenerationSettings) -> tuple[str, ...]:
        """The drafters a step may use: --drafter's list, or for auto every one this engine can run."""
        if s.drafters == ("auto",):
            return tuple(n for n, ok in (("ngram", True), ("model", self.dft is not None),
                                         ("mtp", self.mtp is not None)) if ok)
        return s.drafters

    @property
    def n_ctx(self) -> int:
        return self.engine.n_ctx

    @property
    def decode_s(self) -> float:
        """Time inside llama_decode so far on this session's own contexts (a window on probation's)."""
        pb = self._probation
        return self._scratch_decode_s + (self.dft.ctx.decode_s if pb is not None else 0.0)

    @property
    def n_restores(self) -> int:
        """Checkpoint restores so far, both models (memories that cannot drop part of a sequence)."""
        return sum(c.n_restores for c in (self.tgt, self.dft) if c is not None)

    @property
    def n_rollbacks(self) -> int:
        """Recurrent/hybrid tails dropped through state snapshots so far, both models."""
        return sum(c.n_rollbacks for c in (self.tgt, self.dft) if c is not None)

    def controller(self, s: GenerationSettings) -> AdaptiveDraft | AdaptiveDrafters:
        """The draft_max="auto" controller for these sampling settings. It lives as long as the session
        (reset() included): costs and acceptance belong to the pair and the machine, not to one prompt, so
        later generations start from what earlier ones measured instead of from a prior."""
        key = (s.draft_cap, s.accept_mode, s.temp, s.top_k, s.top_p, s.min_p, s.p_min, s.drafters)
        if key not in self._controllers:
            eng = self.engine
            # an n-gram lookup costs next to nothing; a model about its share of the target's bytes
            ratio = eng.draft.size_bytes / max(eng.target.size_bytes, 1) if eng.draft is not None else 0.01
            attention = eng.target.attention_per_context_token()
            if s.drafters == ("auto",):
                self._controllers[key] = AdaptiveDrafters(s.draft_cap, {n: self._cost_prior(n) for n in
                                                                        self.available_drafters(s)},
                                                          attention_prior=attention, model="model",
                                                          memoryless=("ngram",))
            else:
                self._controllers[key] = AdaptiveDraft(s.draft_cap, cost_ratio_prior=ratio, attention_prior=attention)
        return self._controllers[key]

    def _cost_prior(self, name: str) -> float:
        """A drafter's cost per token before any is measured, as a share of one target token."""
        eng = self.engine
        if name == "model":
            return eng.draft.size_bytes / max(eng.target.size_bytes, 1)
        if name == "mtp":  # one decoder layer of the target's, and its output head
            return min(1.0, 2.0 / max(eng.target.n_layer, 1))
        return 0.01

    def _auto_limits(self, s: GenerationSettings, n_draft_max: int) -> dict[str, int]:
        """--drafter auto: the most each available drafter could draft this step (an n-gram proposal exists only
        on a match, and is as long as what followed it)."""
        limits = {}
        for name in self.available_drafters(s):
            if name == "ngram":
                limits[name] = len(propose(self.history, s.ngram_min, s.ngram_max, n_draft_max))
            else:
                limits[name] = n_draft_max
        return limits

    # ==== the speculative step ================================================================
    def _pick(self, row: np.ndarray, p_min: float, samp: "Sampling") -> tuple[int, SparseDist | None] | None:
        """The next draft token from a drafter's logits row (greedy, or sampled from its transformed distribution
        under rejection), or None to stop drafting (top probability below p_min, or an id the target lacks)."""
        n_vocab_tgt = self.engine.target.n_vocab
        if samp.draft_tf is None:
            tok = int(row.argmax())
            if tok >= n_vocab_tgt or (p_min > 0 and top_probability(row) < p_min):
                return None
            return tok, None
        # Sample only ids the target has (renormalised): stopping on a sampled id it lacks would make the stop
        # depend on the sampled value and bias the output law.
        clock = self.engine.clock
        ts = clock()
        q = restrict(samp.draft_tf(row), n_vocab_tgt)
        stop = q is None or (p_min > 0 and q.top_prob() < p_min)
        tok = -1 if stop else sample(q, samp.rng)
        samp.sample_s += clock() - ts
        return None if stop else (tok, q)

    def _draft(self, n_max: int, p_min: float, samp: "Sampling") -> tuple[list[int], list[SparseDist], tuple]:
        """Draft up to n_max tokens: greedy, or sampled from the draft's transformed distribution (rejection).

        Stops early when the draft's top probability < p_min. Returns (tokens, their distributions in
        rejection mode, (seconds to the first token, seconds per further token)): the first includes a short
        catch-up (None after a long one, which is prefill-like); the second is None below two tokens.
        """
        dft = self.dft
        clock = self.engine.clock
        t_start = clock()
        self._fit_draft(len(self.history) + n_max)
        seen = dft.next_index()
        catchup = len(self.history) - seen
        dft.extend(self.history[seen:], logits="last")  # catch up, incl. the last token
        dft.save_checkpoint()
        t_loop = clock()
        drafts: list[int] = []
        dists: list[SparseDist] = []
        while True:
            got = self._pick(dft.ctx.logits(1)[0], p_min, samp)
            if got is None:
                break
            drafts.append(got[0])
            if got[1] is not None:
                dists.append(got[1])
            if len(drafts) >= n_max:
                break
            dft.extend([got[0]], logits="last")
        # first + (k-1)·per_token is the step's drafting time: the catch-up decode yields the first token
        first = t_loop - t_start if drafts and catchup <= 2 else None
        long_catchup = (catchup, t_loop - t_start) if drafts and catchup > 2 else None
        per_token = (clock() - t_loop) / (len(drafts) - 1) if len(drafts) >= 2 else None
        return drafts, dists, (first, per_token, long_catchup)

    def _draft_mtp(self, n_max: int, p_min: float, samp: "Sampling") -> tuple[list[int], list[SparseDist], tuple]:
        """Draft with the target's MTP head, as _draft does with a draft model (same picking, same timings)."""
        mtp, clock = self.mtp, self.engine.clock
        a = mtp.missing_from()
        if a is not None:  # the trunk rows from there were dropped (a rollback): the target evaluates them again
            self.tgt.truncate(a)
            self.tgt.extend(self.history[len(self.tgt.tokens):-1], logits="none")
            mtp.n_redecodes += 1
        t_catchup, catchup = clock(), len(self.history) - len(mtp.tokens)
        if catchup > 2:  # a long catch-up (after plain steps) is prefill-like:
            mtp.catch_up(len(self.history) - 1)      # decoded apart, so the first token's cost stays clean
        t_first = clock()
        mtp.begin()
        t_loop = clock()
        drafts: list[int] = []
        dists: list[SparseDist] = []
        try:
            while True:
                got = self._pick(mtp.ctx.logits(), p_min, samp)
                if got is None:
                    break
                drafts.append(got[0])
                if got[1] is not None:
                    dists.append(got[1])
                if len(drafts) >= n_max:
                    break
                mtp.advance(got[0], len(drafts))
        finally:
            mtp.end()
        first = t_loop - t_first if drafts else None
        long_catchup = (catchup, t_loop - t_catchup) if drafts and catchup > 2 else None
        per_token = (clock() - t_loop) / (len(drafts) - 1) if len(drafts) >= 2 else None
        return drafts, dists, (first, per_token, long_catchup)

    def _propose(self, s: GenerationSettings, samp: "Sampling", n_draft_max: int,
                 drafters: tuple[str, ...] | None = None) -> tuple:
        """(drafts, their distributions in rejection mode, draft costs, drafter) from the first drafter with a
        proposal: an n-gram match in the text so far, the draft model or the target's MTP head."""
        names = self.available_drafters(s) if drafters is None else drafters
        for name in names if n_draft_max > 0 else ():
            if name == "ngram":
                drafts = propose(self.history, s.ngram_min, s.ngram_max, n_draft_max)
                if drafts:
                    return drafts, [point_mass(t) for t in drafts] if samp.draft_tf else [], (None, None, None), name
            elif name == "mtp" and self.mtp is not None:
                return (*self._draft_mtp(n_draft_max, s.p_min, samp), name)
            elif name == "model" and self.dft is not None:
                return (*self._draft(n_draft_max, s.p_min, samp), name)
        return [], [], (None, None, None), None

    def _step(self, s: GenerationSettings, samp: "Sampling", n_draft_max: int,
              drafters: tuple[str, ...] | None = None) -> "StepResult":
        clock = self.engine.clock
        t0 = clock()
        drafts, q, costs, drafter = self._propose(s, samp, n_draft_max, drafters)
        if len(drafts) < s.draft_min:
            drafts, q, drafter = [], [], None
        t1 = clock()
        # One target pass over [last, d1..dn], logits at every position.
        self.tgt.save_checkpoint(n_next=len(drafts) + 1)  # the verify is one decode; its first token stays
        self.tgt.extend([self.history[-1]] + drafts, logits="all")
        if samp.mode == "greedy":
            emitted = greedy_emit(self.tgt.ctx.logits(len(drafts) + 1), drafts)
        elif samp.mode == "rejection":
            ts = clock()
            p = samp.target_tf.rows(self.tgt.ctx.logits(len(drafts) + 1))
            emitted = rejection_emit(drafts, q, p, samp.rng)
            samp.sample_s += clock() - ts
        else:
            # The target samples at each position; a draft token is accepted when the sample equals it.
            emitted = []
            for i in range(len(drafts) + 1):
                tok = samp.sampler.sample(self.tgt.ctx, i)
                emitted.append(tok)
                if i == len(drafts) or tok != drafts[i]:
                    break
        t2 = clock()
        first, per_token, catchup = costs
        return StepResult(emitted, len(drafts), t1 - t0, t2 - t1, first, per_token, drafter=drafter, catchup=catchup)

    def _rewind(self) -> None:
        """Roll both memories back to the committed history (the target holds all but the last token)."""
        self.tgt.truncate(common_prefix(self.tgt.tokens, self.history[:-1]))
        if self.dft is not None:
            if len(self.history) <= self.dft.offset:
                self.dft.clear()  # rolled back past the draft's window: it starts again from the beginning
            self.dft.truncate(common_prefix(self.dft.tokens, self.dft.view(self.history)))
        if self.mtp is not None:
            self.mtp.truncate(common_prefix(self.mtp.tokens, self.history))

    def _fit_draft(self, n_tokens: int) -> None:
        """Move the draft's window on, if it has one, so that it can hold the history's first n_tokens tokens:
        it restarts from the last half-window of the history (evaluated again at the next catch-up), after the
        history's first DRAFT_SINK tokens. A model attends heavily to the first tokens of its context (attention
        sinks): a window without them predicts far worse than one with them."""
        window, dft = self.window, self.dft
        if window is None or n_tokens - dft.offset + dft.sink <= window:
            return
        dft.clear()
        dft.offset = min(n_tokens - window // 2, len(self.history) - 1)
        dft.sink = min(DRAFT_SINK, dft.offset)
        dft.extend(self.history[:dft.sink], logits="none")
        self.n_draft_slides += 1

    def rollback(self, n: int) -> None:
        """Keep the first n tokens of the history and roll both caches back to them (a server's stop string
        that ends inside a multi-token step)."""
        if not 0 < n <= len(self.history):
            raise ValueError(f"cannot roll back to {n} tokens of a {len(self.history)}-token history")
        del self.history[n:]
        self._rewind()

    # ==== generation ============================================================================
    def prefill(self, new_tokens: list[int],
                timed: Callable[[int, int], list[tuple[int, int]]] | None = None,
                agree: int = 0) -> list[tuple]:
        """Append tokens to the history and evaluate all but the last on both models.

        `timed(first, last)`: spans (position, n_tokens) among the new ones (first..last-1 may be evaluated) to
        decode alone and time: (position, n_tokens, target seconds, draft seconds or None) is returned for each,
        what a decode of that many tokens costs the target at that context (with every row's logits, as a
        verify) and, for single tokens, what one costs the draft. `agree`: up to that many new tokens just
        before the timed spans are decoded with every row's logits on both models, and `self.agreement` is set
        to (rows where the draft's greedy choice is the target's, rows compared); None where none were. The
        tokens and positions decoded are the same either way."""
        if not new_tokens:
            raise UsageError("empty prompt; give some text to start from")
        total = len(self.history) + len(new_tokens)
        if total + 1 > self.n_ctx:
            raise ContextFullError(
                f"prompt does not fit in the context ({total} tokens, ctx {self.n_ctx}); "
                "use a larger --ctx or a shorter prompt")
        self.history.extend(new_tokens)
        self.agreement = self._agree_rows = None
        try:
            self._rewind()
            hist, clock = self.history, self.engine.clock
            last = len(hist) - 1
            spans, end = [], len(self.tgt.tokens)
            for pos, n in sorted(set(timed(len(self.tgt.tokens), last) if timed else ())):
                if pos >= end and n >= 1 and pos + n <= last:  # in order, not overlapping
                    spans.append((pos, n))
                    end = pos + n
            if agree > 0 and self.dft is not None:
                # just before the timed spans that end the prompt (and after any earlier one)
                i, stop = len(spans), last
                while i > 0 and sum(spans[i - 1]) == stop:
                    i -= 1
                    stop = spans[i][0]
                start = max(sum(spans[i - 1]) if i else len(self.tgt.tokens), stop - agree)
                if stop - start >= AGREE_MIN:
                    spans.insert(i, (start, -(stop - start)))  # n < 0: an agreement span
            out = []
            for pos, n in spans + [(last, 0)]:
                self.tgt.extend(hist[len(self.tgt.tokens):pos], logits="none")
                if self.dft is not None:
                    self._fit_draft(pos + 1)
                    self.dft.extend(hist[self.dft.next_index():pos], logits="none")
                if n == 0:
                    break
                if n < 0:
                    self._agree(pos, -n)
                    continue
                t0 = clock()
                self.tgt.extend(hist[pos:pos + n], logits="last" if n == 1 else "all")
                t1 = clock()
                draft_s = None
                if n == 1 and self.dft is not None and self.dft.next_index() == pos:
                    self.dft.extend([hist[pos]], logits="last")
                    draft_s = clock() - t1
                out.append((pos, n, t1 - t0, draft_s))
            return out
        except BaseException:
            del self.history[-len(new_tokens):]
            self._rewind()
            raise

    def _agree(self, pos: int, n: int) -> None:
        """Decode history[pos:pos+n] on both models with every row's logits and count the rows where the draft's
        greedy choice is the target's (self.agreement): teacher-forced greedy acceptance on the prompt."""
        self._fit_draft(pos + n)
        dft = self.dft
        if dft.next_index() > pos >= dft.offset:
            # The draft holds rows the target lacks (the history's last token, evaluated by a drafting step or an
            # earlier prefill): drop them, or the rows to compare would be missing on the draft's side.
            dft.truncate(dft.sink + pos - dft.offset)
        toks = self.history[pos:pos + n]
        self.tgt.extend(toks, logits="all")
        want = self.tgt.ctx.logits(n).argmax(axis=1)
        if self.dft.next_index() != pos:  # the draft's window moved on: decode the rest plainly
            self.dft.extend(self.history[self.dft.next_index():pos + n], logits="none")
            return
        self.dft.extend(toks, logits="all")
        got = self.dft.ctx.logits(n).argmax(axis=1)
        ok = got == want
        self.agreement = _agreeing(ok)
        self._agree_rows = (pos, want, ok)

    def window_trial_due(self, n_new: int) -> bool:
        """Whether the prefill of n_new more tokens should end in a window trial (--ctx-draft auto)."""
        n = len(self.history) + n_new
        return self.engine.window_auto and self.window is None and n >= max(WINDOW_TRIAL_MIN, 2 * self._trial_at)

    def try_window(self, ctrl: AdaptiveDraft, overhead: float) -> tuple[int, int] | None:
        """--ctx-draft auto, after a prefill that compared the draft with the target (agreement): decode the same
        prompt rows on a context of the draft's own that holds only the history's first DRAFT_SINK tokens and the
        WINDOW_TRIAL // 2 before the rows (what a window holds just after it slides), and time the next token
        there and on the whole-context draft (the fastest of WINDOW_TIMINGS decodes each). Where the window is
        expected to be faster (window_pays, on the controller's verify costs), the session's draft sees a window
        of WINDOW_TRIAL tokens from now on, drafting from that context (no catch-up to pay), on probation: the
        answer's first WINDOW_PROBATION rows decide whether it is kept (settle_window).
        `ctrl`: the draft model's controller, at this context (at()). Returns the window's agreement when it was
        taken, else None."""
        dft, hist = self.dft, self.history
        last = len(hist) - 1
        if self._agree_rows is None or dft.next_index() != last or self._probation is not None:
            return None
        pos, want, whole_ok = self._agree_rows
        n = len(want)
        eng = self.engine
        self._trial_at = len(hist)
        self.n_window_trials += 1
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
            agree = _agreeing(window_ok)
            c.decode(tokens[rows + n:], rows + n, logits="none")
            t_window = self._time_next(c, hist[last], len(tokens))
            took = window_pays(self.agreement, agree, t_whole, t_window, ctrl.verify_s, overhead, ctrl.cap)
            log.info("draft window trial at %d tokens: whole context %d/%d agree, %.1f ms a token; last %d tokens "
                     "%d/%d, %.1f ms: %s", len(hist), *self.agreement, t_whole * 1e3, WINDOW_TRIAL, *agree,
                     t_window * 1e3, "window" if took else "whole context")
        finally:
            if not took:
                c.close()
        if not took:
            return None
        self._probation = _Probation(dft, last, start, t_whole, t_window, ctrl, whole_ok, window_ok)
        self.dft = Memory(c, tokens=list(tokens), offset=start, sink=DRAFT_SINK)
        self.window = WINDOW_TRIAL
        ctrl.draft_cost_changed(t_window)
        return agree

    def window_on_probation(self) -> int | None:
        """The answer's rows a window on probation has drafted over so far (None: no window on probation)."""
        pb = self._probation
        return None if pb is None else len(self.history) - 1 - pb.start

    def settle_window(self, overhead: float) -> bool:
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
        pb, win, hist = self._probation, self.dft, self.history
        whole, ctrl = pb.whole, pb.ctrl
        n = min(len(hist) - 1 - pb.start, AGREE_TOKENS)
        whole_ok, window_ok, keep = pb.whole_ok, pb.window_ok, False
        agree_whole = _agreeing(whole_ok)

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
                    self.n_window_measures += 1
            else:
                keep = pays(whole_ok)
            agree_whole, agree_window = _agreeing(whole_ok), _agreeing(window_ok)
            self.window_evidence = (agree_whole, agree_window)
            log.info("draft window after %d rows of the answer: whole context %d/%d agree, window %d/%d: %s", n,
                     *agree_whole, *agree_window, "kept" if keep else "given up")
            if keep:
                whole.adopt(win.ctx.state_get(partial=False), win.tokens, win.offset, win.sink)
        finally:
            self._end_probation(keep, agree_whole)
        return keep

    def abandon_window(self) -> None:
        """Give up a window on probation without deciding (an interrupted generation, a reset): the whole
        context's memory drafts again, catching up when it next drafts."""
        if self._probation is not None:
            self._end_probation(False, _agreeing(self._probation.whole_ok))

    def _end_probation(self, keep: bool, agree_whole: tuple[int, int]) -> None:
        pb, win = self._probation, self.dft
        self._probation = None
        self.dft = pb.whole
        self._scratch_decode_s += win.ctx.decode_s
        win.ctx.close()
        if not keep:
            self.window = None
            self.n_window_reverts += 1
            pb.ctrl.memory_replaced(pb.t_whole, agree_whole)

    def _time_next(self, ctx: _ffi.Context, tok: int, at: int) -> float:
        """The fastest of WINDOW_TIMINGS single-token decodes of tok at position `at`, each removed again."""
        clock, best = self.engine.clock, float("inf")
        for _ in range(WINDOW_TIMINGS):
            t0 = clock()
            ctx.decode([tok], at, logits="last")
            best = min(best, clock() - t0)
            ctx.seq_rm(at, -1)
        return best

    def reset_window(self) -> None:
        """Forget what the window trials chose (as a new session would); a draft holding a window starts again."""
        self.abandon_window()
        self.window, self._trial_at = self.engine.draft_window, 0
        if self.dft is not None and self.window is None and self.dft.offset:
            self.dft.clear()

    def generate(self, new_tokens: list[int], settings: GenerationSettings,
                 speculative: bool = True) -> "Generation":
        settings.validate()
        if speculative:
            self.engine.check_drafters(settings)
        return Generation(self, new_tokens, settings, speculative)
