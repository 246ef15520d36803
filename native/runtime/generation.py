"""A generation: speculative steps turned into token events, with text, timing and stats."""

from __future__ import annotations

import codecs
from typing import Callable, Iterator, TYPE_CHECKING

from ..control.chooser import DrafterChooser
from ..control.length import LengthController
from ..control.step import Choice, Handover, StepOutcome
from ..core.accept import accepted_per_position
from ..core.constraint import Guide
from ..core.sampling import Sampling
from ..core.settings import AGREE_TOKENS, GenerationSettings
from ..core.stats import GenerationStats, RunningCounts, TokenEvent
from ..drafters import registry
from . import step as speculative
from .step import Ask, StepResult

if TYPE_CHECKING:
    from .session import Session


def new_controller(ses: Session, s: GenerationSettings) -> LengthController | DrafterChooser:
    """A new draft_max="auto" controller (Session.controller keeps one per sampling settings): one per drafter
    under --drafter auto, else one for the drafters' list."""
    eng = ses.engine
    attention = eng.target.attention_per_context_token()
    if s.drafters == (registry.AUTO,):
        names = ses.available_drafters(s)
        return DrafterChooser(s.draft_cap, registry.cost_priors(eng, names), attention_prior=attention,
                                model=ses.reader.name if ses.reader is not None else None,
                                memoryless=[n for n in names if not ses.drafters[n].has_memory])
    # the dearest drafter of the list (registry.cost_priors): an n-gram lookup costs next to nothing, a model about
    # its share of the target's bytes (--drafter ngram with a draft model loaded is priced as the lookup it is)
    ratio = max(registry.cost_priors(eng, ses.available_drafters(s)).values(), default=0.01)
    return LengthController(s.draft_cap, cost_ratio_prior=ratio, attention_prior=attention)


def step_overhead(ctrl: LengthController | DrafterChooser) -> float:
    """The per-step overhead a draft window's trial is priced with (--drafter auto: the one all drafters share)."""
    return ctrl.shared.overhead if isinstance(ctrl, DrafterChooser) else ctrl.overhead


def reader_window(ses: Session) -> int | None:
    """The recent tokens the session's reader sees (None: the whole context)."""
    r = ses.reader
    return r.window if r is not None else ses.engine.draft_window


def drafter_counts(ses: Session) -> dict[str, int]:
    """The session's drafters' counters so far (Drafter.counts), summed by field."""
    out: dict[str, int] = {}
    for d in ses.drafters.values():
        for k, v in d.counts().items():
            out[k] = out.get(k, 0) + v
    return out


def handover_rule(ses: Session, s: GenerationSettings, p: RunningCounts,
                  choice: Choice) -> Callable[[list[int]], bool] | None:
    """A step's stop rule for a drafter's drafts (Session.until): hand over where the choice's handover drafter
    would propose enough (DrafterChooser._handover, priced at the first drafted token: a step the batch keeps
    plain never asks); counted in n_handovers."""
    if choice.find_handover is None:
        return None
    found: list[Handover | None] = []

    def until(drafts: list[int]) -> bool:
        if not found:
            found.append(choice.handover)
        handover = found[0]
        if handover is None or ses.drafters[handover.to].lookahead(drafts, handover.least, s) < handover.least:
            return False
        p.n_handovers += 1
        return True
    return until


def make_stats(g: Generation, stop: str, gen_s: float) -> GenerationStats:
    """A generation's stats as they stand (its counters since start)."""
    p, s, ctrl, samp = g._p, g.settings, g.controller, g._samp
    guide = samp.guide if samp is not None else None
    counts = drafter_counts(g.session)
    grew = {k: v - p.drafter_counts_at_start.get(k, 0) for k, v in counts.items()}
    return GenerationStats(
        speculative=g.speculative, n_prompt=len(g.new_tokens), n_generated=len(g.tokens),
        n_steps=p.n_steps, n_drafted=p.n_drafted, n_accepted=sum(p.accepted),
        accepted_per_pos=tuple(accepted_per_position(p.accepted, s.draft_cap)) if g.speculative else (),
        prompt_ms=p.prompt_s * 1e3, draft_ms=p.draft_s * 1e3, verify_ms=p.verify_s * 1e3,
        gen_ms=gen_s * 1e3, decode_ms=(g._decode_s() - p.decode_s_at_start) * 1e3,
        n_restores=g.session.n_restores - p.restores_at_start, n_rollbacks=g.session.n_rollbacks - p.rollbacks_at_start,
        n_draft_slides=grew.get("n_draft_slides", 0),
        draft_window=reader_window(g.session) if g.speculative else None,
        n_window_trials=grew.get("n_window_trials", 0), n_window_reverts=grew.get("n_window_reverts", 0),
        n_drafted_store=p.drafted_from.get("store", 0), n_accepted_store=p.accepted_from.get("store", 0),
        n_drafted_text=p.drafted_from.get("text", 0), n_accepted_text=p.accepted_from.get("text", 0),
        stop_reason=stop,
        accept_mode=(samp.mode if samp else "greedy") if g.speculative else (
            "greedy" if s.temp <= 0 else "sample"),
        sample_ms=samp.sample_s * 1e3 if samp else 0.0,
        vocab_map=g.session.engine.vocab_translation if g.speculative else None,
        vocab_overlap=g.session.engine.vocab_overlap if g.speculative else None,
        n_vocab_unaligned=grew.get("n_vocab_unaligned", 0), n_vocab_full=grew.get("n_vocab_full", 0),
        n_vocab_tli_steps=grew.get("n_vocab_tli_steps", 0), n_vocab_string_steps=grew.get("n_vocab_string_steps", 0),
        n_plain_steps=ctrl.n_plain_steps - p.plain_steps_at_start if ctrl else 0,
        n_probes=ctrl.n_probes - p.probes_at_start if ctrl else 0, n_handovers=p.n_handovers,
        steps_by_k=tuple(sorted(p.steps_by_k.items())), tried_per_pos=tuple(p.tried),
        verify_ms_by_size=tuple((b, n, ms * 1e3) for b, (n, ms) in sorted(p.verify_by_size.items())),
        draft_next_ms=p.draft_next_s * 1e3, n_draft_next=p.n_draft_next,
        n_drafted_by=tuple(sorted(p.drafted_by.items())), n_accepted_by=tuple(sorted(p.accepted_by.items())),
        constrained=guide is not None, n_drafted_constrained=p.drafted_constrained, n_accepted_constrained=p.accepted_constrained,
        n_masked_rows=guide.n_rows if guide else 0, n_masks=guide.n_masks if guide else 0,
        n_drafted_unforced=guide.n_unforced if guide else 0,
        mask_ms=guide.mask_s * 1e3 if guide else 0.0)


class Generation:
    """Iterate for TokenEvents; `stats` is set when the iteration ends (also on interruption);
    `snapshot()` gives the stats so far while it runs."""

    def __init__(self, session: Session, new_tokens: list[int], settings: GenerationSettings, speculative: bool):
        self.session = session
        self.new_tokens = list(new_tokens)
        self.settings = settings
        self.speculative = speculative
        self.stats: GenerationStats | None = None
        self.controller: LengthController | None = None  # draft_max="auto": its final estimates (for tune)
        self.draft_limit = 0  # the last step's room to draft (_choose_draft)
        self.prepared = True  # start(prepare): its draft was got ready (timings, agreement)
        self.tokens: list[int] = []
        self._text: list[str] = []
        self._p = RunningCounts()
        self._clock = session.engine.clock
        self._samp: Sampling | None = None
        self._reader = None  # the drafter that reads the prompt, where this generation may draft with it
        self._wants = self._trial = False  # whether _read_prompt seeds acceptance / tries a draft window
        eng = session.engine  # the target's context, and where it may draft the drafters' own (Drafter.provide)
        self._ctxs = [eng.tgt_ctx, *(c for c in eng.provided.values() if speculative and hasattr(c, "decode_s"))]

    @property
    def sampling(self) -> Sampling | None:
        """The sampling state of the running generation (set by start())."""
        return self._samp

    @property
    def n_steps(self) -> int:
        return self._p.n_steps

    @property
    def text(self) -> str:
        return "".join(self._text)

    def _decode_s(self) -> float:
        return sum(c.decode_s for c in self._ctxs) + (self.session.decode_s if self.speculative else 0.0)

    def snapshot(self) -> GenerationStats:
        """The stats so far (stop_reason "running"); the final ones once the generation has ended."""
        if self.stats is not None:
            return self.stats
        t0 = self._p.t_gen0
        return make_stats(self, "running", 0.0 if t0 is None else self._clock() - t0)

    def __iter__(self) -> Iterator[TokenEvent]:
        self.start()
        try:
            while (plan := self.next_step()) is not None:
                events = self.take(speculative.step([Ask(self.session, self.settings, self._samp, *plan)])[0])
                yield from self._deliver(events)
                self.after_delivery()
        finally:
            self.conclude()

    # ---- the loop's pieces: a batch of sequences (runtime/batch.py) runs them itself, one step for all ----
    def start(self, prepare: bool = True, joined: list | None = None, alone: bool = True) -> None:
        """Evaluate the prompt and get ready for the first step. `prepare` False (joining a batch that is not
        drafting, runtime/batch.py): no calibration timings or prompt agreement, the prompt in one decode.
        `joined`: the prompt's untimed end is left to the caller, for one decode with other prompts
        (Session.prefill_target); joined_prefill(seconds) follows it. `alone`: the first step is likely this
        sequence's alone, so the prefill evaluates the last token too (folded, Session.take_ahead); a batch that
        runs others steps it with them, and the prompt stops before it as before."""
        ses, s, p = self.session, self.settings, self._p
        self.prepared = prepare
        self._stop = "interrupted"  # until the loop ends by itself
        self._done = self._first = False
        self._prefill(prepare, joined, alone)
        self._samp = Sampling(s, self.speculative, None if s.constraint is None else
                              Guide(s.constraint, ses.engine.target, self.tokens, self._clock))
        if self.controller is not None:
            p.plain_steps_at_start, p.probes_at_start = self.controller.n_plain_steps, self.controller.n_probes
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        p.decode_s_at_start = self._decode_s()
        p.restores_at_start, p.rollbacks_at_start, p.drafter_counts_at_start = ses.n_restores, ses.n_rollbacks, drafter_counts(ses)
        p.t_gen0 = self._clock()

    def joined_prefill(self, seconds: float) -> None:
        """The decode that evaluated this prompt's end with others' (start(joined=...)) took `seconds`: the
        prompt's time, the whole of it (as a shared verify's), not the generation's."""
        p = self._p
        p.prompt_s += seconds
        p.decode_s_at_start = self._decode_s()
        p.t_gen0 = self._clock()

    def next_step(self) -> tuple[int, tuple[str, ...] | None] | None:
        """The next step's draft length and drafters, or None where the generation has ended."""
        remaining = self._remaining()
        done = None if self._done else self._stop_before_step(remaining)
        if self._done or done:
            self._stop = done or self._stop
            return None
        self._t_step = self._clock()
        self.session.until = None
        self._first = self._p.n_steps == 0 and self.speculative
        # the first token comes from the target's prefill alone (a plain step): drafting waits for it
        n_draft_max, drafters = (0, ()) if self._first else self._choose_draft(remaining)
        return max(n_draft_max, 0), drafters

    def take(self, step: StepResult) -> list[TokenEvent]:
        """Commit a step's tokens, count it, rewind the memories to the history and tell the controller."""
        p = self._p
        p.n_steps += 1
        p.draft_s += step.draft_s
        p.verify_s += step.verify_s
        events, done = self._emit(step, self._utf8, self._remaining())
        if self.speculative:
            p.count_step(step, len(events))
        self._last = (step, len(events))
        self.session.rewind()
        if not self._first:
            self._observe(step, self._t_step)
        if done:
            self._stop, self._done = done, True
        return events

    def after_delivery(self, read: bool = True) -> None:
        """Once the first token is out: the draft's side of the prefill (_read_prompt); `read` False (a sequence
        in a batch of several, runtime/batch.py): not now — its draft reads the prompt as a catch-up when the batch
        first lets it draft, which at high load may be never."""
        if self._first and not self._done:
            self._first = False
            if read:
                self._read_prompt()
            else:
                self.session.drop_reader_prefill()

    @property
    def read_pending(self) -> bool:
        """Whether the first token is out and the draft's side of the prefill waits (after_delivery comes next)."""
        return self._first and not self._done

    @property
    def ended(self) -> bool:
        """Whether the last step ended the generation (end of generation, n_predict): conclude() comes next."""
        return self._done

    def keep(self, n: int) -> None:
        """The consumer used only the last step's first n tokens (a stop string): count only those."""
        step, n_events = self._last
        if self.speculative and n < n_events:
            self._p.count_step(step, n_events, sign=-1)
            self._p.count_step(step, n)

    def conclude(self) -> None:
        """End the generation (also when interrupted): tell the drafters (Drafter.ended), rewind, and the final
        stats."""
        self._end(self._stop, self._samp, self._utf8)

    def _remaining(self) -> int | None:
        s = self.settings
        return None if s.n_predict is None else s.n_predict - len(self.tokens)

    def _stop_before_step(self, remaining: int | None) -> str | None:
        if remaining is not None and remaining <= 0:
            return "n_predict"
        if len(self.session.history) >= self.session.n_ctx:
            return "ctx"
        return None

    def _prefill(self, prepare: bool = True, joined: list | None = None, alone: bool = True) -> None:
        """Evaluate the prompt on the target (the draft's side waits for the first token: _read_prompt). Where
        nothing was measured at this context yet, the prefill times single tokens on each model, so that the first
        speculative step is priced at this context (at thousands of tokens attention changes the costs). Before the
        draft model was tried enough, it also compares the reader's greedy choices with the target's over the
        prompt's last rows (greedy decoding: acceptance is exactly that agreement; under rejection sampling, each
        row's expected acceptance Σ min(p, q))."""
        ses, s, p = self.session, self.settings, self._p
        auto_drafter = s.drafters == (registry.AUTO,)
        ctrl = ses.controller(s) if self.speculative and (s.adaptive or auto_drafter) else None
        ses.attach(s, self.speculative)
        self.controller = ctrl
        if ctrl is not None:
            ctrl.new_answer()
        self._reader = ses.reader if ses.reader is not None and ses.reader.name in ses.available_drafters(s) else None
        tp0 = self._clock()
        greedy_reader = ctrl is not None and self._reader is not None and s.temp <= 0
        # the prompt's rows tell the acceptance where verification has a law for it: greedy, or rejection sampling
        sampled = s if s.accept_mode == "rejection" else None
        self._wants = (greedy_reader or ctrl is not None and self._reader is not None and sampled is not None) \
            and ctrl.wants_agreement() and prepare
        # whether the reader wants the prompt compared for its own sake (a draft model: a window trial at a long
        # context, --ctx-draft auto)
        self._trial = greedy_reader and prepare and self._reader.wants_prompt_rows(len(self.new_tokens))
        has_reader = self._reader is not None
        ses.prefill_target(self.new_tokens,
                           spans_to_time=(lambda first, last: ctrl.calibration_points(first, last, has_reader))
                           if ctrl is not None and prepare else None,
                           agree=AGREE_TOKENS if self._wants or self._trial else 0,
                           sampled=sampled, joined=joined, fold=alone)
        p.prompt_s = self._clock() - tp0

    def _read_prompt(self) -> None:
        """The draft's side of the prefill, once the first token is out: the reader reads the prompt, the
        controller gets the timings and the agreement, and a draft window may be tried. Its time counts as the
        prompt's (prompt_ms), not the generation's."""
        ses, ctrl, reader, p = self.session, self.controller, self._reader, self._p
        t0, d0 = self._clock(), self._decode_s()
        timings = ses.prefill_reader()
        for pos, n, target_s, draft_s in timings:  # the reader's timing prices only a reader this generation drafts with
            ctrl.calibrate(pos, target_s, draft_s if reader is not None else None, n)
        own = ctrl.per[reader.name] if isinstance(ctrl, DrafterChooser) and reader is not None else ctrl
        if own is not None and reader is not None and ses.read_timing is not None:
            own.draft.calibrate_catchup(*ses.read_timing)  # its catch-up's price until one is measured
        agreement = ses.agreement
        if self._trial and agreement is not None:
            ctrl.at(len(ses.history))
            agreement = reader.prompt_compared(own, lambda: step_overhead(self.controller)) or agreement
        if self._wants and agreement is not None:
            ctrl.seed_acceptance(*agreement)
        spent = self._clock() - t0
        p.prompt_s += spent
        p.t_gen0 += spent
        p.decode_s_at_start += self._decode_s() - d0

    def _choose_draft(self, remaining: int | None) -> tuple[int, tuple[str, ...] | None]:
        """This step's draft length and drafters (None: --drafter's list; under auto the controller's choice,
        () for plain decoding)."""
        ses, s, ctrl = self.session, self.settings, self.controller
        if not self.speculative:
            return 0, None
        n_draft_max = min(s.draft_cap, ses.n_ctx - len(ses.history) - 1)
        if remaining is not None:
            n_draft_max = min(n_draft_max, remaining - 1)
        self.draft_limit = max(n_draft_max, 0)  # what the step could draft (a batch's planner may use it all)
        if ctrl is None:
            return n_draft_max, None
        ctrl.at(len(ses.history), remaining)
        if isinstance(ctrl, DrafterChooser):
            n = max(n_draft_max, 0)
            choice = ctrl.choose(ses.auto_limits(s, n), ses.auto_keys(s, n))
            ses.until = handover_rule(ses, s, self._p, choice)
            return choice.k, (choice.drafter,) if choice.drafter else ()
        return ctrl.choose(n_draft_max), None

    def _observe(self, step: StepResult, t_step: float) -> None:
        """Tell the controller what the step drafted, accepted and cost, and the drafters that a step was taken."""
        ctrl = self.controller
        if ctrl is not None:
            overhead_s = self._clock() - t_step - step.draft_s - step.verify_s
            ctrl.observe(StepOutcome(n_drafted=step.n_drafted, n_accepted=len(step.emitted) - 1,
                                     draft_token_s=step.draft_token_s, verify_s=step.verify_s, overhead_s=overhead_s,
                                     draft_s=step.draft_s, first_token_s=step.first_token_s, catchup=step.catchup,
                                     drafter=step.drafter, acceptance=step.acceptance, shared=step.shared))
        for d in self.session.drafters.values():
            d.stepped(step)

    def _emit(self, step: StepResult, utf8, remaining: int | None) -> tuple[list[TokenEvent], str | None]:
        """Commit the step's tokens to the history, up to an end of generation or n_predict."""
        eng, p = self.session.engine, self._p
        events = []
        for i, tok in enumerate(step.emitted):
            self.session.history.append(tok)
            self.tokens.append(tok)
            is_eog = eng.target.is_eog(tok)
            piece = "" if is_eog else utf8.decode(eng.target.piece(tok))
            self._text.append(piece)
            lp = step.logprobs[i] if step.logprobs is not None else None
            events.append(TokenEvent(tok, piece, i < len(step.emitted) - 1, p.n_steps - 1,
                                     *((lp.logprob, lp.top) if lp is not None else ())))
            if is_eog:
                return events, "eog"
            if remaining is not None and len(self.tokens) >= self.settings.n_predict:
                return events, "n_predict"
        return events, None

    def _deliver(self, events: list[TokenEvent]) -> Iterator[TokenEvent]:
        n_read = 0
        try:
            for ev in events:
                yield ev
                n_read += 1
        except GeneratorExit:  # the consumer stopped inside this step (a stop string, Ctrl-C)
            self.keep(n_read + 1)
            raise

    def _end(self, stop: str, samp: Sampling, utf8) -> None:
        ses, p = self.session, self._p
        try:
            for d in ses.drafters.values():
                d.ended(self.new_tokens, self.tokens, interrupted=stop == "interrupted")
        finally:
            gen_s = self._clock() - p.t_gen0
            try:
                ses.rewind()
            finally:
                samp.close()
                tail = utf8.decode(b"", final=True)
                if tail:
                    self._text.append(tail)
                self.stats = make_stats(self, stop, gen_s)

    def run(self) -> "Generation":
        """Consume the whole generation (no streaming)."""
        for _ in self:
            pass
        return self
