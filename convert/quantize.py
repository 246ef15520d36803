"""Quantization with llama.cpp's own quantizer (llama_model_quantize), by the usual type names."""

from __future__ import annotations

import logging
from pathlib import Path

from ..atomic import atomic_output
from ..errors import UsageError
from ..native.llama import ffi as _ffi
from ..native.llama.quantize_proc import quantize_in_child
from .writer import ProgressFn

log = logging.getLogger("specq.convert")

# Types offered on the command line. The IQ* types need an importance matrix, which convert does not make.
QUANT_TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_0", "Q5_1", "Q4_K_M", "Q4_K_S", "Q4_0", "Q4_1",
               "Q3_K_L", "Q3_K_M", "Q3_K_S", "Q2_K")
# Approximate bits per weight, for the free-disk estimate only.
BITS_PER_WEIGHT = {"Q8_0": 8.5, "Q6_K": 6.6, "Q5_K_M": 5.7, "Q5_K_S": 5.5, "Q5_0": 5.5, "Q5_1": 6.0,
                   "Q4_K_M": 4.9, "Q4_K_S": 4.6, "Q4_0": 4.5, "Q4_1": 5.0, "Q3_K_L": 4.3, "Q3_K_M": 3.9,
                   "Q3_K_S": 3.5, "Q2_K": 3.4}


def parse_quant(value: str | None, flag: str) -> str | None:
    """Normalise a --quant value: a type name, or None for "none"."""
    if value is None or value.strip().lower() == "none":
        return None
    name = value.strip().upper()
    if name not in QUANT_TYPES:
        raise UsageError(f"unknown {flag} type ({value}); choose one of {', '.join(QUANT_TYPES)}, or none")
    return name


def ftype_of(name: str) -> int:
    table = _ffi.ftype_by_name()
    if name not in table:
        raise UsageError(f"this llama.cpp build has no quantization type {name}; choose another --quant")
    return table[name]


def quantize_file(src: Path, dst: Path, quant: str, threads: int = 0, progress: ProgressFn | None = None,
                  task: str = "quantize") -> Path:
    """Quantize `src` to `dst` (atomically) as `quant`; progress counts tensors."""
    ftype = ftype_of(quant)

    def on_tensor(i: int, n: int) -> None:
        if progress:
            progress(task, i, n)

    with atomic_output(dst) as tmp:
        log.info("quantizing %s -> %s as %s", src.name, dst.name, quant)
        quantize_in_child(src, tmp, ftype, n_threads=threads, on_tensor=on_tensor)  # Ctrl-C ends it at once
    return dst
