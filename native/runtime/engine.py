"""The speculative decoding engine: target + optional draft over llama.cpp's C API.

Layers (as in mlx-lm): `Session._step` is one speculative step (draft → one batched verify → accept);
`Session.generate` turns steps into token events with text and timing; the CLI prints them.
Baseline decoding is the same loop with no draft, so comparisons are like for like.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

from ...errors import UsageError
from ...machine import physical_cores
from ..core.compat import VocabInfo, check_compatible
from ..core.settings import AUTO_DRAFT_CAP, DRAFT_MAX_CAP, MIN_DRAFT_WINDOW
from ..drafters import registry
from ..drafters.mtp import no_head_error
from ..llama import ffi as _ffi
from .config import choose_flash_attn, kv_streams, on_cpu
from .session import Session


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
                 flash_attn: str = "auto", draft_flash_attn: str | None = None, mtp: bool | None = False,
                 parallel: int = 1):
        """Each model gets its own context size, batch size, threads and GPU layers (the draft's default to
        the target's); generation stops at the smaller context, since the draft holds the same tokens.
        `cpu_amx` lets llama.cpp use its AMX weight buffer, which crashes on some builds (native/llama/cpu.py).
        `clock` times the steps (default time.perf_counter); a SimulatedClock makes timings deterministic.
        `rollback_tokens`: on a recurrent/hybrid target, how many rejected tokens a verify can roll back through
        llama.cpp's state snapshots (n_rs_seq) instead of a checkpoint copy; longer drafts fall back to it.
        `flash_attn`/`draft_flash_attn`: on, off or auto: off for a model on the CPU alone, llama.cpp's choice
        elsewhere (config.choose_flash_attn: on the CPU flash attention decodes slower at long context).
        `mtp`: True loads the target's MTP head as a drafter (a target without one is refused), None loads it
        where the target has one (--drafter auto), False never.
        `draft_ctx`: the draft's context; smaller than ctx, the draft sees a window of that many recent tokens
        (after the history's first DRAFT_SINK); None or 0: the whole context; "auto": the whole context, or a
        window of WINDOW_TRIAL tokens where a session measures that it pays (greedy, --draft-max auto).
        `parallel`: sequences held at once (`session(seq)` for each), `ctx` tokens each, in one cache per model, so
        that one decode can carry rows of several (runtime/batch.py), the MTP head's too; more than one turns the
        window trials off."""
        if parallel < 1:
            raise UsageError(f"--parallel must be at least 1 ({parallel})")
        self.parallel = parallel
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
                                                                     draft_devices or devices, parallel)
        choose_flash_attn(flash_attn, ngl, devices, parallel)  # a bad value fails before any load
        # what the drafters' resources are opened with (Drafter.provide)
        self.ctx_asked, self.n_batch_asked, self.mtp_asked = ctx, n_batch, mtp
        self.draft_n_ctx = draft_ctx or ctx  # None or 0: all of it
        self.draft_n_batch = max(draft_n_batch or n_batch, parallel)
        self.provided: dict[str, object] = {}  # each drafter kind's resources on this engine, by name
        self.target = _ffi.Model(target, n_gpu_layers=ngl, main_gpu=main_gpu, tensor_split=tensor_split,
                                 devices=devices, cpu_amx=cpu_amx, load_mtp=mtp is not False)
        self.draft = None
        try:
            if mtp is True and self.target.n_layer_nextn < 1:
                raise no_head_error(self.target)
            if draft is not None:
                self.draft = _ffi.Model(draft, n_gpu_layers=ngl_draft, main_gpu=main_gpu,
                                        tensor_split=draft_tensor_split, devices=draft_devices, cpu_amx=cpu_amx)
                check_compatible(VocabInfo.of(self.target), VocabInfo.of(self.draft))
            t = self.target
            plain_cache = not (t.is_recurrent_or_hybrid or t.n_swa or mtp is not False and t.n_layer_nextn > 0)
            streams = kv_streams(parallel, on_cpu(ngl, devices), plain_cache)
            flash_attn = self.flash_attn = choose_flash_attn(flash_attn, ngl, devices, parallel, streams)
            # A verify batch [last, d1..dn] must be one decode with logits at every row: never split it.
            rows = parallel * (DRAFT_MAX_CAP + 1)  # every sequence's verify in one decode
            self.tgt_ctx = _ffi.Context(self.target, ctx, self.threads, n_batch=max(n_batch, rows),
                                        n_outputs_max=rows, name="target",
                                        n_rs_seq=rollback_tokens if self.target.is_recurrent_or_hybrid else 0,
                                        flash_attn=flash_attn, n_seq=parallel,
                                        unified=not streams)
            self.tgt_ctx.warm_up()
            for name, cls in registry.DRAFTERS.items():  # the draft model's context, the MTP head's, ...
                got = cls.provide(self)
                if got is not None:
                    self.provided[name] = got
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
        if self.draft_window is not None or self.draft is None or self.draft.is_recurrent_or_hybrid or parallel > 1:
            self.window_auto = False  # a fixed window, no draft model, or a memory that cannot drop a tail
        self.n_ctx = self.tgt_ctx.n_ctx
        self.clock = clock or time.perf_counter
        if isinstance(clock, SimulatedClock):
            for c in (self.tgt_ctx, *self.provided.values()):
                if hasattr(c, "on_decode"):
                    c.on_decode = clock.on_decode

    @property
    def dft_ctx(self) -> _ffi.Context | None:
        """The draft model's context (the model drafter's resource), where a draft model is loaded."""
        return self.provided.get("model")

    @property
    def mtp_ctx(self) -> _ffi.MtpContext | None:
        """The target's MTP head's context (the MTP drafter's resource), where it was loaded."""
        return self.provided.get("mtp")

    def info(self, which: str = "target") -> ModelInfo:
        m = self.target if which == "target" else self.draft
        return ModelInfo(str(m.path), m.size_bytes, m.n_params, m.n_layer, m.n_vocab)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.target.tokenize(text, add_special=add_special, parse_special=True)

    def session(self, seq: int = 0) -> "Session":
        """A conversation on sequence `seq` of both models' memories (one Session per sequence at a time)."""
        return Session(self, seq)

    def close(self) -> None:
        provided = getattr(self, "provided", {})
        for c in (*reversed(provided.values()), getattr(self, "tgt_ctx", None)):
            if hasattr(c, "close"):
                c.close()
        for m in (getattr(self, "draft", None), getattr(self, "target", None)):
            if m is not None:
                m.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
