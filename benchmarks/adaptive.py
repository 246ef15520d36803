"""draft_max=auto against plain decoding and a sweep of fixed draft lengths, on three pairs.

    python benchmarks/adaptive.py [--pairs good,useless,expensive,deep] [--n-predict 256]
        [--repeat 3] [--threads 2] [--prompts F.jsonl] [--limit-prompts N] [--good-sweep 1,2,4,8,16]
        [--temp T --top-k 40 --top-p 0.9 --seed S] [--out results.json]

Pairs (all share the SmolLM2-135M vocabulary; the target is the demo pair's F32 target):
  useless:   the target's first 2 layers (+ embeddings/output): ~0% acceptance
  expensive: the target's first 19 of 30 layers: costs ~0.7 of the target
  good:      the demo pair's Q4_1 draft
  deep:      benchmarks/deep_pair.py's pair (a 120-block F16 target made from the demo target, the demo draft)
At --temp > 0 every mode samples with the same seed (rejection sampling under speculation); "best fixed" is the
fixed length with the best median over the repeats, and `stability` gives each mode's slowest repeat ÷ its median.
Each pair runs through `specq bench`'s own loop (run_bench): the built-in prompt set (or --prompts, e.g.
benchmarks/prompts/adaptive12.jsonl), each prompt as one chat turn, baseline and every draft-max (auto included) alternating per prompt and repeat. A mode's rate
is its generated tokens over its generation time summed over the prompts, per repeat; the median over
repeats is compared. (draft_max=auto keeps what it learned across a session's generations, as in chat.)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import gguf
import numpy as np

from specq.native.llama import ffi as _ffi
from specq.native.commands.bench import BenchConfig, load_prompt_set, read_prompt_set, run_bench
from specq.native.commands.demo import cache_dir, demo_pair
from specq.native.commands.placement import default_ngl
from specq.native.runtime.config import EngineConfig
from specq.native.core.settings import GenerationSettings
from deep_pair import deep_pair  # noqa: E402 (benchmarks/ is the script's folder)


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


def file_names_only(doc: dict) -> None:
    """A bench document's model paths as file names: no path of this machine in the committed JSON."""
    for role in ("target", "draft"):
        if doc.get(role):
            doc[role]["path"] = Path(doc[role]["path"]).name


def machine() -> dict:
    model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    return {"cpu": model, "logical_cpus": __import__("os").cpu_count(), "python": platform.python_version(),
            "llama_cpp_python": _ffi.llama_cpp_python_version()}


def mode_of(run: dict) -> str:
    return "baseline" if run["mode"] == "baseline" else str(run["draft_max"])


def load_prompts(path: str | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The built-in prompt set, or a JSONL file of {"name", "prompt"} objects."""
    if path is None:
        return load_prompt_set("default")
    return read_prompt_set(Path(path).read_text(encoding="utf-8"))


def run_pair(name: str, target: Path, draft: Path, sweep: list, n_predict: int, repeat: int,
             threads: int | None, prompt_file: str | None = None, settings: GenerationSettings | None = None,
             limit: int = 0) -> dict:
    names, prompts = load_prompts(prompt_file)
    if limit:
        names, prompts = names[:limit], prompts[:limit]
    engine = EngineConfig(str(target), str(draft), threads=threads, ngl=default_ngl(), ngl_draft=default_ngl())
    cfg = BenchConfig(engine=engine, prompts=prompts, prompt_names=names, chat=True,
                      settings=settings or GenerationSettings(n_predict=n_predict), repeat=repeat,
                      sweep=tuple((k, 0.0) for k in sweep))

    def progress(run: dict) -> None:
        print(f"{name:9s} rep {run['repeat']} {run['prompt_name']:9s} {mode_of(run):8s} "
              f"{run['tokens_per_s']:6.1f} tok/s", file=sys.stderr, flush=True)

    doc = run_bench(cfg, on_run=progress)
    modes = list(dict.fromkeys(mode_of(r) for r in doc["runs"]))
    per_repeat = {m: [] for m in modes}
    for rep in range(repeat):
        for m in modes:
            rows = [r for r in doc["runs"] if r["repeat"] == rep and mode_of(r) == m]
            per_repeat[m].append(1e3 * sum(r["n_generated"] for r in rows) / sum(r["gen_ms"] for r in rows))
    med = {m: statistics.median(v) for m, v in per_repeat.items()}
    fixed = [m for m in modes if m not in ("baseline", "auto")]
    best = max(fixed, key=lambda m: med[m])
    cost = next(pt["summary"]["cost_ratio"] for pt in doc["sweep"] if str(pt["draft_max"]) == best)
    auto_runs = [r for r in doc["runs"] if mode_of(r) == "auto"]
    file_names_only(doc)
    stability = {m: min(v) / med[m] for m, v in per_repeat.items()}
    return {"pair": name, "target": Path(target).name, "draft": Path(draft).name, "cost_ratio_at_best_fixed": cost,
            "prompts": list(names), "tokens_per_s_per_repeat": per_repeat, "median_tokens_per_s": med,
            "stability": stability,
            "auto_vs_plain": med["auto"] / med["baseline"], "best_fixed": best,
            "auto_vs_best_fixed": med["auto"] / med[best],
            "auto_steps": sum(r["n_steps"] for r in auto_runs),
            "auto_plain_steps": sum(r["n_plain_steps"] for r in auto_runs),
            "auto_probes": sum(r["n_probes"] for r in auto_runs),
            "identical_output": all(pt["summary"]["identical_output"] for pt in doc["sweep"]),
            "bench": doc}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-predict", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--pairs", default="useless,expensive,good")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prompts", help="a JSONL prompt file instead of the built-in set")
    ap.add_argument("--good-sweep", default="1,2,4,8,16", help="fixed draft lengths to run on the good and deep pairs")
    ap.add_argument("--limit-prompts", type=int, default=0, help="only the first N prompts of the set")
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=40)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    a = ap.parse_args()
    target, good = demo_pair()
    sweep = [int(k) for k in a.good_sweep.split(",")] + ["auto"]
    pairs = {
        "useless": lambda: (target, first_layers(target, cache_dir() / "SmolLM2-135M-first2.F32.gguf", 2), [4, "auto"]),
        "expensive": lambda: (target, first_layers(target, cache_dir() / "SmolLM2-135M-first19.F32.gguf", 19),
                              [2, "auto"]),
        "good": lambda: (target, good, sweep),
        "deep": lambda: (*deep_pair(), sweep),
    }
    settings = GenerationSettings(n_predict=a.n_predict, temp=a.temp, top_k=a.top_k, top_p=a.top_p, seed=a.seed)
    doc = {"machine": machine(), "command": " ".join(sys.argv), "n_predict": a.n_predict, "repeat": a.repeat,
           "temp": a.temp, "top_k": a.top_k, "top_p": a.top_p, "seed": a.seed,
           "prompt_set": (a.prompts or "default") + " (each prompt as one chat turn)", "results": []}
    for name in a.pairs.split(","):
        t, d, modes = pairs[name]()
        res = run_pair(name, t, d, modes, a.n_predict, a.repeat, a.threads, a.prompts, settings, a.limit_prompts)
        doc["results"].append(res)
        med = res["median_tokens_per_s"]
        print(f"{name}: " + " · ".join(f"{m} {v:.1f}" for m, v in med.items())
              + f" tok/s; auto {res['auto_vs_plain']:.2f}x plain, {res['auto_vs_best_fixed']:.2f}x best fixed "
              f"(k={res['best_fixed']})", file=sys.stderr, flush=True)
    text = json.dumps(doc, indent=1)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
