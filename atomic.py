"""Atomic file output, shared by the converter (GGUF files) and the pair manifest (convert, `specq tune --write`):
a file appears whole under its name or not at all."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

# half-written outputs, removed by native/llama/abort_guard.py if the process has to end inside C
pending: set[Path] = set()


def temp_path(final: Path) -> Path:
    """A hidden name in the output directory that never ends in .gguf."""
    return final.with_name(f".{final.name}.{os.getpid()}.part")


@contextlib.contextmanager
def atomic_output(final: Path) -> Iterator[Path]:
    """Yield a temporary path; on success it is fsynced and renamed to `final`, on any failure removed."""
    tmp = temp_path(final)
    pending.add(tmp)  # a native abort removes it too (abort_guard)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    finally:
        pending.discard(tmp)
