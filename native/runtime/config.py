"""What an Engine is opened with: one frozen EngineConfig the CLI builds and hands down, and the attention-path
rule (choose_flash_attn) that both the engine and the placement flags apply."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ...errors import UsageError
from ..llama import ffi as _ffi
from ..core.settings import AUTO_DRAFT_CAP

if TYPE_CHECKING:
    from .engine import Engine

FLASH_ATTN_VALUES = ("auto", "on", "off")


FA_PARALLEL_MIN = 2  # sequences in one unified cache from which the CPU's flash-attention kernel pays


def choose_flash_attn(flag: str, ngl: int, devices: tuple[str, ...] | None, parallel: int = 1,
                      streams: bool = False) -> str:
    """The attention path for one model: what --flash-attn says, and for auto, on a model that runs on the CPU
    alone off — or on where FA_PARALLEL_MIN or more sequences share one unified cache (not `streams`, a stream
    per sequence: kv_streams) — else llama.cpp's own choice ("auto": on where the device supports it).

    On the CPU, llama.cpp's flash-attention kernel decodes slower than the plain one once the context is
    long, and a verify batch more so: docs/benchmarks.md#long-context measures plain decoding and verifies
    both ways from 0.5k to 8k tokens. It does process a prompt faster, so a long prompt followed by a short
    answer can be quicker with --flash-attn on. With several sequences in one unified cache (--parallel) the
    plain kernel attends every row to every sequence's cells and masks the others', where the flash kernel skips
    masked cells: benchmarks/parallel_attention.py (docs/benchmarks.md, "The attention path with several
    sequences") measured it faster with it on at 2, 4 and 8 sequences, plain steps and verifies of 4 rows each, at
    200-2,000 tokens each (0.40-0.96 of the time off), where one sequence is as fast either way (0.94-1.10).
    With a stream per sequence each row attends its own stream, as one sequence does: a 4-sequence step took
    0.26-0.88 of the time with it off on an AVX-512 Xeon (docs/benchmarks.md, "On an Intel Xeon (AVX-512, AMX)")."""
    if flag not in FLASH_ATTN_VALUES:
        raise UsageError(f"--flash-attn must be auto, on or off ({flag})")
    if flag != "auto":
        return flag
    if not on_cpu(ngl, devices):
        return "auto"
    return "on" if parallel >= FA_PARALLEL_MIN and not streams else "off"


def on_cpu(ngl: int, devices: tuple[str, ...] | None) -> bool:
    """Whether a model with these placement flags runs on the CPU alone."""
    if devices is not None and not devices:  # no device at all: the CPU (the draft beside --rpc devices)
        return True
    return (ngl == 0 or not _ffi.supports_gpu_offload()) if not devices else \
        all(d.upper().startswith("CPU") for d in devices)


def kv_streams(parallel: int, cpu: bool, plain_cache: bool) -> bool:
    """The target's cache layout for --parallel: a stream per sequence (llama-server's -np default) or one
    unified cache. In one cache every row's attention walks every sequence's cells; on the CPU, where the
    batch's planner keeps several sequences plain nearly always, separate streams made a plain step of the
    deep pair 14% cheaper and served plain loads 0.89x -> 0.99x llama-server's (docs/benchmarks.md, "a KV stream
    per sequence"). A verify mixing row counts is split there into equal-length passes, so a GPU, where
    drafting pays, keeps one cache; so do recurrent, sliding-window and MTP targets (`plain_cache` False),
    whose memory a padding row (ffi.padding_rows) would change."""
    return parallel > 1 and cpu and plain_cache


@dataclass(frozen=True)
class EngineConfig:
    """Everything Engine's constructor takes but the clock, with Engine's own defaults (see Engine.__init__ for
    what each means). Sequences are tuples here (frozen, hashable) and lists where Engine takes lists."""

    target: str
    draft: str | None = None
    ctx: int = 4096
    threads: int | None = None
    ngl: int = 0
    ngl_draft: int = 0
    n_batch: int = 512
    main_gpu: int = 0
    tensor_split: tuple[float, ...] | None = None
    draft_tensor_split: tuple[float, ...] | None = None
    devices: tuple[str, ...] | None = None  # () is no device: the CPU
    draft_devices: tuple[str, ...] | None = None
    draft_ctx: int | str | None = "auto"
    draft_threads: int | None = None
    draft_n_batch: int | None = None
    cpu_amx: bool = False
    rollback_tokens: int = AUTO_DRAFT_CAP
    flash_attn: str = "auto"
    draft_flash_attn: str | None = None
    mtp: bool | None = False
    parallel: int = 1

    def options(self) -> dict:
        """Engine's keyword arguments (all but target, draft and the clock)."""
        def as_list(v):
            return list(v) if v is not None else None

        return {"ctx": self.ctx, "threads": self.threads, "ngl": self.ngl, "ngl_draft": self.ngl_draft,
                "n_batch": self.n_batch, "main_gpu": self.main_gpu,
                "tensor_split": list(self.tensor_split) if self.tensor_split else None,
                "draft_tensor_split": list(self.draft_tensor_split) if self.draft_tensor_split else None,
                "devices": as_list(self.devices), "draft_devices": as_list(self.draft_devices),
                "draft_ctx": self.draft_ctx, "draft_threads": self.draft_threads,
                "draft_n_batch": self.draft_n_batch, "cpu_amx": self.cpu_amx,
                "rollback_tokens": self.rollback_tokens, "flash_attn": self.flash_attn,
                "draft_flash_attn": self.draft_flash_attn, "mtp": self.mtp, "parallel": self.parallel}

    def open(self, clock: Callable[[], float] | None = None,
             factory: Callable[..., Engine] | None = None) -> Engine:
        """Load the models: Engine(target, draft, ...), or `factory` with the same arguments (a test's fake)."""
        if factory is None:
            from .engine import Engine as factory  # engine.py imports this module: import it when used
        return factory(self.target, self.draft, clock=clock, **self.options())
