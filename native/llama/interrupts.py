"""Ctrl-C around C calls that call back into Python.

While llama.cpp runs it calls our log callback; a KeyboardInterrupt raised inside a ctypes callback is
printed as "Exception ignored" and lost, so the work would go on. Around such calls the SIGINT handler
only records the interrupt, and it is raised once the C call has returned.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator


@contextlib.contextmanager
def deferred_sigint() -> Iterator[None]:
    """Hold Ctrl-C during the block, then raise KeyboardInterrupt if one came (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    hit = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: hit.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
    if hit:
        raise KeyboardInterrupt
