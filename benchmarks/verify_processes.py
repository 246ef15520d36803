"""The target's verify costs in fresh processes: V(1), V(2) and V(9) after a 100-token prefix, each process
loading the model anew (a server's start), medians of 5 alternating passes a size over `--windows` windows. On a
2-core cloud EPYC the cost of a batched pass was one of two levels per process, which flips --drafter auto's
choice on a pair where drafting is marginal (docs/benchmarks.md, "Why auto sometimes decodes plain at N = 1").

    python benchmarks/verify_processes.py [--pair deep|demo] [--processes 6] [--windows 2] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

SIZES = (1, 2, 9)
PREFIX = 100


def one_process(pair_name: str, windows: int, threads: int) -> list[dict[str, float]]:
    """This process: the target loaded, warmed up, then `windows` windows of alternating passes."""
    import numpy as np

    from deep_pair import pair
    from specq.native.llama import ffi

    target, _ = pair(pair_name)
    model = ffi.Model(target)
    ctx = ffi.Context(model, 2048, threads, n_batch=64, n_outputs_max=16)
    ctx.warm_up()
    rng = np.random.default_rng(0)
    ctx.decode(rng.integers(300, 40000, PREFIX).tolist(), 0, logits="none")

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        ctx.decode(rng.integers(300, 40000, n).tolist(), PREFIX, logits="all")
        ctx.logits(n)
        dt = time.perf_counter() - t0
        ctx.seq_rm(PREFIX, -1)
        return dt * 1e3

    out = []
    for _ in range(windows):
        got: dict[int, list[float]] = {n: [] for n in SIZES}
        for _ in range(5):
            for n in SIZES:
                got[n].append(timed(n))
        out.append({f"v{n}_ms": statistics.median(v) for n, v in got.items()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", choices=("demo", "deep"), default="deep")
    ap.add_argument("--processes", type=int, default=6)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(one_process(a.pair, a.windows, a.threads)))
        return
    rows = []
    for i in range(a.processes):
        p = subprocess.run([sys.executable, __file__, "--child", "--pair", a.pair, "--windows", str(a.windows),
                            "--threads", str(a.threads)], capture_output=True, text=True, check=True)
        windows = json.loads(p.stdout.strip().splitlines()[-1])
        last = windows[-1]
        rows.append({"process": i, "windows": windows, "v2_over_v1": last["v2_ms"] / last["v1_ms"],
                     "v9_over_v1": last["v9_ms"] / last["v1_ms"]})
        print(f"process {i}: " + ", ".join(f"{k} {v:.1f}" for k, v in last.items())
              + f"; V(2)/V(1) {rows[-1]['v2_over_v1']:.2f}, V(9)/V(1) {rows[-1]['v9_over_v1']:.2f}",
              file=sys.stderr, flush=True)
    if a.json:
        from specq.machine import cpu_name

        Path(a.json).write_text(json.dumps({"settings": {k: v for k, v in vars(a).items() if k not in ("json", "child")},
                                            "cpu": cpu_name(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
