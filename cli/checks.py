"""Checks the commands make before any work starts: output paths, finite numbers, the pair's two files.

A long benchmark must not run to the end only to fail on a bad --csv path; a NaN temperature must not be
accepted; a swapped or doubled pair gets one loud warning with the fix.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from pathlib import Path

from ..errors import UsageError

_TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.\d+\.(tmp|part)$")  # atomic writers' hidden temporary files


def user_path(filename) -> str:
    """The path a user asked for, where an OS error names one of our hidden temporary files instead."""
    if not filename:
        return ""
    p = Path(os.fsdecode(filename))
    m = _TEMP_NAME.match(p.name)
    return str(p.with_name(m.group("name"))) if m else str(p)


def check_output_path(flag: str, value: str | os.PathLike | None) -> None:
    """Refuse (exit 2) an output path that cannot be written, before the work that fills it."""
    if value is None or str(value) == "-":
        return
    p = Path(value).expanduser()
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise UsageError(f"{flag} is a folder ({p}); give a file path like {p / 'results'}")
    if not parent.is_dir():
        raise UsageError(f"{flag} folder not found ({parent}); create it first or pick another {flag} path")
    if not _can_create_in(parent) or (p.exists() and not os.access(p, os.W_OK)):
        raise UsageError(f"{flag} is not writable ({p}); check the permissions or pick another path")


def _can_create_in(folder: Path) -> bool:
    """Create and remove a probe file: permission bits say nothing for root or on special file systems."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".specq-probe-"):
            return True
    except OSError:
        return False


def check_finite(**flags: float | None) -> None:
    """NaN and infinity are no temperature or probability: exit 2 naming the flag."""
    for name, value in flags.items():
        if value is not None and not math.isfinite(value):
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} must be a finite number ({value}); e.g. {flag} 0.8")


def _n_params(path: Path) -> int | None:
    """Weights in a GGUF, from its tensor table; None when it cannot be read (the loader says why later)."""
    from ..errors import SpecqError
    from ..native.llama.gguf_header import read_header

    try:
        return sum(math.prod(t.shape) for t in read_header(path).tensors)
    except (SpecqError, OSError, ValueError):
        return None


def pair_warning(target: Path | None, draft: Path | None) -> str | None:
    """The same file as target and draft, or a draft larger than its target: it runs, but say how to fix it."""
    if target is None or draft is None:
        return None
    t_n, d_n = _n_params(Path(target)), _n_params(Path(draft))
    if t_n is None or d_n is None:
        return None
    if Path(target).resolve() == Path(draft).resolve():
        return (f"the draft is the target itself ({draft}); drafting cannot beat the target alone: pass a smaller "
                "model of the same family as --draft, or omit --draft")
    if d_n > t_n:
        return (f"the draft has more weights than the target ({draft}: {d_n / 1e6:.1f}M, {target}: "
                f"{t_n / 1e6:.1f}M); are they swapped? pass the large model as --target, the small one as --draft")
    return None
