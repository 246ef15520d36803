"""A wave of N prompts joining `specq serve --parallel N` at once: their tokens evaluated one prompt per decode (as
the scheduler did) against all of them in one decode (Batch.add_all, as llama-server does), in the target's
served layout on the CPU (a stream per sequence) and on a GPU (one unified cache, where llama.cpp splits a batch
into ubatches by rows alone); flash attention on in both. The prompts are those of
benchmarks/prompts/adaptive12.jsonl in ChatML (the demo pair's template), all but each one's last token, as a
prefill leaves it. Medians of --repeat waves after a warm-up, the two ways in turn.

    python benchmarks/joined_prefill.py [--pair demo|deep] [--threads 2] [--parallel 4,8] [--repeat 7] \
        [--json benchmarks/results/joined_prefill-demo-xeon2-threads2.json]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from parallel_attention import start, write  # noqa: E402
from serve_load import load_prompts  # noqa: E402
from specq.native.llama import ffi  # noqa: E402

def prompts(model: ffi.Model) -> list[list[int]]:
    texts = load_prompts()
    return [model.tokenize(f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n")[:-1]
            for t in texts]


def measure(model: ffi.Model, threads: int, n: int, repeat: int, unified: bool) -> dict:
    ctx = ffi.Context(model, 2048, threads, n_seq=n, flash_attn="on", unified=unified)
    toks = prompts(model)
    ts: dict[str, list[float]] = {"one by one": [], "joined": []}
    waves = [[toks[(r * n + s) % len(toks)] for s in range(n)] for r in range(repeat + 1)]
    try:
        for wave in waves:
            for way in ts:
                t0 = time.perf_counter()
                if way == "joined":
                    ctx.decode_seqs([(s, t, 0, "none") for s, t in enumerate(wave)])
                else:
                    for s, t in enumerate(wave):
                        ctx.decode(t, 0, logits="none", seq=s)
                ts[way].append(time.perf_counter() - t0)
                for s in range(n):
                    ctx.clear(seq=s)
    finally:
        ctx.close()
    ms = {k: 1e3 * statistics.median(v[1:]) for k, v in ts.items()}
    row = {"parallel": n, "layout": "unified" if unified else "streams",
           "tokens_per_wave": statistics.median(sum(map(len, w)) for w in waves[1:]),
           "one_by_one_ms": ms["one by one"], "joined_ms": ms["joined"],
           "joined_over_one_by_one": ms["joined"] / ms["one by one"]}
    print(f"N={n} {row['layout']}: one by one {ms['one by one']:.1f} ms, joined {ms['joined']:.1f} ms "
          f"({row['joined_over_one_by_one']:.2f}x), ~{row['tokens_per_wave']:.0f} tokens a wave",
          file=sys.stderr, flush=True)
    return row


def main() -> None:
    a, target, load0 = start(__doc__, 2, "4,8", "0")
    model = ffi.Model(target)
    rows = [measure(model, a.threads, int(n), a.repeat, unified) for n in a.parallel.split(",")
            for unified in (False, True)]
    write(a, target, load0, rows)


if __name__ == "__main__":
    main()
