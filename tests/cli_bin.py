"""Where the tests find the installed CLI: beside the interpreter running them, never a fixed path."""

from __future__ import annotations

import os
import sys
from pathlib import Path

BIN_DIR = Path(sys.executable).parent  # the venv's bin/ (not resolved: a venv's python is a symlink)
SPECQ = str(BIN_DIR / ("specq.exe" if os.name == "nt" else "specq"))
