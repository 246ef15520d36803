"""The attention path with several sequences (`--parallel N` on the CPU) in one unified cache, or with
`--layout streams` a stream per sequence (the CPU's served layout since config.kv_streams): flash attention off
against on, for one target decode of N sequences × r rows after P cached tokens each (a plain step: r = 1; a
verify of 3 drafted tokens: r = 4). Two contexts, one per path, timed in turn (medians of 7 after a warm-up).

Why one cache differs from one sequence: the plain kernel attends each row to every cell of the unified cache and
masks the other sequences' cells, where the CPU's flash kernel skips masked cells (config.choose_flash_attn); with
a stream each, each row attends its own stream, as one sequence does.

    python benchmarks/parallel_attention.py [--pair demo|deep] [--threads 1] [--parallel 1,2,3,4,8] \
        [--depths 200,1000,2000] [--layout unified|streams] [--json benchmarks/results/parallel_attention-demo.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from deep_pair import pair  # noqa: E402
from specq.native.runtime import engine as _engine  # noqa: E402
from specq.native.runtime.engine import Engine  # noqa: E402


def measure(target: Path, threads: int, n: int, depths: list[int], repeat: int) -> list[dict]:
    engines = {fa: Engine(target, None, ctx=max(depths) + 64, threads=threads, parallel=n, flash_attn=fa)
               for fa in ("off", "on")}
    rng = np.random.default_rng(0)
    rows_out = []
    try:
        for p in depths:
            for e in engines.values():
                e.tgt_ctx.clear()
                for s in range(n):
                    e.tgt_ctx.decode(rng.integers(300, e.tgt_ctx.n_vocab - 1, p).tolist(), 0, logits="none", seq=s)
            for r in (1, 4):
                ts: dict[str, list[float]] = {fa: [] for fa in engines}
                for _ in range(repeat + 1):
                    for fa, e in engines.items():
                        ctx = e.tgt_ctx
                        t0 = time.perf_counter()
                        ctx.decode_seqs([(s, rng.integers(300, ctx.n_vocab - 1, r).tolist(), p, "all")
                                         for s in range(n)])
                        ctx.logits(r, seq=n - 1)
                        ts[fa].append(time.perf_counter() - t0)
                        for s in range(n):
                            ctx.seq_rm(p, -1, seq=s)
                ms = {fa: 1e3 * statistics.median(v[1:]) for fa, v in ts.items()}
                rows_out.append({"layout": "unified" if e.tgt_ctx.unified else "streams", "parallel": n, "depth": p,
                                 "rows_per_seq": r, "off_ms": ms["off"], "on_ms": ms["on"],
                                 "on_over_off": ms["on"] / ms["off"]})
                print(f"N={n} depth {p} rows {n}x{r}: off {ms['off']:.1f} ms, on {ms['on']:.1f} ms "
                      f"(on/off {ms['on'] / ms['off']:.2f})", file=sys.stderr, flush=True)
    finally:
        for e in engines.values():
            e.close()
    return rows_out


def arguments(doc: str, threads: int, parallel: str, depths: str) -> argparse.Namespace:
    """The options of this script and of kv_layout.py (one decode of N sequences at P tokens each)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--pair", choices=("demo", "deep"), default="demo")
    ap.add_argument("--threads", type=int, default=threads)
    ap.add_argument("--parallel", default=parallel)
    ap.add_argument("--depths", default=depths)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--layout", choices=("unified", "streams"), default="unified",
                    help="the target's KV layout with several sequences (parallel_attention.py only)")
    ap.add_argument("--json")
    return ap.parse_args()


def start(doc: str, threads: int, parallel: str, depths: str) -> tuple[argparse.Namespace, Path, tuple]:
    """The options (arguments), the pair's target and the load before the run, for this script and its kin."""
    a = arguments(doc, threads, parallel, depths)
    target, _ = pair(a.pair)
    return a, target, os.getloadavg()


def write(a: argparse.Namespace, target: Path, load0: tuple, rows: list[dict]) -> None:
    """The run's JSON (settings, machine, load before and after, every row) to --json, where given."""
    doc = {"pair": a.pair, "target": target.name, "settings": {k: v for k, v in vars(a).items() if k != "json"},
           "machine": platform.machine(), "cpus": os.cpu_count(), "load_before": load0,
           "load_after": os.getloadavg(), "rows": rows}
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")


def main() -> None:
    a, target, load0 = start(__doc__, 1, "1,2,3,4,8", "200,1000,2000")
    _engine.kv_streams = lambda parallel, cpu, plain_cache: a.layout == "streams" and parallel > 1
    rows = []
    for n in [int(x) for x in a.parallel.split(",")]:
        rows += measure(target, a.threads, n, [int(x) for x in a.depths.split(",")], a.repeat)
    write(a, target, load0, rows)


if __name__ == "__main__":
    main()
