"""The speculative decoding engine: target + optional draft over llama.cpp's C API.

Layers (as in mlx-lm): `Session._step` is one speculative step (draft → one batched verify → accept);
`Session.generate` turns steps into token events with text and timing; the CLI prints them.
Baseline decoding is the same loop with no draft, so comparisons are like for like.
"""

from __future__ import annotations

import codecs
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from ..errors import ContextFullError, ModelFileError, UsageError
from . import _ffi
from .accept import accepted_per_position, greedy_emit, rejection_emit, top_probability
from .adaptive import AdaptiveDraft, AdaptiveDrafters, paired_acceptance, window_pays, window_pays_at
from .compat import VocabInfo, check_compatible
from .mtp import MtpDrafter
from .ngram import parse_drafter, point_mass, propose
from .placement import choose_flash_attn
from .sampling import SparseDist, Transform, restrict, sample

log = logging.getLogger("specq.engine")

# The largest draft the target context is sized for (its output rows per verify are draft_max + 1).
DRAFT_MAX_CAP = 64
# `draft_max="auto"`: the adaptive controller picks each step's length in 0..AUTO_DRAFT_CAP.
AUTO_DRAFT_CAP = 16
AGREE_TOKENS = 32  # prompt rows compared between target and draft before the first draft (Session.prefill's agree)
AGREE_MIN = 4
MIN_DRAFT_WINDOW = 2 * (DRAFT_MAX_CAP + 2)  # a window slides to half its size, leaving room for a whole draft
DRAFT_SINK = 4  # the history's first tokens a draft window keeps (Session._fit_draft)
# --ctx-draft auto: at a long context a session times a draft that sees only this many recent tokens against the
# whole-context one, and keeps the faster (Session.try_window); first at WINDOW_TRIAL_MIN tokens, again when
# the context has doubled
WINDOW_TRIAL = 512
WINDOW_TRIAL_MIN = 3 * WINDOW_TRIAL
WINDOW_TIMINGS = 3  # single-token decodes timed on each side of a window trial (the fastest counts)
# A window the trial took on the prompt's rows is kept once it agrees with the target on this many rows of the
# answer about as well as the whole context does (Session.settle_window); until then the whole context's memory
# waits untouched, so that giving the window up costs no new prefill
WINDOW_PROBATION = 24
ACCEPT_MODES = ("auto", "match", "rejection")


def physical_cores() -> int:
    """Physical CPU cores (llama.cpp's own default), falling back to the logical count."""
    try:
        cores = set()
        phys = core = None
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("physical id"):
                    phys = line.split(":")[1].strip()
                elif line.startswith("core id"):
                    core = line.split(":")[1].strip()
                elif not line.strip():
                    if core is not None:
                        cores.add((phys, core))
                    phys = core = None
        if cores:
            return len(cores)
    except OSError:
        pass
    return os.cpu_count() or 1


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
    drafter: str = "model"  # "model", "ngram", "mtp", a comma list ("model,ngram": the n-gram's proposal on a
    # match, else the model's) or "auto" (the adaptive controller chooses per step, plain decoding included)
    ngram_min: int = 3  # the shortest ending of the text an n-gram proposal needs to have seen before
    ngram_max: int = 6

    @property
    def drafters(self) -> tuple[str, ...]:
        """The drafters in the order each step tries them (native/ngram.py)."""
        return parse_drafter(self.drafter)

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
        self.drafters  # noqa: B018 (raises on a bad --drafter)
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise UsageError(f"--ngram-min must be at least 1 and at most --ngram-max ({self.ngram_min}, "
                             f"{self.ngram_max})")
        return self


def mtp_option(drafters: tuple[str, ...]) -> bool | None:
    """Engine(mtp=...) for these drafters: required for mtp, where present for auto, else not loaded."""
    return True if "mtp" in drafters else (None if drafters == ("auto",) else False)


@dataclass(frozen=True)
class TokenEvent:
    token: int
    text: str  # the decoded text this token completes ('' while a UTF-8 sequence is incomplete)
    from_draft: bool
    step: int


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
    sample_ms: float = 0.0  # rejection mode: time in the sampling transform and acceptance (both models)
    n_plain_steps: int = 0  # draft_max=auto: steps that chose not to draft (probes excluded)
    n_probes: int = 0  # draft_max=auto: short drafts tried while plain decoding was winning
    n_rollbacks: int = 0  # recurrent/hybrid tails dropped through state snapshots (no checkpoint restore)
    n_draft_slides: int = 0  # times the draft's window moved on (a --ctx-draft smaller than --ctx)
    draft_window: int | None = None  # the recent tokens the draft sees at the end (None: the whole context)
    n_window_trials: int = 0  # --ctx-draft auto: windowed drafts timed against the whole-context one
    n_window_reverts: int = 0  # windows a trial took and the answer's rows then gave up (Session.settle_window)
    n_drafted_by: tuple[tuple[str, int], ...] = ()  # per drafter ("model", "ngram", "mtp")
    n_accepted_by: tuple[tuple[str, int], ...] = ()
    # The cost model's inputs (native/cost.py): what each step drafted, verified and cost.
    steps_by_k: tuple[tuple[int, int], ...] = ()  # (verified draft length, steps)
    tried_per_pos: tuple[int, ...] = ()  # steps that verified position i+1 with positions 1..i accepted
    verify_ms_by_size: tuple[tuple[int, int, float], ...] = ()  # (batch size, passes, total ms)
    draft_next_ms: float = 0.0  # drafted tokens after a step's first, where measured: their time...
    n_draft_next: int = 0  # ...and how many

    @property
    def n_tried(self) -> int:
        """Draft positions reached: verified with every earlier position of the step accepted."""
        return sum(self.tried_per_pos)

    @property
    def overhead_fraction(self) -> float:
        """Share of generation time spent outside llama_decode (Python, sampling, bookkeeping)."""
        return max(0.0, 1.0 - self.decode_ms / self.gen_ms) if self.gen_ms > 0 else 0.0


@dataclass
class _Cache:
    """One model's context and exactly the tokens its memory holds (positions 0..len-1)."""

    ctx: _ffi.Context
    tokens: list[int] = field(default_factory=list)  # history[:sink] + history[offset:], at positions 0..
    offset: int = 0  # a draft's window: where in the history the recent tokens it holds begin
    sink: int = 0  # a window also keeps the history's first tokens (attention sinks), this many
    checkpoint: tuple[int, bytes] | None = None  # (n_tokens, state) for memories without partial removal
    partial_rm: bool = True
    n_restores: int = 0  # checkpoint restores; on a sliding-window memory, re-evaluations (cells gone)
    n_rollbacks: int = 0  # tails removed through n_rs_seq snapshots, or from a sliding window that has slid

    def _can_roll_back(self, n: int, held: int) -> bool:
        """Whether seq_rm may drop positions n.. of a recurrent memory: the snapshots cover only the tail of the
        last decode, at most n_rs_seq tokens (past that llama.cpp's seq_rm may report success and be wrong)."""
        return 0 < held - n <= self.ctx.n_rs_seq and n >= self.ctx.last_decode_pos0

    def truncate(self, n: int) -> None:
        """Make the memory hold exactly tokens[:n], whatever an interrupted call left in it.

        The memory is the source of truth: `extend` records tokens before decoding them, so after an
        exception anywhere the list may claim more than the memory holds (never the reverse), and
        positions past the list are removed whatever the list says."""
        held = self.ctx.pos_max() + 1
        if held < len(self.tokens):  # a decode that did not complete: its tokens are not in the memory
            del self.tokens[held:]
        n = min(n, len(self.tokens))
        if held <= n:
            return
        if self.partial_rm and not self.ctx.window_intact(n):
            # A sliding-window cache already reused the cells that position n attends to: evaluate again.
            keep = self.tokens[:n]
            self.ctx.clear()  # (the draft window's offset stays: the same tokens at the same positions)
            self.tokens.clear()
            self.n_restores += 1
            self.extend(keep, logits="none")
            return
        if self.partial_rm and self.ctx.seq_rm(n, -1):
            del self.tokens[n:]
            if self.ctx.n_swa and self.ctx.pos_min() > 0:  # the window had slid: count what relied on it
                self.n_rollbacks += 1
            return
        if not self.partial_rm and self._can_roll_back(n, held) and self.ctx.seq_rm(n, -1):
            del self.tokens[n:]
            self.n_rollbacks += 1
            return
        # Recurrent/hybrid memory: go back to the checkpoint, then re-evaluate up to n.
        keep = self.tokens[:n]
        if self.checkpoint is None or self.checkpoint[0] > n:
            self.ctx.clear()
            base = 0
        else:
            base, state = self.checkpoint
            self.ctx.state_set(state)
            self.ctx.seq_rm(base, -1)  # hybrid: the attention part still holds the later positions
            self.n_restores += 1
        del self.tokens[base:]
        self.extend(keep[base:], logits="none")

    def save_checkpoint(self, n_next: int | None = None) -> None:
        """Save the state before decoding `n_next` more tokens (None: several decodes) that may be rolled back;
        not needed where the snapshots can roll the whole next decode back but its first token."""
        if self.partial_rm:
            return
        if n_next is not None and n_next - 1 <= self.ctx.n_rs_seq:
            return
        self.checkpoint = (len(self.tokens), self.ctx.state_get())

    def extend(self, new: list[int], logits: str) -> None:
        n0 = len(self.tokens)
        self.tokens.extend(new)  # recorded first: an interruption leaves the list ahead of the memory
        self.ctx.decode(new, n0, logits=logits)

    def adopt(self, state: bytes, tokens: list[int], offset: int, sink: int) -> None:
        """Hold what another context of the same model holds (its memory, `state`): a window's tokens."""
        self.clear()
        self.ctx.state_set(state, partial=False)
        self.tokens[:] = tokens
        self.offset, self.sink = offset, sink

    def view(self, history: list[int]) -> list[int]:
        """The tokens of `history` this memory is meant to hold (a window: the sinks, then the recent ones)."""
        return history[:self.sink] + history[self.offset:] if self.offset else history

    def next_index(self) -> int:
        """The history index of the next token to evaluate."""
        return self.offset + len(self.tokens) - self.sink

    def clear(self) -> None:
        self.offset = 0
        self.sink = 0
        self.tokens.clear()
        self.checkpoint = None
        self.ctx.clear()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


class SimulatedClock:
    """A deterministic clock: time moves only by a modelled cost per llama_decode, so that what the adaptive
    controller decides depends on the costs given, not on how busy the machine is (tests, replays).

    `cost(name, n_tokens, pos0)` → seconds for one decode of n tokens at positions pos0.. by the "target" or
    the "draft"."""

    def __init__(self, cost: Callable[[str, int, int], float]):
        self.cost = cost
        self.now = 0.0
        self.n_decodes = 0

    def __call__(self) -> float:
        return self.now

    def on_decode(self, name: str, n_tokens: int, pos0: int) -> None:
        self.now += self.cost(name, n_tokens, pos0)
        self.n_decodes += 1


@dataclass(frozen=True)
class ModelInfo:
    path: str
    size_bytes: int
    n_params: int
    n_layer: int
    n_vocab: int


class Engine:
    """Loads a target (and optionally a draft) and creates contexts for them."""

    def __init__(self, target: str | os.PathLike, draft: str | os.PathLike | None = None, *,
                 ctx: int = 4096, threads: int | None = None, ngl: int = 0, ngl_draft: int = 0,
                 n_batch: int = 512, main_gpu: int = 0, tensor_split: list[float] | None = None,
                 draft_tensor_split: list[float] | None = None, devices: list[str] | None = None,
                 draft_devices: list[str] | None = None, draft_ctx: int | str | None = "auto",
                 draft_threads: int | None = None, draft_n_batch: int | None = None, cpu_amx: bool = False,
                 clock: Callable[[], float] | None = None, rollback_tokens: int = AUTO_DRAFT_CAP,
                 flash_attn: str = "auto", draft_flash_attn: str | None = None, mtp: bool | None = False):
        """Each model gets its own context size, batch size, threads and GPU layers (the draft's default to
        the target's); generation stops at the smaller context, since the draft holds the same tokens.
        `cpu_amx` lets llama.cpp use its AMX weight buffer, which crashes on some builds (native/cpu.py).
        `clock` times the steps (default time.perf_counter); a SimulatedClock makes timings deterministic.
        `rollback_tokens`: on a recurrent/hybrid target, how many rejected tokens a verify can roll back through
        llama.cpp's state snapshots (n_rs_seq) instead of a checkpoint copy; longer drafts fall back to it.
        `flash_attn`/`draft_flash_attn`: on, off or auto: off for a model on the CPU alone, llama.cpp's choice
        elsewhere (placement.choose_flash_attn: on the CPU flash attention decodes slower at long context).
        `mtp`: True loads the target's MTP head as a drafter (a target without one is refused), None loads it
        where the target has one (--drafter auto), False never.
        `draft_ctx`: the draft's context; smaller than ctx, the draft sees a window of that many recent tokens
        (after the history's first DRAFT_SINK); None or 0: the whole context; "auto": the whole context, or a
        window of WINDOW_TRIAL tokens where a session measures that it pays (greedy, --draft-max auto)."""
        self.window_auto = draft_ctx == "auto"
        if self.window_auto:
            draft_ctx = None
        elif isinstance(draft_ctx, str):
            raise UsageError(f"--ctx-draft must be a number or auto ({draft_ctx})")
        for flag, v, least in (("--ctx", ctx, 16), ("--ctx-draft", draft_ctx or None, 16),
                               ("--threads", threads, 1), ("--threads-draft", draft_threads, 1)):
            if v is not None and v < least:
                raise UsageError(f"{flag} must be at least {least} ({v})")
        self.threads = threads or physical_cores()
        self.draft_threads = draft_threads or self.threads
        draft_flash_attn = self.draft_flash_attn = choose_flash_attn(draft_flash_attn or flash_attn, ngl_draft,
                                                                     draft_devices or devices)
        flash_attn = choose_flash_attn(flash_attn, ngl, devices)
        self.target = _ffi.Model(target, n_gpu_layers=ngl, main_gpu=main_gpu, tensor_split=tensor_split,
                                 devices=devices, cpu_amx=cpu_amx, load_mtp=mtp is not False)
        self.draft = None
        self.mtp_ctx = None
        try:
            if mtp is True and self.target.n_layer_nextn < 1:
                raise ModelFileError(f"the target has no MTP layers ({self.target.path}); use --drafter model or "
                                     "ngram, or a target converted with its MTP head")
            if draft is not None:
                self.draft = _ffi.Model(draft, n_gpu_layers=ngl_draft, main_gpu=main_gpu,
                                        tensor_split=draft_tensor_split, devices=draft_devices, cpu_amx=cpu_amx)
                check_compatible(VocabInfo.of(self.target), VocabInfo.of(self.draft))
            # A verify batch [last, d1..dn] must be one decode with logits at every row: never split it.
            self.tgt_ctx = _ffi.Context(self.target, ctx, self.threads, n_batch=max(n_batch, DRAFT_MAX_CAP + 1),
                                        n_outputs_max=DRAFT_MAX_CAP + 1, name="target",
                                        n_rs_seq=rollback_tokens if self.target.is_recurrent_or_hybrid else 0,
                                        flash_attn=flash_attn)
            self.dft_ctx = (_ffi.Context(self.draft, draft_ctx or ctx, self.draft_threads,  # None or 0: all of it
                                         n_batch=draft_n_batch or n_batch, n_outputs_max=AGREE_TOKENS, name="draft",
                                         flash_attn=draft_flash_attn)
                            if self.draft is not None else None)
            if mtp is not False and self.target.n_layer_nextn > 0:
                self.mtp_ctx = _ffi.MtpContext(self.target, ctx, self.threads, n_batch=n_batch)
            for c in (self.tgt_ctx, self.dft_ctx):
                if c is not None:
                    c.warm_up()
        except BaseException:
            self.close()
            raise
        # A draft context smaller than the target's is a window: the draft sees only the most recent tokens
        # (at long context its attention then costs what it does at short context), the target all of them.
        self.draft_window = None
        if self.dft_ctx is not None and self.dft_ctx.n_ctx < self.tgt_ctx.n_ctx:
            if self.dft_ctx.n_ctx < MIN_DRAFT_WINDOW:
                self.close()
                raise UsageError(f"--ctx-draft below --ctx makes the draft see a window of recent tokens, at least "
                                 f"{MIN_DRAFT_WINDOW} ({self.dft_ctx.n_ctx})")
            self.draft_window = self.dft_ctx.n_ctx
        if self.draft_window is not None or self.draft is None or self.draft.is_recurrent_or_hybrid:
            self.window_auto = False  # a fixed window, no draft model, or a memory that cannot drop a tail
        self.n_ctx = self.tgt_ctx.n_ctx
        self.clock = clock or time.perf_counter
        if isinstance(clock, SimulatedClock):
            for c in (self.tgt_ctx, self.dft_ctx, self.mtp_ctx):
                if c is not None:
                    c.on_decode = clock.on_decode

    def check_drafters(self, s: GenerationSettings) -> None:
        """Refuse drafters this engine cannot run: a model without a draft, an MTP head the target lacks."""
        names = s.drafters
        if "mtp" in names and self.mtp_ctx is None:
            if self.target.n_layer_nextn < 1:
                raise ModelFileError(f"the target has no MTP layers ({self.target.path}); use --drafter model or "
                                     "ngram, or a target converted with its MTP head")
            raise UsageError("--drafter mtp needs the engine loaded with its MTP head (Engine(..., mtp=True))")
        if "model" in names and self.draft is None:
            raise UsageError("speculative decoding needs a draft model; pass --draft (or --drafter ngram or mtp)")

    def info(self, which: str = "target") -> ModelInfo:
        m = self.target if which == "target" else self.draft
        return ModelInfo(str(m.path), m.size_bytes, m.n_params, m.n_layer, m.n_vocab)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.target.tokenize(text, add_special=add_special, parse_special=True)

    def session(self) -> "Session":
        return Session(self)

    def close(self) -> None:
        for name in ("mtp_ctx", "dft_ctx", "tgt_ctx"):
            c = getattr(self, name, None)
            if c is not None:
                c.close()
        for m in (getattr(self, "draft", None), getattr(self, "target", None)):
            if m is not None:
                m.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class _Step:
    emitted: list[int]
    n_drafted: int
    draft_s: float
    verify_s: float
    first_token_s: float | None = None  # seconds to the first drafted token (catch-up included), where clean
    draft_token_s: float | None = None  # seconds per further drafted token, where measured
    drafter: str | None = None  # who proposed this step's drafts ("model", "ngram", "mtp")
    catchup: tuple[int, float] | None = None  # a long catch-up: (tokens, seconds with the first drafted token)


class _Sampling:
    """How one generation verifies: the mode, llama.cpp's chain (greedy/match), transforms + rng (rejection)."""

    def __init__(self, s: GenerationSettings, speculative: bool):
        # Without a draft, "match" is plain sampling with llama.cpp's chain: the baseline's reference.
        self.mode = s.accept_mode if speculative else ("greedy" if s.temp <= 0 else "match")
        self.sampler = _ffi.Sampler(s.temp, s.top_k, s.top_p, s.min_p, s.seed)
        self.target_tf = self.draft_tf = None
        self.rng = None
        self.sample_s = 0.0
        if speculative and self.mode == "rejection":
            self.rng = np.random.default_rng(s.seed)
            self.target_tf = Transform(s.temp, s.top_k, s.top_p, s.min_p)
            self.draft_tf = Transform(s.temp, s.top_k, s.top_p, s.min_p)

    def close(self) -> None:
        self.sampler.close()
        for t in (self.target_tf, self.draft_tf):
            if t is not None:
                t.close()


def _agreeing(ok: np.ndarray) -> tuple[int, int]:
    """(rows where the draft's greedy choice was the target's, rows compared)."""
    return int(np.count_nonzero(ok)), len(ok)


@dataclass
class _Probation:
    """A draft window a trial took on the prompt's rows and has not kept yet (Session.settle_window): the window
    drafts from a context of its own while the whole context's memory (the engine's draft context) waits as the
    trial left it."""

    whole: _Cache  # the draft's whole-context memory, holding history[:start]
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
        self.tgt = _Cache(engine.tgt_ctx, partial_rm=not engine.target.is_recurrent_or_hybrid)
        self.dft = (_Cache(engine.dft_ctx, partial_rm=not engine.draft.is_recurrent_or_hybrid)
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
                                                          attention_prior=attention)
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
    def _pick(self, row: np.ndarray, p_min: float, samp: "_Sampling") -> tuple[int, SparseDist | None] | None:
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

    def _draft(self, n_max: int, p_min: float, samp: "_Sampling") -> tuple[list[int], list[SparseDist], tuple]:
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

    def _draft_mtp(self, n_max: int, p_min: float, samp: "_Sampling") -> tuple[list[int], list[SparseDist], tuple]:
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

    def _propose(self, s: GenerationSettings, samp: "_Sampling", n_draft_max: int,
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

    def _step(self, s: GenerationSettings, samp: "_Sampling", n_draft_max: int,
              drafters: tuple[str, ...] | None = None) -> "_Step":
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
        return _Step(emitted, len(drafts), t1 - t0, t2 - t1, first, per_token, drafter=drafter, catchup=catchup)

    def _rewind(self) -> None:
        """Roll both memories back to the committed history (the target holds all but the last token)."""
        self.tgt.truncate(_common_prefix(self.tgt.tokens, self.history[:-1]))
        if self.dft is not None:
            if len(self.history) <= self.dft.offset:
                self.dft.clear()  # rolled back past the draft's window: it starts again from the beginning
            self.dft.truncate(_common_prefix(self.dft.tokens, self.dft.view(self.history)))
        if self.mtp is not None:
            self.mtp.truncate(_common_prefix(self.mtp.tokens, self.history))

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
        self.dft = _Cache(c, tokens=list(tokens), offset=start, sink=DRAFT_SINK)
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


@dataclass
class _Progress:
    """A generation's running counters: what `Generation.snapshot()` and the final stats are built from."""

    prompt_s: float = 0.0
    n_steps: int = 0
    n_drafted: int = 0
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted, per step that drafted
    draft_s: float = 0.0
    verify_s: float = 0.0
    t_gen0: float | None = None
    decode0: float = 0.0
    restores0: int = 0
    rollbacks0: int = 0
    slides0: int = 0
    trials0: int = 0
    reverts0: int = 0
    plain0: int = 0  # the controller's counters when this generation began (it outlives generations)
    probes0: int = 0
    drafted_by: dict = field(default_factory=dict)
    accepted_by: dict = field(default_factory=dict)
    steps_by_k: dict = field(default_factory=dict)
    tried: list[int] = field(default_factory=list)
    verify_by_size: dict = field(default_factory=dict)
    draft_next_s: float = 0.0
    n_draft_next: int = 0

    def count_step(self, step: "_Step", n_kept: int, sign: int = 1) -> None:
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
        self._p = _Progress()
        self._clock = session.engine.clock
        self._samp: _Sampling | None = None
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

        samp = self._samp = _Sampling(s, self.speculative)
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
                    args = (step.n_drafted, len(step.emitted) - 1, step.draft_token_s, step.verify_s,
                            self._clock() - t_step - step.draft_s - step.verify_s, step.draft_s, step.first_token_s,
                            step.catchup)
                    if auto_drafter:
                        ctrl.observe(step.drafter, *args)
                    else:
                        ctrl.observe(*args)
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
