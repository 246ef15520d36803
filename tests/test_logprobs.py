"""Log-probabilities of the emitted tokens (GenerationSettings.logprobs): the log-softmax of the target's raw
logits on the row that chose each token, read from the verify's rows. The reference is llama-cpp-python's own
`Llama` evaluating the same tokens with every row's logits, and a log-softmax written here."""

from __future__ import annotations

import numpy as np
import pytest
from llama_cpp import Llama

from specq.native.runtime.batch import Batch
from specq.native.runtime.engine import Engine
from specq.native.core.settings import GenerationSettings

PROMPT = "def fibonacci(n):"
TOL = 0.05  # batch-vs-single rounding (INTERFACES.md)


def reference_rows(model, tokens: list[int], n_prompt: int) -> np.ndarray:
    """Row i: the raw log-softmax that chose tokens[n_prompt + i], evaluated by llama-cpp-python alone."""
    llm = Llama(str(model), n_ctx=256, n_threads=1, logits_all=True, verbose=False)
    llm.eval(tokens[:-1])
    rows = np.array(llm.scores[n_prompt - 1:len(tokens) - 1], dtype=np.float64)
    rows -= rows.max(axis=1, keepdims=True)
    return rows - np.log(np.exp(rows).sum(axis=1, keepdims=True))


def check_against(ref: np.ndarray, g, n_top: int) -> None:
    events = list(g.events)
    assert len(events) == len(g.tokens) and all(ev.logprob is not None for ev in events)
    for i, ev in enumerate(events):
        assert ev.logprob == pytest.approx(ref[i, ev.token], abs=TOL)
        assert len(ev.top_logprobs) == n_top
        lps = [lp for _, lp in ev.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        for tok, lp in ev.top_logprobs:
            assert lp == pytest.approx(ref[i, tok], abs=TOL)
        # the top n are the row's most likely (up to the rounding at the boundary)
        assert lps[-1] >= np.sort(ref[i])[-n_top] - TOL


def generate(e: Engine, **kw):
    ses = e.session()
    g = ses.generate(e.tokenize(PROMPT), GenerationSettings(n_predict=24, **kw))
    g.events = list(g)
    return ses, g


def test_logprobs_of_drafted_tokens_are_the_targets_raw_log_softmax(tiny_target, tiny_close):
    with Engine(tiny_target, tiny_close, ctx=256, threads=1) as e:
        prompt = e.tokenize(PROMPT)
        ses, g = generate(e, draft_max=4, logprobs=5)
    assert len(set(g.tokens)) > 5 and g.stats.n_drafted > 0 and g.stats.n_accepted > 0
    assert any(ev.from_draft for ev in g.events)  # some reported rows are drafted positions of a verify
    ref = reference_rows(tiny_target, prompt + g.tokens, len(prompt))
    check_against(ref, g, 5)
    # greedy: each token is its row's most likely
    assert all(ev.top_logprobs[0][0] == ev.token for ev in g.events)


def test_logprobs_are_before_temperature_and_truncation(tiny_target, tiny_close):
    """At T 1.5 with top-k 2 the reported law is still the raw one: five alternatives, their raw values."""
    with Engine(tiny_target, tiny_close, ctx=256, threads=1) as e:
        prompt = e.tokenize(PROMPT)
        ses, g = generate(e, draft_max=4, logprobs=5, temp=1.5, top_k=2, top_p=1.0, min_p=0.0, seed=3)
    assert g.stats.n_drafted > 0
    ref = reference_rows(tiny_target, prompt + g.tokens, len(prompt))
    check_against(ref, g, 5)


def test_no_logprobs_unless_asked(tiny_target, tiny_close):
    with Engine(tiny_target, tiny_close, ctx=256, threads=1) as e:
        _, g = generate(e, draft_max=4)
    assert all(ev.logprob is None and ev.top_logprobs == () for ev in g.events)


def test_logprobs_per_sequence_in_a_batch(tiny_target, tiny_close):
    """Two sequences verified in one decode: each one's logprobs come from its own rows."""
    prompts = [PROMPT, "The quick brown fox"]
    with Engine(tiny_target, tiny_close, ctx=256, threads=1, parallel=2) as e:
        toks = [e.tokenize(p) for p in prompts]
        gens = [e.session(i).generate(t, GenerationSettings(n_predict=20, draft_max=4, logprobs=lp))
                for i, (t, lp) in enumerate(zip(toks, (3, None)))]
        batch = Batch()
        events: dict[int, list] = {0: [], 1: []}
        for g in gens:
            batch.add(g)
        while batch.live:
            for g, evs in batch.step():
                events[gens.index(g)].extend(evs)
        assert e.tgt_ctx.n_multi_decodes > 0  # the two were verified in one decode
    gens[0].events = events[0]
    assert gens[0].stats.n_drafted > 0 and len(set(gens[0].tokens)) > 5
    assert all(ev.logprob is None for ev in events[1]) and events[1]
    ref = reference_rows(tiny_target, toks[0] + gens[0].tokens, len(toks[0]))
    check_against(ref, gens[0], 3)
