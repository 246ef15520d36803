"""Exact rejection sampling: speculative sampling follows the target's own distribution (chi-square)."""

from __future__ import annotations

import numpy as np
import pytest

from specq.errors import UsageError
from specq.native.core.accept import rejection_emit
from specq.native.runtime.engine import Engine
from specq.native.core.settings import GenerationSettings
from specq.native.core.sampling import SparseDist, Transform, sample
from stats import chi2_pvalue, chi2_sf
from tinymodels import TinySpec, write_tiny_gguf

SMALL = TinySpec(n_merges=40)  # ~300 tokens: enough samples per token for a chi-square test
PROMPT = "The quick brown"


def test_chi2_sf_matches_known_values():
    # Reference values from tables: chi2(3) at 7.815 → 0.05; chi2(10) at 23.209 → 0.01; chi2(1) at 0 → 1.
    assert chi2_sf(7.815, 3) == pytest.approx(0.05, abs=2e-4)
    assert chi2_sf(23.209, 10) == pytest.approx(0.01, abs=1e-4)
    assert chi2_sf(200.0, 150) == pytest.approx(0.00391, rel=0.05)
    assert chi2_sf(0.0, 1) == 1.0


def as_dict(d: SparseDist) -> dict:
    return {int(i): float(p) for i, p in zip(d.ids, d.probs)}


def test_rejection_emit_on_synthetic_distributions_is_exact():
    rng = np.random.default_rng(0)
    ids = np.arange(12, dtype=np.int32)
    p0 = SparseDist(ids, rng.dirichlet(np.ones(12)))
    q0 = SparseDist(ids[:8], rng.dirichlet(np.ones(8)))  # the draft misses some of the target's support
    p1 = SparseDist(ids[:3], np.array([0.5, 0.3, 0.2]))
    counts: dict = {}
    for _ in range(20000):
        x = sample(q0, rng)
        t = rejection_emit([x], [q0], [p0, p1], rng)[0]
        counts[t] = counts.get(t, 0) + 1
    assert chi2_pvalue(counts, as_dict(p0)) > 0.01
    # a wrong reference (uniform) is rejected: the test can fail
    assert chi2_pvalue(counts, {i: 1 / 12 for i in range(12)}) < 1e-6


@pytest.fixture(scope="module")
def small_pair(models_dir):
    t = write_tiny_gguf(models_dir / "small_target.gguf", seed=11, spec=SMALL)
    d = write_tiny_gguf(models_dir / "small_close.gguf", seed=12, spec=SMALL, noise_from=(11, 0.3))
    with Engine(t, d, ctx=128, threads=1) as e:
        yield e


def next_logits(ctx, tokens):
    ctx.clear()
    ctx.decode(tokens, 0, logits="last")
    return np.array(ctx.logits(1)[0])


SETTINGS = [dict(temp=1.0, top_k=0, top_p=1.0, min_p=0.0), dict(temp=0.7, top_k=40, top_p=0.95, min_p=0.05)]


@pytest.mark.parametrize("kw", SETTINGS)
def test_rejection_on_real_model_distributions_gives_target_two_token_joint(small_pair, kw):
    """Draft two tokens from the real draft model; the first two emitted tokens follow the target's joint law."""
    e = small_pair
    prefix = e.tokenize(PROMPT)
    tf_t, tf_d = Transform(**kw), Transform(**kw)
    p0 = tf_t(next_logits(e.tgt_ctx, prefix))
    q0 = tf_d(next_logits(e.dft_ctx, prefix))
    first = set(p0.ids.tolist()) | set(q0.ids.tolist())
    p1 = {x: tf_t(next_logits(e.tgt_ctx, prefix + [x])) for x in first}
    q1 = {x: tf_d(next_logits(e.dft_ctx, prefix + [x])) for x in first}
    dummy = SparseDist(np.array([0], np.int32), np.array([1.0]))
    rng = np.random.default_rng(1)
    n = 20000
    c_first: dict = {}
    c_second: dict = {}
    top = int(p0.ids[np.argmax(p0.probs)])
    for _ in range(n):
        x1 = sample(q0, rng)
        x2 = sample(q1[x1], rng)
        out = rejection_emit([x1, x2], [q0, q1[x1]], [p0, p1[x1], dummy], rng)
        c_first[out[0]] = c_first.get(out[0], 0) + 1
        if out[0] == top:  # the second token, given the target's most likely first token
            if len(out) == 1:  # the step ended at the first token; the next step samples from the target
                out = out + [sample(p1[top], rng)]
            c_second[out[1]] = c_second.get(out[1], 0) + 1
    assert chi2_pvalue(c_first, as_dict(p0)) > 0.01
    assert sum(c_second.values()) > 1000
    assert chi2_pvalue(c_second, as_dict(p1[top])) > 0.01
    # the test can fail: a uniform law over the same support is rejected
    assert chi2_pvalue(c_first, {int(i): 1 / len(p0.ids) for i in p0.ids}) < 0.01
    tf_t.close()
    tf_d.close()


@pytest.mark.parametrize("accept", ["match", "rejection"])
def test_speculative_drafted_token_end_to_end_matches_target_alone(small_pair, accept):
    """End to end through the engine (short generations): the law of the first drafted token (the second: the
    first is the target's prefill's own), given the target's likeliest first token, is the target's."""
    e = small_pair
    kw = SETTINGS[1]
    prefix = e.tokenize(PROMPT)
    tf = Transform(**kw)
    p0 = tf(next_logits(e.tgt_ctx, prefix))
    top = int(p0.ids[np.argmax(p0.probs)])
    p1 = as_dict(tf(next_logits(e.tgt_ctx, prefix + [top])))
    tf.close()
    counts: dict = {}
    base: dict = {}
    ses = e.session()
    for seed in range(3000):
        ses.reset()
        g = ses.generate(prefix, GenerationSettings(n_predict=3, draft_max=1, seed=seed, accept=accept, **kw)).run()
        if g.tokens[0] == top:
            assert g.stats.n_drafted == 1
            counts[g.tokens[1]] = counts.get(g.tokens[1], 0) + 1
        if accept == "match":  # target-alone sampling with llama.cpp's chain, the reference
            ses.reset()
            b = ses.generate(prefix, GenerationSettings(n_predict=2, seed=seed, **kw), speculative=False).run()
            if b.tokens[0] == top:
                base[b.tokens[1]] = base.get(b.tokens[1], 0) + 1
    assert sum(counts.values()) > 500
    assert chi2_pvalue(counts, p1) > 0.01
    if base:
        assert chi2_pvalue(base, p1) > 0.01


def test_rejection_accepts_more_than_match_at_temperature_1(tiny_target, tiny_close):
    with Engine(tiny_target, tiny_close, ctx=256, threads=1) as e:
        toks = e.tokenize("def fibonacci(n):")
        rate = {}
        for mode in ("match", "rejection"):
            drafted = accepted = 0
            for seed in range(4):
                st = e.session().generate(toks, GenerationSettings(n_predict=48, draft_max=4, temp=1.0, seed=seed,
                                                                   accept=mode)).run().stats
                assert st.accept_mode == mode
                drafted += st.n_drafted
                accepted += st.n_accepted
            rate[mode] = accepted / drafted
    assert rate["rejection"] > rate["match"] + 0.05, rate


def test_temperature_zero_is_greedy_in_every_mode(tiny_target, tiny_close):
    with Engine(tiny_target, tiny_close, ctx=256, threads=1) as e:
        toks = e.tokenize("def fibonacci(n):")
        outs = [e.session().generate(toks, GenerationSettings(n_predict=24, accept=m)).run() for m in
                ("auto", "match", "rejection")]
        base = e.session().generate(toks, GenerationSettings(n_predict=24), speculative=False).run()
    assert all(g.tokens == base.tokens for g in outs)
    assert all(g.stats.accept_mode == "greedy" for g in outs)


def test_rejection_is_reproducible_with_a_seed(tiny_target, tiny_close):
    with Engine(tiny_target, tiny_close, ctx=256, threads=1) as e:
        toks = e.tokenize("The quick brown fox")
        s = GenerationSettings(n_predict=32, temp=0.9, seed=7)
        a, b = (e.session().generate(toks, s).run() for _ in range(2))
        c = e.session().generate(toks, GenerationSettings(n_predict=32, temp=0.9, seed=8)).run()
    assert a.stats.accept_mode == "rejection" and a.stats.sample_ms > 0
    assert a.tokens == b.tokens and a.tokens != c.tokens


def test_bad_accept_mode_is_a_usage_error():
    with pytest.raises(UsageError, match="--accept"):
        GenerationSettings(accept="sometimes").validate()
