"""Facts about this machine and user that every layer may read: specq's cache folder and the physical core count.
Imports nothing of specq's, so that the root's modules, the converter, the engine and the CLI all reach it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """specq's cache folder: $SPECQ_CACHE_DIR, else $XDG_CACHE_HOME/specq, else ~/.cache/specq."""
    if os.environ.get("SPECQ_CACHE_DIR"):
        return Path(os.environ["SPECQ_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specq"


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else the machine's architecture."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


def physical_cores() -> int:
    """Physical CPU cores (llama.cpp's own default), falling back to the logical count."""
    try:
        cores = set()
        phys = core = None
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("physical id"):
                    phys = line.split(":")[1].strip()
                elif line.startswith("core id"):
                    core = line.split(":")[1].strip()
                elif not line.strip():
                    if core is not None:
                        cores.add((phys, core))
                    phys = core = None
        if cores:
            return len(cores)
    except OSError:
        pass
    return os.cpu_count() or 1
