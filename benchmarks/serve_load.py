"""Load on `specq serve` against llama-cpp-python's own OpenAI server on the same target (no draft).

N concurrent clients (each a thread with its own `openai` client) send R streaming chat requests each, one
after the other, to a server on a loopback port; every request is bounded by a timeout and the run by N·R
requests. Reported per server and N: requests/s, time to first token (p50/p99), latency (p50/p99), the
tokens/s each client sees (its tokens over its own busy time, averaged over clients) and the total tokens/s.
Both servers run one generation at a time (llama-cpp-python's behind a lock, specq's in its worker), so
they differ in what each generation costs and in how they queue. Both servers are up at once and take
turns for each N, so a shared machine's load hits both alike. llama-cpp-python runs with
`--interrupt_requests False` (by default a new request cuts the running stream short, which would make its
concurrent runs finish fast with truncated answers) and each request asks it for no repeat penalty (its
default is 1.1), so both write the target's greedy text; the run reports for how many prompts every answer,
from both servers at every N, was the same.

llama-cpp-python's server runs from its own virtual environment (its FastAPI stack stays out of specq's):
    python3 -m venv /tmp/llama-server-venv
    /tmp/llama-server-venv/bin/pip install "llama-cpp-python[server]==0.3.36" -c .ci/constraints.txt
Run (the demo pair; about ten minutes on 2 cores; again with --draft-max 8):
    python benchmarks/serve_load.py --clients 1,4,16 --requests 2 --max-tokens 64 --draft-max auto \
        --reference-python /tmp/llama-server-venv/bin/python --json benchmarks/results/serve_load-kauto-cpu2.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "benchmarks" / "prompts" / "adaptive12.jsonl"


def load_prompts() -> list[str]:
    """The benchmarks' general prompts (PROMPTS), in order."""
    return [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]
START_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 600
_PORT = re.compile(r"on http://127\.0\.0\.1:(\d+)/v1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}): {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"the server did not start in {START_TIMEOUT_S}s")


class Server:
    """A server subprocess on 127.0.0.1; `url` once it answers /v1/models."""

    def __init__(self, argv: list[str], log: Path, port: int | None, env: dict | None = None):
        self.log = log
        self._f = open(log, "w")
        # as a user runs it: llama.cpp's own OpenMP settings (a PASSIVE wait policy once halved specq serve's speed)
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._f, stderr=subprocess.STDOUT,
                                     env=None if env is None else {**os.environ, **env})
        try:
            if port is None:  # specq serve --port 0 prints the port it got
                deadline = time.monotonic() + START_TIMEOUT_S
                while not (m := _PORT.search(log.read_text())):
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"specq serve did not start: {log.read_text()[-2000:]}")
                    time.sleep(0.2)
                port = int(m.group(1))
            self.url = f"http://127.0.0.1:{port}"
            wait_ready(self.url, self.proc, log)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._f.close()


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) each thread of a process has used so far: {tid: (name, seconds)}."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        out[int(task.name)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def cpu_split(before: dict, after: dict, n_compute: int, wall_s: float, clients_s: float) -> dict:
    """Where a load's CPU went, from two thread_cpu readings of the server: its `n_compute` busiest threads over
    the load (llama.cpp's compute threads: the one that decodes and its workers) apart from the rest of the server
    (HTTP, tokenizing, streaming), and the clients' process, each in seconds and as a share of the wall."""
    used = sorted(((after[t][1] - before.get(t, (None, 0.0))[1], after[t][0]) for t in after), reverse=True)
    compute, rest = sum(s for s, _ in used[:n_compute]), sum(s for s, _ in used[n_compute:])
    return {"compute_threads_s": compute, "other_server_threads_s": rest, "clients_s": clients_s,
            "other_server_share_of_wall": rest / wall_s, "clients_share_of_wall": clients_s / wall_s,
            "busiest": [[name, round(s, 3)] for s, name in used[:n_compute + 3]]}


def one_request(client, model: str, prompt: str | list[dict], max_tokens: int, extra: dict) -> dict:
    """One streaming chat request (a prompt as one user message, or a conversation's messages): time to first
    token, latency, tokens (from usage; a server without stream usage: max_tokens when it stopped for length,
    else its content chunks)."""
    t0 = time.perf_counter()
    first = None
    chunks = 0
    usage = finish = None
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    stream = client.chat.completions.create(model=model, messages=messages,
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=extra)
    text = []
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            text.append(ch.choices[0].delta.content)
            chunks += 1
            if first is None:
                first = time.perf_counter()
        if ch.choices and ch.choices[0].finish_reason:
            finish = ch.choices[0].finish_reason
        if getattr(ch, "usage", None):
            usage = ch.usage
    t1 = time.perf_counter()
    n = usage.completion_tokens if usage else (max_tokens if finish == "length" else chunks)
    return {"ttft_s": (first or t1) - t0, "latency_s": t1 - t0, "tokens": n, "usage_reported": usage is not None,
            "finish_reason": finish, "text": "".join(text), "prompt_tokens": usage.prompt_tokens if usage else None}


def run_load(url: str, model: str, prompts: list, n_clients: int, n_requests: int, max_tokens: int,
             extra: dict | None = None, texts: dict | None = None, label: str = "") -> dict:
    """N clients × R requests; `texts` collects each prompt's answers: {prompt index: {text: {who}}}."""
    import openai

    results: list[list[dict]] = [[] for _ in range(n_clients)]
    errors: list[str] = []

    def client_loop(c: int) -> None:
        cl = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=REQUEST_TIMEOUT_S, max_retries=0)
        for r in range(n_requests):
            i = (c * n_requests + r) % len(prompts)
            try:
                results[c].append(one_request(cl, model, prompts[i], max_tokens, extra or {}))
                if texts is not None:
                    texts.setdefault(i, {}).setdefault(results[c][-1]["text"], set()).add(f"{label} N={n_clients}")
            except Exception as e:  # a failed request is reported, not retried
                errors.append(f"client {c}: {type(e).__name__}: {e}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client_loop, args=(c,)) for c in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQUEST_TIMEOUT_S * n_requests)
    wall = time.perf_counter() - t0
    rows = [r for rs in results for r in rs]
    ttft = sorted(r["ttft_s"] for r in rows)
    lat = sorted(r["latency_s"] for r in rows)
    per_client = [sum(r["tokens"] for r in rs) / sum(r["latency_s"] for r in rs) for rs in results if rs]
    return {
        "clients": n_clients, "requests": len(rows), "errors": errors, "wall_s": wall,
        "requests_per_s": len(rows) / wall, "tokens": sum(r["tokens"] for r in rows),
        "total_tokens_per_s": sum(r["tokens"] for r in rows) / wall,
        "tokens_per_s_per_client": statistics.mean(per_client) if per_client else None,
        "ttft_p50_s": pct(ttft, 50), "ttft_p95_s": pct(ttft, 95), "ttft_p99_s": pct(ttft, 99),
        "latency_p50_s": pct(lat, 50), "latency_p99_s": pct(lat, 99),
        "usage_reported": all(r["usage_reported"] for r in rows),
        "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] for r in rows) if rows and all(
            r["prompt_tokens"] is not None for r in rows) else None,
        "finish_reasons": {f: sum(r["finish_reason"] == f for r in rows) for f in {r["finish_reason"] for r in rows}},
    }


def chosen_kinds(ap: argparse.ArgumentParser, text: str, allowed: tuple[str, ...]) -> list[str]:
    """--kinds: a comma-separated choice among `allowed` (a usage error otherwise)."""
    kinds = [k.strip() for k in text.split(",")]
    if not set(kinds) <= set(allowed):
        ap.error(f"--kinds: choose from {', '.join(allowed)}")
    return kinds


def pct(sorted_values: list[float], p: float) -> float | None:
    """The p-th percentile, nearest rank (with few samples p99 is the maximum)."""
    if not sorted_values:
        return None
    k = max(0, min(len(sorted_values) - 1, round(p / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[k]


def model_of(server: Server) -> str:
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none").models.list().data[0].id


def report(row: dict) -> None:
    print(f"{row['server']:>18} N={row['clients']:>2}: {row['requests_per_s']:.2f} req/s, TTFT p50 "
          f"{row['ttft_p50_s']:.2f}s p99 {row['ttft_p99_s']:.2f}s, latency p50 {row['latency_p50_s']:.2f}s p99 "
          f"{row['latency_p99_s']:.2f}s, {row['tokens_per_s_per_client']:.1f} tok/s per client, "
          f"{row['total_tokens_per_s']:.1f} tok/s total", file=sys.stderr, flush=True)


# llama-cpp-python's server applies a repeat penalty of 1.1 unless told otherwise: off, so that both servers
# write the target's own greedy text (the same work, and a check that specq's is exact under load).
EXTRA = {"specq serve": {}, "llama-cpp-python": {"repeat_penalty": 1.0}}


def bench_interleaved(servers: dict[str, Server], prompts: list[str], a) -> tuple[list[dict], dict]:
    """For each N, each server in turn: both see the machine in about the same state (it is shared).
    Also: for how many prompts every answer of every server was the same text."""
    models = {name: model_of(srv) for name, srv in servers.items()}
    for name, srv in servers.items():  # warm-up: first touch of the weights
        run_load(srv.url, models[name], prompts, 1, 1, a.max_tokens, EXTRA[name])
    rows = []
    texts: dict[int, dict] = {}
    for n in a.clients:
        for name, srv in servers.items():
            row = {"server": name, **run_load(srv.url, models[name], prompts, n, a.requests, a.max_tokens,
                                              EXTRA[name], texts, name)}
            report(row)
            rows.append(row)
    same = {"prompts": len(texts), "identical": sum(len(v) == 1 for v in texts.values()),
            "differing": {i: [{"text": t, "from": sorted(who)} for t, who in v.items()]
                          for i, v in texts.items() if len(v) > 1}}
    print(f"answers identical across servers and loads: {same['identical']} of {same['prompts']} prompts",
          file=sys.stderr, flush=True)
    return rows, same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--requests", type=int, default=2, help="requests per client, one after the other")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft-max", default="auto")
    ap.add_argument("--reference-python", help="a python with llama-cpp-python[server] (skip the reference "
                                               "without it)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    a.clients = [int(x) for x in a.clients.split(",")]
    from specq.native.commands.demo import demo_pair

    target, draft = demo_pair()
    prompts = load_prompts()
    specq_bin = str(Path(sys.executable).parent / "specq")
    load0 = os.getloadavg()  # the machine is shared: say how busy it was
    servers: dict[str, Server] = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            servers["specq serve"] = Server(
                [specq_bin, "serve", "--host", "127.0.0.1", "--port", "0", "--threads", str(a.threads),
                 "--draft-max", a.draft_max, "--max-queue", "64", "--max-tokens", str(a.max_tokens)],
                Path(tmp) / "specq.log", None)
            if a.reference_python:
                port = free_port()
                servers["llama-cpp-python"] = Server(
                    [a.reference_python, "-m", "llama_cpp.server", "--model", str(target), "--host", "127.0.0.1",
                     "--port", str(port), "--n_ctx", "4096", "--n_threads", str(a.threads),
                     "--n_threads_batch", str(a.threads), "--verbose", "False",
                     # by default a new request interrupts the running stream; queue them instead, like specq
                     "--interrupt_requests", "False"],
                    Path(tmp) / "reference.log", port)
            rows, same = bench_interleaved(servers, prompts, a)
        finally:
            for srv in servers.values():
                srv.stop()
    doc = {"target": target.name, "draft": draft.name, "settings": {k: v for k, v in vars(a).items()
                                                                    if k not in ("json", "reference_python")},
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_before": load0,
                       "load_after": os.getloadavg()}, "identical_answers": same, "runs": rows}
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
