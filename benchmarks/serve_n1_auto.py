"""specq serve at N = 1 as serve_vs_llamaserver.py starts it (defaults: --drafter auto, --draft-max auto), a fresh
server each round: its warm-up (16 tokens) and two 96-token greedy answers, non-streaming, each answer's
`usage.speculative` (drafted, accepted, tokens/s). Whether a round drafts is decided in its first answers
(docs/benchmarks.md, "Why auto sometimes decodes plain at N = 1").

    python benchmarks/serve_n1_auto.py [--pair deep|demo] [--rounds 3] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import serve_vs_llamaserver as svl  # noqa: E402
from serve_load import Server, load_prompts, model_of  # noqa: E402


def main() -> None:
    import openai

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", choices=("demo", "deep"), default="deep")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    target, draft = svl.pair(a.pair)
    prompts = load_prompts()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            srv = Server(svl.specq_defaults(1, target, draft, a.threads), Path(tmp) / f"serve-{r}.log", None)
            try:
                model = model_of(srv)
                client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none")
                for label, i, n in (("warm-up", 0, 16), ("answer 1", 0, 96), ("answer 2", 1, 96)):
                    got = client.chat.completions.create(model=model, max_tokens=n, temperature=0,
                                                         messages=[{"role": "user", "content": prompts[i]}])
                    spec = got.usage.model_dump().get("speculative") or {}
                    rows.append({"round": r, "request": label, **{k: spec.get(k) for k in
                                 ("n_drafted", "n_accepted", "accept_rate", "tokens_per_s", "draft_ms", "verify_ms")}})
                    print(rows[-1], file=sys.stderr, flush=True)
            finally:
                srv.stop()
    if a.json:
        Path(a.json).write_text(json.dumps({"settings": vars(a), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
