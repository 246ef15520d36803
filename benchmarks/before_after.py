"""The same benchmarks from two checkouts of specq, alternating round by round: is a refactor speed-neutral?

Each checkout runs with its own Python (a venv with that checkout installed editable, or any Python that imports
`specq` from it), so each measures its own code, with this checkout's benchmark scripts; rounds alternate
before/after (and the order flips every round) so that load from elsewhere hits both.
Reports each benchmark's specq figure per checkout (medians over rounds) and after ÷ before.

    python benchmarks/before_after.py --before DIR --before-python DIR/.venv/bin/python \\
        --after . --after-python .venv/bin/python --llama-bin <llama.cpp build>/bin --rounds 3 \\
        --json benchmarks/results/before_after-X.json

Benchmarks (short settings, so that a round takes minutes): vs_llamacpp.py (demo pair, draft-max 8, its specq
tok/s and specq ÷ llama.cpp in the same run), drafters.py (auto on the general and copy sets, 2 prompts each,
64 tokens), serve_vs_engine.py (demo pair, one request through serve, no TTFT) and serve_vs_llamaserver.py
(demo pair, 1 and 4 streaming clients, two 96-token requests each: specq serve with the draft and asked for the
target alone, and llama-server plain from --llama-bin, whose ratio normalises each run for load).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(python: str, tree: Path, script: str, args: list[str]) -> dict:
    """One benchmark: this script's own copy of it (the same instrument for both checkouts), run by the
    checkout's Python from the checkout's folder."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "out.json"
        flag = "--out" if script == "drafters.py" else "--json"
        cmd = [python, str(Path(__file__).parent / script), *args, flag, str(out)]
        p = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"{script} failed in {tree} ({p.returncode}): {p.stderr[-2000:]}")
        return json.loads(out.read_text())


def figures(name: str, doc: dict) -> dict[str, float]:
    """The specq numbers a benchmark's document gives (tokens/s), and its own within-run ratio where it has one."""
    if name == "vs_llamacpp":
        s = doc["summary"]
        return {"specq_tok_s": s["specq_tokens_per_s"], "specq_over_llamacpp": s["ratio"]}
    if name == "serve_vs_llamaserver":
        out = {}
        for n, r in doc["ratios"].items():
            med = r["medians"]
            out[f"n{n}_specq_tok_s"] = med["specq"]["total_tokens_per_s"]
            out[f"n{n}_specq_plain_tok_s"] = med["specq plain"]["total_tokens_per_s"]
            out[f"n{n}_specq_over_llamaserver_plain"] = r["vs_plain"]
        return out
    if name == "serve_vs_engine":
        s = doc["summary"]
        return {"serve_tok_s_wall": s["serve_tok_s_wall"], "engine_tok_s": s["engine_tok_s"]}
    out = {}
    for st in doc["sets"]:
        for mode in ("baseline", "model", "auto"):
            if mode in st["median_tokens_per_s"]:
                out[f"{st['set']}_{mode}_tok_s"] = st["median_tokens_per_s"][mode]
        out[f"{st['set']}_auto_over_alone"] = st["vs_target_alone"]["auto"]
    return out


BENCHES = {
    "vs_llamacpp": ("vs_llamacpp.py", lambda a: ["--llama-bin", a.llama_bin, "--repeat", "3",
                                                 f"--llama-args={a.llama_args}"]),
    "drafters": ("drafters.py", lambda a: ["--repeat", "1", "--n-predict", "64", "--limit-prompts", "2",
                                           "--threads", "2"]),
    "serve_vs_engine": ("serve_vs_engine.py", lambda a: ["--pair", "demo", "--repeats", "3", "--n-predict", "128",
                                                         "--ttft-prompts", "500"]),
    "serve_vs_llamaserver": ("serve_vs_llamaserver.py",
                             lambda a: ["--llama-server", str(Path(a.llama_bin) / "llama-server"), "--clients", "1,4",
                                        "--kinds", "specq,specq plain,llama-server plain", "--requests", "2",
                                        "--max-tokens", "96"]),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--before-python", required=True)
    ap.add_argument("--after", type=Path, default=Path("."))
    ap.add_argument("--after-python", default=sys.executable)
    ap.add_argument("--llama-bin", required=True)
    ap.add_argument("--llama-args", default="", help="vs_llamacpp.py's --llama-args (-nr on an AMX Xeon)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default=",".join(BENCHES))
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    trees = {"before": (a.before_python, a.before.resolve()), "after": (a.after_python, a.after.resolve())}
    rows = []
    for r in range(a.rounds):
        order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for name in a.only.split(","):
            script, args = BENCHES[name]
            for which in order:
                python, tree = trees[which]
                got = figures(name, run(python, tree, script, args(a)))
                rows.append({"round": r, "bench": name, "tree": which, **got})
                print(json.dumps(rows[-1]), flush=True)
    summary = {}
    for name in a.only.split(","):
        keys = sorted({k for row in rows if row["bench"] == name for k in row} - {"round", "bench", "tree"})
        for k in keys:
            med = {w: statistics.median(row[k] for row in rows if row["bench"] == name and row["tree"] == w
                                        and row.get(k) is not None) for w in ("before", "after")}
            summary[f"{name}.{k}"] = {**med, "after_over_before": med["after"] / med["before"]}
    print(json.dumps(summary, indent=1))
    if a.json:
        a.json.write_text(json.dumps({"rounds": a.rounds, "summary": summary, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
