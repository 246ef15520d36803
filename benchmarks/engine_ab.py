"""One tree's engine in-process, as benchmarks/serve_vs_engine.py runs it (demo pair, draft-max auto, greedy, the
default prompt): one warm-up, then 4 generations, tokens/s each. Run it with each checkout's Python, alternating:

    for i in 1 2 3; do <after python> benchmarks/engine_ab.py after; <before python> benchmarks/engine_ab.py before; done
"""

from __future__ import annotations

import sys
import time

from specq.native.commands.bench import DEFAULT_PROMPT
from specq.native.commands.demo import demo_pair
from specq.native.core.settings import GenerationSettings
from specq.native.runtime.engine import Engine


def main() -> None:
    target, draft = demo_pair()
    eng = Engine(target, draft, ctx=4096, threads=2)
    ses = eng.session()
    prompt = eng.tokenize(DEFAULT_PROMPT)
    s = GenerationSettings(n_predict=128, draft_max="auto", temp=0.0)
    ses.reset()
    ses.generate(prompt, s).run()
    out = []
    for _ in range(4):
        time.sleep(1.0)  # idle OpenMP workers stop spinning, as between serve_vs_engine's runs
        ses.reset()
        g = ses.generate(prompt, s).run()
        out.append(round(g.stats.tokens_per_s, 1))
    st = g.stats
    print(sys.argv[1] if len(sys.argv) > 1 else "", out, st.n_steps, st.n_drafted, st.n_accepted,
          round(st.draft_ms), round(st.verify_ms), round(st.gen_ms))


if __name__ == "__main__":
    main()
