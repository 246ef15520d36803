"""Mutation check of the engine's rules: apply one wrong rule at a time, run the exactness tests, and report
which tests kill it. Exits non-zero if any mutant survives (no test fails) or a mutation no longer applies.

The source files are edited in place and restored afterwards (also on Ctrl-C or a kill); run it on a clean tree.

    python benchmarks/mutations.py [--only NAME,...] [--markdown] [--first]

A whole run takes about as long as the tests, once per mutant (29 here: ~1.5 h on 2 cores); --first stops each
mutant's run at its first failing test (every mutant still has to die; the table then names that one test).
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ["tests/test_exactness.py", "tests/test_rejection.py", "tests/test_engine.py", "tests/test_accept.py",
         "tests/test_tinyqwen35.py", "tests/test_hybrid.py", "tests/test_swa.py", "tests/test_mtp.py",
         "tests/test_counts.py", "tests/test_parallel.py", "tests/test_logprobs.py",
         "tests/test_batch_plan.py", "tests/test_constrained.py", "tests/test_serve_tools_e2e.py",
         "tests/test_drafter_interface.py", "tests/test_auto_drafter.py", "tests/test_suffix.py",
         "tests/test_crossvocab.py", "tests/test_first_token.py"]


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    edits: tuple[tuple[str, str, str], ...]  # (file, exact text, replacement)


MUTANTS = [
    Mutant("constraint-verify-unmasked", "under a constraint the target's verify rows are not masked (greedy and "
                                         "rejection read the raw rows)",
           (("native/core/sampling.py",
             "return logits if self.guide is None else self.guide.rows(logits, drafts)", "return logits"),)),
    Mutant("constraint-draft-unmasked", "under a constraint the draft's rows are not masked (it proposes from its raw "
                                        "distribution; proposals are still cut at a forbidden token)",
           (("native/core/sampling.py",
             "return row if self.guide is None else self.guide.row(row, drafts, len(drafts))", "return row"),)),
    Mutant("batch-rows-of-first", "in a decode of several sequences, each sequence's logits read from the decode's "
                                  "first output rows instead of its own",
           (("native/llama/ffi.py", "off = self._out_row.get(seq, 0)\n", "off = 0\n"),)),
    Mutant("batch-snapshots-shared", "a sequence's rollback snapshots taken to cover the last decode of sequence 0 "
                                     "instead of its own last decode",
           (("native/llama/ffi.py", "last_decode_pos0 = property(lambda self: self.parent._last_pos0.get(self.seq, 0))",
             "last_decode_pos0 = property(lambda self: self.parent._last_pos0.get(0, 0))"),)),
    Mutant("bonus-from-draft", "the bonus token drawn from the draft's last distribution, not the target's p[n]",
           (("native/core/accept.py", "[draw_sparse(*_pair(p[n]), rng)]", "[draw_sparse(*_pair(q[n - 1] if n else p[n]), rng)]"),)),
    Mutant("resample-from-p", "after a rejection, sample from p instead of norm(max(0, p - q))",
           (("native/core/accept.py", "residual = np.maximum(pp - _probs_at(q[a], ids), 0.0)", "residual = pp"),)),
    Mutant("accept-with-p", "accept a draft token with probability p(x) instead of min(1, p(x)/q(x))",
           (("native/core/accept.py", "reject = np.flatnonzero(rng.random(n) * qd >= pt)",
             "reject = np.flatnonzero(rng.random(n) >= pt)"),)),
    Mutant("hybrid-no-seq-rm", "no seq_rm after restoring a hybrid checkpoint (stale attention positions stay)",
           (("native/core/memory.py", "            self.ctx.seq_rm(base, -1)  # hybrid: the attention part still holds the later positions\n",
             ""),)),
    Mutant("rollback-across-decodes", "a hybrid tail dropped through n_rs_seq snapshots beyond the last decode "
                                      "(llama.cpp's seq_rm then reports success with a wrong state)",
           (("native/core/memory.py", "return 0 < held - n <= self.ctx.n_rs_seq and n >= self.ctx.last_decode_pos0",
             "return 0 < held - n <= self.ctx.n_rs_seq"),)),
    Mutant("swa-trust-seq-rm", "a sliding-window cache rolled back with seq_rm even where it no longer holds the "
                               "window of the first kept position (llama.cpp reports success)",
           (("native/llama/ffi.py", "return self.n_swa == 0 or self.pos_min(seq) <= max(0, n - self.n_swa)",
             "return True"),)),
    Mutant("swa-full", "llama.cpp's full-size sliding-window cache: the window never slides, the tests' "
                       "rollbacks from a slid window never happen",
           (("native/llama/ffi.py", "params.swa_full = bool(swa_full)", "params.swa_full = True"),)),
    Mutant("ignore-eog", "end of generation ignored",
           (("native/runtime/generation.py", "if is_eog:\n                return events, \"eog\"",
             "if False:\n                return events, \"eog\""),)),
    Mutant("draft-min-ignored", "--draft-min never drops a short draft",
           (("native/runtime/step.py", "keep = n >= a.settings.draft_min", "keep = True"),)),
    Mutant("per-pos-exactly", "accepted_per_pos counts steps accepting exactly i+1, not at least i+1",
           (("native/core/accept.py", "at_least = np.cumsum(counts[::-1])[::-1]", "at_least = counts"),)),
    Mutant("record-after-decode", "tokens recorded after llama_decode returns, and truncate trusts the list "
                                  "(defect 1: an interruption in between leaves a cache out of step)",
           (("native/core/memory.py", "        n0 = len(self.tokens)\n        self.tokens.extend(new)  # recorded first: an interruption leaves the list ahead of the memory\n        self.ctx.decode(new, n0, logits=logits)",
             "        self.ctx.decode(new, len(self.tokens), logits=logits)\n        self.tokens.extend(new)"),
            ("native/core/memory.py", "        held = self.ctx.pos_max() + 1\n        if held < len(self.tokens):",
             "        held = len(self.tokens)\n        if held < len(self.tokens):"))),
    Mutant("split-verify", "a verify batch larger than n_batch is split and only its last chunk's rows read "
                           "(defect 2)",
           (("native/runtime/engine.py", "n_batch=max(n_batch, rows)", "n_batch=n_batch"),
            ("native/llama/ffi.py", 'if logits == "all" and n > self.n_batch:', "if False:"))),
    Mutant("wide-vocab-stop", "the draft samples its whole vocabulary and stops on an id the target lacks "
                              "(defect 3: the stop depends on the sampled value)",
           (("native/drafters/base.py", "q = restrict(samp.draft_tf(row), n_vocab_tgt)", "q = samp.draft_tf(row)"),
            ("native/drafters/base.py", "return None if stop else (tok, q)",
             "return None if stop or tok >= n_vocab_tgt else (tok, q)"))),
    Mutant("count-unemitted", "n_drafted/n_accepted count draft tokens past an EOG or a stop inside a step "
                              "(defect 4)",
           (("native/core/stats.py", "        if n_kept < len(step.emitted):\n", "        if False:\n"),)),
    Mutant("count-emitted-only", "a step counts as drafted only the positions up to its first rejection, not every "
                                 "draft token verified (accept_rate became the per-position α)",
           (("native/core/stats.py", "        if n_kept < len(step.emitted):\n", "        if True:\n"),)),
    Mutant("controller-peeks", "the step's outcome seen before choosing: a sequence whose first draft was rejected "
                               "has its step taken back and decoded plain (the draft length chosen after the verify)",
           (("native/runtime/step.py",
             "    logprobs = [logprobs_of(a.session, e, a.settings) for a, (e, _) in zip(asks, accepted)]\n",
             "    if any(d and len(e) == 1 for d, (e, _) in zip(drafts, accepted)):\n"
             "        for a in asks:\n"
             "            a.session.rewind()\n"
             "        return step([Ask(a.session, a.settings, a.samp, 0, ()) if d and len(e) == 1 else a\n"
             "                     for a, d, (e, _) in zip(asks, drafts, accepted)])\n"
             "    logprobs = [logprobs_of(a.session, e, a.settings) for a, (e, _) in zip(asks, accepted)]\n"),)),
    Mutant("mtp-pairing", "the MTP head fed token k with the trunk's hidden state h_{k-2} instead of h_{k-1}",
           (("native/drafters/mtp.py", "            rows = self.rows.take(m - 1, upto - 1)\n",
             "            rows = np.roll(self.rows.take(m - 1, upto - 1), 1, axis=0)\n"),)),
    Mutant("mtp-own-state", "a drafted token fed to the MTP head with the trunk's last row, not the head's own "
                            "output state",
           (("native/drafters/mtp.py", "        h = self.ctx.hidden()", "        h = self.rows.rows[-1].copy()"),)),
    Mutant("batch-own-lengths", "a batched step drafts what each sequence would alone (no batch cost model)",
           (("native/control/batch_plan.py", "        self.last_c = best_c\n",
             "        best_c = top\n        self.last_c = best_c\n"),)),
    Mutant("shared-step-costs", "a step shared with other sequences teaches each sequence's controller the batch's "
                                "verify time as its own",
           (("native/control/length.py", "        if step.shared:\n", "        if False:\n"),)),
    Mutant("mtp-rows-of-first-seq", "in a batched verify every MTP head is handed sequence 0's trunk rows",
           (("native/llama/ffi.py", "                sink = self._hidden_sinks.get(seq)\n",
             "                sink = self._hidden_sinks.get(0)\n"),)),
    Mutant("mtp-one-memory", "every sequence's MTP head decodes into sequence 0 of the head's cache",
           (("native/llama/ffi.py", "C.llama_batch_ext_add_token(b, int(seq), int(tokens[i]))",
             "C.llama_batch_ext_add_token(b, 0, int(tokens[i]))"),)),
    Mutant("logprobs-after-temperature", "logprobs reported from the tempered distribution, not the raw logits",
           (("native/core/logprobs.py", "    x = row.astype(np.float64)\n", "    x = row.astype(np.float64) / 1.5\n"),)),
    Mutant("logprobs-row-shift", "a token's logprobs read from the row after the one that chose it",
           (("native/core/logprobs.py", "zip(rows, emitted)", "zip(np.roll(rows, -1, axis=0), emitted)"),)),
    Mutant("end-untold", "the drafters are not told a generation ended (Drafter.ended): a store across "
                         "requests learns nothing, a window on probation is never settled",
           (("native/runtime/generation.py",
             '                d.ended(self.new_tokens, self.tokens, interrupted=stop == "interrupted")\n',
             "                pass\n"),)),
    Mutant("resources-unshared", "each session's drafter opens its engine resource anew instead of the one the "
                                 "engine provides (Drafter.shared)",
           (("native/drafters/base.py", "        return self.session.engine.provided.get(self.name)\n",
             "        return type(self).provide(self.session.engine)\n"),)),
    Mutant("handover-ignored", "--drafter auto: the draft model drafts on past the point where an n-gram would "
                               "copy (Session.until ignored)",
           (("native/drafters/model.py", "n_max, self.session.until)", "n_max, None)"),)),
    Mutant("fold-stale-row", "a folded prefill's row read after another decode of the context (Session.take_ahead "
                             "without its stamp)",
           (("native/runtime/session.py", "if use and stamp == self.tgt.ctx.n_decode_calls and len",
             "if use and len"),)),
    Mutant("fold-sampler-output-row", "llama.cpp's sampler given the output row, not its batch index, after a "
                                      "folded prefill (Context.output_index)",
           (("native/llama/ffi.py", 'self._out_at = {seq: m - 1 if logits == "last" else 0}',
             "self._out_at = {seq: 0}"),)),
    Mutant("catchup-beside-first-token", "a draft with a deferred prompt read catches up in the step that gives "
                                         "another sequence its first token (Batch._first_tokens_first skipped)",
           (("native/runtime/batch.py", "            if wishes:\n                plans = self._first_tokens_first(",
             "            if False:\n                plans = self._first_tokens_first("),)),
    Mutant("suffix-keeps-interrupted", "--drafter suffix: an interrupted generation's partial output enters the "
                                       "store",
           (("native/drafters/suffix.py", "if self.on and not interrupted and output", "if self.on and output"),)),
    Mutant("suffix-rarest-continuation", "--drafter suffix: the path follows the least frequent continuation",
           (("native/drafters/suffix.py", "tok = max(counts, key=counts.__getitem__)",
             "tok = min(counts, key=counts.__getitem__)"),)),
    Mutant("suffix-sampled-q-point-mass", "--drafter suffix at T > 0: a sampled draft verified with a point mass "
                                          "on the drawn token as q (the law holds, acceptance falls to sum q*p)",
           (("native/drafters/suffix.py", "        dists.append(q)\n", "        dists.append(point_mass(tok))\n"),)),
    Mutant("suffix-q-not-renormalised", "--drafter suffix at T > 0: the count law not renormalised after the "
                                        "threshold drop (q sums below 1)",
           (("native/drafters/suffix.py", "return SparseDist(ids[keep], w[keep] / w[keep].sum())",
             "return SparseDist(ids[keep], w[keep])"),)),
    Mutant("auto-evidence-pooled", "--drafter auto: a drafter's evidence keys ignored (one acceptance estimate "
                                   "for a long match's copies and a short match's guesses)",
           (("native/control/chooser.py", "self.keys = dict(keys or {})", "self.keys = {}"),)),
    Mutant("guide-foreign-matcher", "a constraint compiled for another (closed) model used as it is: its matcher "
                                    "keeps that model's freed vocabulary pointer",
           (("native/core/constraint.py", "if c.compiled is None or not compiled_for(model, c):",
             "if c.compiled is None:"),)),
    Mutant("named-choice-repeats", "a named tool_choice lets the call grammar repeat (parallel_tool_calls' default "
                                   "kept): the answer may hold several calls",
           (("native/serving/tools.py", 'parallel is not False and kind != "function")', "parallel is not False)"),)),
    Mutant("tli-unnormalised", "TLI's q over target ids not renormalised over the shared tokens (it sums to the "
                               "shared mass)",
           (("native/core/vocabmap.py", "return SparseDist(ids.astype(np.int32), probs / mass), mass",
             "return SparseDist(ids.astype(np.int32), probs), mass"),)),
    Mutant("string-last-word-proposed", "the string path proposes the draft text's last word, whose split more "
                                        "text can still change",
           (("native/drafters/crossvocab.py",
             "text = bytes(draft_text[:char_end(draft_text)]) if ended else held_back(draft_text)",
             "text = bytes(draft_text[:char_end(draft_text)])"),)),
    Mutant("xvocab-memory-kept", "a cross-vocabulary draft's memory not rolled back after a partial acceptance",
           (("native/drafters/crossvocab.py",
             "self.memory.truncate(common_prefix(self.memory.tokens, self.text.sync(self.session.history)))",
             "self.text.sync(self.session.history)"),)),
    Mutant("vocab-auto-ignores-cost", "--vocab-map auto scores a translation by tokens a step, not tokens a second",
           (("native/control/translation.py", "rate = b.tokens / b.seconds", "rate = float(b.tokens)"),)),
    Mutant("attention-any-gain", "the attention probe takes flash attention where it is faster by any margin",
           (("native/runtime/attention.py", 'return AttentionProbe("on" if at["on"] < (1 - PROBE_GAIN) * at["off"]',
             'return AttentionProbe("on" if at["on"] < at["off"]'),
            ("native/runtime/attention.py", 'if at["on"] >= (1 - PROBE_GAIN) * at["off"] or deep <= short:',
             'if at["on"] >= at["off"] or deep <= short:'))),
    Mutant("attention-short-only", "the attention probe never looks deeper than its short depth",
           (("native/runtime/attention.py", "far = _time_both(ctxs, n_seq, deep)", "far = at"),)),
    Mutant("pick-longest-prefix", "a new request takes the idle sequence with the longest shared prefix, whatever "
           "another conversation's cache loses",
           (("native/serving/scheduler.py", "ses = pick_session(self.idle, job.prompt)",
             "ses = max(self.idle, key=lambda s: common_prefix(s.tgt.tokens, job.prompt))"),)),
]


def run_tests(timeout: int, first: bool = False, tests: list[str] = TESTS) -> tuple[int, list[str], float]:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(["-x"] if first else []),
                        *tests], cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    failed = sorted({m.group(1) for m in re.finditer(r"^(?:FAILED|ERROR) (\S+)", r.stdout, re.M)})
    summary = re.search(r"\d+ (?:passed|failed|errors?|skipped)\b.* in [\d.]+s", r.stdout)
    if r.returncode != 0 and not failed and not summary:
        # the test process ended inside a test (a native abort: specq's one line, exit 1) with no summary
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        failed = [f"(process)::ended inside a test: {last[:100]}"]
    return r.returncode, failed, time.perf_counter() - t0


def apply(m: Mutant, originals: dict[Path, str]) -> None:
    """Apply a mutant's edits, keeping each file's original text in `originals` (for restoring)."""
    for rel, old, new in m.edits:
        p = ROOT / rel
        text = p.read_text(encoding="utf-8")
        originals.setdefault(p, text)
        if text.count(old) != 1:
            raise SystemExit(f"mutant {m.name}: the text to replace occurs {text.count(old)} times in {rel}; "
                             "update benchmarks/mutations.py")
        p.write_text(text.replace(old, new), encoding="utf-8")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated mutant names")
    ap.add_argument("--markdown", action="store_true", help="print the result table as Markdown")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--first", action="store_true", help="stop each mutant's tests at the first failure")
    ap.add_argument("--json", type=Path, help="write every mutant's killing tests here")
    ap.add_argument("--tests", help="comma-separated test files or ids to run instead of the exactness set "
                                    "(a quick check of which of them kill each mutant)")
    a = ap.parse_args()
    chosen = [m for m in MUTANTS if not a.only or m.name in a.only.split(",")]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a `kill` restores the sources too (finally below)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "native"], cwd=ROOT, capture_output=True, text=True).stdout
    if dirty.strip():
        raise SystemExit("native/ has uncommitted changes; commit or stash them first (the mutants edit it in place)")
    tests = a.tests.split(",") if a.tests else TESTS
    rc, failed, secs = run_tests(a.timeout, tests=tests)
    if rc != 0:
        raise SystemExit(f"the tests fail without any mutation: {failed}")
    print(f"unmutated: tests pass ({secs:.0f} s)", flush=True)
    rows, survivors = [], []
    for m in chosen:
        originals: dict[Path, str] = {}
        try:
            apply(m, originals)
            rc, failed, secs = run_tests(a.timeout, a.first, tests)
        finally:
            for p, text in originals.items():
                p.write_text(text, encoding="utf-8")
        killed = rc != 0 and bool(failed)
        if not killed:
            survivors.append(m.name)
        rows.append((m, failed))
        print(f"{m.name}: {'killed by ' + str(len(failed)) + ' tests' if killed else 'SURVIVED'} ({secs:.0f} s)",
              flush=True)
    if a.json:
        a.json.write_text(json.dumps({m.name: failed for m, failed in rows}, indent=1) + "\n")
    if a.markdown:
        print("\n| mutant (wrong rule) | killed by |\n|---|---|")
        for m, failed in rows:
            names = ", ".join(f"`{f.split('::', 1)[1]}`" for f in failed[:4]) + (
                f" and {len(failed) - 4} more" if len(failed) > 4 else "")
            print(f"| `{m.name}`: {m.what} | {names or '**survived**'} |")
    if survivors:
        print("survivors: " + ", ".join(survivors), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
