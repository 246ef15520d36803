"""llama.cpp's quick calls keep the GIL (native/llama/held.py): between two decodes the engine's thread does not
hand the GIL to a waiting thread (specq serve's HTTP loop) at every call."""

from __future__ import annotations

import sys
import threading

import llama_cpp.llama_cpp as C

from specq.native.runtime.engine import Engine
from specq.native.llama import held


def handovers(call, n_calls: int = 500, trials: int = 3, first: bool = False) -> int:
    """The fewest times, over `trials`, that a busy thread ran while `call` was made n_calls times; `first`: 1 as
    soon as one call let it run (up to trials × n_calls calls), else 0."""
    count, stop = [0], threading.Event()

    def busy():
        while not stop.is_set():
            count[0] += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(0.05)  # the busy thread gets the GIL only when this one lets go of it
    t = threading.Thread(target=busy)
    t.start()
    try:
        seen = []
        for _ in range(trials):
            c0 = count[0]
            for _ in range(n_calls):
                call()
                if first and count[0] != c0:
                    return 1
            seen.append(count[0] - c0)
        return 0 if first else min(seen)
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)


def test_the_engines_quick_calls_keep_the_gil_where_ctypes_would_release_it(tiny_target):
    with Engine(tiny_target, ctx=64, threads=1) as e:
        ctx, model = e.tgt_ctx, e.target
        ctx.decode(e.tokenize("hello there"), 0, logits="last")
        mem = C.llama_get_memory(ctx.handle)
        # the check can see a handover: a released GIL is taken only when the waiting thread wakes in time, which
        # on a loaded machine may take many calls
        assert handovers(lambda: C.llama_memory_seq_pos_max(mem, 0), n_calls=2000, trials=50, first=True) > 0
        assert handovers(lambda: held.llama_memory_seq_pos_max(mem, 0)) == 0
        for call in (lambda: ctx.pos_max(), lambda: ctx.pos_min(), lambda: ctx.logits(1), lambda: ctx.seq_rm(5),
                     lambda: model.is_eog(3)):
            assert handovers(call) == 0
