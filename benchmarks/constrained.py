"""Constrained output's costs: the grammar's mask per token on two vocabularies, and the demo pair's speed-up over
the target alone with and without a JSON schema (`--pair deep`: benchmarks/deep_pair.py's pair).

    python benchmarks/constrained.py [--threads 1] [--n-predict 160] [--rounds 2] [--draft-max 6]
        [--vocab-48k PATH] [--vocab-big PATH] [--json benchmarks/results/constrained-cpu2.json]

1. Mask time: the Guide's own path (core/constraint.py) along a JSON document that follows the schema, token by
   token: the matcher's mask (llguidance), unpacked to one bool per id, and a logits row of the vocabulary's
   size masked (apply_mask). The demo target's vocabulary (49,152 ids) and a large one (`--vocab-big`, default the
   qwen35 vocabulary-only GGUF in llama.cpp's sdist, `$LLAMA_SRC/models/ggml-vocab-qwen35.gguf`); the tokenizer
   bridge needs only the vocabulary.
2. Speed-up: the demo pair (SmolLM2-135M F32 target, its Q4_1 draft) at greedy, each prompt asking for a JSON
   answer, in four modes alternating per prompt and round: the target alone and speculative, each free and under
   the schema. A mode's rate is its generated tokens over its generation time, summed over the prompts of a
   round; the median over rounds is compared. The issue's bar: the constrained speed-up >= 0.9x the free one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from deep_pair import pair as pair_by_name  # (benchmarks/, the script's folder)
from specq.native.commands.demo import demo_pair
from specq.native.core.constraint import Constraint, Guide, apply_mask, compile_constraint
from specq.native.runtime.engine import Engine
from specq.native.core.settings import GenerationSettings
from specq.native.llama import ffi as _ffi
from specq.native.llama.guidance import lltokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "author": {"type": "object", "properties": {"name": {"type": "string"}, "born": {"type": "integer"}},
                   "required": ["name", "born"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "summary": {"type": "string"},
    },
    "required": ["title", "author", "tags", "summary"],
}
DOC = {"title": "The Old Man and the Sea", "author": {"name": "Ernest Hemingway", "born": 1899},
       "tags": ["novel", "sea", "fishing", "classic"],
       "summary": "An aging Cuban fisherman struggles for days with a giant marlin far out in the Gulf Stream, "
                  "and brings home only its skeleton after sharks eat the rest."}
SUBJECTS = ["a novel about the sea", "a cookbook from Italy", "a history of Rome", "a guide to Python",
            "a book about chess", "a travel guide to Japan"]


def mask_times(path: Path, rounds: int = 20) -> dict:
    """Per token of DOC (pretty-printed) under SCHEMA: the Guide's mask and a masked logits row, in microseconds."""
    model = _ffi.Model(path, vocab_only=True)
    try:
        t0 = time.perf_counter()
        lltokenizer(model)  # the bridge, made once per model
        t1 = time.perf_counter()
        c = compile_constraint(model, Constraint("json_schema", json.dumps(SCHEMA)))
        compile_s, tokenizer_s = time.perf_counter() - t1, t1 - t0
        doc = model.tokenize(json.dumps(DOC, indent=2), add_special=False, parse_special=False)
        row = np.random.default_rng(0).standard_normal(model.n_vocab).astype(np.float32)
        masks, applies = [], []
        for _ in range(rounds):
            done: list[int] = []
            guide = Guide(c, model, done)
            for tok in doc:
                t1 = time.perf_counter()
                allowed = guide.allowed()
                t2 = time.perf_counter()
                apply_mask(row, allowed)
                t3 = time.perf_counter()
                assert allowed[tok], "the document does not follow the schema"
                masks.append(t2 - t1)
                applies.append(t3 - t2)
                done.append(tok)
        both = [a + b for a, b in zip(masks, applies)]
        return {"vocab": path.name, "n_vocab": model.n_vocab, "doc_tokens": len(doc), "rounds": rounds,
                "tokenizer_ms": round(tokenizer_s * 1e3, 1), "compile_ms": round(compile_s * 1e3, 2),
                "mask_us_mean": round(statistics.fmean(masks) * 1e6, 1),
                "mask_us_p50": round(statistics.median(masks) * 1e6, 1),
                "mask_us_p99": round(sorted(masks)[int(0.99 * len(masks))] * 1e6, 1),
                "apply_us_mean": round(statistics.fmean(applies) * 1e6, 1),
                "total_us_mean": round(statistics.fmean(both) * 1e6, 1)}
    finally:
        model.close()


def speedups(threads: int, n_predict: int, rounds: int, draft_max: int, pair: str = "demo") -> dict:
    target, draft = pair_by_name(pair)
    modes = [("alone", False, False), ("spec", True, False), ("alone+schema", False, True),
             ("spec+schema", True, True)]
    per_round: dict[str, list[float]] = {m: [] for m, _, _ in modes}
    detail: dict[str, dict] = {m: {"tokens": 0, "gen_ms": 0.0, "drafted": 0, "accepted": 0, "mask_ms": 0.0}
                               for m, _, _ in modes}
    with Engine(target, draft, ctx=1024, threads=threads) as e:
        c = compile_constraint(e.target, Constraint("json_schema", json.dumps(SCHEMA)))
        prompts = [e.tokenize(f"<|im_start|>user\nDescribe {s} as JSON: its title, author (name, born), tags and "
                              f"a one-sentence summary.<|im_end|>\n<|im_start|>assistant\n") for s in SUBJECTS]
        for r in range(rounds):
            sums = {m: [0, 0.0] for m, _, _ in modes}
            for i, toks in enumerate(prompts):
                order = modes if (r + i) % 2 == 0 else modes[::-1]  # alternate: load hits every mode alike
                for name, spec, constrained in order:
                    s = GenerationSettings(n_predict=n_predict, draft_max=draft_max,
                                           constraint=c if constrained else None)
                    ses = e.session()
                    ses.reset()
                    st = ses.generate(toks, s, speculative=spec).run().stats
                    sums[name][0] += st.n_generated
                    sums[name][1] += st.gen_ms
                    d = detail[name]
                    d["tokens"] += st.n_generated
                    d["gen_ms"] += st.gen_ms
                    d["drafted"] += st.n_drafted
                    d["accepted"] += st.n_accepted
                    d["mask_ms"] += st.mask_ms
            for name, (n, ms) in sums.items():
                per_round[name].append(n / (ms / 1e3))
    rate = {m: statistics.median(v) for m, v in per_round.items()}
    free, constrained = rate["spec"] / rate["alone"], rate["spec+schema"] / rate["alone+schema"]
    return {"tokens_per_s": {m: round(v, 2) for m, v in rate.items()},
            "per_round": {m: [round(x, 2) for x in v] for m, v in per_round.items()},
            "speedup_free": round(free, 3), "speedup_constrained": round(constrained, 3),
            "constrained_over_free": round(constrained / free, 3),
            "detail": {m: {k: round(v, 2) if isinstance(v, float) else v for k, v in d.items()}
                       for m, d in detail.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-predict", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--draft-max", type=int, default=6)
    ap.add_argument("--vocab-big", type=Path, default=Path(os.environ.get("LLAMA_SRC", "vendor/llama.cpp"))
                    / "models" / "ggml-vocab-qwen35.gguf")
    ap.add_argument("--pair", choices=("demo", "deep"), default="demo",
                    help="the pair of the speed-up (deep: benchmarks/deep_pair.py, the demo's vocabulary)")
    ap.add_argument("--no-mask", action="store_true", help="skip the mask timings (the speed-up only)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    load0 = os.getloadavg()
    out = {"pair": a.pair, "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "threads": a.threads,
           "draft_max": a.draft_max, "n_predict": a.n_predict, "rounds": a.rounds,
           "loadavg_before": [round(x, 2) for x in load0]}
    out["mask"] = [] if a.no_mask else \
        [mask_times(demo_pair()[0])] + ([mask_times(a.vocab_big)] if a.vocab_big.is_file() else [])
    for m in out["mask"]:
        print(f"mask {m['vocab']} ({m['n_vocab']} ids): {m['mask_us_mean']} us/token mean (p50 {m['mask_us_p50']}, "
              f"p99 {m['mask_us_p99']}), apply {m['apply_us_mean']} us, tokenizer {m['tokenizer_ms']} ms, "
              f"schema compile {m['compile_ms']} ms")
    out["speedup"] = speedups(a.threads, a.n_predict, a.rounds, a.draft_max, a.pair)
    out["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    sp = out["speedup"]
    print(f"tokens/s {sp['tokens_per_s']}; speed-up free {sp['speedup_free']}x, under the schema "
          f"{sp['speedup_constrained']}x ({sp['constrained_over_free']} of free); load {load0} -> "
          f"{out['loadavg_after']}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
