"""The drafters by name: the one place that lists them, parses --drafter and checks them against an engine.

Adding a drafter: a module in native/drafters/ with a `Drafter` subclass (base.py), and one entry in DRAFTERS
(or `register(cls)` at run time, as tests do).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...errors import UsageError
from .base import AUTO, TARGET_TOKENS, Drafter
from .model import ModelDrafter
from .mtp import MtpDrafter
from .ngram import NgramDrafter
from .suffix import SuffixDrafter

if TYPE_CHECKING:
    from ..runtime.engine import Engine
    from ..runtime.session import Session

DRAFTERS: dict[str, type[Drafter]] = {cls.name: cls for cls in (ModelDrafter, NgramDrafter, SuffixDrafter,
                                                                  MtpDrafter)}


def register(cls: type[Drafter]) -> None:
    """Make a drafter available by its name (`--drafter NAME`, and under auto)."""
    if cls.name in DRAFTERS or cls.name == AUTO or "," in cls.name:
        raise ValueError(f"a drafter named {cls.name!r} cannot be registered")
    if cls.units != TARGET_TOKENS:  # the step verifies target token ids: nothing translates others yet
        raise ValueError(f"drafter {cls.name!r} proposes {cls.units!r}, not the target's token ids")
    DRAFTERS[cls.name] = cls


def unregister(name: str) -> None:
    DRAFTERS.pop(name)


def _tried_first(names) -> list[str]:
    # A model's (or MTP head's) proposal always exists, an n-gram one only on a match: those go first.
    return sorted(names, key=lambda n: not DRAFTERS[n].on_match_only)


def parse_drafter(text: str) -> tuple[str, ...]:
    """--drafter NAME | a comma list | auto → the drafters in the order they are tried (("auto",) for auto: the
    adaptive controller chooses among the available ones each step)."""
    names = tuple(x.strip() for x in str(text).split(",") if x.strip())
    if names == (AUTO,):
        return names
    if not names or any(n not in DRAFTERS for n in names) or len(set(names)) != len(names):
        raise UsageError(f"--drafter must be {', '.join(DRAFTERS)}, a comma list of them, or auto ({text})")
    return tuple(_tried_first(names))


def needs_draft_model(drafters: tuple[str, ...]) -> bool:
    return any(n != AUTO and DRAFTERS[n].needs_draft_model for n in drafters)


def drafts_without_model(drafters: tuple[str, ...]) -> bool:
    """Whether these drafters can speculate with no draft model loaded (n-gram lookup, the MTP head, auto)."""
    return any(n == AUTO or not DRAFTERS[n].needs_draft_model for n in drafters)


def speculates(engine, drafters: tuple[str, ...]) -> bool:
    """Whether a generation with these drafters may speculate on this engine: with its draft model, or with a
    drafter that needs none (the one place every command and the server decide it)."""
    return engine.draft is not None or drafts_without_model(drafters)


def engine_options(drafters: tuple[str, ...]) -> dict:
    """The Engine(...) options these drafters need (the target's MTP head for mtp, and for auto where it has one)."""
    out: dict = {}
    for cls in DRAFTERS.values():
        out.update(cls.engine_options(drafters))
    return out


def check(engine: Engine, drafters: tuple[str, ...]) -> None:
    """Refuse drafters this engine cannot run: a model without a draft, an MTP head the target lacks."""
    for name in drafters:
        if name != AUTO:
            DRAFTERS[name].check(engine)


def build(session: Session) -> dict[str, Drafter]:
    """One session's drafters: every registered one its engine can run, in the order auto tries them."""
    eng = session.engine
    return {n: DRAFTERS[n].for_engine(eng)(session) for n in _tried_first(DRAFTERS) if DRAFTERS[n].available(eng)}


def cost_priors(engine: Engine, names) -> dict[str, float]:
    """Each drafter's cost per token before any is measured, as a share of one target token."""
    return {n: DRAFTERS[n].cost_prior(engine) for n in names}
