"""The KV layout of `--parallel N` on the CPU: specq's one unified cache (kv_unified, every sequence's cells in one
stream) against llama-server's default of one stream per sequence (`-np N` without `--kv-unified`), for one
target decode of N sequences after P cached tokens each, flash attention on in both (as both servers run it at
N ≥ 2 on the CPU). Row patterns: a plain step (1 row each), an equal verify (r rows each) and a mixed one (the
first sequence 5 rows, the others 1: separate streams split it into equal-length ubatches, one graph each).
Two contexts, timed in turn, medians after a warm-up.

    python benchmarks/kv_layout.py [--pair demo|deep] [--threads 2] [--parallel 4,8] [--depths 200,1000] \
        [--json benchmarks/results/kv_layout-deep-cpu2.json]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from parallel_attention import start, write  # noqa: E402
from specq.native.llama import ffi  # noqa: E402

PATTERNS = {"plain": lambda n: [1] * n, "verify 3": lambda n: [3] * n, "mixed 5+1": lambda n: [5] + [1] * (n - 1)}


def measure(model: ffi.Model, threads: int, n: int, depth: int, repeat: int) -> list[dict]:
    ctxs = {k: ffi.Context(model, 2048, threads, n_seq=n, flash_attn="on", unified=k == "unified")
            for k in ("unified", "streams")}
    rng = np.random.default_rng(0)
    out = []
    try:
        for c in ctxs.values():
            for s in range(n):
                c.decode(rng.integers(300, c.n_vocab - 1, depth).tolist(), 0, logits="none", seq=s)
        for name, rows in PATTERNS.items():
            ts: dict[str, list[float]] = {k: [] for k in ctxs}
            for _ in range(repeat + 1):
                for k, c in ctxs.items():
                    parts = [(s, rng.integers(300, c.n_vocab - 1, r).tolist(), depth, "all")
                             for s, r in enumerate(rows(n))]
                    t0 = time.perf_counter()
                    c.decode_seqs(parts)
                    ts[k].append(time.perf_counter() - t0)
                    for s in range(n):
                        c.seq_rm(depth, -1, seq=s)
            ms = {k: 1e3 * statistics.median(v[1:]) for k, v in ts.items()}
            out.append({"parallel": n, "depth": depth, "rows": name, "unified_ms": ms["unified"],
                        "streams_ms": ms["streams"], "unified_over_streams": ms["unified"] / ms["streams"]})
            print(f"N={n} depth {depth} {name}: unified {ms['unified']:.1f} ms, streams {ms['streams']:.1f} ms "
                  f"({ms['unified'] / ms['streams']:.2f}x)", file=sys.stderr, flush=True)
    finally:
        for c in ctxs.values():
            c.close()
    return out


def main() -> None:
    a, target, load0 = start(__doc__, 2, "4,8", "200,1000")
    model = ffi.Model(target)
    rows = []
    for n in [int(x) for x in a.parallel.split(",")]:
        for p in [int(x) for x in a.depths.split(",")]:
            rows += measure(model, a.threads, n, p, a.repeat)
    write(a, target, load0, rows)


if __name__ == "__main__":
    main()
