"""specq's speculative loop against llama.cpp's own `llama-speculative-simple`, like for like.

Same GGUF pair, same llama.cpp tree (the llama-cpp-python sdist's vendor/llama.cpp, built with CMake),
same threads, context, draft settings and raw prompt; runs alternate (llama.cpp, specq, llama.cpp, ...)
and medians of >= 5 are reported. Also reports specq's Python overhead per step: the share of generation
time spent outside llama_decode.

Build llama.cpp's tool once (from the sdist of the same llama-cpp-python version):
    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/sdist && tar xzf ...
    cmake -B /tmp/llama-build -S .../vendor/llama.cpp -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF
    cmake --build /tmp/llama-build -j2 --target llama-speculative-simple
Run:
    python benchmarks/vs_llamacpp.py --llama-bin /tmp/llama-build/bin --repeat 5 --json docs/bench/vs_llamacpp.json
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "The history of the Roman Empire"
DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s")
ACCEPT = re.compile(r"accept\s+=\s+([\d.]+)%")
N_DRAFTED = re.compile(r"n_drafted\s+=\s+(\d+)")
N_ACCEPT = re.compile(r"n_accept\s+=\s+(\d+)")


def run_llamacpp(binary: Path, target: str, draft: str, a) -> dict:
    cmd = [str(binary), "-m", target, "--spec-type", "draft-simple", "--spec-draft-model", draft,
           "--spec-draft-n-max", str(a.draft_max), "--spec-draft-n-min", "0", "--spec-draft-p-min", str(a.p_min),
           "-p", a.prompt, "-n", str(a.n_predict), "--temp", "0", "--seed", "0", "-t", str(a.threads),
           "-c", str(a.ctx), "-ngl", "0", "--spec-draft-ngl", "0", *a.llama_args.split()]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, errors="replace")  # random weights: any bytes
    if p.returncode != 0:
        sys.exit(f"llama-speculative-simple failed ({p.returncode}):\n{p.stderr[-3000:]}")
    log = p.stdout + p.stderr
    m = DECODED.search(log)
    if not m:
        sys.exit(f"could not parse llama-speculative-simple output:\n{log[-3000:]}")
    return {"tool": "llama.cpp", "n_generated": int(m.group(1)), "gen_s": float(m.group(2)),
            "tokens_per_s": float(m.group(3)),
            "accept_rate": float(ACCEPT.search(log).group(1)) / 100 if ACCEPT.search(log) else None,
            "n_drafted": int(N_DRAFTED.search(log).group(1)) if N_DRAFTED.search(log) else None,
            "n_accepted": int(N_ACCEPT.search(log).group(1)) if N_ACCEPT.search(log) else None,
            "wall_s": time.perf_counter() - t0, "command": cmd}


def run_specq(target: str, draft: str, a, default: bool = False) -> dict:
    """specq with llama.cpp's draft settings; default=True: specq's own defaults (draft-max auto) and the
    target alone in the same process (the baseline row)."""
    cmd = [sys.executable, "-m", "specq.cli.main", "bench", "--target", target, "--draft", draft,
           "--prompt", a.prompt, "--n-predict", str(a.n_predict), "--temp", "0", "--seed", "0",
           "--threads", str(a.threads), "--ctx", str(a.ctx), "--ngl", "0", "--ngl-draft", "0", "--json", "-", "-q"]
    if not default:
        cmd += ["--draft-max", str(a.draft_max), "--p-min", str(a.p_min), "--no-baseline"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    cmd[0] = "python"  # recorded without this machine's path
    if p.returncode != 0:
        sys.exit(f"specq bench failed ({p.returncode}): {p.stderr[-3000:]}")
    rows = json.loads(p.stdout)["runs"]
    row = next(r for r in rows if r.get("n_steps") is not None)
    out = {"tool": "specq-default" if default else "specq", "n_generated": row["n_generated"],
           "gen_s": row["gen_ms"] / 1000,
           "tokens_per_s": row["tokens_per_s"], "accept_rate": row["accept_rate"], "n_drafted": row["n_drafted"],
           "n_accepted": row["n_accepted"], "n_steps": row["n_steps"], "decode_ms": row["decode_ms"],
           "gen_ms": row["gen_ms"], "overhead_fraction": row["overhead_fraction"],
           "python_ms_per_step": (row["gen_ms"] - row["decode_ms"]) / max(row["n_steps"], 1),
           "step_ms": row["gen_ms"] / max(row["n_steps"], 1),
           "n_rollbacks": row.get("n_rollbacks"), "n_restores": row.get("n_restores"), "command": cmd}
    base = [r for r in rows if r.get("n_steps") is None]
    if default and base:
        out["target_alone_tokens_per_s"] = base[0]["tokens_per_s"]
        out["identical_to_target_alone"] = base[0]["tokens"] == row["tokens"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", type=Path, required=True, help="folder with llama-speculative-simple")
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--n-predict", type=int, default=128)
    ap.add_argument("--draft-max", type=int, default=8)
    ap.add_argument("--p-min", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--llama-args", default="", help="more arguments for llama-speculative-simple (-nr on an AMX "
                                                      "Xeon, where its repacked Q4_1 draft crashes: NOTES.md)")
    ap.add_argument("--with-default", action="store_true",
                    help="also run specq with its default settings (draft-max auto) and the target alone")
    a = ap.parse_args()
    if a.target is None:
        from specq.native.commands.demo import demo_pair

        t, d = demo_pair()
        a.target, a.draft = str(t), str(d)
    binary = a.llama_bin / "llama-speculative-simple"
    runs = []
    tools = ["llama.cpp", "specq"] + (["specq-default"] if a.with_default else [])
    for i in range(a.repeat):
        for tool in tools[i % len(tools):] + tools[:i % len(tools)]:  # the order rotates with the repeat
            r = (run_llamacpp(binary, a.target, a.draft, a) if tool == "llama.cpp"
                 else run_specq(a.target, a.draft, a, default=tool == "specq-default"))
            r["repeat"] = i
            runs.append(r)
            print(f"{r['tool']:9s} rep {i}: {r['tokens_per_s']:6.1f} tok/s, accept {r['accept_rate']}", file=sys.stderr)

    def med(tool, key):
        vals = [r[key] for r in runs if r["tool"] == tool and r.get(key) is not None]
        return statistics.median(vals) if vals else None

    summary = {
        "llamacpp_tokens_per_s": med("llama.cpp", "tokens_per_s"),
        "specq_tokens_per_s": med("specq", "tokens_per_s"),
        "llamacpp_accept_rate": med("llama.cpp", "accept_rate"),
        "specq_accept_rate": med("specq", "accept_rate"),
        "specq_overhead_fraction": med("specq", "overhead_fraction"),
        "specq_python_ms_per_step": med("specq", "python_ms_per_step"),
        "specq_step_ms": med("specq", "step_ms"),
    }
    summary["ratio"] = summary["specq_tokens_per_s"] / summary["llamacpp_tokens_per_s"]
    if a.with_default:
        summary["specq_default_tokens_per_s"] = med("specq-default", "tokens_per_s")
        summary["target_alone_tokens_per_s"] = med("specq-default", "target_alone_tokens_per_s")
        summary["default_speedup"] = summary["specq_default_tokens_per_s"] / summary["target_alone_tokens_per_s"]
        summary["default_identical"] = all(r["identical_to_target_alone"] for r in runs
                                           if r["tool"] == "specq-default")
    doc = {"machine": {"platform": platform.platform(), "processor": platform.processor(),
                       "python": platform.python_version()},
           "settings": {k: v for k, v in vars(a).items() if k != "json"} | {"llama_bin": str(a.llama_bin),
                                                                          "json": str(a.json)},
           "runs": runs, "summary": summary}
    text = json.dumps(doc, indent=2, default=str)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(text + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
