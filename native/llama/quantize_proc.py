"""llama.cpp's quantizer in a child process, so that Ctrl-C ends it at once.

`llama_model_quantize` is one C call that can run for minutes; in-process, a Ctrl-C would land only when it
returns (and the log callback swallows it). The child runs in its own session, reports progress as
"i n" lines on stdout, and is killed when the parent is interrupted; the caller removes its output.
Run as `python -m specq.native.llama.quantize_proc SRC DST FTYPE THREADS VERBOSE`.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from typing import Callable

from ...errors import LlamaCallError, SpecqError


def quantize_in_child(src: str | os.PathLike, dst: str | os.PathLike, ftype: int, n_threads: int = 0,
                      on_tensor: Callable[[int, int], None] | None = None) -> None:
    """quantize() in a child process; KeyboardInterrupt kills it (the caller removes `dst`)."""
    verbose = logging.getLogger("specq.llama").isEnabledFor(logging.DEBUG)
    cmd = [sys.executable, "-m", __name__, str(src), str(dst), str(int(ftype)), str(int(n_threads)), str(int(verbose))]
    # stderr into a file, not a pipe: a chatty child must never block on a pipe nobody reads yet
    with tempfile.TemporaryFile("w+") as errf:
        # its own session: the terminal's Ctrl-C goes to us only, and we decide when the child ends
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None if verbose else errf,
                                 stdin=subprocess.DEVNULL, start_new_session=True, text=True)
        try:
            for line in child.stdout:
                parts = line.split()
                if on_tensor is not None and len(parts) == 2 and all(p.isdigit() for p in parts):
                    on_tensor(int(parts[0]), int(parts[1]))
            rc = child.wait()
        except BaseException:
            child.kill()
            child.wait()
            raise
        finally:
            child.stdout.close()
        errf.seek(0)
        err = errf.read()
    if rc != 0:
        lines = [ln for ln in err.splitlines() if ln.strip()]
        if lines:  # the child's own one-line message (an abort's line already carries the prefix)
            raise SpecqError(lines[-1].removeprefix("specq: error: "))
        raise LlamaCallError("llama_model_quantize", rc, f"{src} -> {dst} (the quantizer process ended)")


def _child(argv: list[str]) -> int:
    src, dst, ftype, threads, verbose = argv
    logging.basicConfig(stream=sys.stderr, format="%(name)s: %(message)s")
    logging.getLogger("specq.llama").setLevel(logging.DEBUG if verbose == "1" else logging.CRITICAL + 1)
    from . import ffi as _ffi

    def progress(i: int, n: int) -> None:
        print(i, n, flush=True)

    try:
        _ffi.quantize_with_progress(src, dst, int(ftype), n_threads=int(threads), on_tensor=progress)
    except Exception as e:  # the parent turns this line into its own error
        print(f"{e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
