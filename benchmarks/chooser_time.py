"""The drafter chooser's time per step under --drafter auto in a batch (runtime/batch.py), with no profiler: N
greedy generations of 96 tokens stepped together in process, each sequence's Generation._choose_draft timed
(its chooser's choice, priced every step whatever the batch's planner then does with it). Compare two checkouts
by running it with each on PYTHONPATH.

    python benchmarks/chooser_time.py [--pair demo|deep] [--parallel 8] [--rounds 3] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from deep_pair import pair  # noqa: E402
from serve_load import load_prompts  # noqa: E402
from specq.native.core.settings import GenerationSettings  # noqa: E402
from specq.native.runtime import generation  # noqa: E402
from specq.native.runtime.batch import Batch  # noqa: E402
from specq.native.runtime.engine import Engine  # noqa: E402

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", choices=("demo", "deep"), default="demo")
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--label", default="", help="which checkout this is (before/after), for the JSON")
    ap.add_argument("--json")
    a = ap.parse_args()
    spent = [0.0, 0]
    choose = generation.Generation._choose_draft

    def timed(self, remaining):
        t0 = time.perf_counter()
        out = choose(self, remaining)
        spent[0] += time.perf_counter() - t0
        spent[1] += 1
        return out

    generation.Generation._choose_draft = timed
    target, draft = pair(a.pair)
    texts = load_prompts()
    rows = []
    with Engine(target, draft, ctx=2048, threads=a.threads, parallel=a.parallel) as e:
        prompts = [e.tokenize(f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n") for t in texts]  # ChatML
        planner = Batch().planner  # kept across rounds, as a server keeps it
        for r in range(a.rounds):
            batch, gens = Batch(planner), []
            for i in range(a.parallel):
                ses = e.session(i)
                ses.reset()
                s = GenerationSettings(n_predict=96, draft_max="auto", drafter="auto")
                gens.append(ses.generate(prompts[(i + r * a.parallel) % len(prompts)], s))
            spent[:] = [0.0, 0]
            t0 = time.perf_counter()
            batch.add_all(gens)
            batch.run()
            rows.append({"round": r, "wall_s": time.perf_counter() - t0, "choose_s": spent[0], "calls": spent[1],
                         "us_per_call": 1e6 * spent[0] / max(spent[1], 1), "steps": batch.n_steps})
            print(rows[-1], file=sys.stderr, flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"settings": vars(a), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
