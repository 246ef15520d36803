"""Load on `specq serve` against llama-cpp-python's own OpenAI server on the same target (no draft).

N concurrent clients (each a thread with its own `openai` client) send R streaming chat requests each, one
after the other, to a server on a loopback port; every request is bounded by a timeout and the run by N·R
requests. Reported per server and N: requests/s, time to first token (p50/p99), latency (p50/p99), the
tokens/s each client sees (its tokens over its own busy time, averaged over clients) and the total tokens/s.
Both servers run one generation at a time (llama-cpp-python's behind a lock, specq's in its worker), so
they differ in what each generation costs and in how they queue. llama-cpp-python runs with
`--interrupt_requests False`: by default a new request cuts the running stream short, which would make its
concurrent runs finish fast with truncated answers.

llama-cpp-python's server runs from its own virtual environment (its FastAPI stack stays out of specq's):
    python3 -m venv /tmp/llama-server-venv
    /tmp/llama-server-venv/bin/pip install "llama-cpp-python[server]==0.3.36" -c .ci/constraints.txt
Run (the demo pair; a few minutes on 2 cores):
    python benchmarks/serve_load.py --clients 1,4,16 --requests 2 --max-tokens 64 \
        --reference-python /tmp/llama-server-venv/bin/python --json benchmarks/results/serve_load-cpu2.json
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

    def __init__(self, argv: list[str], log: Path, port: int | None):
        self.log = log
        self._f = open(log, "w")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._f, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
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


def one_request(client, model: str, prompt: str, max_tokens: int) -> dict:
    """One streaming chat request: time to first token, latency, tokens (usage, else content chunks)."""
    t0 = time.perf_counter()
    first = None
    chunks = 0
    usage = None
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            chunks += 1
            if first is None:
                first = time.perf_counter()
        if getattr(ch, "usage", None):
            usage = ch.usage
    t1 = time.perf_counter()
    n = usage.completion_tokens if usage else chunks
    return {"ttft_s": (first or t1) - t0, "latency_s": t1 - t0, "tokens": n, "usage_reported": usage is not None}


def run_load(url: str, model: str, prompts: list[str], n_clients: int, n_requests: int, max_tokens: int) -> dict:
    import openai

    results: list[list[dict]] = [[] for _ in range(n_clients)]
    errors: list[str] = []

    def client_loop(c: int) -> None:
        cl = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=REQUEST_TIMEOUT_S, max_retries=0)
        for r in range(n_requests):
            try:
                results[c].append(one_request(cl, model, prompts[(c * n_requests + r) % len(prompts)], max_tokens))
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
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "latency_p50_s": pct(lat, 50), "latency_p99_s": pct(lat, 99),
        "usage_reported": all(r["usage_reported"] for r in rows),
    }


def pct(sorted_values: list[float], p: float) -> float | None:
    """The p-th percentile, nearest rank (with few samples p99 is the maximum)."""
    if not sorted_values:
        return None
    k = max(0, min(len(sorted_values) - 1, round(p / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[k]


def bench_server(name: str, server: Server, prompts: list[str], a) -> list[dict]:
    import openai

    model = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none").models.list().data[0].id
    run_load(server.url, model, prompts, 1, 1, a.max_tokens)  # warm-up: first-touch of the weights
    out = []
    for n in a.clients:
        row = {"server": name, **run_load(server.url, model, prompts, n, a.requests, a.max_tokens)}
        print(f"{name:>18} N={n:>2}: {row['requests_per_s']:.2f} req/s, TTFT p50 {row['ttft_p50_s']:.2f}s "
              f"p99 {row['ttft_p99_s']:.2f}s, latency p50 {row['latency_p50_s']:.2f}s p99 {row['latency_p99_s']:.2f}s, "
              f"{row['tokens_per_s_per_client']:.1f} tok/s per client, {row['total_tokens_per_s']:.1f} tok/s total",
              file=sys.stderr, flush=True)
        out.append(row)
    return out


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
    from specq.native.demo import demo_pair

    target, draft = demo_pair()
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    specq_bin = str(Path(sys.executable).parent / "specq")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        srv = Server([specq_bin, "serve", "--host", "127.0.0.1", "--port", "0", "--threads", str(a.threads),
                      "--draft-max", a.draft_max, "--max-queue", "64", "--max-tokens", str(a.max_tokens)],
                     Path(tmp) / "specq.log", None)
        try:
            rows += bench_server("specq serve", srv, prompts, a)
        finally:
            srv.stop()
        if a.reference_python:
            port = free_port()
            ref = Server([a.reference_python, "-m", "llama_cpp.server", "--model", str(target), "--host", "127.0.0.1",
                          "--port", str(port), "--n_ctx", "4096", "--n_threads", str(a.threads),
                          "--n_threads_batch", str(a.threads), "--verbose", "False",
                          # by default a new request interrupts the running stream; queue them instead, like specq
                          "--interrupt_requests", "False"],
                         Path(tmp) / "reference.log", port)
            try:
                rows += bench_server("llama-cpp-python", ref, prompts, a)
            finally:
                ref.stop()
    doc = {"target": target.name, "draft": draft.name, "settings": {k: v for k, v in vars(a).items()
                                                                    if k not in ("json", "reference_python")},
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count()}, "runs": rows}
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
