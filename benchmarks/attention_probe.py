"""What `--flash-attn auto` measures with a KV stream per sequence on the CPU (runtime/attention.py), run fresh: for
each pair and N, an Engine opened as `specq serve --parallel N --ctx C` opens it, with an empty cache folder so
that the probe runs; reported: the probe's step times each way at both depths, its choice and how long opening the
engine took with the probe (against a second open that finds the answer cached).

    python benchmarks/attention_probe.py [--pairs deep,demo] [--parallel 4,8] [--ctx 2048] [--threads 2] \
        [--json benchmarks/results/attention_probe-epyc2.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from deep_pair import pair  # noqa: E402
from specq.machine import cpu_name  # noqa: E402
from specq.native.runtime import attention  # noqa: E402
from specq.native.runtime.engine import Engine  # noqa: E402


def opened(target: Path, ctx: int, threads: int, n: int) -> tuple[float, attention.AttentionProbe | None]:
    t0 = time.perf_counter()
    with Engine(target, ctx=ctx, threads=threads, parallel=n) as e:
        return time.perf_counter() - t0, e.attention_probe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", default="deep,demo")
    ap.add_argument("--parallel", default="4,8")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["SPECQ_CACHE_DIR"] = tmp
        for name in a.pairs.split(","):
            target, _ = pair(name)
            for n in [int(x) for x in a.parallel.split(",")]:
                probed_s, probe = opened(target, a.ctx, a.threads, n)
                cached_s, again = opened(target, a.ctx, a.threads, n)
                rows.append({"pair": name, "target": target.name, "parallel": n, "open_with_probe_s": probed_s,
                             "open_cached_s": cached_s, "probe": dataclasses.asdict(probe),
                             "cached_choice": again.choice})
                print(f"{name} N={n}: {probe.describe(n)}; open {probed_s:.1f} s, cached {cached_s:.1f} s",
                      file=sys.stderr, flush=True)
    doc = {"settings": {k: v for k, v in vars(a).items() if k != "json"}, "depths": attention.PROBE_DEPTHS,
           "steps": attention.PROBE_STEPS, "gain": attention.PROBE_GAIN, "machine": platform.machine(),
           "cpu": cpu_name(), "cpus": os.cpu_count(), "rows": rows}
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
