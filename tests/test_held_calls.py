"""llama.cpp's quick calls keep the GIL (native/llama/held.py): between two decodes the engine's thread does not
hand the GIL to a waiting thread (specq serve's HTTP loop) at every call."""

from __future__ import annotations

import sys
import threading

import llama_cpp.llama_cpp as C

from specq.native.core.engine import Engine
from specq.native.llama import held


def handovers(call, n_calls: int = 500, trials: int = 3) -> int:
    """The fewest times, over `trials`, that a busy thread ran while `call` was made n_calls times."""
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
            seen.append(count[0] - c0)
        return min(seen)
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)


def test_the_engines_quick_calls_keep_the_gil_where_ctypes_would_release_it(tiny_target):
    with Engine(tiny_target, ctx=64, threads=1) as e:
        ctx, model = e.tgt_ctx, e.target
        ctx.decode(e.tokenize("hello there"), 0, logits="last")
        mem = C.llama_get_memory(ctx.handle)
        assert handovers(lambda: C.llama_memory_seq_pos_max(mem, 0)) > 0  # the check can see a handover
        assert handovers(lambda: held.llama_memory_seq_pos_max(mem, 0)) == 0
        for call in (lambda: ctx.pos_max(), lambda: ctx.pos_min(), lambda: ctx.logits(1), lambda: ctx.seq_rm(5),
                     lambda: model.is_eog(3)):
            assert handovers(call) == 0
