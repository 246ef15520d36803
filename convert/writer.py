"""Streaming GGUF writer: one tensor at a time, in row chunks, into a temporary file renamed at the end.

Peak memory is a chunk (CHUNK_BYTES) plus the tokenizer metadata, whatever the model size. BF16 is
carried as uint16 bits end to end, so a BF16 checkpoint written as BF16 is bit-exact.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import gguf
import numpy as np

from ..atomic import atomic_output
from ..errors import ConversionError
from .checkpoint import MappedFiles, TensorRef

log = logging.getLogger("specq.convert")

ProgressFn = Callable[[str, int, int], None]  # (task, done, total)

OUTTYPES = {
    "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
}
_SRC_TO_OUTTYPE = {"BF16": "bf16", "F16": "f16", "F32": "f32"}
_NP_OUT = {gguf.GGMLQuantizationType.F32: np.dtype("<f4"), gguf.GGMLQuantizationType.F16: np.dtype("<f2"),
           gguf.GGMLQuantizationType.BF16: np.dtype("<u2")}


def source_outtype(src_dtype: str) -> str:
    return _SRC_TO_OUTTYPE[src_dtype]


# ---- dtype conversion on raw bits ---------------------------------------------------------------
def to_f32(chunk: np.ndarray, src: str) -> np.ndarray:
    if src == "BF16":
        return (chunk.astype(np.uint32) << 16).view(np.float32)
    return chunk.astype(np.float32, copy=False)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round to nearest even, as ggml does; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), r)


def convert_chunk(chunk: np.ndarray, src: str, out: gguf.GGMLQuantizationType) -> np.ndarray:
    """Raw source bits -> the output type's numpy representation (unchanged when the types agree)."""
    if OUTTYPES[_SRC_TO_OUTTYPE[src]][0] == out:
        return chunk
    f = to_f32(chunk, src)
    if out == gguf.GGMLQuantizationType.F32:
        return f
    if out == gguf.GGMLQuantizationType.F16:
        return f.astype(np.float16)
    return f32_to_bf16_bits(f)


# ---- what to write ------------------------------------------------------------------------------
@dataclass
class TensorJob:
    """One output tensor: a source tensor (row-chunked, transformed) or generated data."""

    name: str
    out_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # output shape, numpy order (rows first)
    ref: TensorRef | None = None
    data: np.ndarray | None = None  # generated tensors, already in the output representation
    row_block: int = 1
    transform: Callable[[np.ndarray], np.ndarray] | None = None  # row-local op on raw-bit chunks
    # row-local op on the float32 values (after transform); its result is rounded once, to out_type
    values: Callable[[np.ndarray], np.ndarray] | None = None
    finish: Callable[[], np.ndarray | None] | None = None  # rows appended after the last chunk (raw bits)
    row_runs: list[tuple[int, int]] | None = None  # source row ranges in output order (a row reordering)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * _NP_OUT[self.out_type].itemsize


class _Stream:
    """Duck-typed array for GGUFWriter.write_tensor_data: writes the tensor chunk by chunk."""

    def __init__(self, job: TensorJob, maps: MappedFiles, on_bytes: Callable[[int], None]):
        self.job, self.maps, self.on_bytes = job, maps, on_bytes
        self.nbytes = job.nbytes

    def chunks(self) -> Iterator[np.ndarray]:
        job = self.job
        if job.ref is None:
            yield job.data
            return
        rows_out = job.shape[0] if len(job.shape) > 1 else None
        done = 0
        source = (self.maps.rows(job.ref, job.row_block) if job.row_runs is None
                  else self.maps.row_runs(job.ref, job.row_runs))
        for raw in source:
            src = job.ref.dtype
            if job.transform is not None:
                raw = job.transform(raw)
            if job.values is not None:
                # computed from the checkpoint's values in float32, never rounded back to its dtype
                raw, src = np.asarray(job.values(to_f32(raw, src)), dtype=np.float32), "F32"
            if rows_out is not None:
                raw = raw[:max(0, rows_out - done)]  # trimming drops trailing padding rows
                done += len(raw)
            if len(raw):
                yield convert_chunk(raw, src, job.out_type)
        if job.finish is not None:
            extra = job.finish()
            if extra is not None and len(extra):
                yield convert_chunk(extra, job.ref.dtype, job.out_type)

    def tofile(self, fout) -> None:
        written = 0
        for c in self.chunks():
            c = np.ascontiguousarray(c, dtype=_NP_OUT[self.job.out_type])
            fout.write(memoryview(c).cast("B"))
            written += c.nbytes
            self.on_bytes(c.nbytes)
        if written != self.nbytes:
            raise ConversionError(f"tensor {self.job.name} produced {written} bytes, expected {self.nbytes}; "
                                  "this is a bug in specq's converter")


# ---- the file -----------------------------------------------------------------------------------
def write_gguf(final: Path, arch_name: str, metadata: Callable[[gguf.GGUFWriter], None], jobs: list[TensorJob],
               task: str = "write", progress: ProgressFn | None = None) -> Path:
    """Write a GGUF with the given metadata and tensors to `final`, atomically."""
    total = sum(j.nbytes for j in jobs)
    done = 0

    def on_bytes(n: int) -> None:
        nonlocal done
        done += n
        if progress:
            progress(task, done, total)

    with atomic_output(final) as tmp, MappedFiles() as maps:
        w = gguf.GGUFWriter(None, arch_name)
        try:
            metadata(w)
            for j in jobs:
                np_dtype = _NP_OUT[j.out_type]
                raw = j.out_type if j.out_type == gguf.GGMLQuantizationType.BF16 else None
                w.add_tensor_info(j.name, j.shape, np_dtype, j.nbytes, raw_dtype=raw)
            w.write_header_to_file(tmp)
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            if progress:
                progress(task, 0, total)
            for j in jobs:
                log.debug("writing %s %s %s", j.name, j.shape, j.out_type.name)
                w.write_tensor_data(_Stream(j, maps, on_bytes))  # type: ignore[arg-type]
            w.flush()
        finally:
            w.close()
    return final
