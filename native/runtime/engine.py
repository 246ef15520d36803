"""The speculative decoding engine: target + optional draft over llama.cpp's C API.

Layers (as in mlx-lm): `Session._step` is one speculative step (draft → one batched verify → accept);
`Session.generate` turns steps into token events with text and timing; the CLI prints them.
Baseline decoding is the same loop with no draft, so comparisons are like for like.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ...errors import IncompatibleDraftError, UsageError
from ...machine import physical_cores
from ..core import vocabmap
from ..control.translation import TranslationChooser
from ..core.settings import DRAFT_MAX_CAP, MIN_DRAFT_WINDOW
from ..drafters import registry
from ..drafters.mtp import no_head_error
from ..llama import ffi as _ffi
from .attention import AttentionProbe, choose_attention
from .config import EngineConfig, choose_flash_attn, kv_streams, on_cpu
from .session import Session

log = logging.getLogger("specq.engine")


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


def as_list(v: tuple | None) -> list | None:
    return list(v) if v is not None else None


class Engine:
    """Loads a target (and optionally a draft) and creates contexts for them."""

    vocabulary: str = vocabmap.SAME  # the draft's vocabulary against the target's (vocabmap.classify)
    vocab_bridge: vocabmap.VocabBridge | None = None  # a draft of another vocabulary: what the two share
    vocab_map: str | None = None  # --vocab-map for such a draft
    vocab_overlap: float | None = None  # its overlap (vocabmap's glossary)
    vocab_chooser: TranslationChooser | None = None  # --vocab-map auto: picks each step's translation
    attention_probe: AttentionProbe | None = None  # the CPU's attention path with a stream per sequence, measured

    def __init__(self, target: str | os.PathLike | EngineConfig, draft: str | os.PathLike | None = None, *,
                 clock: Callable[[], float] | None = None, **options):
        """Load the models and make the contexts: from an EngineConfig (runtime/config.py: every option, its default
        and what it means), or from the target, the draft and any of EngineConfig's fields as keywords
        (`Engine(target, draft, ctx=256)`). `clock` times the steps (default time.perf_counter); a
        SimulatedClock makes timings deterministic."""
        cfg = target if isinstance(target, EngineConfig) else EngineConfig(
            str(target), None if draft is None else str(draft),
            **{k: tuple(v) if isinstance(v, list) else v for k, v in options.items()})
        self.config = cfg
        ctx, threads, ngl, ngl_draft, n_batch = cfg.ctx, cfg.threads, cfg.ngl, cfg.ngl_draft, cfg.n_batch
        devices, draft_devices = as_list(cfg.devices), as_list(cfg.draft_devices)
        draft_ctx, draft_threads, flash_attn, mtp, parallel = (cfg.draft_ctx, cfg.draft_threads, cfg.flash_attn,
                                                               cfg.mtp, cfg.parallel)
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
        draft_flash_attn = self.draft_flash_attn = choose_flash_attn(cfg.draft_flash_attn or flash_attn, ngl_draft,
                                                                     draft_devices or devices, parallel)
        choose_flash_attn(flash_attn, ngl, devices, parallel)  # a bad value fails before any load
        # what the draft model's context is opened with (Drafter.provide)
        self.draft_n_ctx = draft_ctx or ctx  # None or 0: all of it
        self.draft_n_batch = max(cfg.draft_n_batch or n_batch, parallel)
        self.provided: dict[str, object] = {}  # each drafter kind's resources on this engine, by name
        self.target = _ffi.Model(cfg.target, n_gpu_layers=ngl, main_gpu=cfg.main_gpu,
                                 tensor_split=as_list(cfg.tensor_split), devices=devices, cpu_amx=cfg.cpu_amx,
                                 load_mtp=mtp is not False)
        self.draft = None
        try:
            if mtp is True and self.target.n_layer_nextn < 1:
                raise no_head_error(self.target)
            if cfg.draft is not None:
                self.draft = _ffi.Model(cfg.draft, n_gpu_layers=ngl_draft, main_gpu=cfg.main_gpu,
                                        tensor_split=as_list(cfg.draft_tensor_split), devices=draft_devices,
                                        cpu_amx=cfg.cpu_amx)
                self._bridge_vocabularies(cfg.vocab_map)
            t = self.target
            plain_cache = not (t.is_recurrent_or_hybrid or t.n_swa or mtp is not False and t.n_layer_nextn > 0)
            streams = kv_streams(parallel, on_cpu(ngl, devices), plain_cache)
            flash_attn = self._attention_path(flash_attn, streams, ctx)
            # A verify batch [last, d1..dn] must be one decode with logits at every row: never split it.
            rows = parallel * (DRAFT_MAX_CAP + 1)  # every sequence's verify in one decode
            self.tgt_ctx = _ffi.Context(self.target, ctx, self.threads, n_batch=max(n_batch, rows),
                                        n_outputs_max=rows, name="target",
                                        n_rs_seq=cfg.rollback_tokens if self.target.is_recurrent_or_hybrid else 0,
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
        if self.vocab_bridge is not None:
            self._check_translated_draft()
        if self.draft_window is not None or self.draft is None or self.draft.is_recurrent_or_hybrid or parallel > 1 \
                or self.vocab_bridge is not None:
            self.window_auto = False  # a fixed window, no draft, a memory that cannot drop a tail, other tokens
        self.n_ctx = self.tgt_ctx.n_ctx
        self.clock = clock or time.perf_counter
        if isinstance(clock, SimulatedClock):
            for c in (self.tgt_ctx, *self.provided.values()):
                if hasattr(c, "on_decode"):
                    c.on_decode = clock.on_decode

    def _bridge_vocabularies(self, vocab_map: str) -> None:
        """Classify the draft's vocabulary; where it differs, build what the translation needs."""
        if vocab_map not in vocabmap.VOCAB_MAPS:
            raise UsageError(f"--vocab-map must be {', '.join(vocabmap.VOCAB_MAPS)} ({vocab_map})")
        self.vocabulary = vocabmap.classify(self.target, self.draft)
        if self.vocabulary == vocabmap.DIFFERENT:
            self.vocab_bridge = vocabmap.VocabBridge(vocabmap.Tokenizer(self.target), vocabmap.Tokenizer(self.draft))
            self.vocab_map = vocab_map
            if vocab_map == vocabmap.AUTO:
                self.vocab_chooser = TranslationChooser()
            if self.draft_n_ctx == self.config.ctx:  # the draft may need more tokens for the same text
                self.draft_n_ctx = int(self.config.ctx * vocabmap.DRAFT_CTX_FACTOR)

    @property
    def vocab_translation(self) -> str | None:
        """The translation a draft of another vocabulary runs (None: a draft of the target's vocabulary); under
        auto, the one that has drafted more steps so far (TLI before any: control/translation.py)."""
        if self.vocab_bridge is None:
            return None
        return self.vocab_map if self.vocab_chooser is None else self.vocab_chooser.leading

    def _check_translated_draft(self) -> None:
        """A draft of another vocabulary: refuse a window (--ctx-draft) and too little overlap, closing the engine."""
        try:
            if self.draft_window is not None:
                raise UsageError("a draft of another vocabulary sees the whole context: leave --ctx-draft out")
            self._check_overlap()
        except BaseException:
            self.close()
            raise

    def _check_overlap(self) -> None:
        """Measure the overlap (vocabmap's glossary) on the calibration text. Below OVERLAP_MIN TLI cannot help: a
        forced --vocab-map tli is refused, and auto drafts through the string path alone (its proposals do not go
        through shared tokens), saying so in one line."""
        self.vocab_overlap = self.measure_overlap()
        if self.vocab_overlap >= vocabmap.OVERLAP_MIN or self.vocab_map == vocabmap.STRING:
            return
        share = (f"the draft's vocabulary differs from the target's and only {self.vocab_overlap:.0%} of its "
                 f"probability mass falls on the {self.vocab_bridge.n_shared} tokens they share")
        if self.vocab_map == vocabmap.TLI:
            raise IncompatibleDraftError(
                f"{share} (TLI needs {vocabmap.OVERLAP_MIN:.0%} to help); --vocab-map string drafts through text "
                f"instead, or use a draft whose tokenizer is closer to the target's (target {self.target.path}, "
                f"draft {self.draft.path})")
        log.warning("%s (TLI needs %.0f%% to help): the string path drafts alone", share, 100 * vocabmap.OVERLAP_MIN)
        self.vocab_map, self.vocab_chooser = vocabmap.STRING, None

    def measure_overlap(self) -> float:
        """A draft of another vocabulary's overlap (vocabmap's glossary) on the calibration text."""
        c = self.dft_ctx
        toks = self.draft.tokenize(vocabmap.CALIBRATION, add_special=True, parse_special=False)[:c.n_ctx - 1]
        rows = []
        step = max(1, min(c.n_outputs_max, c.n_batch))
        for i in range(0, len(toks), step):
            c.decode(toks[i:i + step], i, logits="all")
            rows.extend(c.logits(len(toks[i:i + step])))
        c.clear()
        return self.vocab_bridge.overlap(np.asarray(rows))

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

    def _attention_path(self, flag: str, streams: bool, ctx: int) -> str:
        """The target's attention path (choose_flash_attn); with a KV stream per sequence on the CPU under
        --flash-attn auto measured on this machine once (runtime/attention.py), since CPUs disagree there about
        which kernel steps faster (`streams`: config.kv_streams, only ever on the CPU)."""
        self.flash_attn = choose_flash_attn(flag, self.config.ngl, as_list(self.config.devices), self.parallel, streams)
        if flag == "auto" and streams:
            self.attention_probe = choose_attention(self.target, self.threads, self.parallel, ctx)
            if self.attention_probe is not None:
                log.info("%s", self.attention_probe.describe(self.parallel))
                self.flash_attn = self.attention_probe.choice
        return self.flash_attn

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
