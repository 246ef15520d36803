"""The suffix drafter's store at its bound: memory and lookup time with 1M tokens stored (issue 54's bounds:
<= 256 MB RSS, <= 50 us of lookup per drafted token), and after as many tokens again pushed the oldest out.

The answers are made of real text: the demo model's tokenizer over code and prose stitched from the prompt sets,
each answer a random window of that corpus with a few tokens changed (answers that repeat parts of each other, as an
agent's do, without being copies). Then lookups: the endings of other windows, each asked for up to 16 tokens.

    python benchmarks/suffix_store.py --tokens 1000000 --json benchmarks/results/suffix_store-xeon2.json
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time
from pathlib import Path

import numpy as np

from specq.native.commands.demo import demo_pair
from specq.native.drafters.suffix import STORE_ANSWERS, SuffixStore
from specq.native.llama import ffi

HERE = Path(__file__).parent


def rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024


def corpus(model) -> np.ndarray:
    """Token ids of every prompt text under benchmarks/prompts, repeated out to 200k tokens."""
    rows = [json.loads(line) for f in sorted((HERE / "prompts").glob("*.jsonl"))
            for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]
    text = "\n".join(r["prompt"] if "prompt" in r else "\n".join(m["content"] for m in r["messages"]) for r in rows)
    toks = np.array(model.tokenize(text, add_special=False, parse_special=False), dtype=np.int32)
    return np.resize(toks, max(len(toks), 200_000))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--answer-len", type=int, default=200)
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--json")
    a = ap.parse_args()
    target, _ = demo_pair()
    model = ffi.Model(target, vocab_only=True)
    text = corpus(model)
    rng = np.random.default_rng(0)
    n_answers = a.tokens // a.answer_len
    answers = []
    for _ in range(n_answers):
        at = int(rng.integers(0, len(text) - a.answer_len))
        ans = text[at:at + a.answer_len].copy()
        ans[rng.integers(0, a.answer_len, 4)] = rng.integers(0, model.n_vocab, 4)  # a few tokens changed
        answers.append(ans.tolist())
    before = rss_mib()
    store = SuffixStore(max_tokens=a.tokens, max_answers=max(STORE_ANSWERS, n_answers))
    t0 = time.perf_counter()
    for ans in answers:
        store.add(ans)
    fill_s = time.perf_counter() - t0
    after = rss_mib()
    endings = [text[at - 24:at].tolist() for at in rng.integers(24, len(text), a.lookups)]
    t0 = time.perf_counter()
    drafted = sum(len(store.index.path(e, 16).tokens) for e in endings)
    look_s = time.perf_counter() - t0
    for ans in answers:  # as many again: the oldest go, the store (and its index) stay within the bound
        store.add(ans[::-1])
    del answers
    cycled = rss_mib()
    doc = {"machine": {"cpu": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                                    if ln.startswith("model name")), "?"), "python": platform.python_version()},
           "command": " ".join(["python", "benchmarks/suffix_store.py", *sys.argv[1:]]),
           "tokens_stored": store.index.n_tokens, "answers_stored": store.n_answers,
           "rss_mib_store": after - before, "rss_mib_store_cycled_twice_over": cycled - before, "fill_s": fill_s, "lookups": a.lookups, "drafted": drafted,
           "lookup_us_per_call": look_s / a.lookups * 1e6,
           "lookup_us_per_drafted_token": look_s / max(drafted, 1) * 1e6}
    print(json.dumps(doc, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
