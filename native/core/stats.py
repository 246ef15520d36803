"""What a generation reports: token events, frozen stats, and the running counters behind them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..runtime.step import StepResult


@dataclass(frozen=True)
class TokenEvent:
    token: int
    text: str  # the decoded text this token completes ('' while a UTF-8 sequence is incomplete)
    from_draft: bool
    step: int
    logprob: float | None = None  # GenerationSettings.logprobs: the target's raw log-probability of the token
    top_logprobs: tuple[tuple[int, float], ...] = ()  # and its row's most likely tokens (id, log-probability)


class Rates:
    """Derived rates of anything with n_accepted, n_drafted, n_tried, n_steps, n_generated and gen_ms.

    Two acceptances, named for what they are: `accept_rate` = accepted ÷ every draft token the target verified
    (llama.cpp's and llama-server's ratio); `alpha` = accepted ÷ the draft positions reached (verified with every
    earlier one accepted), the per-position α of the speed-up formula E(k) = (1 − α^(k+1)) / (1 − α)."""

    @property
    def accept_rate(self) -> float | None:
        return self.n_accepted / self.n_drafted if self.n_drafted else None

    @property
    def alpha(self) -> float | None:
        return self.n_accepted / self.n_tried if self.n_tried else None

    @property
    def mean_accepted_per_step(self) -> float | None:
        return self.n_accepted / self.n_steps if self.n_steps else None

    @property
    def tokens_per_s(self) -> float:
        return self.n_generated / (self.gen_ms / 1000.0) if self.gen_ms > 0 else 0.0


@dataclass(frozen=True)
class GenerationStats(Rates):
    speculative: bool
    n_prompt: int
    n_generated: int
    n_steps: int
    n_drafted: int  # draft tokens the target verified (up to where the generation ended inside a step)
    n_accepted: int
    accepted_per_pos: tuple[int, ...]
    prompt_ms: float
    draft_ms: float
    verify_ms: float
    gen_ms: float
    decode_ms: float  # time inside llama_decode (both models) during generation
    n_restores: int  # checkpoint restores, both models (memories that cannot remove part of a sequence)
    stop_reason: str  # "eog" | "n_predict" | "ctx" | "interrupted"
    accept_mode: str = "greedy"  # "greedy" | "match" | "rejection"
    vocab_map: str | None = None  # a draft model of another vocabulary: its translation ("tli" | "string")
    vocab_overlap: float | None = None  # and its overlap (core/vocabmap.py)
    n_vocab_unaligned: int = 0  # such a draft's string-path steps with nothing to propose
    n_vocab_full: int = 0  # such a draft's steps with no proposal: its context could not hold the text
    n_vocab_tli_steps: int = 0  # such a draft's steps drafted by TLI (--vocab-map auto chooses per step)
    n_vocab_string_steps: int = 0  # and by the string path
    sample_ms: float = 0.0  # rejection mode: time in the sampling transform and acceptance (both models)
    n_plain_steps: int = 0  # draft_max=auto: steps that chose not to draft (probes excluded)
    n_probes: int = 0  # draft_max=auto: short drafts tried while plain decoding was winning
    n_handovers: int = 0  # --drafter auto: draft-model steps stopped where an n-gram would propose (Session.until)
    n_rollbacks: int = 0  # recurrent/hybrid tails dropped through state snapshots (no checkpoint restore)
    n_draft_slides: int = 0  # times the draft's window moved on (a --ctx-draft smaller than --ctx)
    draft_window: int | None = None  # the recent tokens the draft sees at the end (None: the whole context)
    n_window_trials: int = 0  # --ctx-draft auto: windowed drafts timed against the whole-context one
    n_window_reverts: int = 0  # windows a trial took and the answer's rows then gave up (DraftWindow.settle)
    n_drafted_by: tuple[tuple[str, int], ...] = ()  # per drafter, by its registry name
    # --drafter suffix: tokens it proposed from earlier answers (the engine's store) and from this request's own
    # text, and how many of each the target accepted
    n_drafted_store: int = 0
    n_accepted_store: int = 0
    n_drafted_text: int = 0
    n_accepted_text: int = 0
    n_accepted_by: tuple[tuple[str, int], ...] = ()
    # The cost model's inputs (native/control/report.py): what each step drafted, verified and cost.
    steps_by_k: tuple[tuple[int, int], ...] = ()  # (verified draft length, steps)
    tried_per_pos: tuple[int, ...] = ()  # steps that verified position i+1 with positions 1..i accepted
    verify_ms_by_size: tuple[tuple[int, int, float], ...] = ()  # (batch size, passes, total ms)
    draft_next_ms: float = 0.0  # drafted tokens after a step's first, where measured: their time...
    n_draft_next: int = 0  # ...and how many
    # constrained output (GenerationSettings.constraint): drafted/accepted in steps under the constraint, the masks
    # the grammar computed (each position once), the logits rows masked (draft and target) and the time in masking
    constrained: bool = False
    n_drafted_constrained: int = 0
    n_accepted_constrained: int = 0
    n_masks: int = 0
    n_drafted_unforced: int = 0  # drafted tokens proposed where the grammar allowed more than one token
    n_masked_rows: int = 0
    mask_ms: float = 0.0

    @property
    def n_tried(self) -> int:
        """Draft positions reached: verified with every earlier position of the step accepted."""
        return sum(self.tried_per_pos)

    @property
    def overhead_fraction(self) -> float:
        """Share of generation time spent outside llama_decode (Python, sampling, bookkeeping)."""
        return max(0.0, 1.0 - self.decode_ms / self.gen_ms) if self.gen_ms > 0 else 0.0


@dataclass
class RunningCounts:
    """A generation's running counters: what `Generation.snapshot()` and the final stats are built from."""

    prompt_s: float = 0.0
    n_steps: int = 0
    n_drafted: int = 0
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted, per step that drafted
    draft_s: float = 0.0
    verify_s: float = 0.0
    t_gen0: float | None = None
    decode_s_at_start: float = 0.0
    restores_at_start: int = 0
    rollbacks_at_start: int = 0
    drafter_counts_at_start: dict = field(default_factory=dict)  # the drafters' counters when it began (Drafter.counts)
    plain_steps_at_start: int = 0  # the controller's counters when this generation began (it outlives generations)
    probes_at_start: int = 0
    n_handovers: int = 0  # --drafter auto: draft-model steps stopped where an n-gram would propose (Session.until)
    drafted_by: dict = field(default_factory=dict)
    accepted_by: dict = field(default_factory=dict)
    drafted_from: dict = field(default_factory=dict)  # by Proposal.source (the suffix drafter's store, text)
    accepted_from: dict = field(default_factory=dict)
    steps_by_k: dict = field(default_factory=dict)
    tried: list[int] = field(default_factory=list)
    verify_by_size: dict = field(default_factory=dict)
    draft_next_s: float = 0.0
    n_draft_next: int = 0
    drafted_constrained: int = 0  # drafted and accepted in steps under a constraint
    accepted_constrained: int = 0

    def count_step(self, step: "StepResult", n_kept: int, sign: int = 1) -> None:
        """Add one step's draft counts and cost-model inputs (sign -1 takes them back). Every draft token the
        target verified counts as drafted, except where the generation ended inside the step (an EOG, n_predict,
        a stop string: `n_kept` < the tokens it emitted), whose positions past the last token kept count nowhere."""
        k, a = step.n_drafted, len(step.emitted) - 1
        if n_kept < len(step.emitted):
            k, a = min(k, n_kept), min(a, n_kept)
        if step.n_drafted:
            self.n_drafted += sign * k
            if sign > 0:
                self.accepted.append(a)
            else:
                self.accepted.pop()
            self.drafted_by[step.drafter] = self.drafted_by.get(step.drafter, 0) + sign * k
            self.accepted_by[step.drafter] = self.accepted_by.get(step.drafter, 0) + sign * a
            if step.source is not None:
                self.drafted_from[step.source] = self.drafted_from.get(step.source, 0) + sign * k
                self.accepted_from[step.source] = self.accepted_from.get(step.source, 0) + sign * a
            if step.constrained:
                self.drafted_constrained += sign * k
                self.accepted_constrained += sign * a
        self.steps_by_k[step.n_drafted] = self.steps_by_k.get(step.n_drafted, 0) + sign
        reach = min(k, a + 1)
        self.tried.extend([0] * (reach - len(self.tried)))
        for i in range(reach):
            self.tried[i] += sign
        v = self.verify_by_size.setdefault(step.n_drafted + 1, [0, 0.0])
        v[0] += sign
        v[1] += sign * step.verify_s
        if step.draft_token_s is not None and step.n_drafted >= 2:
            self.draft_next_s += sign * step.draft_token_s * (step.n_drafted - 1)
            self.n_draft_next += sign * (step.n_drafted - 1)
