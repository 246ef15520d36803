"""llama.cpp's `llama-lookup` (examples/lookup, the same vendored tree) over a list of requests, for agentic.py:
its n-gram cache at the context level alone (`lookup`), or with a static cache file that `llama-lookup-create`
builds from the warm-up half's text (its prompts and the answers llama-lookup gave them) and a dynamic cache file
that every run reads and writes back (`-lcd`: the warm-up half's runs fill it, the measured half's go on
updating it, as a server that kept it would) — `lookup-cached`.

A run's rate is its own "decoded N tokens in S seconds" (the prompt's evaluation not counted, as specq's gen_ms);
llama-lookup stops after the step that passes -n, so it may print a few tokens more than asked.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from vs_llamacpp import DECODED, N_ACCEPT, N_DRAFTED  # llama.cpp's examples print the same summary lines


def lookup(bin_dir: Path, target: Path, prompt: str, work: Path, a, seed: int, draft_max: int,
           static: Path | None = None, dynamic: Path | None = None) -> dict:
    """One request through llama-lookup: its answer's text, generated tokens, generation seconds, drafted and
    accepted tokens."""
    f = work / "prompt.txt"
    f.write_text(prompt, encoding="utf-8")
    cmd = [str(bin_dir / "llama-lookup"), "-m", str(target), "-f", str(f), "-n", str(a.n_predict),
           "--temp", str(a.temp), "--seed", str(seed), "-t", str(a.threads), "-tb", str(a.threads),
           "-c", str(a.ctx), "--spec-draft-n-max", str(draft_max)]
    if static is not None:
        cmd += ["-lcs", str(static)]
    if dynamic is not None:
        cmd += ["-lcd", str(dynamic)]
    p = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    m = DECODED.search(p.stderr)
    if p.returncode != 0 or not m:
        sys.exit(f"llama-lookup failed ({p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    out = p.stdout
    at = out.find(prompt)
    text = out[at + len(prompt):] if at >= 0 else out
    return {"text": text.strip("\n"), "n_generated": int(m.group(1)), "gen_ms": 1e3 * float(m.group(2)),
            "n_drafted": int(N_DRAFTED.search(p.stderr).group(1)),
            "n_accepted": int(N_ACCEPT.search(p.stderr).group(1))}


def build_static(bin_dir: Path, target: Path, corpus: str, work: Path, a) -> Path:
    """llama-lookup-create's static cache from `corpus` (tokenized as one text)."""
    f, static = work / "corpus.txt", work / "static.bin"
    f.write_text(corpus, encoding="utf-8")
    p = subprocess.run([str(bin_dir / "llama-lookup-create"), "-m", str(target), "-f", str(f), "-c", "0",
                        "-t", str(a.threads), "-lcs", str(static)], capture_output=True, text=True, errors="replace")
    if p.returncode != 0 or not static.exists():
        sys.exit(f"llama-lookup-create failed ({p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    return static


def warm_caches(bin_dir: Path, target: Path, prompts: list[str], work: Path, a, draft_max: int) -> tuple[Path, Path]:
    """The warm-up half through llama-lookup with a dynamic cache file (filled by each run), then the static cache
    from the half's prompts and those answers."""
    dynamic = work / "dynamic.bin"
    dynamic.unlink(missing_ok=True)
    corpus = []
    for prompt in prompts:
        r = lookup(bin_dir, target, prompt, work, a, 0, draft_max, dynamic=dynamic)
        corpus.append(prompt + r["text"])
    return build_static(bin_dir, target, "\n".join(corpus), work, a), dynamic
