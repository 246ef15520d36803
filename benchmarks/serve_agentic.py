"""`specq serve --drafter suffix` against llama-server's n-gram speculation on agent-like traffic
(benchmarks/prompts/agentic.jsonl), the same vendored llama.cpp tree, at N concurrent clients.

The servers, one at a time (an idle llama-server's threads still poll), their order rotated from round to round:
- specq suffix: `specq serve --drafter suffix --parallel N` (draft-max auto; the store in memory);
- specq ngram: `--drafter ngram`, the request's own text only (what the store adds);
- llama-server ngram-mod: `--spec-type ngram-mod` with its defaults (its hash pool is kept across requests);
- llama-server ngram-cache: `--spec-type ngram-cache -lcs STATIC -lcd DYNAMIC`, both files made from the warm-up half
  by llama-lookup and llama-lookup-create (llama_lookup.warm_caches; llama-server reads the dynamic file and
  never writes it back);
- llama-server plain: the target alone (-np N).
Each server first answers the warm-up half (one client, untimed: the store and ngram-mod's pool fill as a running
server's would), then N streaming clients send the measured half's 24 requests (each client its own run of them,
serve_load.run_load), greedy, --max-tokens each. Reported: aggregate tokens/s (every answer's tokens over the
wall time), median and p95 time to first token, and whether each request got the same text from every server.

    python benchmarks/serve_agentic.py --llama-bin <llama.cpp build>/bin [--pair demo] [--clients 1,4] [--rounds 3]
        [--json benchmarks/results/serve_agentic-demo-xeon2.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from agentic import formatter, load  # noqa: E402
from deep_pair import pair  # noqa: E402
from llama_lookup import warm_caches  # noqa: E402
from serve_load import Server, chosen_kinds, free_port, model_of, run_load  # noqa: E402

HERE = Path(__file__).parent
CTX = 2048  # one sequence's context (specq --ctx; llama-server -c N·CTX)
KINDS = ("specq suffix", "specq ngram", "llama-server ngram-mod", "llama-server ngram-cache", "llama-server plain")


def argv(kind: str, n: int, target: Path, draft: Path, a, port: int, caches: tuple[Path, Path] | None) -> list[str]:
    if kind.startswith("specq"):
        return [str(Path(sys.executable).parent / "specq"), "serve", "--target", str(target), "--draft", str(draft),
                "--host", "127.0.0.1", "--port", "0", "--threads", str(a.threads), "--ctx", str(CTX),
                "--parallel", str(n), "--drafter", kind.split()[1], "--draft-max", "auto", "--max-queue", "64",
                "--max-tokens", str(a.max_tokens)]
    cmd = [str(a.llama_bin / "llama-server"), "-m", str(target), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(n), "-c", str(n * CTX), "-t", str(a.threads), "-tb", str(a.threads), "--no-webui", "-ngl", "0"]
    if kind == "llama-server ngram-mod":
        cmd += ["--spec-type", "ngram-mod"]
    elif kind == "llama-server ngram-cache":
        cmd += ["--spec-type", "ngram-cache", "-lcs", str(caches[0]), "-lcd", str(caches[1])]
    return cmd


def run_one(kind: str, n: int, target: Path, draft: Path, warm: list, measured: list, a, texts: dict, tmp: Path,
            caches: tuple[Path, Path]) -> dict:
    port = None if kind.startswith("specq") else free_port()
    srv = Server(argv(kind, n, target, draft, a, port, caches), tmp / f"{kind.replace(' ', '-')}-{n}.log", port)
    try:
        model = model_of(srv)
        run_load(srv.url, model, warm, 1, len(warm), a.max_tokens)  # untimed: the warm-up half
        row = run_load(srv.url, model, measured, n, len(measured) // n, a.max_tokens, {}, texts, kind)
    finally:
        srv.stop()
    print(f"{kind:>24} N={n}: {row['total_tokens_per_s']:.1f} tok/s aggregate, TTFT p50 {row['ttft_p50_s']:.2f}s "
          f"p95 {row['ttft_p95_s']:.2f}s, errors {len(row['errors'])}", file=sys.stderr, flush=True)
    return {"server": kind, "parallel": n, **row}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bin", type=Path, required=True,
                    help="folder with llama-server, llama-lookup and llama-lookup-create")
    ap.add_argument("--pair", choices=("demo", "deep"), default="demo")
    ap.add_argument("--prompts", type=Path, default=HERE / "prompts" / "agentic.jsonl")
    ap.add_argument("--clients", default="1,4")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="turns of every server at each N (medians over them)")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    target, draft = pair(a.pair)
    warm_rows, measured_rows = load(a.prompts)
    warm, measured = [r["messages"] for r in warm_rows], [r["messages"] for r in measured_rows]
    kinds = chosen_kinds(ap, a.kinds, KINDS)
    load0 = os.getloadavg()
    rows, texts = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        caches = None
        if "llama-server ngram-cache" in kinds:
            caches = warm_caches(a.llama_bin, target, rendered(target, warm), Path(tmp), lookup_args(a), 3)
        for n in [int(x) for x in a.clients.split(",")]:
            for r in range(a.rounds):
                for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
                    row = run_one(kind, n, target, draft, warm, measured, a, texts, Path(tmp), caches)
                    rows.append({**row, "round": r})
    ratios = {}
    for n in sorted({r["parallel"] for r in rows}):
        med = {k: {f: statistics.median(r[f] for r in rows if r["parallel"] == n and r["server"] == k)
                   for f in ("total_tokens_per_s", "ttft_p50_s", "ttft_p95_s")} for k in kinds}
        ratios[n] = {"medians": med, **{f"specq suffix / {k}": med["specq suffix"]["total_tokens_per_s"]
                                        / med[k]["total_tokens_per_s"] for k in kinds if k != "specq suffix"}}
        print(f"N={n}: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios[n].items() if k != "medians"),
              file=sys.stderr, flush=True)
    same = {"requests": len(texts), "identical": sum(len(v) == 1 for v in texts.values()),
            "differing": {i: [{"text": t, "from": sorted(who)} for t, who in v.items()]
                          for i, v in texts.items() if len(v) > 1}}
    args = ["<llama.cpp build>/bin" if x == str(a.llama_bin) else x for x in sys.argv[1:]]  # no path of ours
    doc = {"command": " ".join(["python", "benchmarks/serve_agentic.py", *args]), "pair": a.pair,
           "target": target.name, "draft": draft.name, "ctx_per_sequence": CTX,
           "cpu": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
                       platform.machine()),
           "cpus": os.cpu_count(), "load_before": load0, "load_after": os.getloadavg(), "rows": rows,
           "ratios": ratios, "answers": same}
    print(json.dumps({k: v for k, v in doc.items() if k not in ("rows", "answers")}, indent=1, default=str))
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1, default=str) + "\n")


def rendered(target: Path, conversations: list[list[dict]]) -> list[str]:
    """The conversations as the target's chat template writes them (special tokens as text), for llama-lookup."""
    from specq.native.runtime.engine import Engine

    with Engine(str(target), None, ctx=CTX, threads=1) as eng:
        fmt = formatter(eng)
        return [fmt.render(m) for m in conversations]


def lookup_args(a) -> argparse.Namespace:
    """llama_lookup's settings for the warm-up runs: greedy, this run's threads and answer length."""
    return argparse.Namespace(n_predict=a.max_tokens, temp=0.0, threads=a.threads, ctx=4096)


if __name__ == "__main__":
    main()
