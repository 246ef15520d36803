"""Atomic file output, every writer's (GGUF files, the pair manifest, bench JSON/CSV/plots, chat transcripts, the
demo target): a file appears whole under its name or not at all."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

from .errors import UsageError

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


def write_text(final: Path, text: str, what: str = "path") -> Path:
    """Write `text` to `final` atomically (atomic_output). A missing folder is one UsageError naming it and
    `what` chose the path (e.g. "--json path")."""
    final = Path(final)
    if not final.parent.is_dir():
        raise UsageError(f"folder not found ({final.parent}); create it first or pick another {what}")
    with atomic_output(final) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return final
