"""The suffix drafter on agent-like traffic (benchmarks/prompts/agentic.jsonl, made by make_agentic.py): the
measured half's requests in order, on one engine, per mode:

- baseline: the target alone;
- ngram: n-gram lookup in the request's own text (specq's context-only n-gram);
- suffix-cold: --drafter suffix with an empty store, which learns from the measured half's answers as they come
  (a fresh server);
- suffix-warm: the same after the warm-up half was answered (untimed) into the store;
- auto-warm: --drafter auto (the draft model, n-grams, the store) after the same warm-up;
- suffix-warm-point (ask for it with --modes): suffix-warm with point-mass proposals at T > 0 instead of drafts
  sampled from the store's counts (SuffixDrafter.sampled off), to choose between the two;
- lookup, lookup-cached (ask for them with --modes and --llama-bin): llama.cpp's `llama-lookup` from the same
  vendored tree, its context-level n-gram cache alone, or with static and dynamic cache files made from the
  warm-up half (llama_lookup.py), drafting at most --lookup-draft tokens.

Modes alternate order from repeat to repeat; every mode starts from a store of its own. Greedy output is compared
with the target alone's; each answer's own-repeat share (what n-grams alone accepted of it) and answers that end
in a loop are listed.

    python benchmarks/agentic.py --repeat 3 --n-predict 96 --threads 2 --out benchmarks/results/agentic-demo-xeon2.json
    python benchmarks/agentic.py --pair deep --repeat 1 --n-predict 96 --threads 2 --modes baseline,ngram,suffix-warm,auto-warm \
        --out benchmarks/results/agentic-deep-greedy-xeon2.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path

from deep_pair import pair  # noqa: E402 (benchmarks/ is the script's folder)
from llama_lookup import lookup, warm_caches  # noqa: E402

from specq.native.core.settings import GenerationSettings
from specq.native.core.template import TemplateFormatter, load_template
from specq.native.drafters.suffix import SuffixDrafter, SuffixStore
from specq.native.runtime.engine import Engine

HERE = Path(__file__).parent
MODES = ["baseline", "ngram", "suffix-cold", "suffix-warm", "auto-warm"]


def load(path: Path) -> tuple[list[dict], list[dict]]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r for r in rows if r["half"] == "warmup"], [r for r in rows if r["half"] == "measured"]


def loops(tokens: list[int]) -> bool:
    """An answer that ends repeating a handful of tokens."""
    return len(tokens) >= 48 and len(set(tokens[-32:])) <= 4


def formatter(eng: Engine) -> TemplateFormatter:
    """The target's chat template (as bench --chat and serve render a conversation)."""
    return TemplateFormatter.for_model(load_template(None, eng.target.chat_template(), str(eng.target.path)),
                                       eng.target)


def report(runs: list[dict], mode: str, rep: int) -> None:
    rows = [r for r in runs if r["mode"] == mode and r["repeat"] == rep]
    tps = 1e3 * sum(r["n_generated"] for r in rows) / sum(r["gen_ms"] for r in rows)
    print(f"rep {rep} {mode:12s} {tps:6.1f} tok/s  drafted {sum(r['n_drafted'] for r in rows)} accepted "
          f"{sum(r['n_accepted'] for r in rows)}  store {sum(r.get('n_accepted_store', 0) for r in rows)}"
          f"/{sum(r.get('n_drafted_store', 0) for r in rows)}", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", choices=("demo", "deep"), default="demo", help="deep: benchmarks/deep_pair.py's")
    ap.add_argument("--prompts", default=str(HERE / "prompts" / "agentic.jsonl"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--n-predict", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--modes", default=",".join(MODES), help="also: suffix-warm-point, lookup, lookup-cached")
    ap.add_argument("--llama-bin", type=Path, help="folder with llama-lookup and llama-lookup-create (lookup modes)")
    ap.add_argument("--lookup-draft", type=int, default=8, help="llama-lookup --spec-draft-n-max")
    ap.add_argument("--limit", type=int, default=0, help="only the first N requests of each half (smoke runs)")
    ap.add_argument("--out")
    a = ap.parse_args()
    warmup, measured = load(Path(a.prompts))
    if a.limit:
        warmup, measured = warmup[:a.limit], measured[:a.limit]
    modes = a.modes.split(",")
    target, draft = pair(a.pair)
    runs = []
    with Engine(target, draft, ctx=a.ctx, threads=a.threads, mtp=None) as eng, \
            tempfile.TemporaryDirectory(prefix="agentic-lookup-") as tmp:
        fmt, work = formatter(eng), Path(tmp)

        def tokens(row: dict) -> list[int]:
            return eng.tokenize(fmt.render(row["messages"]))

        def piece_text(toks: list[int]) -> str:
            """The answer as llama-lookup prints it (special tokens written out)."""
            return b"".join(eng.target.piece(t) for t in toks).decode("utf-8", "replace")

        warm_toks, toks = [tokens(r) for r in warmup], [tokens(r) for r in measured]
        raw = [fmt.render(r["messages"]) for r in measured]
        raw_warm = [fmt.render(r["messages"]) for r in warmup]
        ses = eng.session()
        # untimed: the weights paged in and every drafter's first run behind us
        for drafter in ("model", "ngram", "suffix"):
            ses.reset()
            ses.generate(warm_toks[0], GenerationSettings(n_predict=16, drafter=drafter)).run()
        for rep in range(a.repeat):
            for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]:
                if mode.startswith("lookup"):
                    static = dynamic = None
                    if mode == "lookup-cached":
                        static, dynamic = warm_caches(a.llama_bin, target, raw_warm, work, a, a.lookup_draft)
                    for i, prompt in enumerate(raw):
                        r = lookup(a.llama_bin, target, prompt, work, a, rep, a.lookup_draft, static, dynamic)
                        runs.append({"mode": mode, "repeat": rep, "request": measured[i]["name"], **r})
                    report(runs, mode, rep)
                    continue
                eng.provided["suffix"] = SuffixStore()
                SuffixDrafter.sampled = not mode.endswith("-point")
                drafter = {"baseline": "model", "ngram": "ngram", "auto-warm": "auto"}.get(mode, "suffix")
                s = GenerationSettings(n_predict=a.n_predict, draft_max="auto", temp=a.temp, seed=rep,
                                       drafter=drafter).validate()
                if "-warm" in mode:
                    for t in warm_toks:
                        ses.reset()
                        ses.generate(t, s).run()
                for i, t in enumerate(toks):
                    ses.reset()
                    g = ses.generate(t, s, speculative=mode != "baseline").run()
                    st = g.stats
                    runs.append({"mode": mode, "repeat": rep, "request": measured[i]["name"], "tokens": g.tokens,
                                 **({"text": piece_text(g.tokens)} if mode == "baseline" else {}),
                                 "n_generated": st.n_generated, "gen_ms": st.gen_ms, "n_drafted": st.n_drafted,
                                 "n_accepted": st.n_accepted, "n_drafted_by": dict(st.n_drafted_by),
                                 "n_accepted_by": dict(st.n_accepted_by), "n_drafted_store": st.n_drafted_store,
                                 "n_accepted_store": st.n_accepted_store, "n_drafted_text": st.n_drafted_text,
                                 "n_accepted_text": st.n_accepted_text})
                report(runs, mode, rep)
    per = {m: [] for m in modes}
    for m in modes:
        for rep in range(a.repeat):
            rows = [r for r in runs if r["mode"] == m and r["repeat"] == rep]
            per[m].append(1e3 * sum(r["n_generated"] for r in rows) / sum(r["gen_ms"] for r in rows))
    med = {m: statistics.median(v) for m, v in per.items()}
    base = {(r["repeat"], r["request"]): r["tokens"] for r in runs if r["mode"] == "baseline"}
    base_text = {(r["repeat"], r["request"]): r["text"] for r in runs if r["mode"] == "baseline"}

    def same(r: dict) -> bool:
        """Whether a run's answer is the target alone's (llama-lookup's as text, which may run a step past -n)."""
        key = (r["repeat"], r["request"])
        if key not in base:
            return True
        if "tokens" not in r:
            return r["text"].startswith(base_text[key]) or base_text[key].startswith(r["text"])
        return r["tokens"] == base[key]

    identical = {m: all(same(r) for r in runs if r["mode"] == m) for m in modes}
    if a.llama_bin is not None:
        sys.argv = ["<llama.cpp build>/bin" if x == str(a.llama_bin) else x for x in sys.argv]  # no path of ours
    ngram_rows = [r for r in runs if r["mode"] == "ngram" and r["repeat"] == 0]
    doc = {"machine": {"cpu": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                                    if ln.startswith("model name")), "?"), "python": platform.python_version()},
           "command": " ".join(["python", "benchmarks/agentic.py", *sys.argv[1:]]),
           "target": target.name, "draft": draft.name, "n_predict": a.n_predict, "temp": a.temp,
           "requests_measured": len(measured), "requests_warmup": len(warmup),
           "tokens_per_s_per_repeat": per, "median_tokens_per_s": med,
           "vs_baseline": {m: med[m] / med["baseline"] for m in modes} if "baseline" in med else None,
           "identical_to_baseline": identical,
           "own_repeat_share": {r["request"]: r["n_accepted"] / max(r["n_generated"], 1) for r in ngram_rows},
           "loops": sorted({r["request"] for r in runs if r["mode"] == "baseline" and loops(r["tokens"])}),
           "runs": runs}
    print(json.dumps({k: v for k, v in doc.items() if k not in ("runs", "own_repeat_share")}, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
