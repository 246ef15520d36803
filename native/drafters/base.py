"""The drafter interface: what a drafter gives a speculative step, and the pick loop the model-like ones share.

Glossary (every drafter, native/drafters/*.py, speaks these words):
- drafter: proposes up to n tokens to follow the session's committed history; the target verifies them in one pass
  and keeps the longest prefix its own rule accepts, so any drafter is exact (only speed depends on it).
- proposal (`Proposal`): the tokens, their proposal distributions (rejection sampling only; a point mass for a
  drafter that picks deterministically), and what drafting them cost.
- first-token seconds: from the step's start to the first drafted token, a short catch-up (at most CATCHUP_SHORT
  tokens the drafter had not seen) included; per-token seconds: each further drafted token.
- long catch-up (`CatchUp`): a drafter with a memory of the text that fell further behind (after steps it did not
  draft) decodes those tokens first, prefill-like; reported apart so that the first token's cost stays clean.
- rewind: make the drafter's memory hold no more than the committed history (after a verify rejected drafts).
- reads_prompt: a drafter with a memory of the whole prompt (a draft model): prefill evaluates the prompt on it,
  times it and compares its greedy choices with the target's (at most one per session: `Session.reader`).
- on_match_only: a drafter whose proposal exists only sometimes (an n-gram match): tried first in a list, and
  passed over where it has nothing.
- has_memory: a drafter that must decode every committed token before it drafts (a model, an MTP head): tokens
  others emit cost it a catch-up, which the drafter chooser charges to them; an n-gram lookup has none.

- units: what a proposal's ids are. Every drafter proposes target token ids (TARGET_TOKENS); a draft model of
  another vocabulary drafts in its own and translates before it proposes (crossvocab.py, `for_engine`).
- shared (`Drafter.provide`): what every session's drafter of one kind shares on an engine, opened once when the
  engine loads and closed with it: a context of its own, a store that outlives requests.

A drafter's life in a session, each hook a no-op by default:
- `attach(on)`: a generation starts that may (on) or may not draft with it;
- `read_prompt(spans, last)`: a reads_prompt drafter reads the prompt after the target (prefill), times spans
  and compares its greedy choices with the target's (`PromptRead`);
- `wants_prompt_rows(n_new)`, `prompt_compared(ctrl, overhead)`: it asks for the comparison for its own sake and
  may act on it (the draft model's window trial);
- `propose` / `propose_batch`: each step (a drafter that drafts token by token stops once `session.until` holds
  for its drafts: --drafter auto hands the step over to an n-gram match there, `lookahead`); `rewind`: after a
  verify, a rollback or a new prompt; `stepped(step)`: after each step;
- `ended(prompt, output, interrupted)`: the generation ended, whoever drafted;
- `counts()`: its counters for the generation stats; `clear()`: a reset session.

Adding a drafter: one module here with a `Drafter` subclass, and one entry in registry.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, ClassVar, NamedTuple, TYPE_CHECKING

import numpy as np

from ..core.accept import top_probability
from ..core.sampling import Sampling, SparseDist, restrict, sample

if TYPE_CHECKING:
    from ..control.length import LengthController
    from ..core.prompt import AgreeRows, Span
    from ..runtime.engine import Engine
    from ..runtime.session import Session
    from ..runtime.step import StepResult
    from ..core.settings import GenerationSettings

CATCHUP_SHORT = 2  # a catch-up of at most this many tokens is part of the first drafted token's cost
TARGET_TOKENS = "target"  # a drafter's units: the target's token ids
AUTO = "auto"  # --drafter auto: the adaptive controller chooses among the available drafters each step


class CatchUp(NamedTuple):
    """A long catch-up: the tokens decoded before drafting, and the seconds up to the first drafted token."""

    tokens: int
    seconds: float


class Agreement(NamedTuple):
    """Rows where a drafter's greedy choice was the target's, of the rows compared (teacher-forced acceptance)."""

    agree: int
    rows: int


class Timing(NamedTuple):
    """A timed span of the prompt: what a decode of n tokens at pos cost the target (every row's logits, as a
    verify), and what one of as many cost the drafter that reads the prompt (None where none was timed)."""

    pos: int
    n: int
    target_s: float
    draft_s: float | None


@dataclass
class PromptRead:
    """What a drafter's read of the prompt found: the timed spans (`Timing`), its agreement with the target on the
    compared span (None: none compared), and its longest read (context, tokens, seconds): a catch-up's cost."""

    timings: list[Timing] = field(default_factory=list)
    agreement: Agreement | None = None
    longest: tuple[int, int, float] | None = None


@dataclass
class Proposal:
    """One step's draft: the tokens, their distributions (rejection mode, else empty) and the drafting cost."""

    tokens: list[int] = field(default_factory=list)
    dists: list[SparseDist] = field(default_factory=list)
    first_token_s: float | None = None  # seconds to the first drafted token (a short catch-up included), where clean
    token_s: float | None = None  # seconds per further drafted token (None below two tokens)
    catchup: CatchUp | None = None  # a long catch-up before the first token
    source: str | None = None  # where a drafter with several sources took it (the suffix drafter: store, text)


class Drafter:
    """The drafter protocol (see the module's glossary), with the defaults most drafters keep. Class attributes and
    class methods describe the kind (the registry reads them before any session exists); an instance belongs to
    one `Session` and reads its committed history (`session.history`), never changing it."""

    name: ClassVar[str]
    units: ClassVar[str] = TARGET_TOKENS  # what its proposals' ids are (the module's glossary)
    needs_draft_model: ClassVar[bool] = False  # runs only with a draft model loaded (Engine(draft=...))
    on_match_only: ClassVar[bool] = False
    reads_prompt: ClassVar[bool] = False
    has_memory: ClassVar[bool] = True  # decodes every committed token (a catch-up after steps it did not draft)

    def __init__(self, session: Session):
        self.session = session

    @classmethod
    def for_engine(cls, engine: Engine) -> type[Drafter]:
        """The class whose instances draft for this kind on this engine (by default this one; a draft model of
        another vocabulary translates its proposals: crossvocab.py)."""
        return cls

    @classmethod
    def provide(cls, engine: Engine) -> object | None:
        """What every session's drafter of this kind shares on this engine: opened once, after the models load
        (a context of its own, a store that outlives requests); `self.shared` in each instance. The engine warms up
        and times what has warm_up/on_decode (an ffi.Context), and closes what has close() with itself. None
        (the default): nothing."""
        return None

    @property
    def shared(self):
        """What `provide` opened on this session's engine (None: nothing)."""
        return self.session.engine.provided.get(self.name)

    @classmethod
    def available(cls, engine: Engine) -> bool:
        """Whether this engine can run it (a session builds only the available drafters)."""
        return True

    @classmethod
    def check(cls, engine: Engine) -> None:
        """Raise an actionable error where this engine cannot run it (it was asked for by name)."""

    @classmethod
    def cost_prior(cls, engine: Engine) -> float:
        """Its cost per drafted token before any is measured, as a share of one target token (--drafter auto)."""
        return 0.01

    @classmethod
    def engine_options(cls, drafters: tuple[str, ...]) -> dict:
        """Engine(...) options it needs loaded for --drafter's list (("auto",) for auto)."""
        return {}

    def propose(self, n_max: int, s: GenerationSettings, samp: Sampling) -> Proposal:
        """Up to n_max tokens to follow the history (n_max >= 1)."""
        raise NotImplementedError

    @classmethod
    def propose_batch(cls, asks: list[tuple[Drafter, int, GenerationSettings, Sampling]]) -> list[Proposal]:
        """Proposals of several sessions' drafters of this kind, one per (drafter, n_max, settings, sampling): a
        batch of sequences drafts together (runtime/batch.py). By default one after another."""
        return [d.propose(n, s, samp) for d, n, s, samp in asks]

    def limit(self, n_max: int, s: GenerationSettings) -> int:
        """The most it could propose now, at most n_max (--drafter auto weighs drafters by it)."""
        return n_max

    def evidence(self, n_max: int, s: GenerationSettings) -> str | None:
        """What kind of proposal it has now, for --drafter auto to learn acceptance by (DrafterChooser's evidence
        keys; a drafter with no memory of the text only). None by default: one estimate for all its proposals."""
        return None

    def lookahead(self, drafts: list[int], n: int, s: GenerationSettings) -> int:
        """How many tokens (at most n) it would propose were the history followed by `drafts` (--drafter auto hands
        a draft model's step over to it there: Session.until). 0 by default: it does not say."""
        return 0

    def attach(self, on: bool) -> None:
        """A generation begins that may (on) or may not draft with it: start or stop work it does meanwhile."""

    def read_prompt(self, spans: list[tuple[Span, float | AgreeRows]], last: int) -> PromptRead:
        """reads_prompt: read the history up to `last` (the target holds as much) after the target's part of the
        prefill. `spans`: the prompt rows the target decoded apart, each with its seconds (a timed span: time as
        many tokens here) or its rows (an agreement span: compare greedy choices with them)."""
        return PromptRead()

    def wants_prompt_rows(self, n_new: int) -> bool:
        """Whether the prefill of n_new more tokens should compare this drafter with the target for its own sake
        (greedy), then call prompt_compared."""
        return False

    def prompt_compared(self, ctrl: LengthController, overhead: Callable[[], float]) -> Agreement | None:
        """After a prefill it wanted compared (wants_prompt_rows): act on it (`ctrl`: its length controller at
        this context; `overhead()`: the step overhead it is priced with). The agreement that holds now, where it
        changed."""
        return None

    def behind(self) -> int:
        """Tokens of the history it would decode before drafting (a batch's planner prices them)."""
        return 1

    def share_prefix(self, other: Drafter, n: int, prompt: list[int]) -> None:
        """Take over the first n tokens of `prompt` from the same drafter of another session (a shared system
        prompt the target took over), where it keeps a memory of them."""

    def rewind(self) -> None:
        """Hold no more than the committed history (after a verify, a rollback or a new prompt)."""

    def stepped(self, step: StepResult) -> None:
        """A step of the session's generation was taken (whoever drafted it): what it did."""

    def ended(self, prompt: list[int], output: list[int], interrupted: bool) -> None:
        """The session's generation ended (whoever drafted, speculative or not): its prompt and output tokens."""

    def counts(self) -> dict[str, int]:
        """Its counters so far, by GenerationStats field (summed over a session's drafters; the generation
        reports what they grew by)."""
        return {}

    def clear(self) -> None:
        """Forget everything (a reset session)."""

    window: int | None = None  # the recent tokens of the history it sees (None: all)
    n_restores: int = 0  # checkpoint restores of its memory so far (Session.n_restores)
    n_rollbacks: int = 0  # recurrent/hybrid tails it dropped through snapshots so far
    decode_s: float = 0.0  # llama_decode time on contexts of its own (not the engine's)


def pick(row: np.ndarray, p_min: float, samp: Sampling, n_vocab_tgt: int,
         clock: Callable[[], float]) -> tuple[int, SparseDist | None] | None:
    """The next draft token from a drafter's logits row (greedy, or sampled from its transformed distribution
    under rejection), or None to stop drafting (top probability below p_min, or an id the target lacks)."""
    if samp.draft_tf is None:
        tok = int(row.argmax())
        if tok >= n_vocab_tgt or (p_min > 0 and top_probability(row) < p_min):
            return None
        return tok, None
    # Sample only ids the target has (renormalised): stopping on a sampled id it lacks would make the stop
    # depend on the sampled value and bias the output law.
    ts = clock()
    q = restrict(samp.draft_tf(row), n_vocab_tgt)
    stop = q is None or (p_min > 0 and q.top_prob() < p_min)
    tok = -1 if stop else sample(q, samp.rng)
    samp.sample_s += clock() - ts
    return None if stop else (tok, q)


def pick_loop(choose: Callable[[list[int]], tuple[int, SparseDist | None] | None],
              advance: Callable[[int, int], None], n_max: int, until: Callable[[list[int]], bool] | None = None
              ) -> tuple[list[int], list[SparseDist]]:
    """Draft from a model-like drafter: `choose(drafts)` picks the token after the drafts so far (usually `pick`
    on the logits after the last token fed, masked by `Sampling.draft_row` where a constraint applies; a
    translated draft's own), then `advance(token, i)` feeds drafted token i (from 1), until choose stops, n_max
    tokens are drafted or `until(drafts)` holds. The stops depend only on tokens already drafted, never on one
    drawn and then dropped, so a sampled draft keeps its law (the verify's q)."""
    drafts: list[int] = []
    dists: list[SparseDist] = []
    while True:
        got = choose(drafts)
        if got is None:
            break
        drafts.append(got[0])
        if got[1] is not None:
            dists.append(got[1])
        if len(drafts) >= n_max or until is not None and until(drafts):
            break
        advance(got[0], len(drafts))
    return drafts, dists


def proposal_with_costs(drafts: list[int], dists: list[SparseDist], behind: int, t_start: float, t_first: float | None,
          t_loop: float, t_end: float) -> Proposal:
    """A model-like drafter's proposal with its costs: it began at t_start `behind` tokens behind the history, the
    decode that yielded the first token began at t_first (None: that decode was also a long catch-up's), the pick
    loop ran from t_loop to t_end. first + (k-1)·per_token is then the step's drafting time."""
    n = len(drafts)
    return Proposal(drafts, dists,
                    first_token_s=t_loop - t_first if n and t_first is not None else None,
                    token_s=(t_end - t_loop) / (n - 1) if n >= 2 else None,
                    catchup=CatchUp(behind, t_loop - t_start) if n and behind > CATCHUP_SHORT else None)
