"""The last line of defence against native aborts: ggml's abort callback prints one specq error line.

A GGML_ASSERT that Python-side checks did not foresee ends the process inside C. ggml calls this callback
with its message just before abort(); we print one `specq: error:` line, remove the half-written output
files (`atomic.pending`), and end the process with exit code 1 (instead of SIGABRT, a backtrace and a
debugger dump).
"""

from __future__ import annotations

import ctypes
import os

from ...atomic import pending

EXIT_CODE = 1
_installed = None  # keeps the ctypes callback alive for the life of the process

_ABORT_CB = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_explainers: list = []  # message → a better line or None (native/commands/rpc.py names a lost server)


def add_explainer(fn) -> None:
    """fn(message) → the whole line to show for aborts it recognises, else None."""
    if fn not in _explainers:
        _explainers.append(fn)


def abort_line(message: bytes | None) -> str:
    """The one line shown for a native abort (ggml's message is `file:line: text`)."""
    text = (message or b"").decode("utf-8", "replace").strip().replace("\n", " ")
    for explain in _explainers:
        try:
            line = explain(text)
        except Exception:  # never let a helper turn one line into a traceback inside abort()
            line = None
        if line:
            return line
    where, sep, rest = text.partition(": ")
    text = os.path.basename(where) + sep + rest  # the build folder's path says nothing to a user
    return (f"specq: error: llama.cpp aborted ({text}); the input triggered a check specq does not make yet: "
            "run with -v and report it\n")


def _on_abort(message: bytes | None) -> None:
    try:
        os.write(2, abort_line(message).encode("utf-8", "replace"))
        for p in list(pending):
            try:
                p.unlink()
            except OSError:
                pass
    finally:
        os._exit(EXIT_CODE)  # never return into abort(): that would dump a backtrace


def install() -> None:
    """Register the callback with ggml once per process (needs llama_cpp's libggml)."""
    global _installed
    if _installed is not None:
        return
    from llama_cpp._ggml import libggml

    fn = getattr(libggml, "ggml_set_abort_callback", None)
    if fn is None:  # an older ggml: aborts stay native
        return
    fn.argtypes, fn.restype = [_ABORT_CB], ctypes.c_void_p
    _installed = _ABORT_CB(_on_abort)
    fn(_installed)
