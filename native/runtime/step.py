"""The speculative step: for one sequence or several (Engine(parallel=N), a Session each), one path.

1. **Draft**: each sequence's drafter list is tried in order; the first drafter with a proposal drafts (one that
   drafts only on a match is passed over without). Sequences that reach a drafter of the same kind draft together
   (`Drafter.propose_batch`: for a draft model, one decode per draft position over the sequences still drafting;
   for one sequence, its own `propose`). A constraint cuts a proposal at its first forbidden token.
2. **Verify**: ONE target decode carries every sequence's `[last, d1..dn]` rows, logits at each (for one
   sequence, `Memory.extend` on the plain context). A first token alone and plain decodes nothing: its row is
   its prompt's (a folded prefill, `Session.take_ahead`).
3. **Accept**: each sequence's own rule and sampling state on its own rows (`accept`), before any sequence
   rewinds (a hybrid target's rewind may decode again and replace the logits).
The rewind is each generation's own (`Generation.take`: `Session.rewind`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.accept import expected_acceptance, greedy_emit, rejection_emit
from ..core.logprobs import TokenLogprob, token_logprobs
from ..core.memory import extend_many
from ..core.sampling import Sampling
from ..core.settings import GenerationSettings
from ..drafters.base import CatchUp, Drafter, Proposal

if TYPE_CHECKING:
    from .session import Session


@dataclass
class StepResult:
    """What one sequence's step did: the tokens it emitted, who drafted and what it cost (the controller learns
    from it as control/step.py's StepOutcome)."""

    emitted: list[int]
    n_drafted: int
    draft_s: float
    verify_s: float
    first_token_s: float | None = None  # seconds to the first drafted token (catch-up included), where clean
    draft_token_s: float | None = None  # seconds per further drafted token, where measured
    drafter: str | None = None  # who proposed this step's drafts (a registry name)
    catchup: CatchUp | None = None  # a long catch-up before the first drafted token
    source: str | None = None  # where the drafter took its drafts (Proposal.source)
    # rejection sampling: per drafted position (reach, expected acceptance), accept.expected_acceptance
    acceptance: tuple[tuple[float, float], ...] | None = None
    constrained: bool = False  # the step's first token was under a constraint (GenerationSettings.constraint)
    logprobs: list[TokenLogprob] | None = None  # per emitted token, where the settings ask (core/logprobs.py)
    shared: bool = False  # the step's decodes carried other sequences too (its times are the batch's)


@dataclass
class Ask:
    """One sequence's part of a step: its session, settings and sampling state, the most it may draft, and the
    drafters to try in order (None: --drafter's list; (): none, a plain step)."""

    session: Session
    settings: GenerationSettings
    samp: Sampling
    n_draft_max: int
    drafters: tuple[str, ...] | None = None


def propose_all(asks: list[Ask]) -> tuple[list[Proposal], list[str | None]]:
    """Each sequence's proposal and its drafter's name: the first drafter of its list with a proposal (one that
    drafts only on a match is passed over without); drafters of one kind propose together."""
    props: list[Proposal] = [Proposal() for _ in asks]
    names: list[str | None] = [None] * len(asks)
    groups: dict[type, list[tuple[int, Drafter]]] = {}
    for i, a in enumerate(asks):
        ses = a.session
        for name in (ses.available_drafters(a.settings) if a.drafters is None else a.drafters) \
                if a.n_draft_max > 0 else ():
            d = ses.drafters.get(name)
            if d is None:
                continue
            if d.on_match_only:
                prop = d.propose(a.n_draft_max, a.settings, a.samp)
                if not prop.tokens:
                    continue
                props[i], names[i] = prop, name
            else:
                groups.setdefault(type(d), []).append((i, d))
                names[i] = name
            break
    for cls, members in groups.items():
        got = cls.propose_batch([(d, asks[i].n_draft_max, asks[i].settings, asks[i].samp) for i, d in members])
        for (i, _), prop in zip(members, got):
            props[i] = prop
    return props, names


def step(asks: list[Ask]) -> list[StepResult]:
    """One speculative step of every sequence asked: their drafts, one verify decode for all, each one's
    acceptance. Draft and verify times are the step's, the same for each sequence."""
    clock = asks[0].session.engine.clock
    t0 = clock()
    props, names = propose_all(asks)
    drafts, dists = [], []
    constrained = [a.samp.guide is not None and a.samp.guide.active for a in asks]
    for i, (a, prop) in enumerate(zip(asks, props)):
        n = a.samp.allowed_prefix(prop.tokens)  # cut at the first token a constraint forbids (an n-gram's)
        keep = n >= a.settings.draft_min
        drafts.append(prop.tokens[:n] if keep else [])
        dists.append(prop.dists[:n] if keep else [])
        if not keep:
            names[i] = None
    t1 = clock()
    parts = []
    for a, d in zip(asks, drafts):
        if a.session.take_ahead(use=len(asks) == 1 and not d):
            continue  # a first token: its row is the folded prefill's (Session.take_ahead)
        a.session.tgt.save_checkpoint(n_next=len(d) + 1)  # the verify is one decode; its first token stays
        parts.append((a.session.tgt, [a.session.history[-1]] + d, "all"))
    extend_many(parts)
    accepted = [accept(a.session, d, q, a.samp) for a, d, q in zip(asks, drafts, dists)]
    logprobs = [logprobs_of(a.session, e, a.settings) for a, (e, _) in zip(asks, accepted)]
    verify_s = clock() - t1
    return [StepResult(e, len(d), t1 - t0, verify_s, p.first_token_s, p.token_s, drafter=n, catchup=p.catchup,
                       source=p.source if n else None, acceptance=acc, logprobs=lp, shared=len(asks) > 1,
                       constrained=c)
            for (e, acc), d, p, n, lp, c in zip(accepted, drafts, props, names, logprobs, constrained)]


def accept(ses: Session, drafts: list[int], q: list, samp: Sampling) -> tuple[list[int], tuple | None]:
    """The tokens a sequence's verify emits: the accepted drafts, then the target's own next token; under
    rejection also what each drafted position was expected to accept (for the controller, after the fact). Under
    a constraint each row is masked at its position first (greedy and rejection then run on the masked rows)."""
    logits = ses.tgt.ctx.logits
    if samp.mode == "greedy":
        return greedy_emit(samp.verify_rows(logits(len(drafts) + 1), drafts), drafts), None
    if samp.mode == "rejection":
        clock = ses.engine.clock
        ts = clock()
        p = samp.target_tf.rows(samp.verify_rows(logits(len(drafts) + 1), drafts))
        emitted = rejection_emit(drafts, q, p, samp.rng)
        acceptance = tuple(expected_acceptance(drafts, q, p))
        samp.sample_s += clock() - ts
        return emitted, acceptance
    # The target samples at each position; a draft token is accepted when the sample equals it.
    emitted = []
    for i in range(len(drafts) + 1):
        tok = samp.sampler.sample(ses.tgt.ctx, i)
        emitted.append(tok)
        if i == len(drafts) or tok != drafts[i]:
            break
    return emitted, None


def logprobs_of(ses: Session, emitted: list[int], s: GenerationSettings) -> list[TokenLogprob] | None:
    """The emitted tokens' log-probabilities from the verify's target rows (before any rewind decodes)."""
    if s.logprobs is None:
        return None
    return token_logprobs(ses.tgt.ctx.logits(len(emitted)), emitted, s.logprobs)
