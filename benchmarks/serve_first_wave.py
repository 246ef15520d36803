"""The first loads' first tokens through specq serve --parallel N, with the engine's timeline: a server started
as serve_vs_llamaserver.py starts it (with the draft; the benchmark's one-request warm-up), then `--loads` loads
of N streaming clients × 2 requests (96 tokens), each request's arrival and time to first token, and every
prefill, prompt read (the draft's side of a prefill), batch admission and step over 5 ms, timed inside the
server (its Generation and Batch methods wrapped in this script's child mode). Says what the first wave's first
tokens wait for (docs/benchmarks.md, "The first wave's first tokens").

    python benchmarks/serve_first_wave.py [--pair demo|deep] [--parallel 4] [--loads 2] [--context-tokens T]
        [--plain] [--json F]

`--context-tokens T`: each client's prompts carry a document of about T tokens (serve_vs_llamaserver.with_documents);
`--plain`: every request asks for the target alone (draft_max 0). The target's and the draft's sides of each
prefill (Session.prefill_target, prefill_reader) are timed too.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

TIMED = {"Generation": ("_prefill", "_read_prompt"), "Batch": ("add_all", "step", "delivered"),
         "Session": ("prefill_target", "prefill_reader")}
LINE = re.compile(r"^TIMELINE (\{.*\})$", re.M)


def child() -> None:
    """specq's CLI with the engine's methods timed: one TIMELINE line per call over 5 ms, on stderr."""
    from specq.native.runtime import batch, generation, session

    t0 = time.perf_counter()

    def wrap(cls, name: str) -> None:
        inner = getattr(cls, name)

        def timed(self, *args, **kw):
            start = time.perf_counter()
            out = inner(self, *args, **kw)
            ms = 1e3 * (time.perf_counter() - start)
            if ms > 5:
                ev = {"at_s": round(start - t0, 4), "what": f"{cls.__name__}.{name}", "ms": round(ms, 1)}
                if cls is session.Session:
                    ev |= {"seq": self.seq, "tokens": len(args[0]) if args else 0, "history": len(self.history)}
                if cls is generation.Generation:
                    ev |= {"seq": self.session.seq, "prepared": self.prepared}
                elif name == "step":
                    ev["live"] = len(self.live)
                    drafted = [(g.session.seq, g._last[0].drafter, g._last[0].n_drafted, len(g._last[0].emitted))
                               for g in self._stepped if getattr(g, "_last", None) and g._last[0].n_drafted]
                    if drafted:  # (sequence, drafter, drafted, emitted) of each sequence that drafted
                        ev["drafted"] = drafted
                print("TIMELINE " + json.dumps(ev), file=sys.stderr, flush=True)
            return out
        setattr(cls, name, timed)

    for cls in (generation.Generation, batch.Batch, session.Session):
        for name in TIMED[cls.__name__]:
            wrap(cls, name)
    from specq.cli.main import main

    sys.argv = ["specq", *sys.argv[2:]]
    sys.exit(main())


def main() -> None:
    import openai

    import serve_vs_llamaserver as svl
    from serve_load import Server, load_prompts, model_of, run_load

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", choices=("demo", "deep"), default="demo")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--loads", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context-tokens", type=int, default=0, help="a document of about this many tokens a client")
    ap.add_argument("--plain", action="store_true", help="every request with draft_max 0")
    ap.add_argument("--json")
    a = ap.parse_args()
    target, draft = svl.pair(a.pair)
    prompts = load_prompts()
    if a.context_tokens:
        prompts = svl.with_documents(prompts, a.context_tokens, a.parallel, 2)
    extra = {"draft_max": 0} if a.plain else {}
    argv = [sys.executable, __file__, "--child", *svl.specq_defaults(a.parallel, target, draft, a.threads)[1:]]
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "serve.log"
        srv = Server(argv, log, None)
        try:
            model = model_of(srv)
            run_load(srv.url, model, load_prompts(), 1, 1, 16)
            for n in range(a.loads):
                mark, requests, t_load = log.stat().st_size, [], time.perf_counter()

                def client(c: int) -> None:
                    cl = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none")
                    for r in range(2):
                        t0, first = time.perf_counter(), None
                        stream = cl.chat.completions.create(
                            model=model, max_tokens=96, temperature=0, stream=True, extra_body=extra,
                            messages=[{"role": "user", "content": prompts[(c * 2 + r) % len(prompts)]}])
                        for chunk in stream:
                            if first is None and chunk.choices and chunk.choices[0].delta.content:
                                first = time.perf_counter() - t0
                        requests.append({"client": c, "request": r, "sent_s": round(t0 - t_load, 3),
                                         "ttft_s": round(first or 0.0, 3)})

                threads = [threading.Thread(target=client, args=(c,)) for c in range(a.parallel)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                with open(log, "rb") as f:
                    f.seek(mark)
                    timeline = [json.loads(m) for m in LINE.findall(f.read().decode("utf-8", "replace"))]
                loads.append({"load": n, "requests": sorted(requests, key=lambda r: r["sent_s"]),
                              "timeline": timeline})
                print(f"load {n}: TTFT " + ", ".join(f"{r['ttft_s']:.2f}" for r in loads[-1]["requests"])
                      + "; " + "; ".join(f"{e['what']} {e['ms']:.0f} ms" + (f" (seq {e['seq']}, prepared "
                                          f"{e['prepared']})" if "prepared" in e else "")
                                          for e in timeline[:8]), file=sys.stderr, flush=True)
        finally:
            srv.stop()
    if a.json:
        Path(a.json).write_text(json.dumps({"settings": vars(a), "loads": loads}, indent=1) + "\n")


if __name__ == "__main__":
    child() if len(sys.argv) > 1 and sys.argv[1] == "--child" else main()
