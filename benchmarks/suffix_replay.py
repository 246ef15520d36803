"""Replay drafting rules over recorded greedy answers of the agent workload (benchmarks/prompts/agentic.jsonl), no
timing: which rule would save the target the most passes, before one is built into the suffix drafter.

The answers (both halves) come from the demo target, greedy (`--record FILE` writes them, `--answers FILE` reads
them back). Each measured answer is replayed step by step: the rule proposes up to --k tokens after the prompt and
the answer so far, the step accepts the proposal's agreeing prefix and one token more. Reported per kind of
request: steps, tokens drafted and accepted, and a priced cost in units of one single-token decode — a plain step
1, a verify of r rows 1.4 + 0.05·r (tests/test_adaptive.py's cpu_like_costs, the shape measured on these CPUs).
`--oracle` prices each step as if its draft had been cut at its accepted length (no failed rows, no failed steps).
The store holds the warm-up half's answers, and each measured answer once replayed (as suffix-warm).

Rules: ngram (specq's n-gram lookup, ngram_min 3, ngram_max 6), suffix (the suffix drafter's path as built),
suffix-text4 (the request's own text allowed 4x its match's length), hop (each token from the longest ending of the
text and the path so far, in the index whose match is longer, while the path's probability stays ≥ 0.1).
`--factor F` replays with the drafter's MAX_SPEC_FACTOR set to F (every suffix rule; hop has no cap). `--cut TAU`
cuts each proposal where the acceptance learnt so far (over the replay, per evidence key — the suffix drafter's
source and match bucket, or "ngram" — and depth, a prior of 1 in 2) falls below TAU, as a length controller that
knew the key would; it learns from what the whole proposal would have had accepted.

    python benchmarks/suffix_replay.py --record /tmp/agentic-answers.json
    python benchmarks/suffix_replay.py --answers /tmp/agentic-answers.json --rules ngram,suffix,suffix-text4,hop \
        [--oracle] [--factor F] [--cut TAU] > benchmarks/results/suffix_replay-demo.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from agentic import formatter, load  # noqa: E402 (benchmarks/ is the script's folder)

from specq.native.drafters import suffix as sx
from specq.native.drafters.ngram import NgramIndex

HERE = Path(__file__).parent


def record(out: Path) -> None:
    from specq.native.commands.demo import demo_pair
    from specq.native.core.settings import GenerationSettings
    from specq.native.runtime.engine import Engine

    warmup, measured = load(HERE / "prompts" / "agentic.jsonl")
    target, draft = demo_pair()
    rows = {}
    with Engine(target, draft, ctx=4096, threads=2, mtp=None) as eng:
        fmt = formatter(eng)
        ses = eng.session()
        s = GenerationSettings(n_predict=96, draft_max="auto", drafter="ngram").validate()  # greedy: the target's
        for half, reqs in (("warmup", warmup), ("measured", measured)):
            for r in reqs:
                toks = eng.tokenize(fmt.render(r["messages"]))
                ses.reset()
                rows[r["name"]] = {"half": half, "prompt": toks, "answer": ses.generate(toks, s).run().tokens}
    out.write_text(json.dumps(rows))


def ngram(hist: list[int], k: int, store: sx.SuffixStore, text: sx.SuffixIndex) -> tuple[list[int], str]:
    index = NgramIndex(6)
    index.sync(hist)
    return index.propose(3, k), "ngram"


def suffix(hist: list[int], k: int, store: sx.SuffixStore, text: sx.SuffixIndex,
           text_factor: float | None = None) -> tuple[list[int], str]:
    at, match = store.index.occurrences(hist)
    from_store = sx.grow(at, match, k)
    at, match = text.occurrences(hist)
    factor = sx.MAX_SPEC_FACTOR
    sx.MAX_SPEC_FACTOR = factor if text_factor is None else text_factor
    try:
        own = sx.grow(at, match, k)
    finally:
        sx.MAX_SPEC_FACTOR = factor
    path, source = (from_store, "store") if from_store.expected > own.expected else (own, "text")
    return path.tokens, sx.evidence_key(source, path.match) if path.tokens else ""


def hop(hist: list[int], k: int, store: sx.SuffixStore, text: sx.SuffixIndex) -> tuple[list[int], str]:
    path, p, first = [], 1.0, ""
    while len(path) < k:
        (sa, sm), (oa, om) = store.index.occurrences(hist + path), text.occurrences(hist + path)
        at, match = (oa, om) if om >= sm else (sa, sm)
        counts = sx.followers(at, 0) if match >= sx.KEY else {}
        if not counts:
            break
        tok = max(counts, key=counts.__getitem__)
        p *= counts[tok] / len(at)
        if p < sx.MIN_TOKEN_PROB:
            break
        first = first or sx.evidence_key("text" if om >= sm else "store", match)
        path.append(tok)
    return path, first


RULES = {"ngram": ngram, "suffix": suffix, "hop": hop,
         "suffix-text4": lambda h, k, st, t: suffix(h, k, st, t, text_factor=4.0)}


class Cut:
    """--cut TAU: acceptance learnt per (evidence key, depth) over the replay; a proposal is cut at the first depth
    whose estimate (accepted + 1) / (reached + 2) is below TAU."""

    def __init__(self, tau: float):
        self.tau = tau
        self.reached: dict = defaultdict(float)
        self.accepted: dict = defaultdict(float)

    def keep(self, key: str, n: int) -> int:
        for j in range(n):
            at = (key, min(j, 8))
            if (self.accepted[at] + 1) / (self.reached[at] + 2) < self.tau:
                return j
        return n

    def learn(self, key: str, n: int, n_accepted: int) -> None:
        for j in range(min(n, n_accepted + 1)):
            self.reached[(key, min(j, 8))] += 1
            self.accepted[(key, min(j, 8))] += j < n_accepted


def agreed(drafts: list[int], answer: list[int], i: int) -> int:
    n = 0
    while n < len(drafts) and i + n < len(answer) and drafts[n] == answer[i + n]:
        n += 1
    return n


def replay(answers: dict, rule: str, k: int, oracle: bool, cut: float | None = None) -> dict:
    store = sx.SuffixStore()
    for r in answers.values():
        if r["half"] == "warmup":
            store.add(r["prompt"][-sx.PROMPT_TAIL:] + r["answer"])
    per = defaultdict(lambda: {"steps": 0, "drafted": 0, "accepted": 0, "cost": 0.0})
    learnt = Cut(cut) if cut is not None else None
    for name, r in answers.items():
        if r["half"] != "measured":
            continue
        kind, prompt, answer, i = name.split("-")[1], r["prompt"], r["answer"], 0
        text = sx.SuffixIndex()
        text.extend(0, prompt)
        while i < len(answer):
            proposed, key = RULES[rule](prompt + answer[:i], min(k, len(answer) - i), store, text)
            drafts = proposed[:learnt.keep(key, len(proposed))] if learnt is not None else proposed
            n = agreed(drafts, answer, i)
            if learnt is not None:
                learnt.learn(key, len(proposed), agreed(proposed, answer, i))
            rows = n if oracle else len(drafts)
            row = per[kind]
            row["steps"] += 1
            row["drafted"] += len(drafts)
            row["accepted"] += n
            row["cost"] += 1.4 + 0.05 * (rows + 1) if rows else 1.0
            text.extend(0, answer[i:i + n + 1])
            i += n + 1
        store.add(prompt[-sx.PROMPT_TAIL:] + answer)
    per["all"] = {f: sum(v[f] for v in per.values()) for f in ("steps", "drafted", "accepted", "cost")}
    return dict(per)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--record", type=Path, help="answer the workload's requests and write them here")
    ap.add_argument("--answers", type=Path, help="a --record file to replay")
    ap.add_argument("--rules", default="ngram,suffix,suffix-text4,hop")
    ap.add_argument("--k", type=int, default=16, help="the most tokens a step drafts")
    ap.add_argument("--oracle", action="store_true", help="price each draft cut at its accepted length")
    ap.add_argument("--factor", type=float, help="the suffix drafter's MAX_SPEC_FACTOR for this replay")
    ap.add_argument("--cut", type=float, help="cut proposals where the acceptance learnt per key and depth < CUT")
    a = ap.parse_args()
    if a.record:
        record(a.record)
        return
    if not a.answers:
        ap.error("--record FILE or --answers FILE")
    answers = json.loads(a.answers.read_text())
    if a.factor is not None:
        sx.MAX_SPEC_FACTOR = a.factor
    out = {rule: replay(answers, rule, a.k, a.oracle, a.cut) for rule in a.rules.split(",")}
    for rule, per in out.items():
        for kind, row in sorted(per.items()):
            print(f"{rule:13s} {kind:11s} steps {row['steps']:4d} drafted {row['drafted']:5d} "
                  f"accepted {row['accepted']:5d} cost {row['cost']:7.1f}", file=sys.stderr)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
