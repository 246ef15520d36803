"""One request through `specq serve` against the engine in-process (bench's path), on the same pair and prompt.

In-process: an Engine loaded and driven on this script's main thread, greedy speculative generation as
`specq bench` runs it (tokens/s over the generation, and over the wall time with the prefill). Through the
server: `specq serve` as a real subprocess on 127.0.0.1, one non-streamed /v1/completions request; tokens/s =
completion tokens / the request's wall time seen by the client. The two alternate repeat by repeat (the machine
may be shared). Then the time to first token seen by a streaming client at a ~0.5k- and a ~4k-token prompt,
speculative against the same server's target alone (`draft_max: 0` in the request), alternating too.

    python benchmarks/serve_vs_engine.py [--pair demo|deep] [--repeats 3] [--json benchmarks/results/X.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from specq.native.commands.bench import DEFAULT_PROMPT  # noqa: E402
from specq.native.runtime.engine import Engine  # noqa: E402
from specq.native.core.settings import GenerationSettings  # noqa: E402

_PORT = re.compile(r"on http://127\.0\.0\.1:(\d+)/v1")
FILLER = ("The history of computing is a story of machines that got smaller, faster and cheaper, and of the people "
          "who learned to program them. ")


def pair(name: str) -> tuple[str | None, str | None]:
    """(target, draft) paths; the demo pair is the built-in default (None, None: bare `specq serve`)."""
    if name == "demo":
        return None, None
    from deep_pair import deep_pair

    t, d = deep_pair()
    return str(t), str(d)


def post(url: str, body: dict, timeout: float = 600) -> tuple[dict, float]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        doc = json.loads(r.read())
    return doc, time.perf_counter() - t0


def first_token_s(url: str, body: dict, timeout: float = 600) -> float:
    """Seconds from sending a streamed request to the first chunk that carries text."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["text"]:
                t = time.perf_counter() - t0
                for _ in r:  # read the rest: the server finishes the request before the next one
                    pass
                return t
    raise RuntimeError("the stream ended without text")


class Server:
    def __init__(self, args: list[str], log: Path):
        self.log = open(log, "w")
        # as a user runs it: no OMP_WAIT_POLICY or other override in the environment
        self.proc = subprocess.Popen([str(Path(sys.executable).parent / "specq"), "serve", "--host", "127.0.0.1",
                                      "--port", "0", *args], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=self.log)
        deadline = time.monotonic() + 600
        while not (m := _PORT.search(log.read_text())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"specq serve did not start: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        self.url = f"http://127.0.0.1:{m.group(1)}/v1/completions"

    def stop(self) -> int:
        self.proc.terminate()
        rc = self.proc.wait(120)
        self.log.close()
        return rc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", choices=("demo", "deep"), default="demo")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--n-predict", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--ttft-prompts", default="500,3800", help="prompt lengths (tokens) for the TTFT comparison")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    target, draft = pair(a.pair)
    if target is None:
        from specq.native.commands.demo import demo_pair

        target, draft = (str(p) for p in demo_pair())
        serve_args = []  # bare `specq serve`: the built-in demo pair
    else:
        serve_args = ["--target", target, "--draft", draft]
    serve_args += ["--threads", str(a.threads), "--ctx", str(a.ctx)]
    settings = GenerationSettings(n_predict=a.n_predict, draft_max="auto", temp=0.0)
    load0 = os.getloadavg()
    eng = Engine(target, draft, ctx=a.ctx, threads=a.threads)  # on this (main) thread, as bench does
    ses = eng.session()
    prompt = eng.tokenize(DEFAULT_PROMPT)
    server = Server(serve_args, Path(tempfile.mkdtemp()) / "serve.log")
    runs: list[dict] = []
    try:
        body = {"prompt": DEFAULT_PROMPT, "max_tokens": a.n_predict, "temperature": 0, "cache_prompt": False}
        post(server.url, body)  # warm-up, both sides: first-use costs and the controllers' first estimates
        ses.reset()
        ses.generate(prompt, settings).run()
        for r in range(a.repeats):
            for where in (("engine", "serve") if r % 2 == 0 else ("serve", "engine")):
                time.sleep(1.0)  # idle OpenMP workers of the other side stop spinning
                if where == "engine":
                    ses.reset()
                    t0 = time.perf_counter()
                    g = ses.generate(prompt, settings).run()
                    wall = time.perf_counter() - t0
                    runs.append({"where": "engine", "repeat": r, "n": len(g.tokens), "wall_s": wall,
                                 "tok_s": g.stats.tokens_per_s, "tok_s_wall": len(g.tokens) / wall,
                                 "accept_rate": g.stats.accept_rate, "text": g.text})
                else:
                    doc, wall = post(server.url, body)
                    n = doc["usage"]["completion_tokens"]
                    runs.append({"where": "serve", "repeat": r, "n": n, "wall_s": wall, "tok_s_wall": n / wall,
                                 "server_tok_s": doc["usage"]["speculative"]["tokens_per_s"],
                                 "accept_rate": doc["usage"]["speculative"]["accept_rate"],
                                 "text": doc["choices"][0]["text"]})
                print(json.dumps({k: v for k, v in runs[-1].items() if k != "text"}), flush=True)
        ttft: list[dict] = []
        words = FILLER * 400
        for n_tok in (int(x) for x in a.ttft_prompts.split(",")):
            ids = eng.tokenize(words)[:n_tok]
            text = eng.target.detokenize(ids[1:] if ids and ids[0] == eng.target.bos else ids)
            for r in range(a.repeats):
                for mode in (("speculative", "target") if r % 2 == 0 else ("target", "speculative")):
                    req = {"prompt": text, "max_tokens": 8, "temperature": 0, "cache_prompt": False}
                    if mode == "target":
                        req["draft_max"] = 0
                    time.sleep(1.0)
                    ttft.append({"prompt_tokens": n_tok, "mode": mode, "repeat": r,
                                 "ttft_s": first_token_s(server.url, req)})
                    print(json.dumps(ttft[-1]), flush=True)
    finally:
        rc = server.stop()
        eng.close()

    def med(where: str, key: str) -> float:
        return statistics.median(x[key] for x in runs if x["where"] == where)

    summary = {"engine_tok_s": med("engine", "tok_s"), "engine_tok_s_wall": med("engine", "tok_s_wall"),
               "serve_tok_s_wall": med("serve", "tok_s_wall"),
               "same_text": len({x["text"] for x in runs}) == 1}
    summary["ratio"] = summary["serve_tok_s_wall"] / summary["engine_tok_s"]
    summary["ratio_wall"] = summary["serve_tok_s_wall"] / summary["engine_tok_s_wall"]
    for n_tok in sorted({x["prompt_tokens"] for x in ttft}):
        spec = statistics.median(x["ttft_s"] for x in ttft if x["prompt_tokens"] == n_tok and x["mode"] == "speculative")
        alone = statistics.median(x["ttft_s"] for x in ttft if x["prompt_tokens"] == n_tok and x["mode"] == "target")
        summary[f"ttft_{n_tok}"] = {"speculative_s": spec, "target_alone_s": alone, "ratio": spec / alone}
    print(json.dumps(summary, indent=1))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({
            "command": " ".join(["python", "benchmarks/serve_vs_engine.py", *sys.argv[1:]]),
            "pair": {"name": a.pair, "target": Path(target).name, "draft": Path(draft).name},
            "settings": {"n_predict": a.n_predict, "threads": a.threads, "ctx": a.ctx, "draft_max": "auto",
                         "temp": 0, "prompt": DEFAULT_PROMPT},
            "summary": summary, "runs": runs, "ttft": ttft, "server_exit": rc,
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_before": load0,
                        "load_after": os.getloadavg(), "shared": True}}, indent=1))


if __name__ == "__main__":
    main()
