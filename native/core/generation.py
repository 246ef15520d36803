"""A generation: speculative steps turned into token events, with text, timing and stats."""

from __future__ import annotations

import codecs
from typing import Iterator, TYPE_CHECKING

from ..control.chooser import AdaptiveDrafters
from ..control.length import AdaptiveDraft
from ..control.step import StepOutcome
from .accept import accepted_per_position
from .sampling import Sampling
from .settings import AGREE_TOKENS, GenerationSettings, WINDOW_PROBATION
from .stats import GenerationStats, Progress, TokenEvent

if TYPE_CHECKING:
    from .session import Session


class Generation:
    """Iterate for TokenEvents; `stats` is set when the iteration ends (also on interruption);
    `snapshot()` gives the stats so far while it runs."""

    def __init__(self, session: Session, new_tokens: list[int], settings: GenerationSettings, speculative: bool):
        self.session = session
        self.new_tokens = list(new_tokens)
        self.settings = settings
        self.speculative = speculative
        self.stats: GenerationStats | None = None
        self.controller: AdaptiveDraft | None = None  # draft_max="auto": its final estimates (for tune)
        self.tokens: list[int] = []
        self._text: list[str] = []
        self._p = Progress()
        self._clock = session.engine.clock
        self._samp: Sampling | None = None
        eng = session.engine
        self._ctxs = [c for c in (eng.tgt_ctx, eng.dft_ctx if speculative else None) if c is not None]

    @property
    def text(self) -> str:
        return "".join(self._text)

    def _make_stats(self, stop: str, gen_s: float) -> GenerationStats:
        p, s, ctrl, samp = self._p, self.settings, self.controller, self._samp
        return GenerationStats(
            speculative=self.speculative, n_prompt=len(self.new_tokens), n_generated=len(self.tokens),
            n_steps=p.n_steps, n_drafted=p.n_drafted, n_accepted=sum(p.accepted),
            accepted_per_pos=tuple(accepted_per_position(p.accepted, s.draft_cap)) if self.speculative else (),
            prompt_ms=p.prompt_s * 1e3, draft_ms=p.draft_s * 1e3, verify_ms=p.verify_s * 1e3,
            gen_ms=gen_s * 1e3, decode_ms=(self._decode_s() - p.decode0) * 1e3,
            n_restores=self.session.n_restores - p.restores0, n_rollbacks=self.session.n_rollbacks - p.rollbacks0,
            n_draft_slides=self.session.n_draft_slides - p.slides0,
            draft_window=self.session.window if self.speculative else None,
            n_window_trials=self.session.n_window_trials - p.trials0,
            n_window_reverts=self.session.n_window_reverts - p.reverts0,
            stop_reason=stop,
            accept_mode=(samp.mode if samp else "greedy") if self.speculative else (
                "greedy" if s.temp <= 0 else "sample"),
            sample_ms=samp.sample_s * 1e3 if samp else 0.0,
            n_plain_steps=ctrl.n_plain_steps - p.plain0 if ctrl else 0,
            n_probes=ctrl.n_probes - p.probes0 if ctrl else 0,
            steps_by_k=tuple(sorted(p.steps_by_k.items())), tried_per_pos=tuple(p.tried),
            verify_ms_by_size=tuple((b, n, ms * 1e3) for b, (n, ms) in sorted(p.verify_by_size.items())),
            draft_next_ms=p.draft_next_s * 1e3, n_draft_next=p.n_draft_next,
            n_drafted_by=tuple(sorted(p.drafted_by.items())), n_accepted_by=tuple(sorted(p.accepted_by.items())))

    def _decode_s(self) -> float:
        return sum(c.decode_s for c in self._ctxs) + (self.session.decode_s if self.speculative else 0.0)

    def snapshot(self) -> GenerationStats:
        """The stats so far (stop_reason "running"); the final ones once the generation has ended."""
        if self.stats is not None:
            return self.stats
        t0 = self._p.t_gen0
        return self._make_stats("running", 0.0 if t0 is None else self._clock() - t0)

    def __iter__(self) -> Iterator[TokenEvent]:
        ses, s, p = self.session, self.settings, self._p
        eng = ses.engine
        auto_drafter = s.drafters == ("auto",)
        ctrl = ses.controller(s) if self.speculative and (s.adaptive or auto_drafter) else None
        ses._attach_mtp(self.speculative and any(n in ("mtp", "auto") for n in s.drafters))
        self.controller = ctrl
        with_draft = ses.dft is not None and "model" in ses.available_drafters(s)
        tp0 = self._clock()
        p.trials0, p.reverts0 = ses.n_window_trials, ses.n_window_reverts
        # Where nothing was measured at this context yet, the prefill times single tokens on each model, so
        # that the first step is priced at this context (at thousands of tokens attention changes the costs).
        # Before the draft model was tried enough, the prefill also compares its greedy choices with the target's
        # over the prompt's last rows (greedy decoding: acceptance is exactly that agreement).
        greedy_model = ctrl is not None and with_draft and s.temp <= 0
        wants = greedy_model and ctrl.wants_agreement()
        # --ctx-draft auto: at a long context, whether a draft window would be faster (Session.try_window)
        trial = greedy_model and ses.window_trial_due(len(self.new_tokens))
        agree = AGREE_TOKENS if wants or trial else 0
        timed = ses.prefill(self.new_tokens,
                            timed=(lambda first, last: ctrl.calibration_points(first, last, with_draft))
                            if ctrl is not None else None, agree=agree)
        for pos, n, target_s, draft_s in timed:
            ctrl.calibrate(pos, target_s, draft_s, n)
        agreement = ses.agreement
        if trial and agreement is not None:
            ctrl.at(len(ses.history))
            drafter = ctrl.per["model"] if auto_drafter else ctrl
            agreement = ses.try_window(drafter, self._overhead()) or agreement
        if wants and agreement is not None:
            ctrl.seed_acceptance(*agreement)
        p.prompt_s = self._clock() - tp0

        samp = self._samp = Sampling(s, self.speculative)
        if ctrl is not None:
            p.plain0, p.probes0 = ctrl.n_plain_steps, ctrl.n_probes
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        stop = "interrupted"
        p.decode0 = self._decode_s()
        p.restores0, p.rollbacks0, p.slides0 = ses.n_restores, ses.n_rollbacks, ses.n_draft_slides
        p.t_gen0 = self._clock()
        try:
            while True:
                remaining = None if s.n_predict is None else s.n_predict - len(self.tokens)
                if remaining is not None and remaining <= 0:
                    stop = "n_predict"
                    break
                if len(ses.history) >= ses.n_ctx:
                    stop = "ctx"
                    break
                n_draft_max = 0
                drafters = None  # None: --drafter's list; auto names this step's choice (() for plain decoding)
                if self.speculative:
                    n_draft_max = min(s.draft_cap, ses.n_ctx - len(ses.history) - 1)
                    if remaining is not None:
                        n_draft_max = min(n_draft_max, remaining - 1)
                    if ctrl is not None:
                        t_step = self._clock()
                        ctrl.at(len(ses.history), remaining)
                        if auto_drafter:
                            name, n_draft_max = ctrl.choose(ses._auto_limits(s, max(n_draft_max, 0)))
                            drafters = (name,) if name else ()
                        else:
                            n_draft_max = ctrl.choose(n_draft_max)
                step = ses._step(s, samp, max(n_draft_max, 0), drafters)
                p.n_steps += 1
                p.draft_s += step.draft_s
                p.verify_s += step.verify_s
                done = None
                events = []
                for i, tok in enumerate(step.emitted):
                    ses.history.append(tok)
                    self.tokens.append(tok)
                    is_eog = eng.target.is_eog(tok)
                    piece = "" if is_eog else utf8.decode(eng.target.piece(tok))
                    self._text.append(piece)
                    events.append(TokenEvent(tok, piece, i < len(step.emitted) - 1, p.n_steps - 1))
                    if is_eog:
                        done = "eog"
                        break
                    if remaining is not None and len(self.tokens) >= s.n_predict:
                        done = "n_predict"
                        break
                if self.speculative:
                    p.count_step(step, len(events))
                ses._rewind()
                if ctrl is not None:
                    ctrl.observe(StepOutcome(
                        step.n_drafted, len(step.emitted) - 1, step.draft_token_s, step.verify_s,
                        self._clock() - t_step - step.draft_s - step.verify_s, step.draft_s, step.first_token_s,
                        step.catchup, drafter=step.drafter))
                rows = ses.window_on_probation()
                if rows is not None and rows >= WINDOW_PROBATION:
                    ses.settle_window(self._overhead())
                n_read = 0
                try:
                    for ev in events:
                        yield ev
                        n_read += 1
                except GeneratorExit:  # the consumer stopped inside this step (a stop string, Ctrl-C)
                    if self.speculative and n_read + 1 < len(events):
                        p.count_step(step, len(events), sign=-1)
                        p.count_step(step, n_read + 1)
                    raise
                if done:
                    stop = done
                    break
            if ses.window_on_probation() is not None:  # an answer shorter than the probation
                ses.settle_window(self._overhead())
        finally:
            ses.abandon_window()  # interrupted on probation: the whole context's memory again
            gen_s = self._clock() - p.t_gen0
            try:
                ses._rewind()
            finally:
                samp.close()
                tail = utf8.decode(b"", final=True)
                if tail:
                    self._text.append(tail)
                self.stats = self._make_stats(stop, gen_s)

    def _overhead(self) -> float:
        """The draft model's controller's per-step overhead (--drafter auto: the one all drafters share)."""
        ctrl = self.controller
        return ctrl.shared.overhead if isinstance(ctrl, AdaptiveDrafters) else ctrl.overhead

    def run(self) -> "Generation":
        """Consume the whole generation (no streaming)."""
        for _ in self:
            pass
        return self
