"""What the KV cache type and n_ubatch do to a target's decoding and prompt speed on this machine, measured with
llama.cpp's own llama-bench on the llama-cpp-python wheel's libraries (the build specq runs on).

    python benchmarks/kv_ubatch.py --llama-bench /tmp/llama-build/bin/llama-bench \\
        --json benchmarks/results/kv_ubatch-demo-epyc2.json [--model M.gguf] [--threads 2] [--depths 2048,8192]

Two sweeps on the target (default: the demo target):
  decode: tg16 at each depth, K/V cache f16 and q8_0 (`-ctk/-ctv`), flash attention off and on; a quantized V
          cache needs flash attention, so q8_0 with it off quantizes K only.
  prompt: pp512 with n_ubatch 128, 256 and 512 (`-ub`), flash attention off and on.
  verify: a 5-token batch at each depth (`-p 5 -d D`: what a speculative verify of 4 drafted tokens costs), K
          cache f16 and q8_0, flash attention off and on (`--no-verify` skips it).
specq's defaults are f16 caches and n_ubatch = n_batch (512).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from adaptive import machine  # noqa: E402
from long_context import wheel_libs  # noqa: E402

from specq.native.commands.demo import demo_pair  # noqa: E402

KEEP = ("n_prompt", "n_gen", "n_depth", "flash_attn", "type_k", "type_v", "n_ubatch", "n_threads", "avg_ts",
        "stddev_ts")


def bench(binary: str, model: Path, args: list[str], libs: Path) -> list[dict]:
    import os

    env = dict(os.environ, LD_LIBRARY_PATH=str(libs))
    cmd = [binary, "-m", str(model), "-ngl", "0", "-o", "json", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    return [{k: row.get(k) for k in KEEP} for row in json.loads(out)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--depths", default="2048,8192")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    model = Path(a.model) if a.model else demo_pair()[0]
    libs = wheel_libs()
    t, r = ["-t", str(a.threads)], ["-r", str(a.repeat)]
    doc = {"command": " ".join(["python", "benchmarks/kv_ubatch.py", *sys.argv[1:]]), "machine": machine(),
           "model": model.name, "libs": "the llama-cpp-python wheel's"}
    doc["decode"] = bench(a.llama_bench, model, ["-p", "0", "-n", "16", "-d", a.depths, "-fa", "0",
                                                 "-ctk", "f16,q8_0", *t, *r], libs)
    doc["decode"] += bench(a.llama_bench, model, ["-p", "0", "-n", "16", "-d", a.depths, "-fa", "1",
                                                  "-ctk", "f16,q8_0", "-ctv", "f16,q8_0", *t, *r], libs)
    doc["prompt"] = bench(a.llama_bench, model, ["-p", "512", "-n", "0", "-ub", "128,256,512", "-fa", "0,1",
                                                 *t, *r], libs)
    if not a.no_verify:
        doc["verify"] = bench(a.llama_bench, model, ["-p", "5", "-n", "0", "-d", a.depths, "-fa", "0,1",
                                                     "-ctk", "f16,q8_0", *t, *r], libs)
    Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    for row in doc["decode"] + doc["prompt"] + doc.get("verify", []):
        print(row)


if __name__ == "__main__":
    main()
