"""Time to the first token in process, the target alone: the engine's prompt evaluation and first step for each of
the serve loads' prompts (serve_load.load_prompts, raw text), one token each, on a fresh history every time. Per
prompt: its tokens, the milliseconds to the first token, and the stats' prompt and verify milliseconds (a prefill
that folds the prompt's last token leaves the first step nothing to decode: Session.take_ahead). Run it on two
checkouts (PYTHONPATH=<checkout>) in turn to compare them; the JSON names the tree it ran.

    python benchmarks/first_token.py [--pair demo|deep] [--threads 2] [--repeat 2] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import specq  # noqa: E402
from deep_pair import pair  # noqa: E402
from serve_load import load_prompts  # noqa: E402
from specq.native.core.settings import GenerationSettings  # noqa: E402
from specq.native.runtime.engine import Engine  # noqa: E402

N_PROMPTS = 6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", choices=("demo", "deep"), default="deep")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    target, draft = pair(a.pair)
    prompts = load_prompts()[:N_PROMPTS]
    rows = []
    with Engine(target, draft, ctx=4096, threads=a.threads) as e:
        ses, one = e.session(), GenerationSettings(n_predict=1)
        ses.generate(e.tokenize(prompts[0]), one, speculative=False).run()  # warm-up
        for rep in range(a.repeat):
            for i, p in enumerate(prompts):
                ses.reset()
                toks = e.tokenize(p)
                t0 = time.perf_counter()
                g = ses.generate(toks, one, speculative=False).run()
                rows.append({"repeat": rep, "prompt": i, "tokens": len(toks), "ms": 1e3 * (time.perf_counter() - t0),
                             "prompt_ms": g.stats.prompt_ms, "verify_ms": g.stats.verify_ms})
    med = statistics.median(r["ms"] for r in rows)
    print(f"{a.pair}: first token median {med:.1f} ms over {len(rows)} prompts "
          f"(tree {Path(specq.__file__).parent.name})", flush=True)
    if a.json:
        a.json.write_text(json.dumps({"pair": a.pair, "threads": a.threads, "tree": Path(specq.__file__).parent.name,
                                      "cpus": os.cpu_count(), "median_ms": med, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
