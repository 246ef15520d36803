"""Per-step cost of rolling a hybrid (qwen35) target back: llama.cpp's n_rs_seq snapshots vs a checkpoint copy.

A speculative step on a hybrid target verifies [last, d1..dk] in one decode and, on a partial acceptance, drops
the rejected tail. The engine does that one of two ways (native/runtime/engine.py `Memory`):

- rollback: the context keeps n_rs_seq recurrent-state snapshots per decode, and `llama_memory_seq_rm` drops the
  tail (what specq does when the draft fits in n_rs_seq, 16 by default);
- restore: a copy of the recurrent state is taken before the verify (`llama_state_seq_get_data_ext`, partial),
  written back on a partial acceptance, and the accepted tokens are decoded again.

This runs both through the engine's own `Memory` on random-weight qwen35 models of growing width and depth,
written at run time (tests/tinymodels.py), and times each step's parts: the checkpoint copy, the verify decode,
the rollback or restore (the state written back, then the accepted tokens decoded again). Modes alternate step by step; acceptance cycles through 0..k-1, so
every step rolls back. Greedy logits are not read: the cost is the memory's, not the sampler's.

    nice python benchmarks/rollback_cost.py --out benchmarks/results/rollback_cost-cpu2.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the fixture writers

from specq.native.llama import ffi as _ffi  # noqa: E402
from specq.native.core.memory import Memory  # noqa: E402
from tinymodels import TinyQwen35Spec, write_tiny_qwen35  # noqa: E402

# (name, spec): width, depth and the linear layers' heads grow together, as they do across Qwen3.5 sizes
SIZES = {
    "s": TinyQwen35Spec(n_layer=8, n_embd=256, n_ff=768, n_head=4, n_head_kv=2, head_dim=64, n_rot=16,
                        rope_sections=(4, 2, 2, 0), linear_k_heads=2, linear_v_heads=4, linear_head_dim=64),
    "m": TinyQwen35Spec(n_layer=16, n_embd=512, n_ff=1536, n_head=8, n_head_kv=2, head_dim=64, n_rot=16,
                        rope_sections=(4, 2, 2, 0), linear_k_heads=4, linear_v_heads=8, linear_head_dim=64),
    "l": TinyQwen35Spec(n_layer=24, n_embd=768, n_ff=2304, n_head=8, n_head_kv=2, head_dim=128, n_rot=32,
                        rope_sections=(8, 4, 4, 0), linear_k_heads=4, linear_v_heads=12, linear_head_dim=128),
}


def recurrent_state_bytes(spec: TinyQwen35Spec) -> int:
    """F32 recurrent state of the linear layers: each head's state matrix plus the conv window."""
    n_linear = sum(not spec.is_full_attention(i) for i in range(spec.n_layer))
    kd, vd = spec.linear_head_dim * spec.linear_k_heads, spec.linear_head_dim * spec.linear_v_heads
    per_layer = spec.linear_v_heads * spec.linear_head_dim ** 2 + (spec.conv_kernel - 1) * (2 * kd + vd)
    return 4 * n_linear * per_layer


def one_step(cache: Memory, rng, n_vocab: int, k: int, accepted: int) -> dict:
    """One verify of k drafts after the cache's tokens, then a rollback to `accepted` of them (+ the last)."""
    n0 = len(cache.tokens)
    batch = rng.integers(10, n_vocab, size=k + 1).tolist()
    r0, s0 = cache.n_rollbacks, cache.n_restores
    t0 = time.perf_counter()
    cache.save_checkpoint(n_next=k + 1)
    t1 = time.perf_counter()
    cache.extend(batch, logits="all")
    cache.ctx.logits(k + 1)
    t2 = time.perf_counter()
    d0 = cache.ctx.decode_s
    cache.truncate(n0 + 1 + accepted)
    t3 = time.perf_counter()
    redecode = cache.ctx.decode_s - d0
    how = "rollback" if cache.n_rollbacks > r0 else "restore" if cache.n_restores > s0 else "none"
    return {"checkpoint_ms": (t1 - t0) * 1e3, "verify_ms": (t2 - t1) * 1e3, "rollback_ms": (t3 - t2) * 1e3,
            "redecode_ms": redecode * 1e3, "state_write_ms": (t3 - t2 - redecode) * 1e3, "step_ms": (t3 - t0) * 1e3, "how": how}


def measure(path: Path, spec: TinyQwen35Spec, k: int, steps: int, prefix: int, threads: int, seed: int) -> dict:
    model = _ffi.Model(path)
    caches = {}
    try:
        for mode, n_rs in (("rollback", 16), ("restore", 0)):
            ctx = _ffi.Context(model, 1024, threads, n_batch=512, n_outputs_max=k + 1, name=mode, n_rs_seq=n_rs)
            caches[mode] = Memory(ctx, partial_rm=False)
        rng = np.random.default_rng(seed)
        start = rng.integers(10, model.n_vocab, size=prefix).tolist()
        for c in caches.values():
            c.extend(start, logits="none")
        state_bytes = len(caches["restore"].ctx.state_get())
        rows = {m: [] for m in caches}
        for i in range(steps + 2):  # two warm-up steps per mode
            for mode, c in caches.items():
                row = one_step(c, rng, model.n_vocab, k, i % k)
                if row["how"] != mode:
                    raise SystemExit(f"{mode} context took the {row['how']} path; the benchmark measures nothing")
                if i >= 2:
                    rows[mode].append(row)
        out = {"state_bytes_measured": state_bytes, "state_bytes_computed": recurrent_state_bytes(spec),
               "n_rs_seq_granted": caches["rollback"].ctx.n_rs_seq, "size_bytes": model.size_bytes,
               "n_params": model.n_params}
        for mode, rs in rows.items():
            out[mode] = {key: statistics.median(r[key] for r in rs)
                         for key in ("checkpoint_ms", "verify_ms", "rollback_ms", "redecode_ms", "state_write_ms", "step_ms")}
            out[mode]["raw_step_ms"] = [round(r["step_ms"], 3) for r in rs]
        return out
    finally:
        for c in caches.values():
            c.ctx.close()
        model.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="s,m,l", help="comma list of " + ",".join(SIZES))
    ap.add_argument("--k", type=int, default=4, help="drafts per verify")
    ap.add_argument("--steps", type=int, default=24, help="measured steps per mode and size")
    ap.add_argument("--prefix", type=int, default=64, help="tokens in the cache before the first step")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.sizes.split(","):
            spec = SIZES[name]
            t0 = time.perf_counter()
            path = write_tiny_qwen35(Path(tmp) / f"qwen35-{name}.gguf", seed=7, spec=spec)
            write_s = time.perf_counter() - t0
            r = measure(path, spec, a.k, a.steps, a.prefix, a.threads, a.seed)
            r.update(n_layer=spec.n_layer, n_embd=spec.n_embd, linear_v_heads=spec.linear_v_heads,
                     linear_head_dim=spec.linear_head_dim, write_s=round(write_s, 2))
            results[name] = r
            print(f"{name}: state {r['state_bytes_measured'] / 2**20:.2f} MiB  "
                  f"rollback step {r['rollback']['step_ms']:.2f} ms (verify {r['rollback']['verify_ms']:.2f}, "
                  f"seq_rm {r['rollback']['rollback_ms']:.3f})  restore step {r['restore']['step_ms']:.2f} ms "
                  f"(copy {r['restore']['checkpoint_ms']:.2f}, verify {r['restore']['verify_ms']:.2f}, "
                  f"write back {r['restore']['state_write_ms']:.2f}, re-decode {r['restore']['redecode_ms']:.2f})",
                  flush=True)
            path.unlink()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    doc = {"benchmark": "rollback_cost", "settings": vars(a) | {"out": Path(a.out).name},
           "machine": {"cpu": cpu, "logical_cpus": os.cpu_count(), "python": platform.python_version(),
                       "llama_cpp_python": _ffi.llama_cpp_python_version()},
           "sizes": results}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
