"""What a served plain step costs under each setting that specq and llama-server may choose differently on the CPU:
one target decode of N sequences, one row each, after D cached tokens each, a KV stream per sequence (both servers'
layout with N sequences on the CPU), with flash attention off (specq's choice there) or on (llama-server's `-fa
auto`), and the weights in specq's CPU buffers or in llama.cpp's own (`--cpu-amx`: llama.cpp's extra buffers,
as llama-server loads them). The four contexts step in turn; medians after two warm-up steps.

    python benchmarks/step_settings.py [--pair deep] [--parallel 4] [--depth 250] [--steps 24] [--threads 2] \
        [--json benchmarks/results/step_settings-deep4-xeon2.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from deep_pair import pair  # noqa: E402
from specq.native.llama import ffi  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", choices=("demo", "deep"), default="deep")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--depth", type=int, default=250)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    target, _ = pair(a.pair)
    n = a.parallel
    models = {"specq buffers": ffi.Model(target), "llama.cpp buffers": ffi.Model(target, cpu_amx=True)}
    ctxs = {}
    rng = np.random.default_rng(0)
    for name, model in models.items():
        for fa in ("off", "on"):
            c = ffi.Context(model, (a.depth + a.steps + 8) * n, a.threads, n_seq=n, flash_attn=fa, unified=False)
            for s in range(n):
                c.decode(rng.integers(300, c.n_vocab - 1, a.depth).tolist(), 0, logits="none", seq=s)
            ctxs[f"{name}, flash attention {fa}"] = c
    ms: dict[str, list[float]] = {k: [] for k in ctxs}
    for step in range(a.steps + 2):
        for key, c in ctxs.items():
            t0 = time.perf_counter()
            c.decode_seqs([(s, [500 + step], a.depth + step, "last") for s in range(n)])
            if step >= 2:
                ms[key].append((time.perf_counter() - t0) * 1e3)
    doc = {"machine": {"cpu": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                                    if ln.startswith("model name")), "?"), "python": platform.python_version()},
           "command": " ".join(["python", "benchmarks/step_settings.py", *sys.argv[1:]]), "target": target.name,
           "parallel": n, "depth": a.depth, "median_step_ms": {k: statistics.median(v) for k, v in ms.items()},
           "step_ms": ms}
    print(json.dumps(doc["median_step_ms"], indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
