"""What one generation asks for (GenerationSettings), and the engine's limits."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...errors import UsageError

if TYPE_CHECKING:
    from .constraint import Constraint

# The largest draft the target context is sized for (its output rows per verify are draft_max + 1).
DRAFT_MAX_CAP = 64
# `draft_max="auto"`: the adaptive controller picks each step's length in 0..AUTO_DRAFT_CAP.
AUTO_DRAFT_CAP = 16
AGREE_TOKENS = 32  # prompt rows compared between target and draft before the first draft (Session.prefill's agree)
AGREE_MIN = 4
MIN_DRAFT_WINDOW = 2 * (DRAFT_MAX_CAP + 2)  # a window slides to half its size, leaving room for a whole draft
DRAFT_SINK = 4  # the history's first tokens a draft window keeps (drafters/model.py: ModelDrafter.fit)
# --ctx-draft auto: at a long context a session times a draft that sees only this many recent tokens against the
# whole-context one, and keeps the faster (drafters/window.py); first at WINDOW_TRIAL_MIN tokens, again when
# the context has doubled
WINDOW_TRIAL = 512
WINDOW_TRIAL_MIN = 3 * WINDOW_TRIAL
WINDOW_TIMINGS = 3  # single-token decodes timed on each side of a window trial (the fastest counts)
# A window the trial took on the prompt's rows is kept once it agrees with the target on this many rows of the
# answer about as well as the whole context does (DraftWindow.settle); until then the whole context's memory
# waits untouched, so that giving the window up costs no new prefill
WINDOW_PROBATION = 24
ACCEPT_MODES = ("auto", "match", "rejection")


@dataclass(frozen=True)
class GenerationSettings:
    n_predict: int | None = 128  # None: until end of generation or a full context
    draft_max: int | str = 8  # or "auto": adaptive length per step (AUTO_DRAFT_CAP at most)
    draft_min: int = 0
    p_min: float = 0.0
    temp: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = 0
    accept: str = "auto"  # "match" | "rejection" | "auto" (rejection at temp > 0); temp 0 is always greedy
    drafter: str = "model"  # a registered drafter's name (native/drafters/registry.py), a comma list (the first with
    # a proposal drafts) or "auto" (the adaptive controller chooses per step, plain decoding included)
    ngram_min: int = 3  # the shortest ending of the text an n-gram proposal needs to have seen before
    ngram_max: int = 6
    logprobs: int | None = None  # None: none computed; n >= 0: each token's log-probability and the top n
    # constrained output (core/constraint.py): a JSON schema or grammar the answer follows; None: free text
    constraint: Constraint | None = None

    @property
    def drafters(self) -> tuple[str, ...]:
        """--drafter's names as written (a comma list, or ("auto",)). Where they meet the drafters they are
        checked and put in the order each step tries them (drafters/registry.py parse_drafter: at the CLI, the
        API and Session.generate, which hands the generation its settings with the names in that order)."""
        return tuple(x.strip() for x in str(self.drafter).split(",") if x.strip())

    @property
    def adaptive(self) -> bool:
        return self.draft_max == "auto"

    @property
    def draft_cap(self) -> int:
        """The most tokens one step may draft."""
        return AUTO_DRAFT_CAP if self.adaptive else int(self.draft_max)

    @property
    def accept_mode(self) -> str:
        """What verification does: "greedy" (temp 0), "match" or "rejection"."""
        if self.temp <= 0:
            return "greedy"
        return "rejection" if self.accept == "auto" else self.accept

    def validate(self) -> "GenerationSettings":
        if self.n_predict is not None and self.n_predict < 1:
            raise UsageError(f"--n-predict must be at least 1 ({self.n_predict}); pass a positive number")
        if isinstance(self.draft_max, str):
            if self.draft_max != "auto":
                raise UsageError(f"--draft-max must be a number or auto ({self.draft_max})")
        elif not 1 <= self.draft_max <= DRAFT_MAX_CAP:
            raise UsageError(f"--draft-max must be between 1 and {DRAFT_MAX_CAP}, or auto ({self.draft_max})")
        if self.accept not in ACCEPT_MODES:
            raise UsageError(f"--accept must be one of {', '.join(ACCEPT_MODES)} ({self.accept})")
        if not 0 <= self.draft_min <= self.draft_cap:
            raise UsageError(f"--draft-min must be between 0 and --draft-max ({self.draft_min})")
        if not 0.0 <= self.p_min <= 1.0:
            raise UsageError(f"--p-min must be between 0 and 1 ({self.p_min})")
        if self.temp < 0:
            raise UsageError(f"--temp must be >= 0 ({self.temp}); use 0 for greedy decoding")
        if not 0.0 < self.top_p <= 1.0:
            raise UsageError(f"--top-p must be in (0, 1] ({self.top_p})")
        if not 0.0 <= self.min_p <= 1.0:
            raise UsageError(f"--min-p must be between 0 and 1 ({self.min_p})")
        if self.top_k < 0:
            raise UsageError(f"--top-k must be >= 0 ({self.top_k}); 0 disables it")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise UsageError(f"logprobs must be between 0 and 20 ({self.logprobs})")
        if not self.drafters:
            raise UsageError(f"--drafter must name a drafter, a comma list of them, or auto ({self.drafter})")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise UsageError(f"--ngram-min must be at least 1 and at most --ngram-max ({self.ngram_min}, "
                             f"{self.ngram_max})")
        return self

