"""CPU backend safety: which of llama.cpp's CPU weight buffers specq lets a model use on this machine.

A native llama.cpp build on an Intel CPU with AMX compiles AMX kernels in (`AMX_INT8 = 1` in the system
info is that compile-time flag) and puts Q4_0/Q4_1/Q8_0/K-quant weights into its "AMX" extra buffer,
whose matmul segfaults on the first decode (upstream ggml-org/llama.cpp#20824). specq never hands
llama.cpp that configuration unless asked (`--cpu-amx`): it turns the extra buffers off and, where the
whole model runs on the CPU, sends the weights the x86 CPU-repack kernels handle to the repack buffer
by name, so that speed-up stays. The decision is a pure function of the build, the CPU's flags and the
opt-in, so every case is testable on any machine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import gguf

AMX_CPU_FLAGS = ("amx_int8", "amx_tile", "amx_bf16")  # as Linux's /proc/cpuinfo names them
# CPU features worth showing in `doctor`: the SIMD levels llama.cpp's CPU kernels choose between.
SHOWN_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vnni", "avx512_bf16", "avx_vnni",
               *AMX_CPU_FLAGS)

# What llama.cpp's x86 CPU-repack buffer repacks (ggml-cpu/repack.cpp, ggml_repack_get_optimal_repack_type):
# these types with AVX2, when the matrix has a multiple of 8 rows. A tensor sent there that it cannot
# repack crashes, so this list may only ever be narrower than llama.cpp's, never wider.
REPACK_TYPES_AVX2 = (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_K,
                     gguf.GGMLQuantizationType.IQ4_NL, gguf.GGMLQuantizationType.MXFP4)
REPACK_ROWS_MULTIPLE = 8
# The AMX buffer's F16 matmul runs AVX-512 kernels, no AMX tile instruction (ggml-cpu/amx/mmq.cpp: "f16 only has
# avx512 kernels"): the crash is the quantized tile path's, so amx-off keeps F16 weights there, as llama.cpp
# would put them (faster for a 4-sequence step of an F16 target on a Xeon: docs/benchmarks.md). Its supports_op:
# the row length a multiple of 16, the rows a multiple of 32 (TILE_N * 2).
AMX_F16_COLS_MULTIPLE, AMX_ROWS_MULTIPLE = 16, 32
# Weights used only as matrix multiplications (the op the repack buffer serves), by gguf's own names.
_MATMUL_TENSORS = (gguf.MODEL_TENSOR.ATTN_Q, gguf.MODEL_TENSOR.ATTN_K, gguf.MODEL_TENSOR.ATTN_V,
                   gguf.MODEL_TENSOR.ATTN_QKV, gguf.MODEL_TENSOR.ATTN_OUT, gguf.MODEL_TENSOR.FFN_GATE,
                   gguf.MODEL_TENSOR.FFN_UP, gguf.MODEL_TENSOR.FFN_DOWN)
_OUTPUT = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.OUTPUT] + ".weight"


@dataclass(frozen=True)
class CpuPolicy:
    """What specq lets llama.cpp do with CPU weight buffers here, and why (doctor's `cpu` key)."""

    features: tuple[str, ...] | None  # SIMD/AMX flags the OS reports (None: could not read them)
    build_has_amx: bool  # the llama.cpp build contains AMX kernels (AMX_INT8 = 1)
    extra_buffers: str  # "on": llama.cpp's choice; "amx-off": AMX off, CPU repack kept; "off": all off
    reason: str

    @property
    def use_extra_bufts(self) -> bool:
        return self.extra_buffers == "on"

    def as_dict(self) -> dict:
        return {"features": list(self.features) if self.features is not None else None,
                "build_has_amx": self.build_has_amx, "extra_buffers": self.extra_buffers, "reason": self.reason}


def cpu_flags(cpuinfo: str | None = None) -> tuple[str, ...] | None:
    """The CPU's feature flags from /proc/cpuinfo (or the given text); None where they cannot be read."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return None
    m = re.search(r"^(?:flags|Features)\s*:(.*)$", cpuinfo, re.MULTILINE)
    return tuple(m.group(1).split()) if m else None


def system_info_flag(system_info: str, name: str) -> bool:
    """Whether llama_print_system_info() reports `NAME = 1` (the build's compile-time CPU features)."""
    return re.search(rf"(^|[|\s]){re.escape(name)}\s*=\s*1\b", system_info) is not None


def decide(system_info: str, flags: tuple[str, ...] | None, allow_amx: bool = False,
           repack_available: bool = True) -> CpuPolicy:
    """The CPU buffer policy for a build (its system info), this CPU's flags and the --cpu-amx opt-in."""
    has_amx_build = system_info_flag(system_info, "AMX_INT8")
    shown = tuple(f for f in SHOWN_FLAGS if f in flags) if flags is not None else None
    cpu_amx = None if flags is None else any(f in flags for f in AMX_CPU_FLAGS)
    if not has_amx_build:
        return CpuPolicy(shown, False, "on", "this llama.cpp build has no AMX kernels; its CPU buffers are safe")
    if allow_amx:
        return CpuPolicy(shown, True, "on", "--cpu-amx: llama.cpp's AMX buffer is on (it can crash: "
                                           "upstream llama.cpp#20824)")
    if cpu_amx is False:
        return CpuPolicy(shown, True, "on", "the build has AMX kernels but this CPU has no AMX, so llama.cpp "
                                           "does not use them")
    why = "this CPU has AMX" if cpu_amx else "the CPU's flags could not be read"
    keep = "CPU repack kept" if repack_available else "no CPU-repack buffer in this build"
    return CpuPolicy(shown, True, "amx-off" if repack_available else "off",
                     f"AMX buffer off: the build has AMX kernels and {why}, and llama.cpp's AMX matmul crashes "
                     f"(upstream llama.cpp#20824); {keep}; F16 weights kept on its AVX-512 path; --cpu-amx opts in")


def _matmul_name(name: str) -> str | None:
    """The layer-independent pattern of a per-layer matmul weight ("blk.\\d+.attn_q.weight"), or None."""
    m = re.fullmatch(r"blk\.(\d+)\.(.+)\.weight", name)
    if not m:
        return None
    stems = {gguf.TENSOR_NAMES[t].split(".", 2)[2] for t in _MATMUL_TENSORS}
    return m.group(2) if m.group(2) in stems else None


def repack_patterns(tensors, avx2: bool) -> list[str]:
    """Regexes (llama.cpp's tensor_buft_overrides) naming exactly the weights the x86 repack buffer can take.

    `tensors`: (name, shape in ggml order, ggml type) of every tensor of a GGUF. One pattern per weight kind
    where all layers qualify, else one per tensor, so the list stays short (llama.cpp tries each pattern on
    each tensor)."""
    if not avx2:
        return []
    return _patterns(tensors, lambda shape, ggml_type: len(shape) == 2 and ggml_type in REPACK_TYPES_AVX2
                     and shape[1] % REPACK_ROWS_MULTIPLE == 0)


def amx_f16_patterns(tensors) -> list[str]:
    """Regexes naming the F16 matmul weights llama.cpp's AMX buffer takes (its AVX-512 path); as repack_patterns."""
    f16 = int(gguf.GGMLQuantizationType.F16)
    return _patterns(tensors, lambda shape, ggml_type: len(shape) == 2 and ggml_type == f16
                     and shape[0] % AMX_F16_COLS_MULTIPLE == 0 and shape[1] % AMX_ROWS_MULTIPLE == 0)


def _patterns(tensors, good) -> list[str]:
    """The matmul weights (and output.weight) for which good(shape, ggml type) holds, as regexes."""
    ok: dict[str, list[bool]] = {}
    names: dict[str, list[str]] = {}
    for name, shape, ggml_type in tensors:
        kind = _OUTPUT if name == _OUTPUT else _matmul_name(name)
        if kind is None:
            continue
        ok.setdefault(kind, []).append(good(shape, ggml_type))
        names.setdefault(kind, []).append(name)
    out = []
    for kind in ok:
        if kind == _OUTPUT:
            if ok[kind][0]:
                out.append("^" + re.escape(_OUTPUT) + "$")
        elif all(ok[kind]):
            out.append(r"^blk\.\d+\." + re.escape(kind) + r"\.weight$")
        else:
            out.extend("^" + re.escape(n) + "$" for n, good in zip(names[kind], ok[kind]) if good)
    return out
