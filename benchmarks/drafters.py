"""Drafters against the target alone: model, ngram, model+ngram and auto (and mtp on a target with an MTP head).

    python benchmarks/drafters.py [--sets general,copy,copy_edit] [--modes ngram,auto] [--n-predict 256] [--repeat 3] [--threads 2]
        [--draft-max auto] [--limit-prompts N] [--target T.gguf --draft D.gguf | --no-draft | --draft-layers N]
        [--temp T] [--raw] [--vocab-map tli|string|auto] [--drop-shared F] [--out results.json]

Default pair: the demo pair (SmolLM2-135M-Instruct F32 target, its Q4_1 draft). `--draft-layers N`: the draft is
the target's own first N blocks (embeddings and output kept; adaptive.first_layers): a useless draft of the same
vocabulary, which auto must leave alone. Prompt sets:
  general: the built-in prompt set (code, chat, reasoning, Chinese, a long-document summary)
  copy:    benchmarks/prompts/copy_heavy.jsonl, editing and summarising tasks whose answers copy from the prompt
  copy_edit: benchmarks/prompts/copy_edit.jsonl, whole functions of 10-40 lines returned with one small change
  adaptive12: benchmarks/prompts/adaptive12.jsonl, twelve everyday requests (SQL, bash, an email, ...) with nothing to copy
`--draft-layers N --cut-draft`: the draft given (or the demo's Q4_1) keeps only its first N blocks instead.
`--drop-shared F`: a draft of another vocabulary shares a random fraction F of its shared tokens no more (seeded;
each token with the same chance, so about F of the shared mass goes): the overlap lowered on a real pair.
Each prompt runs as one chat turn (--raw: as raw text, for a base model). Within a repeat, every prompt runs every mode, target alone included, in an
order that rotates with the repeat (alternating runs); each mode keeps one session for the whole benchmark, so
the adaptive controller (draft-max auto, drafter auto) keeps what it learned across prompts, as in chat. A mode's
rate in a repeat is its generated tokens over its generation time summed over the set's prompts; the medians over
repeats are compared, each against the target alone of the same run.

A target with an MTP head (e.g. Qwen3.6-27B converted with its MTP layers; none can be downloaded on the dev
machines) adds the `mtp` and `mtp,ngram` modes, and `auto` chooses among model, ngram and mtp:
    python benchmarks/drafters.py --target qwen3.6-27b-mtp.Q4_K_M.gguf --draft qwen3.5-0.8b.Q8_0.gguf --ngl 99 \\
        --ngl-draft 99 --out benchmarks/results/drafters-mtp-<gpu>.json
(or --no-draft for ngram, mtp and auto without a draft model); benchmarks/drafters_gpu.sh runs it on a GPU machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

from specq.native.llama import ffi as _ffi
from specq.native.commands import placement
from specq.native.commands.bench import load_prompt_set, prompt_tokens, read_prompt_set, run_record, BenchConfig
from specq.native.commands.demo import demo_pair
from specq.native.runtime.config import EngineConfig
from specq.native.runtime.engine import Engine
from specq.native.core.settings import GenerationSettings

HERE = Path(__file__).parent
SETS = {"general": None, "copy": HERE / "prompts" / "copy_heavy.jsonl",
        "copy_edit": HERE / "prompts" / "copy_edit.jsonl", "adaptive12": HERE / "prompts" / "adaptive12.jsonl"}


def machine() -> dict:
    model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    return {"cpu": model, "logical_cpus": __import__("os").cpu_count(), "python": platform.python_version(),
            "llama_cpp_python": _ffi.llama_cpp_python_version(), "gpu_offload": _ffi.supports_gpu_offload()}


def load_set(name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    path = SETS[name]
    if path is None:
        return load_prompt_set("default")
    return read_prompt_set(path.read_text(encoding="utf-8"))


def modes_for(has_draft: bool, has_mtp: bool) -> list[str]:
    """The drafters to compare (each against "baseline", the target alone)."""
    modes = ["model", "ngram", "model,ngram", "suffix"] if has_draft else ["ngram", "suffix"]
    if has_mtp:
        modes += ["mtp", "mtp,ngram"]
    return ["baseline"] + modes + ["auto"]


def run_set(eng: Engine, set_name: str, modes: list[str], a) -> dict:
    names, prompts = load_set(set_name)
    if a.limit_prompts:
        names, prompts = names[:a.limit_prompts], prompts[:a.limit_prompts]
    cfg = BenchConfig(engine=EngineConfig(str(eng.target.path)), prompts=prompts, chat=not a.raw)
    toks = prompt_tokens(eng, cfg)
    draft_max = a.draft_max if a.draft_max == "auto" else int(a.draft_max)
    sessions = {m: eng.session() for m in modes}
    if "suffix" in eng.provided:  # prompts stand alone here: no run drafts from another's answer (as bench)
        eng.provided["suffix"].learning = False
    runs = []
    for rep in range(a.repeat):
        order = modes[rep % len(modes):] + modes[:rep % len(modes)]  # alternate which mode runs first
        for pi, t in enumerate(toks):
            for m in order:
                spec = m != "baseline"
                s = GenerationSettings(n_predict=a.n_predict, draft_max=draft_max, temp=a.temp, seed=a.seed + rep,
                                       drafter=m if spec else "model").validate()
                ses = sessions[m]
                ses.reset()
                g = ses.generate(t, s, speculative=spec).run()
                row = run_record("speculative" if spec else "baseline", pi, rep, g, s, names[pi])
                row["drafter"] = m
                runs.append(row)
                print(f"{set_name:7s} rep {rep} {names[pi]:10s} {m:12s} {row['tokens_per_s']:7.1f} tok/s"
                      + (f"  drafted {row['n_drafted_by']}" if spec else ""), file=sys.stderr, flush=True)
    per_repeat = {m: [] for m in modes}
    for rep in range(a.repeat):
        for m in modes:
            rows = [r for r in runs if r["repeat"] == rep and r["drafter"] == m]
            per_repeat[m].append(1e3 * sum(r["n_generated"] for r in rows) / sum(r["gen_ms"] for r in rows))
    med = {m: statistics.median(v) for m, v in per_repeat.items()}
    singles = [m for m in modes if m not in ("baseline", "auto")]
    best = max(singles, key=lambda m: med[m], default=None)
    with_auto = "auto" in med and best is not None
    base_tokens = {(r["repeat"], r["prompt_index"]): r["tokens"] for r in runs if r["drafter"] == "baseline"}
    identical = all(r["tokens"] == base_tokens[(r["repeat"], r["prompt_index"])] for r in runs)
    auto_rows = [r for r in runs if r["drafter"] == "auto"]
    auto_by = {}
    for r in auto_rows:
        for k, v in r["n_drafted_by"].items():
            auto_by[k] = auto_by.get(k, 0) + v
    return {"set": set_name, "prompts": list(names), "tokens_per_s_per_repeat": per_repeat,
            "median_tokens_per_s": med, "vs_target_alone": {m: med[m] / med["baseline"] for m in med},
            "best_single": best, "auto_vs_best_single": med["auto"] / med[best] if with_auto else None,
            "auto_drafted_by": auto_by, "auto_plain_steps": sum(r["n_plain_steps"] for r in auto_rows),
            "auto_handovers": sum(r["n_handovers"] for r in auto_rows),
            "identical_output_greedy": identical, "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sets", default="general,copy")
    ap.add_argument("--n-predict", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--draft-max", default="auto")
    ap.add_argument("--limit-prompts", type=int, default=0, help="only the first N prompts of each set (smoke runs)")
    ap.add_argument("--target", help="target GGUF (default: the demo pair)")
    ap.add_argument("--draft", help="draft GGUF (default: the demo pair's, with the demo target)")
    ap.add_argument("--no-draft", action="store_true", help="no draft model: ngram, mtp and auto only")
    ap.add_argument("--draft-layers", type=int, default=0, help="the draft: the target's first N blocks (useless)")
    ap.add_argument("--modes", help="only these drafter modes (comma list; the target alone always runs)")
    ap.add_argument("--cut-draft", action="store_true", help="--draft-layers cuts the draft, not the target")
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ngl", type=int, default=None)
    ap.add_argument("--ngl-draft", type=int, default=None)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--raw", action="store_true", help="prompts as raw text, not chat turns (a base model)")
    ap.add_argument("--vocab-map", default="auto", help="a draft of another vocabulary: tli, string or auto")
    ap.add_argument("--drop-shared", type=float, default=0.0, help="a draft of another vocabulary: share a "
                    "random fraction of its shared tokens no more (a lower overlap)")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.target:
        target, draft = Path(a.target), (Path(a.draft) if a.draft else None)
    else:
        target, draft = demo_pair()
    if a.no_draft:
        draft = None
    if a.draft_layers:
        from adaptive import first_layers
        from specq.native.commands.demo import cache_dir

        src = draft if a.cut_draft else target
        draft = first_layers(src, cache_dir() / f"{src.stem}-first{a.draft_layers}.gguf", a.draft_layers)
    ngl = placement.default_ngl() if a.ngl is None else a.ngl
    ngl_draft = placement.default_ngl() if a.ngl_draft is None else a.ngl_draft
    doc = {"machine": machine(), "command": " ".join(["python", "benchmarks/drafters.py", *sys.argv[1:]]),
           "target": target.name, "draft": draft.name if draft else None, "n_predict": a.n_predict,
           "repeat": a.repeat, "draft_max": a.draft_max, "temp": a.temp, "draft_layers": a.draft_layers,
           "cut_draft": a.cut_draft,
           "sets": []}
    with Engine(target, draft, ctx=a.ctx, threads=a.threads, ngl=ngl, ngl_draft=ngl_draft, mtp=None,
                vocab_map=a.vocab_map) as eng:
        doc["target_has_mtp"] = eng.mtp_ctx is not None
        if a.drop_shared:
            shared = eng.vocab_bridge.shared_d
            rng = __import__("numpy").random.default_rng(a.seed)
            eng.vocab_bridge.drop(rng.choice(shared, size=int(a.drop_shared * len(shared)), replace=False))
            eng.vocab_overlap = eng.measure_overlap()
            doc["drop_shared"] = a.drop_shared
        doc |= {"vocabulary": eng.vocabulary, "vocab_map": eng.vocab_translation, "vocab_overlap": eng.vocab_overlap}
        modes = modes_for(draft is not None, eng.mtp_ctx is not None)
        if a.modes:
            modes = ["baseline"] + [m for m in modes if m in a.modes.split(",") and m != "baseline"]
        for set_name in a.sets.split(","):
            res = run_set(eng, set_name, modes, a)
            doc["sets"].append(res)
            med = res["median_tokens_per_s"]
            print(f"{set_name}: " + " · ".join(f"{m} {v:.1f}" for m, v in med.items()) + " tok/s"
                  + (f"; auto {res['vs_target_alone']['auto']:.2f}x target alone, {res['auto_vs_best_single']:.2f}x "
                     f"the best single drafter ({res['best_single']})" if res["auto_vs_best_single"] else ""),
                  file=sys.stderr, flush=True)
    text = json.dumps(doc, indent=1)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(json.dumps({k: v for k, v in doc.items() if k != "sets"}
                     | {"sets": [{k: v for k, v in s.items() if k != "runs"} for s in doc["sets"]]}, indent=1))


if __name__ == "__main__":
    main()
