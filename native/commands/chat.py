"""`specq chat` as a library: messages, the target's own chat template, multi-turn reuse of both caches.

Each turn renders the whole conversation with the template, keeps the longest part of the session's token
history whose text is a prefix of that rendering, and prefills only the rest. Slash commands are parsed
and applied by pure functions; the CLI only prints.
"""

from __future__ import annotations

import json
import math
import logging
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

from ...version import __version__
from ...atomic import write_text
from ...errors import ContextFullError, UsageError, check_text
from ..runtime.config import EngineConfig
from ..runtime.engine import Engine
from ..core.settings import GenerationSettings
from ..core.stats import GenerationStats, Rates, TokenEvent
from ..drafters.registry import speculates
from ..core.template import TemplateFormatter, load_template, model_token_text

log = logging.getLogger("specq.chat")


# ==== matching the rendered conversation against what the caches hold ============================
def _is_continuation(b: int) -> bool:
    return 0x80 <= b <= 0xBF


def reusable_prefix(pieces: list[bytes], rendered: bytes) -> int:
    """How many held tokens (given as their byte pieces) spell a prefix of `rendered`, ending on a character
    boundary, so the rest of the rendering can be tokenized on its own."""
    n = pos = 0
    best = 0
    for p in pieces:
        if rendered[pos:pos + len(p)] != p:
            break
        pos += len(p)
        n += 1
        if pos == len(rendered) or not _is_continuation(rendered[pos]):
            best = n
    return best


def as_text(raw: str) -> str:
    """Message text kept with surrogate escapes (exact bytes) → printable text."""
    return raw.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


class ConversationFullError(ContextFullError):
    """A turn does not fit: the CLI words the fix (/reset exists only in an interactive chat)."""

    def __init__(self, n_tokens: int, n_ctx: int, first_turn: bool):
        self.n_tokens, self.n_ctx, self.first_turn = n_tokens, n_ctx, first_turn
        if first_turn:  # nothing to forget: the system prompt and this one message are too long
            super().__init__(f"the system prompt and this message do not fit in the context ({n_tokens} tokens, "
                             f"ctx {n_ctx}); use a larger --ctx, or a shorter --system or message")
        else:
            super().__init__(f"the conversation is full ({n_tokens} tokens, ctx {n_ctx}); "
                             "type /reset to start a new one, or use a larger --ctx")


# ==== slash commands (pure) ======================================================================
HELP = """\
/help          this list
/reset         forget the conversation (keeps the system prompt)
/stats         acceptance and timing for this session
/k N           draft at most N tokens per step (/k auto: adaptive)
/pmin X        stop drafting when the draft's top-1 probability is below X
/temp T        sampling temperature (0: greedy)
/n N           at most N tokens per answer (/n off: no limit)
/system TEXT   set the system prompt (the conversation is re-read)
/save FILE     write the transcript and statistics as JSON
/quit          leave (Ctrl-D works too)"""


@dataclass(frozen=True)
class Command:
    name: str
    arg: str = ""


COMMANDS = ("help", "reset", "stats", "k", "pmin", "temp", "n", "system", "save", "quit")


def parse_command(line: str) -> Command | None:
    """'/k 4' → Command('k', '4'); a line that is not a slash command → None."""
    s = line.strip()
    if not s.startswith("/") or s.startswith("//"):
        return None
    name, _, arg = s[1:].partition(" ")
    name = name.lower()
    if name == "exit":
        name = "quit"
    if name not in COMMANDS:
        raise UsageError(f"unknown command (/{name}); type /help for the list")
    return Command(name, arg.strip())


def apply_setting(settings: GenerationSettings, cmd: Command) -> GenerationSettings:
    """The settings after /k, /pmin, /temp or /n (validated; UsageError on a bad value)."""
    if cmd.name == "n" and cmd.arg.lower() in ("off", "none"):
        return replace(settings, n_predict=None)
    if cmd.name == "k" and cmd.arg.lower() == "auto":
        return replace(settings, draft_max="auto").validate()
    field_name, conv = {"k": ("draft_max", int), "pmin": ("p_min", float), "temp": ("temp", float),
                       "n": ("n_predict", int)}[cmd.name]
    try:
        value = conv(cmd.arg)
        if not math.isfinite(value):
            raise ValueError(cmd.arg)
    except ValueError:
        raise UsageError(f"/{cmd.name} needs a number ({cmd.arg or 'nothing given'}); e.g. /{cmd.name} "
                         f"{'4' if conv is int else '0.5'}")
    new = replace(settings, **{field_name: value})
    if field_name == "draft_max":
        new = replace(new, draft_min=min(new.draft_min, value))
    return new.validate()


# ==== turns and totals ===========================================================================
@dataclass
class Turn:
    user: str
    answer: str
    prompt_tokens: list[int]  # the new tokens this turn prefilled
    n_reused: int  # tokens of the history kept from earlier turns
    tokens: list[int]  # the answer's tokens
    stats: GenerationStats | None

    def record(self) -> dict:
        st = self.stats
        rec = {"user": as_text(self.user), "answer": as_text(self.answer), "n_reused": self.n_reused,
               "prompt_tokens": list(self.prompt_tokens), "tokens": list(self.tokens)}
        if st is not None:
            rec.update({k: v for k, v in asdict(st).items() if k != "accepted_per_pos"})
            rec.update({"accepted_per_pos": list(st.accepted_per_pos), "accept_rate": st.accept_rate,
                        "alpha": st.alpha, "mean_accepted_per_step": st.mean_accepted_per_step, "tokens_per_s": st.tokens_per_s})
        return rec


@dataclass
class Totals(Rates):
    turns: int = 0
    n_generated: int = 0
    n_steps: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    n_tried: int = 0  # draft positions reached (Rates.alpha)
    gen_ms: float = 0.0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    prompt_ms: float = 0.0
    n_prompt: int = 0

    def add(self, st: GenerationStats) -> None:
        self.turns += 1
        for k in ("n_generated", "n_steps", "n_drafted", "n_accepted", "n_tried", "gen_ms", "draft_ms", "verify_ms",
                  "prompt_ms", "n_prompt"):
            setattr(self, k, getattr(self, k) + getattr(st, k))

    def final_line(self) -> dict:
        """The piped-mode stats line: exactly the keys INTERFACES.md names."""
        return {"turns": self.turns, "n_generated": self.n_generated, "accept_rate": self.accept_rate,
                "alpha": self.alpha, "mean_accepted_per_step": self.mean_accepted_per_step, "tokens_per_s": self.tokens_per_s}


# ==== the chat session ===========================================================================
class Answer:
    """One streamed answer: iterate for TokenEvents; `turn` is complete after the iteration ends."""

    def __init__(self, chat: "ChatSession", turn: Turn, gen):
        self.chat, self.turn, self.gen = chat, turn, gen
        self._it: Iterator[TokenEvent] | None = None

    def __iter__(self) -> Iterator[TokenEvent]:
        self._it = iter(self.gen)
        try:
            for ev in self._it:
                self.turn.tokens.append(ev.token)
                yield ev
        finally:
            self.close()

    def close(self) -> None:
        """End the answer (also when the consumer stops early): caches rewound, the turn recorded once."""
        if self._it is not None:
            self._it.close()  # runs the engine's rewind in its `finally`
            self._it = None
        if self.turn.stats is None and self.gen.stats is not None:
            self.chat._finish(self.turn, self.gen.stats)

    @property
    def stats(self) -> GenerationStats | None:
        return self.gen.stats

    def snapshot(self) -> GenerationStats | None:
        """This answer's stats so far (None from an engine that cannot tell)."""
        snap = getattr(self.gen, "snapshot", None)
        return snap() if snap else None


class ChatSession:
    """A conversation over an Engine (anything with .target, .session(), .n_ctx and .draft)."""

    def __init__(self, engine: Engine, template: str, settings: GenerationSettings = GenerationSettings(n_predict=None),
                 system: str | None = None):
        self.engine = engine
        tgt = engine.target
        self._bos_text = model_token_text(tgt, tgt.bos)
        self.formatter = TemplateFormatter.for_model(template, tgt)
        self.settings = settings.validate()
        self.speculative = speculates(engine, self.settings.drafters)
        self.system = check_text(system, "--system") if system else None
        self.session = engine.session()
        self.messages: list[dict] = []
        self.turns: list[Turn] = []
        self.totals = Totals()
        self._lead = 0  # tokens at the start of the history that are not in the rendered text (an added BOS)

    # -- conversation state ---------------------------------------------------------------------
    @property
    def n_ctx(self) -> int:
        return self.engine.n_ctx

    @property
    def n_used(self) -> int:
        return len(self.session.history)

    def reset(self) -> None:
        self.session.reset()
        self.messages = []
        self._lead = 0

    def set_system(self, text: str | None) -> None:
        self.system = check_text(text, "the system prompt") if text else None

    def conversation(self, user: str | None = None) -> list[dict]:
        msgs = ([{"role": "system", "content": self.system}] if self.system else []) + list(self.messages)
        if user is not None:
            msgs.append({"role": "user", "content": user})
        return msgs

    # -- one turn -------------------------------------------------------------------------------
    def plan_turn(self, user: str) -> tuple[int, list[int]]:
        """(tokens of the history to keep, new tokens to prefill) for the conversation plus `user`."""
        tgt = self.engine.target
        rendered = self.formatter.render(self.conversation(user)).encode("utf-8", "surrogateescape")
        hist = self.session.history
        if not hist:
            keep = 0
        else:
            keep = self._lead + reusable_prefix([tgt.piece(t) for t in hist[self._lead:]], rendered[:]) \
                if len(hist) > self._lead else self._lead
        held = b"".join(tgt.piece(t) for t in hist[self._lead:keep])
        rest = rendered[len(held):].decode("utf-8", "replace")
        new = tgt.tokenize(rest, add_special=False, parse_special=True)
        if keep == 0:
            self._lead = 1 if (tgt.add_bos and not rest.startswith(self._bos_text or "\0")) else 0
            new = [tgt.bos] * self._lead + new
        return keep, new

    def ask(self, user: str) -> Answer:
        """Start a turn; iterate the returned Answer to stream it. ContextFullError if it cannot fit."""
        raw_user = check_text(user, "the message")
        keep, new = self.plan_turn(raw_user)
        if keep + len(new) + 1 > self.n_ctx:
            raise ConversationFullError(keep + len(new), self.n_ctx, first_turn=not self.messages)
        if keep < len(self.session.history):
            log.debug("the rendering of earlier turns changed: keeping %d of %d tokens", keep,
                      len(self.session.history))
            # The engine rewinds both caches to the history at the start of the next prefill.
            del self.session.history[keep:]
        log.debug("turn %d: prefilling %d new tokens (reusing %d)", len(self.turns) + 1, len(new), keep)
        gen = self.session.generate(new, self.settings, speculative=self.speculative)
        turn = Turn(user=raw_user, answer="", prompt_tokens=new, n_reused=keep, tokens=[], stats=None)
        return Answer(self, turn, gen)

    def _finish(self, turn: Turn, stats: GenerationStats) -> None:
        tgt = self.engine.target
        turn.stats = stats
        # The answer as the exact bytes of its tokens, so the next rendering matches the cached history.
        raw = b"".join(tgt.piece(t) for t in turn.tokens if not tgt.is_eog(t))
        turn.answer = raw.decode("utf-8", "surrogateescape")
        self.turns.append(turn)
        self.totals.add(stats)
        if stats.n_generated or stats.stop_reason != "interrupted":
            self.messages += [{"role": "user", "content": turn.user},
                              {"role": "assistant", "content": turn.answer}]

    # -- saving -----------------------------------------------------------------------------------
    def transcript(self, extra: dict | None = None) -> dict:
        t = self.totals
        doc = {
            "specq_version": __version__,
            "target": str(self.engine.target.path),
            "draft": str(self.engine.draft.path) if self.engine.draft is not None else None,
            "settings": asdict(self.settings),
            "system": self.system,
            "messages": [{"role": m["role"], "content": as_text(m["content"])} for m in self.conversation()],
            "turns": [tr.record() for tr in self.turns],
            "totals": {**asdict(t), "accept_rate": t.accept_rate, "alpha": t.alpha,
                       "mean_accepted_per_step": t.mean_accepted_per_step,
                       "tokens_per_s": t.tokens_per_s},
            "history": list(self.session.history),
            "n_ctx": self.n_ctx,
        }
        doc.update(extra or {})
        return doc

    def save(self, path: str | os.PathLike, extra: dict | None = None) -> Path:
        return write_json_atomic(Path(path), self.transcript(extra))


def write_json_atomic(path: Path, doc: dict) -> Path:
    """Write to a temporary file beside `path`, then rename: never a half-written file."""
    return write_text(path, json.dumps(doc, indent=2) + "\n")


def open_chat(engine: EngineConfig, *, template: str | None, settings: GenerationSettings, system: str | None,
              engine_factory: Callable[..., Engine] = Engine) -> ChatSession:
    """Load the models and start a conversation (closing the engine if the template is unusable)."""
    eng = engine.open(factory=engine_factory)
    try:
        tpl = load_template(template, eng.target.chat_template(), engine.target)
        return ChatSession(eng, tpl, settings, system)
    except BaseException:
        eng.close()
        raise


# ==== live statistics for the dashboard (data only; the CLI draws them) =============================
class RateWindow:
    """Tokens per second over the last `window_s` seconds of generation."""

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self._events: list[tuple[float, int]] = []  # (time, tokens) per batch of tokens
        self._start: float | None = None

    def start(self, t: float) -> None:
        self._events.clear()
        self._start = t

    def add(self, t: float, n: int = 1) -> None:
        if self._start is None:
            self._start = t
        self._events.append((t, n))
        cut = t - self.window_s
        while self._events and self._events[0][0] < cut:
            self._events.pop(0)

    def rate(self, now: float) -> float | None:
        if self._start is None or not self._events:
            return None
        t0 = max(self._start, now - self.window_s)
        n = sum(k for t, k in self._events if t >= t0)
        return n / (now - t0) if now > t0 else None


def health_hint(alpha: float | None, tokens_per_step: float | None, draft_ms_step: float | None,
                verify_ms_step: float | None) -> str:
    """One line on whether drafting pays, taking one verify pass as roughly one target token. `alpha` is the
    per-position acceptance (Rates.alpha): what decides how far a draft gets, whatever its length."""
    if alpha is None or not tokens_per_step or draft_ms_step is None or not verify_ms_step:
        return "no draft statistics yet"
    est = tokens_per_step * verify_ms_step / (draft_ms_step + verify_ms_step)
    if alpha < 0.4 and est < 1.2:
        return f"draft too weak: {100 * alpha:.0f}% accepted per position; try a closer draft or a smaller /k"
    if est < 1.0:
        return "draft too slow for its acceptance: drafting costs more than it saves; try a smaller /k or /pmin 0.5"
    if est < 1.2:
        return f"marginal: about {est:.1f}× the target alone (estimated); try /k or /pmin"
    return f"healthy: about {est:.1f}× the target alone (estimated)"


@dataclass
class AnswerProgress:
    """What is known about the answer being streamed: from its token events, then from its final stats."""

    started: float
    window: RateWindow = field(default_factory=RateWindow)
    n_tokens: int = 0
    n_from_draft: int = 0
    n_steps: int = 0
    stats: GenerationStats | None = None  # the final stats, once the answer has ended
    live: GenerationStats | None = None  # the engine's stats so far, while it streams

    def __post_init__(self):
        self.window.start(self.started)

    def add(self, ev: TokenEvent, now: float) -> None:
        self.n_tokens += 1
        self.n_from_draft += ev.from_draft
        self.n_steps = max(self.n_steps, ev.step + 1)
        self.window.add(now, 1)


@dataclass(frozen=True)
class PanelData:
    state: str  # "generating", then one of _STATES' values
    answer_accept: float | None  # accepted ÷ drafted (Rates.accept_rate)
    session_accept: float | None
    answer_alpha: float | None  # accepted ÷ draft positions reached (Rates.alpha)
    session_alpha: float | None
    tokens_per_step: float | None
    draft_ms_step: float | None
    verify_ms_step: float | None
    verify_draft_ratio: float | None
    hint: str
    window_tps: float | None
    n_generated: int
    session_generated: int
    from_draft: float | None  # share of this answer's tokens that came from the draft
    ctx_used: int
    n_ctx: int
    draft_max: int
    p_min: float
    temp: float
    speculative: bool


_STATES = {"eog": "done", "ctx": "context full", "n_predict": "done (n-predict)", "interrupted": "interrupted"}


def panel_data(p: AnswerProgress, totals: Totals, ctx_used: int, n_ctx: int, settings: GenerationSettings,
               speculative: bool, now: float) -> PanelData:
    """Numbers for the panel: this answer's final stats when done, else the engine's live snapshot (or what
    its events tell); per-step timing from this answer once it has a step, else from the session so far."""
    st = p.stats
    cur = st or p.live
    n_steps = cur.n_steps if cur else p.n_steps
    n_gen = st.n_generated if st else p.n_tokens
    src = cur if cur is not None and cur.n_steps else (totals if totals.n_steps else None)
    draft_step = src.draft_ms / src.n_steps if src else None
    verify_step = src.verify_ms / src.n_steps if src else None
    answer_acc = cur.accept_rate if cur else None
    tps_step = n_gen / n_steps if n_steps else None
    ratio = verify_step / draft_step if (draft_step and verify_step) else None
    answer_alpha = cur.alpha if cur else None
    alpha_for_hint = answer_alpha if answer_alpha is not None else totals.alpha
    state = "generating" if st is None else _STATES.get(st.stop_reason, st.stop_reason)
    return PanelData(
        state=state, answer_accept=answer_acc, session_accept=totals.accept_rate, answer_alpha=answer_alpha,
        session_alpha=totals.alpha, tokens_per_step=tps_step,
        draft_ms_step=draft_step, verify_ms_step=verify_step, verify_draft_ratio=ratio,
        hint=health_hint(alpha_for_hint, tps_step, draft_step, verify_step) if speculative else "target alone (no draft)",
        window_tps=p.window.rate(now), n_generated=n_gen, session_generated=totals.n_generated,
        from_draft=(p.n_from_draft / p.n_tokens) if p.n_tokens else None, ctx_used=ctx_used, n_ctx=n_ctx,
        draft_max=settings.draft_max, p_min=settings.p_min, temp=settings.temp, speculative=speculative)
