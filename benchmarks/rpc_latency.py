"""The target on an RPC server behind an injected network latency: target alone vs speculative.

    python benchmarks/rpc_latency.py [--rtt 0,1,5] [--n-predict 128] [--repeat 3] [--draft-max 8]
        [--threads 1] [--server-threads 1] [--tiny] [--out results.json] [--markdown]

One `specq rpc-server` (this machine's CPU) holds the whole target; the draft runs in the client. Between
them sits a delaying TCP proxy written here (no netem rights needed): every chunk waits rtt/2 in each
direction, in order, as netem's delay does. The proxy also reads the client's command stream (| cmd u8 |
size u64 | payload |) to count graph computations, and counts round trips: a server→client chunk after
client→server traffic, i.e. each time the client waited for an answer.

Each (rtt, mode) is its own `specq bench` process through a fresh proxy: target alone (plain decoding,
one target decode per token) and speculative (--no-baseline, one verify per step). From the 0 ms runs
the cost model predicts the others with no fitted constant:

    t_plain(L) = t_plain(0) + r_plain · L          per token   (r_plain: round trips per plain decode)
    t_step(L)  = t_step(0)  + r_verify · L         per step    (r_verify: round trips per verify; drafting is local)
    speed-up(L) = t_plain(L) · E / t_step(L)        E = tokens per step, the same at every L at temp 0

--tiny uses two tiny generated models (a smoke test of the pipeline, no meaningful speeds); the default
is the demo pair (SmolLM2-135M-Instruct F32 target, Q4_1 draft).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SPECQ = str(Path(sys.executable).parent / "specq")
PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring and two tests."
GRAPH_CMDS = (10, 16)  # RPC_CMD_GRAPH_COMPUTE, RPC_CMD_GRAPH_RECOMPUTE (ggml-rpc.cpp)


class DelayProxy:
    """127.0.0.1:port → upstream, each chunk delivered rtt/2 after it was read, per direction."""

    def __init__(self, upstream: tuple[str, int], rtt_ms: float):
        self.upstream = upstream
        self.half = rtt_ms / 2000.0
        self.lock = threading.Lock()
        self.round_trips = 0
        self.graphs = 0
        self.rt_at_first_graph = None
        self.last_dir = None
        self.commands: dict[int, int] = {}
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            parser = self._parser()
            next(parser)
            self._pump(client, server, "up", parser)
            self._pump(server, client, "down", None)

    def _parser(self):
        """Client→server bytes → command counts (the HELLO comes first like any command)."""
        buf = b""
        while True:
            while len(buf) < 9:
                buf += yield
            cmd, size = struct.unpack("<BQ", buf[:9])
            buf = buf[9:]
            with self.lock:
                self.commands[cmd] = self.commands.get(cmd, 0) + 1
                if cmd in GRAPH_CMDS:
                    self.graphs += 1
                    if self.rt_at_first_graph is None:
                        self.rt_at_first_graph = self.round_trips
            while len(buf) < size:
                size -= len(buf)
                buf = yield
            buf = buf[size:]

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str, parser) -> None:
        q: queue.Queue = queue.Queue()

        def read() -> None:
            while True:
                try:
                    data = src.recv(1 << 20)
                except OSError:
                    data = b""
                with self.lock:
                    if data and direction == "down" and self.last_dir == "up":
                        self.round_trips += 1
                    if data:
                        self.last_dir = direction
                if data and parser is not None:
                    parser.send(data)
                q.put((time.monotonic() + self.half, data))
                if not data:
                    return

        def write() -> None:
            while True:
                due, data = q.get()
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                if not data:
                    try:
                        dst.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    return
                try:
                    dst.sendall(data)
                except OSError:
                    return

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=write, daemon=True).start()

    def stats(self) -> dict:
        with self.lock:
            after = self.round_trips - (self.rt_at_first_graph or 0)
            return {"round_trips": self.round_trips, "round_trips_after_load": after, "graphs": self.graphs,
                    "commands": dict(sorted(self.commands.items()))}

    def close(self) -> None:
        self.sock.close()


def start_server(threads: int) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([SPECQ, "rpc-server", "--port", str(port), "--threads", str(threads), "-q"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    end = time.monotonic() + 120
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            time.sleep(0.5)  # listening; let it reach accept() before the first client
            return p, port
        except OSError:
            time.sleep(0.2)
    p.kill()
    raise SystemExit("rpc-server did not start; run `specq rpc-build` first")


def bench(target: Path, draft: Path | None, port: int, args) -> dict:
    cmd = [SPECQ, "bench", "--target", str(target), "--prompt", PROMPT, "--chat", "--temp", "0",
           "--n-predict", str(args.n_predict), "--repeat", str(args.repeat), "--threads", str(args.threads),
           "--ctx", "1024", "--rpc", f"127.0.0.1:{port}", "--json", "-", "-q"]
    if draft is not None:
        cmd += ["--draft", str(draft), "--no-baseline", "--draft-max", str(args.draft_max)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench failed: {r.stderr.strip()}")
    return json.loads(r.stdout)


def summarise(doc: dict, proxy: dict, speculative: bool) -> dict:
    runs = doc["runs"]
    gen_s = sum(r["gen_ms"] for r in runs) / 1000
    n_tok = sum(r["n_generated"] for r in runs)
    # target decodes during generation: one per token (plain), one per step (speculative); + 1 prefill per run
    n_dec = sum(r["n_steps"] for r in runs) if speculative else n_tok
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "s_per_decode": gen_s / max(n_dec, 1),
            "tokens_per_decode": n_tok / max(n_dec, 1),
            "round_trips_per_decode": proxy["round_trips_after_load"] / max(n_dec + len(runs), 1),
            "graphs_per_decode": proxy["graphs"] / max(n_dec + len(runs), 1),
            "accept_rate": statistics.median(r["accept_rate"] for r in runs) if speculative else None,
            "tokens": [r["tokens"] for r in runs]}


def tiny_pair(folder: Path) -> tuple[Path, Path]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tinymodels import TinySpec, write_tiny_gguf

    spec = TinySpec(n_layer=6, n_embd=256, n_ff=512)
    return (write_tiny_gguf(folder / "rpc-tiny-target.gguf", seed=1, spec=spec),
            write_tiny_gguf(folder / "rpc-tiny-draft.gguf", seed=3, spec=spec, noise_from=(1, 0.05)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rtt", default="0,1,5", help="round-trip times in ms")
    ap.add_argument("--n-predict", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--draft-max", default="8")
    ap.add_argument("--threads", type=int, default=1, help="client threads (the draft)")
    ap.add_argument("--server-threads", type=int, default=1)
    ap.add_argument("--tiny", action="store_true", help="tiny generated models: a smoke test")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    rtts = [float(x) for x in args.rtt.split(",")]
    if rtts[0] != 0:
        raise SystemExit("--rtt must start with 0: the model predicts the others from it")
    tmp = tempfile.TemporaryDirectory()
    if args.tiny:
        target, draft = tiny_pair(Path(tmp.name))
    else:
        from specq.native.commands.demo import demo_pair

        target, draft = demo_pair()
    server, port = start_server(args.server_threads)
    rows = []
    try:
        for rtt in rtts:
            row = {"rtt_ms": rtt}
            for mode, d in (("plain", None), ("speculative", draft)):
                proxy = DelayProxy(("127.0.0.1", port), rtt)
                doc = bench(target, d, proxy.port, args)
                pstats = proxy.stats()
                proxy.close()
                row[mode] = {**summarise(doc, pstats, d is not None), "proxy": pstats}
                print(f"rtt {rtt:g} ms {mode}: {row[mode]['tokens_per_s']:.1f} tok/s, "
                      f"{row[mode]['round_trips_per_decode']:.1f} round trips per target decode", file=sys.stderr)
            row["speedup"] = row["speculative"]["tokens_per_s"] / row["plain"]["tokens_per_s"]
            row["identical_output"] = row["speculative"]["tokens"] == row["plain"]["tokens"]
            rows.append(row)
    finally:
        server.kill()
    z = rows[0]
    for row in rows:
        L = row["rtt_ms"] / 1000
        t_plain = z["plain"]["s_per_decode"] + row["plain"]["round_trips_per_decode"] * L
        t_step = z["speculative"]["s_per_decode"] + row["speculative"]["round_trips_per_decode"] * L
        row["predicted_speedup"] = t_plain * z["speculative"]["tokens_per_decode"] / t_step
    doc = {"benchmark": "rpc_latency", "settings": {k: (v.name if isinstance(v, Path) else v)  # no machine paths
                                                    for k, v in vars(args).items()},
           "target": target.name, "draft": draft.name, "machine": {
               "cpu": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                            if ln.startswith("model name")), "?"),
               "logical_cpus": os.cpu_count(), "python": platform.python_version()},
           "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    lines = ["| RTT | plain tok/s | spec tok/s | speed-up | predicted | round trips / plain decode | "
             "round trips / verify | tokens / verify | same output |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rtt_ms']:g} ms | {r['plain']['tokens_per_s']:.1f} | {r['speculative']['tokens_per_s']:.1f}"
                     f" | {r['speedup']:.2f}× | {r['predicted_speedup']:.2f}× | "
                     f"{r['plain']['round_trips_per_decode']:.1f} | {r['speculative']['round_trips_per_decode']:.1f} | "
                     f"{r['speculative']['tokens_per_decode']:.2f} | {'yes' if r['identical_output'] else 'NO'} |")
    print("\n".join(lines) if args.markdown else json.dumps(rows, indent=1, default=str)[:4000])


if __name__ == "__main__":
    main()
