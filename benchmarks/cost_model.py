"""Does bench's cost model explain the measurement? Measured vs predicted vs ideal speed-up on three pairs.

For each pair, one `specq bench` sweep (baseline and draft-max 2, 4, 8, auto, alternating, `--repeat` times,
the built-in `code` and `summary` prompts as chat turns) through bench's own loop; per point: the measured speed-up (median tokens/s ÷ median baseline tokens/s), the
predicted one (native/control/report.py: the adaptive controller's model on the run's measured per-position acceptance,
draft costs, verify cost by batch size and overhead) and the ideal one (a verify as cheap as one token).

Pairs (all from the demo model, nothing downloaded):
  demo:    SmolLM2-135M-Instruct F32 target + its Q4_1 draft
  useless: the same target + its first 2 layers as draft (~0% acceptance)
  deep:    benchmarks/deep_pair.py's 120-layer F16 target + the Q4_1 draft

    python benchmarks/cost_model.py [--pairs demo,useless,deep] [--repeat 3] [--n-predict 128] [--threads 2]
        [--out benchmarks/results/cost_model-NAME.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from adaptive import file_names_only, first_layers, machine
from deep_pair import deep_pair
from specq.native.commands.bench import BenchConfig, load_prompt_set, run_bench
from specq.native.commands.demo import cache_dir, demo_pair
from specq.native.commands.placement import default_ngl
from specq.native.runtime.config import EngineConfig
from specq.native.core.settings import GenerationSettings

POINTS = (2, 4, 8, "auto")
PROMPTS = ("code", "summary")  # from the built-in set, as chat turns: answers that run past --n-predict


def pairs() -> dict:
    target, draft = demo_pair()
    return {
        "demo": lambda: (target, draft),
        "useless": lambda: (target, first_layers(target, cache_dir() / "SmolLM2-135M-first2.F32.gguf", 2)),
        "deep": lambda: deep_pair(90, 0.02),
    }


def run_pair(name: str, target: Path, draft: Path, n_predict: int, repeat: int, threads: int | None) -> dict:
    names, texts = load_prompt_set("default")
    chosen = [i for i, n in enumerate(names) if n in PROMPTS]
    engine = EngineConfig(str(target), str(draft), threads=threads, ngl=default_ngl(), ngl_draft=default_ngl())
    cfg = BenchConfig(engine=engine, prompts=tuple(texts[i] for i in chosen),
                      prompt_names=tuple(names[i] for i in chosen), chat=True,
                      settings=GenerationSettings(n_predict=n_predict), repeat=repeat,
                      sweep=tuple((k, 0.0) for k in POINTS))

    def progress(run: dict) -> None:
        label = "baseline" if run["mode"] == "baseline" else str(run["draft_max"])
        print(f"{name:8s} rep {run['repeat']} {run['prompt_name']:8s} {label:8s} {run['tokens_per_s']:6.1f} tok/s "
              f"({run['n_generated']} tokens)", file=sys.stderr, flush=True)

    doc = run_bench(cfg, on_run=progress)
    file_names_only(doc)
    rows = []
    for pt in doc["sweep"]:
        s = pt["summary"]
        rows.append({"draft_max": pt["draft_max"], "measured": s["speedup"], "predicted": s["predicted_speedup"],
                     "ideal": s["ideal_speedup"], "alpha": s["alpha"], "alpha_per_pos": s["alpha_per_pos"],
                     "draft_first_ms": s["draft_first_ms"], "draft_next_ms": s["draft_next_ms"],
                     "verify_ms_by_size": s["verify_ms_by_size"], "baseline_tokens_per_s": s["baseline_tokens_per_s"],
                     "speculative_tokens_per_s": s["speculative_tokens_per_s"],
                     "predicted_error": (s["predicted_speedup"] / s["speedup"] - 1)
                     if s["predicted_speedup"] and s["speedup"] else None,
                     "identical_output": s["identical_output"]})
    return {"pair": name, "target": Path(target).name, "draft": Path(draft).name, "points": rows, "bench": doc}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", default="demo,useless,deep")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--n-predict", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    known = pairs()
    doc = {"machine": machine(), "command": "python benchmarks/cost_model.py " + " ".join(sys.argv[1:]),
           "results": []}
    lines = ["| pair | draft-max | measured | predicted | ideal | predicted error |", "|---|---|---|---|---|---|"]
    for name in a.pairs.split(","):
        res = run_pair(name, *known[name](), a.n_predict, a.repeat, a.threads)
        doc["results"].append(res)
        for p in res["points"]:
            err = f"{100 * p['predicted_error']:+.1f}%" if p["predicted_error"] is not None else "—"
            fmt = lambda v: f"{v:.2f}×" if v is not None else "—"  # noqa: E731
            lines.append(f"| {name} | {p['draft_max']} | {fmt(p['measured'])} | {fmt(p['predicted'])} | "
                         f"{fmt(p['ideal'])} | {err} |")
        print("\n".join(lines[-len(res["points"]):]), file=sys.stderr, flush=True)
    if a.out:
        a.out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
