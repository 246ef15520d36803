"""Reading safetensors checkpoints without loading them: headers, and tensors as memory-mapped row chunks.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte offsets)
and the raw data. We map each file once and release the pages of every chunk after use, so the
resident set stays near one chunk whatever the size of the model.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import ConversionError

# safetensors dtype -> (numpy dtype used to carry the raw bits, bytes per element)
# BF16 travels as uint16 bits: numpy has no bfloat16, and row operations do not need the values.
DTYPES = {"BF16": np.dtype("<u2"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4")}
CHUNK_BYTES = 32 << 20
_PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor lives: file, dtype name, shape and absolute byte range."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_elems(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64))


def read_header(path: Path) -> dict[str, TensorRef]:
    """The tensors of one .safetensors file (raises ConversionError on a malformed file)."""
    try:
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ConversionError(f"safetensors file is truncated ({path}); download it again")
            (n,) = struct.unpack("<Q", raw)
            if n > 100 << 20:
                raise ConversionError(f"safetensors header is implausibly large ({path}, {n} bytes); "
                                      "the file is corrupt")
            header = json.loads(f.read(n))
    except (ValueError, UnicodeDecodeError) as e:
        raise ConversionError(f"safetensors header is not valid JSON ({path}: {e}); the file is corrupt")
    size = path.stat().st_size
    base = 8 + n
    out: dict[str, TensorRef] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = info.get("dtype")
        if dtype not in DTYPES:
            raise ConversionError(f"tensor {name} has dtype {dtype} ({path}); specq converts BF16, F16 and F32 "
                                  "checkpoints only")
        start, end = (base + int(o) for o in info["data_offsets"])
        shape = tuple(int(d) for d in info["shape"])
        if end > size or end - start != int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize:
            raise ConversionError(f"tensor {name} lies outside its file or has the wrong size ({path}); "
                                  "the download is incomplete, fetch it again")
        out[name] = TensorRef(name, path, dtype, shape, start, end)
    return out


def read_checkpoint(files: list[Path]) -> dict[str, TensorRef]:
    """All tensors of a (possibly sharded) checkpoint."""
    tensors: dict[str, TensorRef] = {}
    for f in files:
        for name, ref in read_header(f).items():
            if name in tensors:
                raise ConversionError(f"tensor {name} appears in two shards ({tensors[name].file.name}, {f.name}); "
                                      "the checkpoint is inconsistent")
            tensors[name] = ref
    return tensors


class MappedFiles:
    """One read-only mapping per file, opened lazily and closed together."""

    def __init__(self) -> None:
        self._maps: dict[Path, tuple[object, mmap.mmap]] = {}

    def _map(self, path: Path) -> mmap.mmap:
        if path not in self._maps:
            f = path.open("rb")
            self._maps[path] = (f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        return self._maps[path][1]

    def rows(self, ref: TensorRef, row_block: int = 1, chunk_bytes: int = CHUNK_BYTES) -> Iterator[np.ndarray]:
        """Yield the tensor as arrays of whole rows (a multiple of row_block rows), raw dtype bits.

        Each chunk is a copy; the mapped pages behind it are dropped before the next one, so peak
        memory is one chunk, not the file.
        """
        m = self._map(ref.file)
        dt = DTYPES[ref.dtype]
        if len(ref.shape) <= 1:
            chunk = np.frombuffer(m, dtype=dt, count=ref.nbytes // dt.itemsize, offset=ref.start).copy()
            _drop(m, ref.start, ref.end)
            yield chunk
            return
        row_bytes = ref.row_elems * dt.itemsize
        step = max(row_block, (chunk_bytes // max(row_bytes, 1)) // row_block * row_block)
        r = 0
        while r < ref.rows:
            n = min(step, ref.rows - r)
            a, b = ref.start + r * row_bytes, ref.start + (r + n) * row_bytes
            chunk = np.frombuffer(m, dtype=dt, count=n * ref.row_elems, offset=a).reshape((n,) + ref.shape[1:]).copy()
            _drop(m, a, b)
            yield chunk
            r += n

    def row_runs(self, ref: TensorRef, runs: list[tuple[int, int]],
                 chunk_bytes: int = CHUNK_BYTES) -> Iterator[np.ndarray]:
        """Yield rows [a, b) of each run in turn, at most a chunk at a time (a row reordering, streamed)."""
        m = self._map(ref.file)
        dt = DTYPES[ref.dtype]
        row_bytes = ref.row_elems * dt.itemsize
        step = max(1, chunk_bytes // max(row_bytes, 1))
        for a, b in runs:
            for r in range(a, b, step):
                n = min(step, b - r)
                lo = ref.start + r * row_bytes
                chunk = np.frombuffer(m, dtype=dt, count=n * ref.row_elems, offset=lo).reshape((n,) + ref.shape[1:])
                yield chunk.copy()
                _drop(m, lo, lo + n * row_bytes)
        _drop(m, ref.start, ref.end)  # pages the kernel mapped around the runs (fault-around) go too

    def close(self) -> None:
        for f, m in self._maps.values():
            m.close()
            f.close()  # type: ignore[attr-defined]
        self._maps.clear()

    def __enter__(self) -> "MappedFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _drop(m: mmap.mmap, a: int, b: int) -> None:
    """Release the pages of [a, b) from this process (they stay in the page cache, not in our RSS)."""
    lo = a // _PAGE * _PAGE
    hi = min(len(m), -(-b // _PAGE) * _PAGE)
    if hi > lo and hasattr(mmap, "MADV_DONTNEED"):
        m.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
