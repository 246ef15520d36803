"""draft_max=auto against plain decoding and fixed draft lengths, on drafts cut from the demo target.

    /work/venv/bin/python benchmarks/adaptive.py [--n-predict 128] [--repeat 3] [--threads N] [--out results.json]

Pairs (all share the SmolLM2-135M vocabulary; the target is the demo pair's F32 target):
  useless:   the target's first 2 layers (+ embeddings/output): ~0% acceptance
  expensive: the target's first 19 of 30 layers: costs ~0.7 of the target
  good:      the demo pair's Q4_1 draft
Runs alternate (baseline, fixed k..., auto) per repeat; medians of tokens/s are compared.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import gguf
import numpy as np

from specq.native import _ffi
from specq.native.demo import cache_dir, demo_pair
from specq.native.engine import Engine, GenerationSettings

PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring and a short test.\n"


def first_layers(src: Path, dst: Path, n: int) -> Path:
    """Copy a llama GGUF keeping blocks 0..n-1 (with embeddings, norms, output): a same-vocabulary draft."""
    if dst.is_file():
        return dst
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst) + ".tmp", arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = n if name == f"{arch}.block_count" else f.contents()
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, value, f.types[0], sub_type=sub)
    for t in r.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= n:
            continue
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    Path(str(dst) + ".tmp").replace(dst)
    return dst


def machine() -> dict:
    model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    return {"cpu": model, "logical_cpus": __import__("os").cpu_count(), "python": platform.python_version(),
            "llama_cpp_python": _ffi.llama_cpp_python_version()}


def run_pair(name: str, target: Path, draft: Path, modes: list, n_predict: int, repeat: int,
             threads: int | None) -> dict:
    rows = []
    with Engine(target, draft, ctx=1024, threads=threads) as e:
        toks = e.tokenize(PROMPT)
        ses = e.session()
        base_tokens = None
        for rep in range(repeat):
            for mode in modes:
                ses.reset()
                spec = mode != "baseline"
                s = GenerationSettings(n_predict=n_predict, draft_max=mode if spec else 8)
                g = ses.generate(toks, s, speculative=spec).run()
                st = g.stats
                if not spec:
                    base_tokens = g.tokens
                rows.append({"mode": mode, "repeat": rep, "tokens_per_s": st.tokens_per_s, "n_steps": st.n_steps,
                             "n_drafted": st.n_drafted, "accept_rate": st.accept_rate, "draft_ms": st.draft_ms,
                             "verify_ms": st.verify_ms, "gen_ms": st.gen_ms, "n_plain_steps": st.n_plain_steps,
                             "n_probes": st.n_probes, "overhead_fraction": st.overhead_fraction,
                             "identical": g.tokens == base_tokens if spec else None})
                print(f"{name:9s} {str(mode):8s} rep {rep}: {st.tokens_per_s:6.1f} tok/s "
                      f"acc {st.accept_rate if st.accept_rate is not None else float('nan'):.2f} "
                      f"plain {st.n_plain_steps} probes {st.n_probes}", file=sys.stderr, flush=True)
        # the draft/target cost ratio: one token each, median of a few
        cost = {}
        for which, ctx in (("target", e.tgt_ctx), ("draft", e.dft_ctx)):
            ctx.clear()
            ctx.decode(toks, 0, logits="none")
            ts = []
            for i in range(8):
                t0 = time.perf_counter()
                ctx.decode([toks[-1]], len(toks) + i, logits="last")
                ts.append(time.perf_counter() - t0)
            cost[which] = statistics.median(ts) * 1e3
    med = {str(m): statistics.median(r["tokens_per_s"] for r in rows if r["mode"] == m) for m in modes}
    return {"pair": name, "target": str(target), "draft": str(draft), "cost_ratio": cost["draft"] / cost["target"],
            "token_ms": cost, "median_tokens_per_s": med,
            "auto_vs_plain": med["auto"] / med["baseline"],
            "best_fixed": max((m for m in med if m not in ("baseline", "auto")), key=lambda m: med[m], default=None),
            "runs": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-predict", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--pairs", default="useless,expensive,good")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out")
    a = ap.parse_args()
    target, good = demo_pair()
    drafts = {
        "useless": (first_layers(target, cache_dir() / "SmolLM2-135M-first2.F32.gguf", 2), ["baseline", 4, "auto"]),
        "expensive": (first_layers(target, cache_dir() / "SmolLM2-135M-first19.F32.gguf", 19),
                      ["baseline", 2, "auto"]),
        "good": (good, ["baseline", 1, 2, 4, 8, 16, "auto"]),
    }
    doc = {"machine": machine(), "command": " ".join(sys.argv), "n_predict": a.n_predict, "repeat": a.repeat,
           "prompt": PROMPT, "results": []}
    for name in a.pairs.split(","):
        d, modes = drafts[name]
        doc["results"].append(run_pair(name, target, d, modes, a.n_predict, a.repeat, a.threads))
    text = json.dumps(doc, indent=1)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
