"""Read a GGUF file's header, metadata and tensor infos without touching the tensor data.

The planner needs shapes and types only; this reads them through a memory map in well under a second,
even for a 20 GB model with a 150k-token vocabulary (large arrays are skipped, only their length kept).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import gguf

from ...errors import ModelFileError

# GGUF value types (gguf.GGUFValueType): fixed-size ones by struct code.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
ARRAY_KEEP_MAX = 1024  # arrays longer than this (token lists, merges) are kept as their length only


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: ne0 (the contiguous dimension) first
    ggml_type: int
    nbytes: int
    offset: int = 0  # of the data, from the start of the data section


@dataclass(frozen=True)
class SkippedArray:
    """A long array left unread; only its element type and length are known."""

    vtype: int
    length: int


@dataclass(frozen=True)
class GGUFHeader:
    path: str
    version: int
    metadata: dict = field(repr=False)
    tensors: tuple[TensorInfo, ...] = field(repr=False)
    data_offset: int = 0  # where the data section starts in the file (aligned)
    file_size: int = 0

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", "llama"))

    def arch_key(self, suffix: str, default=None):
        """`{arch}.{suffix}`, e.g. arch_key("block_count")."""
        return self.metadata.get(f"{self.arch}.{suffix}", default)


def tensor_nbytes(shape: tuple[int, ...], ggml_type: int, name: str = "", path: str = "") -> int:
    try:
        qtype = gguf.GGMLQuantizationType(ggml_type)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise ModelFileError(f"tensor {name} has an unknown ggml type ({ggml_type}) in {path}; "
                             "this llama.cpp/gguf version may be too old for the file")
    n = 1
    for d in shape:
        n *= int(d)
    if shape and shape[0] % block:
        raise ModelFileError(f"tensor {name} rows ({shape[0]}) are not a multiple of its block size "
                             f"({block}) in {path}; the file is corrupt")
    return n // block * size


class _Cursor:
    def __init__(self, buf, path: str, keep_long: bool = False):
        self.buf, self.pos, self.path = buf, 0, path
        self.keep_long = keep_long  # read the next long array in full (a key the caller asked for)

    def take(self, fmt: str):
        try:
            vals = struct.unpack_from("<" + fmt, self.buf, self.pos)
        except struct.error:
            raise ModelFileError(f"GGUF header is truncated ({self.path}); the file is incomplete: "
                                 "download or convert it again")
        self.pos += struct.calcsize("<" + fmt)
        return vals[0] if len(vals) == 1 else vals

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise ModelFileError(f"GGUF header is truncated ({self.path}); the file is incomplete: "
                                 "download or convert it again")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", "replace")
        self.pos += n
        return s

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            sub, n = self.take("I"), self.take("Q")
            if n <= ARRAY_KEEP_MAX or self.keep_long:
                return [self.value(sub) for _ in range(n)]
            if sub in _SCALARS:
                self.pos += n * struct.calcsize(_SCALARS[sub])
            elif sub == _STRING:  # token lists, merges: walk the lengths without decoding
                for _ in range(n):
                    length = self.take("Q")  # (not `pos += take()`: take moves pos first)
                    self.pos += length
            else:
                for _ in range(n):
                    self.value(sub)
            return SkippedArray(sub, n)
        raise ModelFileError(f"GGUF metadata has an unknown value type ({vtype}) in {self.path}; "
                             "the file is corrupt or newer than this gguf version")


def read_header(path: str | os.PathLike, keep: tuple[str, ...] = ()) -> GGUFHeader:
    """Parse a GGUF file's header; the tensor data may be absent (a header-only or sparse file works).

    keep: metadata keys whose long arrays are read in full (e.g. the token list for validation)."""
    p = Path(path)
    if not p.is_file():
        raise ModelFileError(f"model file not found ({p}); check the path")
    with p.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise ModelFileError(f"not a GGUF file ({p}); convert it with `specq convert` first")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            cur = _Cursor(mm, str(p))
            if bytes(mm[:4]) != b"GGUF":
                raise ModelFileError(f"not a GGUF file ({p}); convert it with `specq convert` first")
            cur.pos = 4
            version, n_tensors, n_kv = cur.take("IQQ")
            if version < 2:
                raise ModelFileError(f"GGUF version {version} is too old ({p}); convert the model again")
            meta = {}
            for _ in range(n_kv):
                key = cur.string()
                cur.keep_long = key in keep
                meta[key] = cur.value(cur.take("I"))
                cur.keep_long = False
            tensors = []
            for _ in range(n_tensors):
                name = cur.string()
                n_dims = cur.take("I")
                shape = tuple(cur.take("Q") for _ in range(n_dims))
                ggml_type, offset = cur.take("IQ")
                tensors.append(TensorInfo(name, shape, ggml_type, tensor_nbytes(shape, ggml_type, name, str(p)),
                                          offset))
            align = meta.get("general.alignment", 32)
            align = align if isinstance(align, int) and align > 0 else 32
            data_offset = -(-cur.pos // align) * align
    return GGUFHeader(str(p), version, meta, tuple(tensors), data_offset, size)
