"""Verify cost of n = 1..k+1 tokens in one target pass, relative to 1 token, and the draft's cost per token.

These are the inputs to the ideal speed-up (BRIEF.md): with acceptance α, draft/target cost ratio c and
verify cost ratio v = t(k+1)/t(1), tokens per unit of target time = (1-α^(k+1)) / ((1-α)(k·c + v)).
Each measurement: evaluate n tokens after a fixed prefix, read the logits (llama_get_logits synchronizes the
device), remove them again; the median of `--repeat` runs after `--warmup` runs. Also records how much device
memory loading took, next to the planner's estimate, when llama.cpp reports device memory.

    python benchmarks/verify_cost.py --target T --draft D [--ngl 999] [--k 16] [--ctx 4096] --out F.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from specq.native.control.expected import expected_tokens_per_pass
from specq.native.llama import ffi as _ffi
from specq.native.commands.plan import Device, plan


def gpu_free() -> int:
    return sum(d.memory_free for d in _ffi.devices() if d.type in ("GPU", "IGPU"))


def time_passes(ctx: _ffi.Context, prefix: int, n: int, rng: np.random.Generator, n_vocab: int,
                warmup: int, repeat: int) -> float:
    """Median milliseconds for one pass over n tokens at positions prefix..prefix+n-1 (logits for all)."""
    times = []
    for i in range(warmup + repeat):
        toks = rng.integers(300, n_vocab, size=n).tolist()
        t0 = time.perf_counter()
        ctx.decode(toks, prefix, logits="all")
        ctx.logits(n)  # synchronizes: the pass is finished when the logits are readable
        dt = time.perf_counter() - t0
        if not ctx.seq_rm(prefix, -1):
            raise SystemExit("this model's memory cannot drop positions; verify cost needs a transformer")
        if i >= warmup:
            times.append(dt * 1e3)
    return statistics.median(times)


def measure(path: str, ngl: int, ctx_size: int, prefix: int, ns: list[int], threads: int, warmup: int,
            repeat: int, seed: int) -> dict:
    free0 = gpu_free()
    model = _ffi.Model(path, n_gpu_layers=ngl)
    ctx = _ffi.Context(model, ctx_size, threads, n_batch=512, n_outputs_max=max(ns), name="bench")
    free1 = gpu_free()
    rng = np.random.default_rng(seed)
    n_layer, size = model.n_layer, model.size_bytes
    try:
        ctx.decode(rng.integers(300, model.n_vocab, size=prefix).tolist(), 0, logits="none")
        ms = {n: time_passes(ctx, prefix, n, rng, model.n_vocab, warmup, repeat) for n in ns}
    finally:
        ctx.close()
        model.close()
    return {"path": path, "ngl": ngl, "n_layer": n_layer, "size_bytes": size, "prefix": prefix,
            "ms": {str(n): round(v, 4) for n, v in ms.items()},
            "ratio_to_1": {str(n): round(v / ms[1], 4) for n, v in ms.items()},
            "device_bytes_used": (free0 - free1) if free0 else None}


def ideal_speedup(alpha: float, k: int, c: float, v: float) -> float:
    """Target-alone time per token over speculative time per token (BRIEF.md, with the measured v)."""
    return expected_tokens_per_pass(alpha, k) / (k * c + v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--ngl", type=int, default=999)
    ap.add_argument("--k", type=int, default=16, help="largest draft length; passes of 1..k+1 tokens are timed")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    _ffi.ensure_backend()
    ns = sorted({1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 17, a.k + 1} & set(range(1, a.k + 2)))
    tgt = measure(a.target, a.ngl, a.ctx, a.prefix, ns, a.threads, a.warmup, a.repeat, 0)
    dft = measure(a.draft, a.ngl, a.ctx, a.prefix, [1], a.threads, a.warmup, a.repeat, 1)
    c = dft["ms"]["1"] / tgt["ms"]["1"]
    gpus = [d for d in _ffi.devices() if d.type in ("GPU", "IGPU")]
    est = None
    if gpus:
        p = plan(a.target, a.draft, [Device(g.name, g.memory_total) for g in gpus], ctx=a.ctx)
        est = {"target_bytes": sum(p.fill.parts["target"].values()) if p.fill else None,
               "draft_bytes": sum(p.fill.parts["draft"].values()) if p.fill else None}
    table = {}
    for k in (4, 8, 16):
        if str(k + 1) in tgt["ratio_to_1"]:
            v = tgt["ratio_to_1"][str(k + 1)]
            table[str(k)] = {"v": v, "ideal_speedup": {str(al): round(ideal_speedup(al, k, c, v), 3)
                                                         for al in (0.5, 0.6, 0.7, 0.8, 0.9)}}
    doc = {"target": tgt, "draft": dft, "c_draft_over_target": round(c, 4), "planner_estimate": est,
           "by_k": table, "devices": [vars(d) for d in _ffi.devices()]}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"target 1-token pass {tgt['ms']['1']:.2f} ms; draft {dft['ms']['1']:.2f} ms (c = {c:.3f})")
    for n in ns:
        print(f"  verify {n:2d} tokens: {tgt['ms'][str(n)]:8.2f} ms  ({tgt['ratio_to_1'][str(n)]:.2f}x of 1 token)")
    for k, row in table.items():
        print(f"  k={k}: v={row['v']:.2f}, ideal speed-up at alpha 0.5..0.9: {row['ideal_speedup']}")


if __name__ == "__main__":
    main()
