"""Speculation at long context: target alone vs auto vs fixed draft lengths at 0.5k-8k tokens of prompt.

Prompts are real English text (the docstrings of Python's standard library modules, the same for a given
Python version), cut to each length in tokens. For each pair and length one session evaluates the prompt
once; every run then rolls the session back to all but the prompt's last 16 tokens and generates from there
(a chat turn at that depth), so runs differ only in how they decode. auto starts each run with a fresh
controller: nothing measured before, as in a new session. Runs alternate (plain, auto, fixed k ...) and
the medians of `--repeat` rounds are reported, with each mode's steps, plain steps and acceptance.

With `--llama-bench PATH`, llama.cpp's own llama-bench (built from the same vendored tree) measures the
target's plain decoding at the same depths with flash attention off and on, same threads: specq's target
alone should reach the better of the two. It runs on the wheel's libllama and ggml (LD_LIBRARY_PATH), so both
sides use the same build of the same code; `--llama-bench-own-libs` keeps its CMake build's.

    python benchmarks/long_context.py --json benchmarks/results/long_context.json \
        [--pairs demo,deep] [--lengths 512,2048,4096,8192] [--n-predict 48] [--repeat 3] [--threads 2] \
        [--fixed 2,4] [--llama-bench /tmp/llama-build/bin/llama-bench] [--draft-ctx default,0] [--task retrieval]

`--task retrieval` ends each prompt with a request to quote the document's first paragraphs, so that the answer
copies from thousands of tokens back: the case where a draft window (`--draft-ctx N`) must lose acceptance.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from adaptive import machine  # noqa: E402
from deep_pair import deep_pair  # noqa: E402

from specq.native.commands.demo import demo_pair  # noqa: E402
from specq.native.runtime.engine import Engine  # noqa: E402
from specq.native.core.settings import GenerationSettings  # noqa: E402

MODULES = ("argparse", "subprocess", "typing", "collections", "json", "asyncio", "unittest", "logging", "email",
           "http.client", "decimal", "datetime", "pathlib", "re", "socket", "threading", "tarfile", "zipfile", "csv",
           "sqlite3", "functools", "itertools", "inspect", "pickle", "random", "statistics", "textwrap", "string",
           "shutil", "tempfile", "heapq", "bisect", "enum", "dataclasses", "contextlib", "abc", "io", "os", "sys")
TAIL = 16  # the prompt's last tokens, evaluated by each run (the turn's new text)
# --task retrieval: the document is followed by a request whose answer copies from its beginning, thousands of
# tokens back (where a draft window cannot see)
QUESTION = "\n\nQuote the first two paragraphs of the text above, word for word.\n\nThe text begins:"


def real_text() -> str:
    docs = []
    for name in MODULES:
        doc = importlib.import_module(name).__doc__
        if doc:
            docs.append(doc.strip())
    return "\n\n".join(docs)


def pairs(names: list[str]) -> dict[str, tuple[Path, Path]]:
    out = {}
    for name in names:
        out[name] = demo_pair() if name == "demo" else deep_pair()
    return out


def prompt_of(eng: Engine, text: str, n: int, task: str) -> list[int]:
    """The first n tokens of the text (continue), or its first n - len(question) tokens and the question."""
    toks = eng.tokenize(text)
    if len(toks) < n:
        raise SystemExit(f"the text has {len(toks)} tokens, fewer than {n}")
    if task == "continue":
        return toks[:n]
    q = eng.tokenize(QUESTION, add_special=False)
    return toks[:n - len(q)] + q


def run_length(eng: Engine, toks: list[int], modes: list, n_predict: int, repeat: int, log) -> dict:
    ses = eng.session()
    ses.prefill(toks[:-TAIL])
    base = len(ses.history)
    runs = []
    for rep in range(repeat):
        for mode in modes:
            ses.rollback(base)
            ses._controllers.clear()  # auto: nothing measured before this run
            ses.reader.trial.reset()  # nor a draft window chosen (--ctx-draft auto), as in a new session
            spec = mode != "plain"
            settings = GenerationSettings(n_predict=n_predict, draft_max=mode if spec else 8)
            g = ses.generate(toks[-TAIL:], settings, speculative=spec).run()
            st = g.stats
            row = {"repeat": rep, "mode": str(mode), "n_prompt": len(toks), "tokens": g.tokens,
                   "tokens_per_s": st.tokens_per_s, "gen_ms": st.gen_ms, "prompt_ms": st.prompt_ms,
                   "n_generated": st.n_generated, "n_steps": st.n_steps, "n_drafted": st.n_drafted,
                   "n_accepted": st.n_accepted, "n_plain_steps": st.n_plain_steps, "n_probes": st.n_probes,
                   "steps_by_k": dict(st.steps_by_k), "draft_ms": st.draft_ms, "verify_ms": st.verify_ms,
                   "n_draft_slides": st.n_draft_slides, "draft_window": st.draft_window,
                   "n_window_trials": st.n_window_trials, "n_window_reverts": st.n_window_reverts,
                   "verify_ms_by_size": [list(v) for v in st.verify_ms_by_size]}
            runs.append(row)
            log(f"  rep {rep} {str(mode):5s} {st.tokens_per_s:6.2f} tok/s  steps {st.n_steps} "
                f"plain {st.n_plain_steps} drafted {st.n_drafted} accepted {st.n_accepted} "
                f"window {st.draft_window} (reverts {st.n_window_reverts}) prompt {st.prompt_ms:.0f} ms")
    ses.reset()
    return summarise(runs, modes)


def summarise(runs: list[dict], modes: list) -> dict:
    med = {str(m): statistics.median(r["tokens_per_s"] for r in runs if r["mode"] == str(m)) for m in modes}
    fixed = [str(m) for m in modes if m not in ("plain", "auto")]
    best = max(fixed, key=lambda m: med[m]) if fixed else None
    plain_tokens = next(r["tokens"] for r in runs if r["mode"] == "plain")
    out = {"median_tokens_per_s": med, "best_fixed": best,
           "identical_output": all(r["tokens"] == plain_tokens for r in runs),
           "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs]}
    if "auto" in med:
        out["auto_vs_plain"] = med["auto"] / med["plain"]
        auto = [r for r in runs if r["mode"] == "auto"]
        out["auto_plain_steps"] = sum(r["n_plain_steps"] for r in auto)
        out["auto_steps"] = sum(r["n_steps"] for r in auto)
        if best:
            out["auto_vs_best_fixed"] = med["auto"] / med[best]
    if best:
        out["best_fixed_vs_plain"] = med[best] / med["plain"]
    return out


def wheel_libs() -> Path:
    """The folder of the installed llama-cpp-python's libllama and ggml libraries."""
    import llama_cpp

    return Path(llama_cpp.__file__).parent / "lib"


def llama_bench(binary: str, model: Path, depths: list[int], threads: int, repeat: int, libs: Path | None) -> list[dict]:
    """llama-bench's tg16 at each depth with flash attention off and on (its JSON rows, trimmed). libs: a folder
    put first on LD_LIBRARY_PATH, so that the binary runs on those libllama/ggml builds (a CMake build's
    RUNPATH yields to it) — the wheel's, for a like-for-like comparison with specq."""
    cmd = [binary, "-m", str(model), "-p", "0", "-n", "16", "-d", ",".join(map(str, depths)), "-fa", "0,1",
           "-t", str(threads), "-r", str(repeat), "-ngl", "0", "-o", "json"]
    env = dict(os.environ)
    if libs is not None:
        env["LD_LIBRARY_PATH"] = f"{libs}:{env['LD_LIBRARY_PATH']}" if env.get("LD_LIBRARY_PATH") else str(libs)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    keep = ("n_depth", "flash_attn", "n_gen", "n_threads", "avg_ts", "stddev_ts", "samples_ts", "type_k", "n_ubatch")
    return [{k: row.get(k) for k in keep} for row in json.loads(out)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", default="demo,deep")
    ap.add_argument("--lengths", default="512,2048,4096,8192")
    ap.add_argument("--n-predict", type=int, default=48)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fixed", default="2,4", help="fixed draft lengths to compare (the best one is reported)")
    ap.add_argument("--flash-attn", default="auto")
    ap.add_argument("--llama-bench", help="path of llama.cpp's llama-bench, built from the same tree")
    ap.add_argument("--llama-bench-repeat", type=int, default=2)
    ap.add_argument("--llama-bench-own-libs", action="store_true",
                    help="run llama-bench on the libraries of its own build (default: the wheel's, like for like)")
    ap.add_argument("--draft-ctx", default="default",
                    help="draft contexts to compare, comma-separated: default = specq's (auto: the whole prompt, "
                         "or a 512-token window where a trial at the prompt measures that it pays), "
                         "0 = the whole prompt too, N = a window of the last N tokens "
                         "(--ctx-draft); each is its own entry: <pair>, <pair>@all, <pair>@window<N>")
    ap.add_argument("--task", choices=("continue", "retrieval"), default="continue",
                    help="continue the text (default), or answer a request to quote its beginning")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    modes = ["plain", "auto", *[int(k) for k in a.fixed.split(",") if k]]
    text = real_text()
    doc = {"command": " ".join(["python", "benchmarks/long_context.py", *sys.argv[1:]]), "machine": machine(),
           "n_predict": a.n_predict, "repeat": a.repeat, "threads": a.threads, "tail_tokens": TAIL,
           "flash_attn": a.flash_attn, "prompt_source": "docstrings of " + ",".join(MODULES), "task": a.task,
           "pairs": {}}
    if a.task == "retrieval":
        doc["question"] = QUESTION

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    runs_of = [(name, tgt_dft, "auto" if w == "default" else int(w))
               for name, tgt_dft in pairs(a.pairs.split(",")).items() for w in a.draft_ctx.split(",")]
    for name, (target, draft), window in runs_of:
        key = name if window == "auto" else f"{name}@all" if window == 0 else f"{name}@window{window}"
        with Engine(target, draft, ctx=max(lengths) + a.n_predict + 64, threads=a.threads,
                    flash_attn=a.flash_attn, draft_ctx=window) as eng:
            entry = doc["pairs"][key] = {"target": target.name, "draft": draft.name, "draft_ctx": window,
                                         "draft_window": eng.draft_window, "lengths": {}}
            entry["target_flash_attn"] = a.flash_attn
            for n in lengths:
                log(f"{key} {n} tokens")
                t0 = time.perf_counter()
                entry["lengths"][str(n)] = run_length(eng, prompt_of(eng, text, n, a.task), modes, a.n_predict,
                                                      a.repeat, log)
                entry["lengths"][str(n)]["wall_s"] = time.perf_counter() - t0
        if a.llama_bench and window == "auto":
            log(f"{name}: llama-bench")
            libs = None if a.llama_bench_own_libs else wheel_libs()
            entry["llama_bench_libs"] = "its own build" if libs is None else "the llama-cpp-python wheel's"
            entry["llama_bench"] = llama_bench(a.llama_bench, target, lengths, a.threads, a.llama_bench_repeat, libs)
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
