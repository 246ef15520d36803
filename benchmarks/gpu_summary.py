"""Print a short table from the JSON files benchmarks/gpu_h200.sh leaves in its output folder."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(d: Path, name: str):
    p = d / name
    return json.loads(p.read_text()) if p.is_file() and p.stat().st_size else None


def main(d: Path) -> None:
    doctor, plan, verify = load(d, "doctor.json"), load(d, "plan.json"), load(d, "verify.json")
    if doctor:
        print(f"doctor: {doctor['verdict']}")
    if plan:
        print(f"plan (0.9 of free): fits={plan['fits']} ngl={plan['target']['ngl']} ngl_draft={plan['draft']['ngl']} "
              f"ctx={plan['ctx']} total={plan['total_bytes'] / 2**30:.2f} GiB")
    if verify:
        t = verify["target"]
        print(f"target 1-token pass {t['ms']['1']:.2f} ms; draft {verify['draft']['ms']['1']:.2f} ms; "
              f"c = {verify['c_draft_over_target']}; device bytes for the target: {t['device_bytes_used']}; "
              f"planner estimate: {verify['planner_estimate']}")
        print("verify n tokens / 1 token: " + ", ".join(f"{n}: {r:.2f}" for n, r in t["ratio_to_1"].items()))
        for k, row in verify["by_k"].items():
            print(f"k={k}: v={row['v']:.2f} ideal speed-up by alpha {row['ideal_speedup']}")
    for name in ("bench.json", "bench_self.json"):
        b = load(d, name)
        if b:
            s = b["summary"]
            spec = [r for r in b["runs"] if r["mode"] == "speculative"]
            dv = [(r["draft_ms"], r["verify_ms"], r["n_steps"]) for r in spec]
            print(f"{name}: baseline {s['baseline_tokens_per_s']} tok/s, speculative {s['speculative_tokens_per_s']} "
                  f"tok/s, accept {s['accept_rate']}, identical {s['identical_output']}; "
                  f"(draft ms, verify ms, steps) {dv}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
