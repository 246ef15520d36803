"""The engine driven from the thread that loaded it and from another thread, alternately: why specq serve and the
Python API compute on the loading thread (docs/benchmarks.md, "The engine driven from another thread").

    python benchmarks/off_thread.py --threads 2 --rounds 5 --json benchmarks/results/off_thread-X.json

The demo pair, the target alone (plain decoding) and speculative (draft-max 8), 128 tokens from one prompt; no
OMP_WAIT_POLICY override (as users run it). Each round runs each mode on the loading thread and on a new thread,
in an order that flips every round.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading

from specq.native.commands.demo import demo_pair
from specq.native.core.settings import GenerationSettings
from specq.native.runtime.engine import Engine

PROMPT = "The history of the printing press begins"


def run(eng: Engine, spec: bool, n: int) -> float:
    ses = eng.session()
    g = ses.generate(eng.tokenize(PROMPT), GenerationSettings(n_predict=n, draft_max=8), speculative=spec).run()
    return g.stats.tokens_per_s


def elsewhere(eng: Engine, spec: bool, n: int) -> float:
    out: list[float] = []
    t = threading.Thread(target=lambda: out.append(run(eng, spec, n)))
    t.start()
    t.join()
    return out[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n-predict", type=int, default=128)
    ap.add_argument("--json")
    a = ap.parse_args()
    target, draft = demo_pair()
    rows = []
    with Engine(target, draft, ctx=1024, threads=a.threads) as eng:
        run(eng, True, 16)  # warm both paths once
        for r in range(a.rounds):
            for spec in (False, True):
                order = ("loader", "other") if r % 2 == 0 else ("other", "loader")
                for where in order:
                    tps = run(eng, spec, a.n_predict) if where == "loader" else elsewhere(eng, spec, a.n_predict)
                    rows.append({"round": r, "mode": "speculative" if spec else "plain", "thread": where,
                                 "tokens_per_s": tps})
                    print(json.dumps(rows[-1]), flush=True)
    summary = {}
    for mode in ("plain", "speculative"):
        med = {w: statistics.median(x["tokens_per_s"] for x in rows if x["mode"] == mode and x["thread"] == w)
               for w in ("loader", "other")}
        summary[mode] = {**med, "other_over_loader": med["other"] / med["loader"]}
    doc = {"machine": platform.processor() or platform.machine(), "threads": a.threads, "n_predict": a.n_predict,
           "rounds": a.rounds, "runs": rows, "summary": summary}
    print(json.dumps(summary, indent=2))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
