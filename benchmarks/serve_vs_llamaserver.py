"""`specq serve --parallel N` against llama.cpp's own `llama-server` built from the same vendored tree.

Three servers on one pair, one at a time, taking turns for each N so that a shared machine's load hits them
alike: specq serve (`--parallel N`, `--ctx C`), llama-server plain (`-np N -c N·C`) and llama-server with the same
draft (`--spec-type draft-simple --spec-draft-model D --spec-draft-n-max 8`). N concurrent streaming clients send
R greedy chat requests each (serve_load.run_load); "specq plain" is the same server asked for the target alone
(`draft_max: 0` in each request), and "specq plain fa-off" that with `--flash-attn off` (the attention path
before --flash-attn auto measured it, runtime/attention.py); reported per server and N: aggregate tokens/s
(every client's tokens over the wall time), median and p95 time to first token. Each server is restarted for each N (its -np,
specq's --parallel). With --rounds R the servers take turns R times at each N and the ratios are of the medians
over the rounds (every round's row is kept). Also: how many prompts got the same answer from every server at
every N; each load's target decodes per generated token from the servers' /metrics (`passes`: specq's
specq:decodes, llama-server's n_decode_total with --metrics); and with --count-passes the passes over the
weights themselves, counted from llama.cpp's batch debug log in one more, untimed load (count_passes); and where
each server's CPU time went over a load (serve_load.cpu_split: its compute threads, the rest of it, the clients).
With --context-tokens T every client's requests carry a document of about T tokens ahead of the question
(with_documents), so the load decodes at that depth.

    python benchmarks/serve_vs_llamaserver.py --llama-server PATH/llama-server [--pair demo|deep] \
        [--clients 1,4,8] [--requests 2] [--max-tokens 96] [--rounds 1] [--cpu-amx] [--spec-args=-nr] \
        [--count-passes] [--context-tokens 0] [--ctx 2048] [--json benchmarks/results/serve_vs_llamaserver-X.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import types
import urllib.request
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from deep_pair import pair  # noqa: E402
from long_context import real_text  # noqa: E402
from serve_load import (Server, chosen_kinds, cpu_split, free_port, load_prompts, model_of,  # noqa: E402
                        run_load, thread_cpu)
from specq.machine import cpu_name  # noqa: E402

CTX = 2048  # one sequence's context (specq --ctx; llama-server -c N·CTX), unless --ctx
CHARS_A_TOKEN = 4  # about, in English prose with SmolLM2's tokenizer (each load reports its prompts' real tokens)
KINDS = ("specq", "specq plain", "llama-server plain", "llama-server spec", "specq plain fa-off")


def argv(kind: str, n: int, target: Path, draft: Path, a, port: int) -> list[str]:
    if kind.startswith("specq"):
        return [str(Path(sys.executable).parent / "specq"), "serve", "--target", str(target), "--draft", str(draft),
                "--host", "127.0.0.1", "--port", "0", "--threads", str(a.threads), "--ctx", str(a.ctx),
                "--parallel", str(n), "--draft-max", a.draft_max, "--max-queue", "64",
                "--max-tokens", str(a.max_tokens)] + (["--cpu-amx"] if a.cpu_amx else []) + a.specq_args.split() \
            + (["--flash-attn", "off"] if kind.endswith("fa-off") else [])
    cmd = [a.llama_server, "-m", str(target), "--host", "127.0.0.1", "--port", str(port), "-np", str(n),
           "-c", str(n * a.ctx), "-t", str(a.threads), "-tb", str(a.threads), "--no-webui", "-ngl", "0", "--metrics"]
    if kind == "llama-server spec":
        cmd += ["--spec-type", "draft-simple", "--spec-draft-model", str(draft), "--spec-draft-n-max", "8",
                "-ngld", "0"] + a.spec_args.split()
    return cmd


def specq_defaults(n: int, target: Path, draft: Path, threads: int = 2) -> list[str]:
    """specq serve's command line as this benchmark starts it, with the defaults (draft-max auto, 96 tokens)."""
    opts = types.SimpleNamespace(threads=threads, draft_max="auto", max_tokens=96, cpu_amx=False, specq_args="",
                                 ctx=CTX)
    return argv("specq", n, target, draft, opts, None)


def with_documents(prompts: list[str], tokens: int, clients: int, requests: int) -> list[str]:
    """--context-tokens: the load's prompts (client c's r-th request is prompt c·R + r, serve_load.run_load), each
    client's carrying one document of about `tokens` tokens ahead of its questions, as an editor's open file or a
    chat about a paper does: evaluated at a client's first request, reused by its next, and every step decodes
    that deep. The documents are stretches of real English text (long_context.real_text) starting at different
    places, so that no client's prompt continues another's."""
    text, n = real_text(), tokens * CHARS_A_TOKEN
    step = (len(text) - n) // max(clients - 1, 1)
    if step < 256:
        raise SystemExit(f"--context-tokens {tokens}: the text is too short for {clients} different documents")
    return [f"Read this document, then answer the question after it.\n\n{text[c * step:c * step + n]}\n\n"
            f"Question: {prompts[i % len(prompts)]}" for i in range(clients * requests) for c in [i // requests]]


def metrics(url: str) -> dict[str, float]:
    """A server's /metrics as {'name{labels}': value} (llama-server's needs --metrics)."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+) (\S+)$", text, re.M)}


def batch_steps(url: str) -> dict[str, float]:
    """specq's /metrics specq:batch_steps{kind} as {kind: count}."""
    return {k.split('"')[1]: v for k, v in metrics(url).items() if k.startswith("specq:batch_steps{")}


def passes(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
    """What the target's llama_decode calls did over a load, from two /metrics readings: decodes per generated
    token, tokens (prompt tokens evaluated and generated) per decode; for llama-server its busy slots per decode,
    for specq the share of the wall inside the target's decodes and the draft model's decodes per token."""
    def d(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    gen, prompt = d("llamacpp:tokens_predicted_total"), d("llamacpp:prompt_tokens_total")
    if 'specq:decodes{model="target"}' in after:
        n = d('specq:decodes{model="target"}')
        prompt -= d("specq:prompt_tokens_reused_total") + d("specq:prompt_tokens_copied_total")  # not evaluated
        out = {"decodes": n, "draft_decodes_per_token": d('specq:decodes{model="draft"}') / max(gen, 1),
               "decode_share_of_wall": d('specq:decode_seconds{model="target"}') / wall_s}
    else:
        n = d("llamacpp:n_decode_total")
        busy = (after["llamacpp:n_busy_slots_per_decode"] * after["llamacpp:n_decode_total"]
                - before["llamacpp:n_busy_slots_per_decode"] * before["llamacpp:n_decode_total"])
        out = {"decodes": n, "busy_slots_per_decode": busy / max(n, 1)}
    return {**out, "generated": gen, "prompt_tokens": prompt, "decodes_per_token": n / max(gen, 1),
            "tokens_per_decode": (gen + prompt) / max(n, 1)}


def served_load(kind: str, n: int, target: Path, draft: Path, prompts: list[str], a, log: Path,
                texts: dict | None = None, debug: bool = False) -> tuple[dict, dict, dict, int]:
    """One server of `kind` started alone, warmed up (the weights touched, the threads started), then the load of N
    clients: the load's row, /metrics before and after it, and the log's size when it began. `debug`: llama.cpp's
    batch debug log on (LLAMA_BATCH_DEBUG, the server's verbose log), for count_passes."""
    port = None if kind.startswith("specq") else free_port()
    cmd = argv(kind, n, target, draft, a, port)
    if debug:
        cmd += ["--verbose"] if kind.startswith("specq") else ["-v"]
    srv = Server(cmd, log, port, env={"LLAMA_BATCH_DEBUG": "1"} if debug else None)
    try:
        model = model_of(srv)
        run_load(srv.url, model, load_prompts(), 1, 1, 16)  # (with documents, the warm-up shares none of them)
        extra = {"draft_max": 0} if kind.startswith("specq plain") else {}  # the target alone, batched
        before, start = metrics(srv.url), log.stat().st_size
        cpu0, self0 = thread_cpu(srv.proc.pid), os.times()
        row = run_load(srv.url, model, prompts, n, a.requests, a.max_tokens, extra, texts, kind)
        cpu1, self1 = thread_cpu(srv.proc.pid), os.times()
        after = metrics(srv.url)
        row["cpu"] = cpu_split(cpu0, cpu1, a.threads, row["wall_s"],
                               self1.user + self1.system - self0.user - self0.system)
        if kind == "specq" and n > 1:  # what the batch's planner did (plain steps: drafting did not pay)
            row["batch_steps"] = batch_steps(srv.url)
    finally:
        srv.stop()
    return row, before, after, start


UBATCH = re.compile(r"added ubatch to split:.*?n_tokens\s+=\s+(\d+)", re.S)


def count_passes(n: int, kind: str, target: Path, draft: Path, prompts: list[str], a, tmp: str) -> dict:
    """--count-passes: the same load once more, untimed, with llama.cpp's batch debug log on: every ubatch
    llama.cpp splits a decode into is one pass over the weights, whatever the server's decode count says (with a KV
    stream per sequence a decode of a prompt chunk beside one-token rows is split in two or more). Both servers'
    logs are read the same way; specq's count includes the draft model's passes where it decoded
    (`draft_decodes` says how many decodes those were)."""
    log = Path(tmp) / f"{kind}-{n}-passes.log"
    row, before, after, start = served_load(kind, n, target, draft, prompts, a, log, debug=True)
    with open(log, "rb") as f:
        f.seek(start)
        rows = [int(m) for m in UBATCH.findall(f.read().decode("utf-8", "replace"))]
    load = passes(before, after, row["wall_s"])
    return {"server": kind, "parallel": n, "ubatches": len(rows), "ubatch_rows": sum(rows),
            "generated": load["generated"], "passes_per_token": len(rows) / max(load["generated"], 1),
            "rows_per_pass": sum(rows) / max(len(rows), 1),
            "ubatch_sizes": {str(k): v for k, v in sorted(Counter(rows).items())},
            "draft_decodes": load.get("draft_decodes_per_token", 0.0) * load["generated"], "errors": row["errors"]}


def run_n(n: int, kinds: list[str], target: Path, draft: Path, prompts: list[str], a, texts: dict,
          tmp: str) -> list[dict]:
    """Each server in turn, alone on the machine (an idle llama-server's threads still poll: three servers up at
    once on 2 cores slowed whichever was working)."""
    out = []
    for kind in kinds:
        row, before, after, _ = served_load(kind, n, target, draft, prompts, a, Path(tmp) / f"{kind}-{n}.log", texts)
        row["passes"] = passes(before, after, row["wall_s"])
        out.append({"server": kind, "parallel": n, **row})
        print(f"{kind:>18} N={n}: {row['total_tokens_per_s']:.1f} tok/s aggregate, TTFT p50 "
              f"{row['ttft_p50_s']:.2f}s p95 {row['ttft_p95_s']:.2f}s, errors {len(row['errors'])}"
              + f", decodes/token {row['passes']['decodes_per_token']:.3f}"
              + f", other server threads {row['cpu']['other_server_share_of_wall']:.1%} of the wall"
              + (f", batch steps {row['batch_steps']}" if "batch_steps" in row else ""), file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--pair", choices=("demo", "deep"), default="demo")
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--requests", type=int, default=2, help="requests per client, one after the other")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft-max", default="auto")
    ap.add_argument("--rounds", type=int, default=1, help="turns of every server at each N (medians over them)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="the servers to run (ratios need all four)")
    ap.add_argument("--cpu-amx", action="store_true",
                    help="specq serve --cpu-amx: llama.cpp's AMX weight buffer, as llama-server uses it on an AMX CPU")
    ap.add_argument("--spec-args", default="",
                    help="more llama-server arguments for its speculative mode (-nr on an AMX CPU: the Q4_1 draft "
                         "in its AMX buffer crashes, docs/troubleshooting.md)")
    ap.add_argument("--specq-args", default="", help="more specq serve arguments (e.g. --flash-attn on)")
    ap.add_argument("--count-passes", action="store_true",
                    help="after the timed rounds, one untimed load per server and N counting llama.cpp's ubatches")
    ap.add_argument("--context-tokens", type=int, default=0,
                    help="a document of about this many tokens ahead of each client's questions (with_documents)")
    ap.add_argument("--ctx", type=int, default=CTX, help="one sequence's context")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    target, draft = pair(a.pair)
    prompts = load_prompts()
    if a.context_tokens:
        clients = max(int(x) for x in a.clients.split(","))
        prompts = with_documents(prompts, a.context_tokens, clients, a.requests)
    kinds = chosen_kinds(ap, a.kinds, KINDS)
    load0 = os.getloadavg()
    rows, texts, counted = [], {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(x) for x in a.clients.split(",")]:
            for r in range(a.rounds):
                rows += [{**row, "round": r} for row in run_n(n, kinds, target, draft, prompts, a, texts, tmp)]
        for n in [int(x) for x in a.clients.split(",")] if a.count_passes else []:
            for kind in kinds:
                counted.append(count_passes(n, kind, target, draft, prompts, a, tmp))
                print(f"{kind:>18} N={n}: {counted[-1]['passes_per_token']:.3f} passes a token, "
                      f"{counted[-1]['rows_per_pass']:.1f} rows a pass", file=sys.stderr, flush=True)
    ratios = {}
    for n in sorted({r["parallel"] for r in rows}):
        by = {k: {f: statistics.median(r[f] for r in rows if r["parallel"] == n and r["server"] == k)
                  for f in ("total_tokens_per_s", "ttft_p50_s")} for k in kinds}
        def ratio(a_: str, b_: str, f: str = "total_tokens_per_s") -> float | None:
            return by[a_][f] / by[b_][f] if a_ in by and b_ in by else None

        ratios[n] = {"vs_plain": ratio("specq", "llama-server plain"),
                     "plain_vs_plain": ratio("specq plain", "llama-server plain"),
                     "vs_spec": ratio("specq", "llama-server spec"),
                     "plain_vs_fa_off": ratio("specq plain", "specq plain fa-off"),
                     "fa_off_vs_plain": ratio("specq plain fa-off", "llama-server plain"),
                     "ttft_p50_vs_plain": ratio("specq", "llama-server plain", "ttft_p50_s"), "medians": by}
        print(f"N={n}: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios[n].items() if isinstance(v, float)),
              file=sys.stderr, flush=True)
    same = {"prompts": len(texts), "identical": sum(len(v) == 1 for v in texts.values())}
    doc = {"pair": a.pair, "target": target.name, "draft": draft.name, "ctx_per_sequence": a.ctx,
           "settings": {k: (Path(v).name if k == "llama_server" else v) for k, v in vars(a).items()
                        if k != "json"}, "machine": platform.machine(),
           "cpus": os.cpu_count(), "load_before": load0, "load_after": os.getloadavg(), "rows": rows,
           "ratios": ratios, "answers": same, "passes_counted": counted, "cpu": cpu_name()}
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
