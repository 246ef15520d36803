"""What --drafter auto believes after a server's first requests at N = 1: a fresh engine per round (as a new
server), a 16-token warm-up then two 96-token greedy answers (the serve benchmarks' load at N = 1, in process),
and after each the chooser's state: the target's verify costs V(1), V(2), V(9), the draft model's first and
further token, its acceptance estimate by position, its probes, and the length it would choose now (0: plain).

    python benchmarks/auto_state.py [--pair deep|demo] [--rounds 3] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from deep_pair import pair  # noqa: E402
from serve_load import load_prompts  # noqa: E402
from specq.native.core.settings import GenerationSettings  # noqa: E402
from specq.native.runtime.batch import Batch  # noqa: E402
from specq.native.runtime.engine import Engine  # noqa: E402

def state(c) -> dict:
    """The chooser's view of the draft model now (milliseconds)."""
    m = c.per["model"]
    return {"v1_ms": 1e3 * c.shared.verify_s(1), "v2_ms": 1e3 * c.shared.verify_s(2), "v9_ms": 1e3 * c.shared.verify_s(9),
            "draft_first_ms": 1e3 * m.first_s(), "draft_token_ms": 1e3 * m.draft_s(),
            "alphas": [round(x, 3) for x in m.alphas()[:8]], "tried": m.acceptance.tried, "probes": c.n_probes,
            "plain_steps": c.n_plain_steps, "best_k_now": m.near_best(16)[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", choices=("demo", "deep"), default="deep")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    target, draft = pair(a.pair)
    texts = load_prompts()
    rows = []
    for r in range(a.rounds):
        with Engine(target, draft, ctx=2048, threads=a.threads, parallel=1) as e:
            ses = e.session(0)
            for i, n in ((0, 16), (0, 96), (1, 96)):
                prompt = e.tokenize(f"<|im_start|>user\n{texts[i]}<|im_end|>\n<|im_start|>assistant\n")  # ChatML
                ses.reset()
                g = ses.generate(prompt, GenerationSettings(n_predict=n, draft_max="auto", drafter="auto"))
                batch = Batch()
                batch.add(g)
                batch.run()
                rows.append({"round": r, "prompt": i, "n_predict": n, "drafted": g.stats.n_drafted,
                             "accepted": g.stats.n_accepted, "tokens_per_s": len(g.tokens) / (g.stats.gen_ms / 1e3),
                             **state(ses.controller(g.settings))})
                print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in rows[-1].items()},
                      file=sys.stderr, flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"settings": vars(a), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
