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
    masked cells: benchmarks/parallel_attention.py measured it faster with it on at 2, 4 and 8 sequences, where
    one sequence is as fast either way (docs/benchmarks.md, "The attention path with several sequences"). With a
    stream per sequence each row attends its own stream, as one sequence does, and off was faster again on a Xeon
    (docs/benchmarks.md, "On an Intel Xeon (AVX-512, AMX)") but slower on an EPYC: there the Engine measures the
    machine (runtime/attention.py), and this rule's "off" is what a model too cheap to measure keeps."""
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
    batch's planner keeps several sequences plain nearly always, separate streams made plain steps cheaper and
    served plain loads closer to llama-server's (docs/benchmarks.md, "a KV stream per sequence"). A verify mixing row counts is split there into equal-length passes, so a GPU, where
    drafting pays, keeps one cache; so do recurrent, sliding-window and MTP targets (`plain_cache` False),
    whose memory a padding row (ffi.padding_rows) would change."""
    return parallel > 1 and cpu and plain_cache


@dataclass(frozen=True)
class EngineConfig:
    """What an Engine is opened with: every option and its default, stated here alone (`Engine(config)`, or
    `Engine(target, draft, **fields)`). Sequences are tuples (frozen, hashable).

    Each model gets its own context size, batch size, threads and GPU layers (the draft's default to the
    target's); generation stops at the smaller context, since the draft holds the same tokens.
    `cpu_amx` lets llama.cpp use its AMX weight buffer, which crashes on some builds (native/llama/cpu.py).
    `rollback_tokens`: on a recurrent/hybrid target, how many rejected tokens a verify can roll back through
    llama.cpp's state snapshots (n_rs_seq) instead of a checkpoint copy; longer drafts fall back to it.
    `flash_attn`/`draft_flash_attn`: on, off or auto: off for a model on the CPU alone, llama.cpp's choice
    elsewhere (choose_flash_attn: on the CPU flash attention decodes slower at long context).
    `mtp`: True loads the target's MTP head as a drafter (a target without one is refused), None loads it
    where the target has one (--drafter auto), False never.
    `draft_ctx`: the draft's context; smaller than ctx, the draft sees a window of that many recent tokens
    (after the history's first DRAFT_SINK); None or 0: the whole context; "auto": the whole context, or a
    window of WINDOW_TRIAL tokens where a session measures that it pays (greedy, --draft-max auto).
    `parallel`: sequences held at once (`Engine.session(seq)` for each), `ctx` tokens each, in one cache per
    model, so that one decode can carry rows of several (runtime/batch.py), the MTP head's too; more than one
    turns the window trials off.
    `suffix_cache`: a file the suffix drafter's store of earlier answers is read from and written back to (None:
    the store lives as long as the engine); `suffix_scope`: "server" (one store for every sequence and request)
    or "request" (none: each request drafts from its own text alone).
    `vocab_map`: how a draft of another vocabulary proposes target tokens (core/vocabmap.py): "tli", "string"
    or "auto" (chosen per generation: drafters/crossvocab.py); a draft of the target's vocabulary ignores it."""

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
    suffix_cache: str | None = None
    suffix_scope: str = "server"
    vocab_map: str = "auto"

    def open(self, clock: Callable[[], float] | None = None,
             factory: Callable[..., Engine] | None = None) -> Engine:
        """Load the models: Engine(self), or `factory(self, clock=clock)` (a test's fake)."""
        if factory is None:
            from .engine import Engine as factory  # engine.py imports this module: import it when used
        return factory(self, clock=clock)
