"""The draft length at batch size B (`serve --parallel`): the cost model's prediction, then the measurement.

Prediction: time one target decode carrying B sequences' verifies of k+1 rows each (`Context.decode_seqs`, after
a prompt-sized prefix per sequence) and one draft decode of B rows (one draft position for every sequence); with
α per position measured on the pair alone (greedy, k = 8), the aggregate tokens per second of a batched step are
B·E(α, k) / (t_verify(B, k) + k·t_draft(B)), and B / t_verify(B, 0) without drafting. The best k falls as B grows
because the verify's cost grows with the batch's total rows B·(k+1).
Measurement: B greedy generations stepped together (runtime/batch.py) at each k and under --draft-max auto: "auto"
(the batch's cost model, control/batch_plan.py, caps each sequence's own length) and "auto-own" (each sequence's
controller alone); aggregate tokens/s, the configurations alternating.

    python benchmarks/batch_draft.py [--pair demo|deep] [--batch 1,4,8] [--k 0,2,4,8] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from specq.native.control.expected import expected_tokens_per_pass  # noqa: E402
from deep_pair import pair  # noqa: E402
from specq.native.control.batch_plan import BatchPlanner  # noqa: E402
from specq.native.runtime.batch import Batch  # noqa: E402
from specq.native.runtime.engine import Engine  # noqa: E402
from specq.native.core.settings import GenerationSettings  # noqa: E402

PROMPTS = Path(__file__).parent / "prompts" / "adaptive12.jsonl"
PLANNERS: dict = {}


def timed(fn, repeat: int) -> float:
    out = []
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out[1:])  # the first is a warm-up


def costs(e: Engine, b: int, ks: list[int], prefix: int, repeat: int) -> dict:
    """Seconds of one target decode of b sequences × (k+1) rows, and of one draft decode of b rows."""
    rng = np.random.default_rng(0)
    for ctx in (e.tgt_ctx, e.dft_ctx):
        ctx.clear()
        for s in range(b):
            ctx.decode(rng.integers(300, ctx.n_vocab - 1, prefix).tolist(), 0, logits="none", seq=s)

    def once(ctx, rows: int):
        def run():
            ctx.decode_seqs([(s, rng.integers(300, ctx.n_vocab - 1, rows).tolist(), prefix, "all")
                             for s in range(b)])
            ctx.logits(rows, seq=b - 1)
            for s in range(b):
                ctx.seq_rm(prefix, -1, seq=s)
        return run

    out = {"verify": {k: timed(once(e.tgt_ctx, k + 1), repeat) for k in ks},
           "draft": timed(once(e.dft_ctx, 1), repeat)}
    for ctx in (e.tgt_ctx, e.dft_ctx):
        ctx.clear()
    return out


def run_batch(e: Engine, b: int, prompts: list[list[int]], k, n: int) -> tuple[float, list]:
    """k: a fixed length (0: the target alone), "auto" (the batch's cost model caps the sequences' own lengths,
    control/batch_plan.py) or "auto-own" (each sequence's controller alone, as before the batch's model)."""
    batch, gens = Batch(PLANNERS.setdefault((b, k), BatchPlanner())), []  # kept across runs, as a server keeps it
    batch.plan_lengths = k != "auto-own"
    for i in range(b):
        ses = e.session(i)
        ses.reset()
        s = GenerationSettings(n_predict=n, draft_max="auto" if k == "auto-own" else (k if k != 0 else 1))
        gens.append(ses.generate(prompts[i % len(prompts)], s, speculative=k != 0))
    t0 = time.perf_counter()
    for g in gens:
        batch.add(g)
    batch.run()
    return sum(len(g.tokens) for g in gens) / (time.perf_counter() - t0), [g.stats for g in gens]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", choices=("demo", "deep"), default="demo")
    ap.add_argument("--batch", default="1,4,8")
    ap.add_argument("--k", default="0,1,2,4,8")
    ap.add_argument("--n-predict", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    target, draft = pair(a.pair)
    batches, ks = [int(x) for x in a.batch.split(",")], [int(x) for x in a.k.split(",")]
    load0 = os.getloadavg()
    with Engine(target, draft, ctx=1024, threads=a.threads, parallel=max(batches)) as e:
        texts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]
        prompts = [e.tokenize(f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n") for t in texts]  # ChatML
        _, alone = run_batch(e, 1, prompts, 8, a.n_predict)
        alpha = alone[0].alpha
        rows = []
        for b in batches:
            c = costs(e, b, ks, len(prompts[0]), a.repeat)
            pred = {k: b * (expected_tokens_per_pass(alpha, k) if k else 1) / (c["verify"][k] + k * c["draft"])
                    for k in ks}
            measured: dict = {k: [] for k in ks + ["auto", "auto-own"]}
            for r in range(a.rounds):
                for k in (ks + ["auto", "auto-own"]) if r % 2 == 0 else (["auto-own", "auto"] + ks[::-1]):
                    measured[k].append(run_batch(e, b, prompts, k, a.n_predict)[0])
            row = {"batch": b, "verify_s": c["verify"], "draft_s": c["draft"], "alpha": alpha,
                   "predicted_tokens_per_s": pred, "predicted_best_k": max(pred, key=pred.get),
                   "measured_tokens_per_s": {str(k): statistics.median(v) for k, v in measured.items()},
                   "measured_runs": {str(k): v for k, v in measured.items()}}
            row["measured_best_k"] = max(row["measured_tokens_per_s"], key=row["measured_tokens_per_s"].get)
            rows.append(row)
            print(f"B={b}: predicted best k {row['predicted_best_k']} "
                  f"({', '.join(f'k{k} {v:.1f}' for k, v in pred.items())} tok/s); measured best "
                  f"{row['measured_best_k']} ({', '.join(f'{k} {v:.1f}' for k, v in row['measured_tokens_per_s'].items())})",
                  file=sys.stderr, flush=True)
    doc = {"pair": a.pair, "settings": vars(a), "cpus": os.cpu_count(), "load_before": load0,
           "load_after": os.getloadavg(), "rows": rows}
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
