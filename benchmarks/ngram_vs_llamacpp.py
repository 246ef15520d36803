"""specq's n-gram drafter against llama.cpp's own n-gram speculative types, like for like.

Same target GGUF (the demo target unless --target), same llama.cpp tree (the llama-cpp-python sdist's
vendor/llama.cpp, built with CMake: see vs_llamacpp.py), same threads and context, greedy, the same prompts: each
prompt of the set rendered with the target's chat template (as bench --chat does) and detokenized to raw text,
which both tokenize with special tokens parsed. Runs alternate per prompt and repeat (the order rotates); a tool's
rate in a repeat is its generated tokens over its generation time summed over the prompts (llama.cpp: its
"decoded N tokens in S seconds"; specq: the generation's own time, in process), and medians over repeats compare.

    python benchmarks/ngram_vs_llamacpp.py --llama-bin DIR [--set copy] [--types ngram-simple,ngram-map-k,ngram-cache]
        [--repeat 5] [--n-predict 128] [--threads 2] [--draft-max auto] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from drafters import SETS, load_set, machine  # noqa: E402 (benchmarks/ is the script's folder)
from vs_llamacpp import DECODED

from specq.native.commands.bench import BenchConfig, prompt_tokens
from specq.native.commands.demo import demo_pair
from specq.native.runtime.config import EngineConfig
from specq.native.runtime.engine import Engine
from specq.native.core.settings import GenerationSettings


def raw_prompts(eng: Engine, set_name: str, limit: int) -> tuple[list[str], list[str]]:
    """The set's prompts as one chat turn each, rendered to raw text (special tokens written out)."""
    names, prompts = load_set(set_name)
    names, prompts = list(names[:limit or None]), list(prompts[:limit or None])
    cfg = BenchConfig(engine=EngineConfig(str(eng.target.path)), prompts=tuple(prompts), chat=True)
    return names, [b"".join(eng.target.piece(t) for t in toks).decode("utf-8", "replace")
                   for toks in prompt_tokens(eng, cfg)]


def run_llamacpp(binary: Path, target: str, raw: str, spec_type: str, a) -> dict:
    cmd = [str(binary), "-m", target, "--spec-type", spec_type, "-p", raw, "-n", str(a.n_predict), "--temp", "0",
           "--seed", "0", "-t", str(a.threads), "-c", str(a.ctx), "-ngl", "0"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    log = p.stdout + p.stderr
    m = DECODED.search(log)
    if p.returncode != 0 or not m:
        sys.exit(f"llama-speculative-simple --spec-type {spec_type} failed ({p.returncode}):\n{log[-3000:]}")
    return {"tool": spec_type, "n_generated": int(m.group(1)), "gen_s": float(m.group(2)),
            "wall_s": time.perf_counter() - t0}


def run_specq(eng: Engine, raw: str, a) -> dict:
    draft_max = a.draft_max if a.draft_max == "auto" else int(a.draft_max)
    s = GenerationSettings(n_predict=a.n_predict, draft_max=draft_max, drafter="ngram").validate()
    g = eng.session().generate(eng.tokenize(raw), s).run()
    st = g.stats
    return {"tool": "specq-ngram", "n_generated": st.n_generated, "gen_s": st.gen_ms / 1e3,
            "n_drafted": st.n_drafted, "n_accepted": st.n_accepted, "n_steps": st.n_steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", type=Path, required=True, help="folder with llama-speculative-simple")
    ap.add_argument("--target")
    ap.add_argument("--set", default="copy", choices=sorted(SETS))
    ap.add_argument("--types", default="ngram-simple,ngram-map-k,ngram-cache")
    ap.add_argument("--limit-prompts", type=int, default=0)
    ap.add_argument("--n-predict", type=int, default=128)
    ap.add_argument("--draft-max", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    target = a.target or str(demo_pair()[0])
    binary = a.llama_bin / "llama-speculative-simple"
    tools = a.types.split(",") + ["specq-ngram"]
    runs = []
    with Engine(target, None, ctx=a.ctx, threads=a.threads) as eng:
        names, raws = raw_prompts(eng, a.set, a.limit_prompts)
        for rep in range(a.repeat):
            for pi, raw in enumerate(raws):
                shift = (rep + pi) % len(tools)
                for tool in tools[shift:] + tools[:shift]:
                    r = run_specq(eng, raw, a) if tool == "specq-ngram" else run_llamacpp(binary, target, raw, tool, a)
                    r.update(repeat=rep, prompt_index=pi, prompt_name=names[pi],
                             tokens_per_s=r["n_generated"] / r["gen_s"])
                    runs.append(r)
                    print(f"rep {rep} {names[pi]:12s} {tool:12s} {r['tokens_per_s']:7.1f} tok/s", file=sys.stderr,
                          flush=True)
    per_repeat = {t: [] for t in tools}
    for rep in range(a.repeat):
        for t in tools:
            rows = [r for r in runs if r["repeat"] == rep and r["tool"] == t]
            per_repeat[t].append(sum(r["n_generated"] for r in rows) / sum(r["gen_s"] for r in rows))
    med = {t: statistics.median(v) for t, v in per_repeat.items()}
    best = max(a.types.split(","), key=lambda t: med[t])
    args = ["<llama.cpp build>/bin" if x == str(a.llama_bin) else x for x in sys.argv[1:]]  # no path of this machine
    doc = {"machine": machine(), "command": " ".join(["python", "benchmarks/ngram_vs_llamacpp.py", *args]),
           "target": Path(target).name, "set": a.set, "prompts": names, "n_predict": a.n_predict,
           "threads": a.threads, "draft_max": a.draft_max, "repeat": a.repeat,
           "tokens_per_s_per_repeat": per_repeat, "median_tokens_per_s": med, "best_llamacpp": best,
           "specq_vs_best_llamacpp": med["specq-ngram"] / med[best],
           "runs": [{k: v for k, v in r.items()} for r in runs]}
    text = json.dumps(doc, indent=1)
    if a.out:
        a.out.write_text(text + "\n")
    print(json.dumps({k: v for k, v in doc.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
