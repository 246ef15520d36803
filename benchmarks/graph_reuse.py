"""What a verify pays when its batch size changes from the last one: llama.cpp rebuilds the graph.

llama.cpp reuses the last decode's compute graph when the new batch has the same shape
(`llama_context::process_ubatch`, `llm_graph_result::can_reuse`); a fixed draft length verifies k+1 tokens every
step and keeps reusing it, auto varies k and rebuilds. This times a b-token decode (logits for every row, removed
again after each pass) in a run of equal sizes against the same size between other sizes, with reuse on and with
LLAMA_GRAPH_REUSE_DISABLE=1 (a child process each), after a 300-token prefix; medians per round.

    python benchmarks/graph_reuse.py --model M.gguf [--threads 2] [--rounds 3] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PATTERNS = {"same 5": ([5] * 30, 5), "5 between 4 and 6": ([4, 5, 6, 5] * 8, 5),
            "same 3": ([3] * 30, 3), "3 between 9s": ([3, 9] * 15, 3)}


def child(model: str, threads: int, rounds: int) -> dict:
    from specq.native.llama.ffi import Context, Model

    ctx = Context(Model(model), n_ctx=4096, n_threads=threads, n_outputs_max=16, name="target")
    ctx.warm_up()
    prefix = 300
    ctx.decode(list(range(100, 100 + prefix)), 0, logits="last")

    def one(n: int) -> float:
        t = time.perf_counter()
        ctx.decode(list(range(500, 500 + n)), prefix, logits="all")
        dt = time.perf_counter() - t
        ctx.seq_rm(prefix)
        return dt

    out: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, (sizes, timed) in PATTERNS.items():
            ts = [one(n) for n in sizes]
            sel = [t for t, n in zip(ts, sizes) if n == timed][2:]
            out.setdefault(name, []).append(round(1e3 * statistics.median(sel), 2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.model, a.threads, a.rounds)))
        return
    command = " ".join(["python", "benchmarks/graph_reuse.py", *sys.argv[1:]])
    doc = {"command": command.replace(os.path.expanduser("~"), "~"), "model": os.path.basename(a.model), "threads": a.threads,
           "unit": "ms per decode, median per round", "results": {}}
    for label, disable in (("reuse on", "0"), ("LLAMA_GRAPH_REUSE_DISABLE=1", "1")):
        env = {**os.environ, "LLAMA_GRAPH_REUSE_DISABLE": disable}
        p = subprocess.run([sys.executable, __file__, "--child", "--model", a.model, "--threads", str(a.threads),
                            "--rounds", str(a.rounds)], env=env, capture_output=True, text=True, check=True)
        doc["results"][label] = json.loads(p.stdout.strip().splitlines()[-1])
    text = json.dumps(doc, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
