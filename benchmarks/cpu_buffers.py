"""What specq's CPU weight-buffer policy (native/llama/cpu.py) costs: plain decoding speed of one model loaded with
llama.cpp's extra buffers on (its default), "amx-off" (extra buffers off, the weights the x86 repack kernels
take sent to the CPU-repack buffer by name: what specq does on an AMX machine) and "off" (no extra buffer).

On a CPU without AMX, "on" is llama.cpp's CPU-repack path, so "amx-off" vs "on" checks that the by-name
overrides keep that speed-up, and "off" vs "on" is what turning the extra buffers off would cost. Each
repeat runs the policies in turn (alternating), greedy, one token per decode after a fixed prompt; the
generated tokens of "amx-off" must equal those of "on" (the same kernels run).

    python benchmarks/cpu_buffers.py [--models demo-q4_1,demo-q4_0,demo-q4_k_m] [--threads 2] [--n 64]
        [--repeat 3] --out benchmarks/results/cpu_buffers-NAME.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from specq.native.llama import ffi as _ffi, cpu
from specq.native.commands.demo import cache_dir, demo_pair

PROMPT = ("The history of the Roman Empire spans more than a thousand years, from the founding of the city to "
          "the fall of Constantinople. In this essay we")
POLICIES = ("on", "amx-off", "off")


def demo_model(name: str) -> Path:
    """demo-q4_1 (the demo draft as shipped), or the demo target quantized to Q4_0 / Q4_K_M (made once)."""
    target, draft = demo_pair()
    if name == "demo-q4_1":
        return draft
    ftype = {"demo-q4_0": "Q4_0", "demo-q4_k_m": "Q4_K_M"}[name]
    path = cache_dir() / f"SmolLM2-135M-Instruct.{ftype}.gguf"
    if not path.is_file():
        _ffi.quantize(target, path, _ffi.ftype_by_name()[ftype])
    return path


def policy(mode: str) -> cpu.CpuPolicy:
    return cpu.CpuPolicy(features=None, build_has_amx=False, extra_buffers=mode, reason="benchmark")


def run_once(path: Path, mode: str, threads: int, n: int) -> dict:
    t0 = time.perf_counter()
    with _ffi.Model(path, cpu_buffers=policy(mode)) as m, _ffi.Context(m, 512, threads, name="bench") as c:
        load_s = time.perf_counter() - t0
        toks = m.tokenize(PROMPT)
        c.decode(toks, 0, logits="last")
        out = []
        t1 = time.perf_counter()
        for i in range(n):
            tok = int(c.logits(1)[0].argmax())
            out.append(tok)
            c.decode([tok], len(toks) + i, logits="last")
        dt = time.perf_counter() - t1
        return {"tokens_per_s": n / dt, "load_s": load_s, "n_repacked_patterns": m.n_repacked, "tokens": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="demo-q4_1,demo-q4_0,demo-q4_k_m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    doc = {"command": "python benchmarks/cpu_buffers.py " + " ".join(
               f"--{k} {v}" for k, v in (("models", a.models), ("threads", a.threads), ("n", a.n),
                                          ("repeat", a.repeat))),
           "machine": {"cpu": platform.processor() or platform.machine(), "system_info": _ffi.system_info(),
                       "cpu_policy_here": _ffi.cpu_policy().as_dict(),
                       "extra_buffer_types": sorted(_ffi.cpu_extra_buffer_types())},
           "models": []}
    for name in a.models.split(","):
        path = demo_model(name)
        runs = {mode: [] for mode in POLICIES}
        for _ in range(a.repeat):
            for mode in POLICIES:
                runs[mode].append(run_once(path, mode, a.threads, a.n))
        ref = runs["on"][0]["tokens"]
        # Same kernels give the same tokens; the repack kernels round differently from the plain ones, so
        # "off" may differ from "on" where weights were repacked.
        row = {"model": name, "file": path.name,
               "identical_to_on": {mode: all(r["tokens"] == ref for r in rs) for mode, rs in runs.items()}}
        for mode, rs in runs.items():
            row[mode] = {"tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rs),
                         "tokens_per_s": [round(r["tokens_per_s"], 2) for r in rs],
                         "n_repacked_patterns": rs[0]["n_repacked_patterns"]}
        on = row["on"]["tokens_per_s_median"]
        row["amx_off_vs_on"] = row["amx-off"]["tokens_per_s_median"] / on
        row["off_vs_on"] = row["off"]["tokens_per_s_median"] / on
        doc["models"].append(row)
        print(f"{name}: on {on:.1f} tok/s · amx-off {row['amx_off_vs_on']:.2f}x · off {row['off_vs_on']:.2f}x · "
              f"same tokens as on: {row['identical_to_on']}", flush=True)
    if a.out:
        a.out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
