"""N-gram (prompt-lookup) drafting: the lookup itself, exactness through the engine (greedy and rejection
sampling with a point-mass proposal), the drafter flags, and the gain on text that repeats its input."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specq.cli.main import app
from specq.errors import UsageError
from specq.native.runtime.engine import Engine
from specq.native.core.settings import GenerationSettings
from specq.native.drafters.ngram import propose
from specq.native.drafters.registry import parse_drafter
from stats import chi2_pvalue
from test_exactness import sampled_law, target_law

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "for i in range(10): print(i * i)"]


def test_propose_follows_the_latest_longest_match():
    #        0  1  2  3  4  5  6  7  8  9
    toks = [1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 3]
    assert propose(toks, 2, 4, 3) == [4, 5, 9]  # the longest ending seen before wins: "1 2 3" at 0..2
    assert propose(toks, 2, 2, 3) == [7, 1, 2]  # of "2 3", the latest occurrence (6..7), followed by 7 1 2
    assert propose(toks, 2, 2, 1) == [7]
    assert propose([1, 2, 3, 4], 2, 4, 3) == []  # no ending seen before
    assert propose(toks, 2, 4, 0) == []
    assert propose([5, 5, 5], 1, 2, 4) == [5, 5, 5, 5]  # an overlapping occurrence counts; drafts go on past the
    # text's end, each token looked up after the ones drafted before it


def test_short_endings_draft_only_a_clear_majority_of_enough_occurrences():
    # "9" never occurred before the end with 3 tokens of context, so the n-gram of --ngram-min (3) tokens is unseen;
    # the 1-gram "9" was followed by 4 twice of three times (66%): drafted (llama.cpp's lax thresholds)
    toks = [9, 4, 1, 9, 4, 2, 9, 5, 3, 8, 9]
    assert propose(toks, 3, 4, 1) == [4]
    assert propose(toks[:-4] + [9, 6, 0, 9], 3, 4, 1) == []  # 9 was followed by 4, 4, 9, 6: half, below 66%
    assert propose([7, 9, 1, 3, 9], 3, 4, 1) == []  # 9 was followed once: not enough


def test_the_index_follows_a_text_cut_back_and_grown_again():
    from specq.native.drafters.ngram import NgramIndex

    text = [1, 2, 3, 4, 1, 2, 3, 5, 6, 7, 8, 1, 2, 3]
    index = NgramIndex(4)
    assert index.sync(text[:8])
    assert index.sync(text) and not index.sync(text)  # grew; then nothing new
    fresh = NgramIndex(4)
    fresh.sync(text[:10] + [9, 9])
    index.sync(text[:10] + [9, 9])  # cut back to 10 tokens, then two others
    assert index.counts == fresh.counts and index.text == fresh.text
    assert index.propose(3, 2) == fresh.propose(3, 2)


def test_parse_drafter_orders_ngram_first_and_refuses_the_rest():
    assert parse_drafter("model") == ("model",)
    assert parse_drafter("model,ngram") == ("ngram", "model") == parse_drafter("ngram, model")
    assert parse_drafter("mtp, ngram") == ("ngram", "mtp") and parse_drafter("auto") == ("auto",)
    for bad in ("auto,ngram", "model,model", "", "ngram,bogus", "MTP"):
        with pytest.raises(UsageError, match="--drafter"):
            parse_drafter(bad)
    with pytest.raises(UsageError, match="--ngram-min"):
        GenerationSettings(ngram_min=4, ngram_max=3).validate()


def test_settings_carry_the_names_as_written_and_a_generation_gets_them_checked_and_ordered(tiny_target):
    """The settings (core/) know no drafter: --drafter's names are checked and put in the order each step tries
    them where they meet the drafters; Session.generate does it for a library user."""
    s = GenerationSettings(drafter="model, ngram", n_predict=4)
    assert s.validate().drafters == ("model", "ngram")
    with Engine(tiny_target, tiny_target, ctx=128, threads=1) as e:
        toks = e.tokenize(PROMPTS[0])
        assert e.session().generate(toks, s).settings.drafters == ("ngram", "model")
        with pytest.raises(UsageError, match="--drafter must be"):
            e.session().generate(toks, GenerationSettings(drafter="ngram,bogus"))
    with pytest.raises(UsageError, match="--drafter"):
        GenerationSettings(drafter=" , ").validate()


@pytest.mark.parametrize("drafter", ["ngram", "model,ngram"])
def test_greedy_identity_with_ngram_drafting(tiny_target, tiny_close, drafter):
    with Engine(tiny_target, tiny_close if "model" in drafter else None, ctx=512, threads=1) as e:
        by: dict = {}
        for prompt in PROMPTS:
            toks = e.tokenize(prompt)
            base = e.session().generate(toks, GenerationSettings(n_predict=96), speculative=False).run()
            g = e.session().generate(toks, GenerationSettings(n_predict=96, draft_max=8, drafter=drafter)).run()
            assert len(set(base.tokens)) > 5 and g.tokens == base.tokens, prompt
            for name, n in g.stats.n_drafted_by:
                by[name] = by.get(name, 0) + n
            assert sum(n for _, n in g.stats.n_drafted_by) == g.stats.n_drafted
            assert sum(n for _, n in g.stats.n_accepted_by) == g.stats.n_accepted
    assert by.get("ngram", 0) > 0  # the tiny model's output repeats itself here and there
    if "model" in drafter:
        assert by.get("model", 0) > 0  # and the model drafts where the text has no match


def point_mass_context(tiny_target, base: list[int]) -> list[int]:
    """A prompt that holds each token the target may sample first (top-4) followed by its likeliest successor:
    after the first token (the target's prefill's own) the 1-gram lookup mostly finds it earlier and drafts a
    point mass there, accepted at some steps and rejected at others."""
    pre = []
    for _ in range(6):
        law = target_law(tiny_target, pre + base, 2, top_k=4)
        firsts: dict[int, list] = {}
        for (y, x), p in law.items():
            firsts.setdefault(y, []).append((p, x))
        want = [t for y, opts in sorted(firsts.items()) for t in (y, max(opts)[1])]
        if want == pre:
            break
        pre = want
    return pre + base


def test_a_point_mass_proposal_keeps_the_joint_law_exact(tiny_target):
    # Accepted with probability p(x), else a sample from p without x: together exactly p.
    kw = dict(temp=1.0, top_k=4, top_p=1.0, min_p=0.0, drafter="ngram", ngram_min=1, ngram_max=1)
    with Engine(tiny_target, None, ctx=128, threads=1) as e:
        toks = point_mass_context(tiny_target, e.tokenize("The quick brown fox"))
        law = target_law(tiny_target, toks, 2, top_k=4)
        counts, stats = sampled_law(e, toks, 3000, 2, n_predict=3, draft_max=1, **kw)
        drafted = sum(dict(st.n_drafted_by).get("ngram", 0) for st in stats)
        accepted = sum(st.n_accepted for st in stats)
    assert len(law) == 16 and drafted > 1500  # the second token was a drafted point mass in most runs
    assert 300 < accepted < drafted - 300  # accepted often, rejected often: both branches of the rule ran
    assert chi2_pvalue(counts, law) > 0.001


def test_bench_with_ngram_alone_needs_no_draft_and_reports_per_drafter(tiny_target):
    r = CliRunner().invoke(app, ["bench", "--target", str(tiny_target), "--drafter", "ngram", "--n-predict", "48",
                                 "--prompt", "The quick brown fox", "--threads", "1", "--json", "-", "-q"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["settings"]["drafter"] == "ngram" and doc["draft"] is None
    spec = [x for x in doc["runs"] if x["mode"] == "speculative"]
    assert spec and set(spec[0]["n_drafted_by"]) <= {"ngram"} and spec[0]["n_drafted"] == sum(
        spec[0]["n_drafted_by"].values())
    assert doc["summary"]["identical_output"] is True


@pytest.mark.parametrize("args, phrase", [(["--drafter", "bogus"], "--drafter"),
                                          (["--drafter", "model,ngram"], "needs a --draft"),
                                          (["--drafter", "ngram", "--ngram-min", "0"], "--ngram-min")])
def test_bad_drafter_flags_are_usage_errors(tiny_target, args, phrase):
    r = CliRunner().invoke(app, ["bench", "--target", str(tiny_target), "--n-predict", "4", *args])
    assert r.exit_code == 2 and phrase in r.stderr, r.output


@pytest.mark.slow
def test_ngram_drafting_accepts_most_of_a_copy_on_the_demo_model():
    from specq.native.commands.demo import demo_pair

    code = "def add(a, b):\n    result = a + b\n    print('adding', a, 'and', b, 'gives', result)\n    return result\n\n"
    target, _ = demo_pair()
    with Engine(target, None, ctx=1024, threads=2) as e:
        toks = e.tokenize("Original:\n" + code + "Copy:\n")
        base = e.session().generate(toks, GenerationSettings(n_predict=64), speculative=False).run()
        g = e.session().generate(toks, GenerationSettings(n_predict=64, draft_max=8, drafter="ngram")).run()
    assert g.tokens == base.tokens and len(set(base.tokens)) > 10
    # the copy is proposed: over half the tokens come from accepted drafts, under half a step a token
    assert g.stats.n_accepted >= 32 and g.stats.n_steps <= 32 and g.stats.alpha >= 0.8


def test_ngram_alone_under_auto_length_is_priced_as_a_lookup_with_a_draft_model_loaded(tiny_target, tiny_unrelated):
    # With a draft model loaded and --drafter ngram, draft_max auto priced each n-gram token as a draft model token:
    # the prefill's timing of the model (3 ms against the target's 10) and the model's share of the target's bytes
    # as the prior; it drafted 18 tokens in 200. A lookup costs next to nothing (registry.cost_priors), so it drafts
    # wherever the text repeats.
    from specq.native.runtime.engine import SimulatedClock
    from test_adaptive import cpu_like_costs

    clock = SimulatedClock(cpu_like_costs(target_one_ms=10.0, draft_ms=3.0))
    with Engine(tiny_target, tiny_unrelated, ctx=1024, threads=1, clock=clock) as e:
        toks = e.tokenize("def fibonacci(n):")
        base = e.session().generate(toks, GenerationSettings(n_predict=200), speculative=False).run()
        g = e.session().generate(toks, GenerationSettings(n_predict=200, draft_max="auto", drafter="ngram")).run()
    assert g.tokens == base.tokens and len(set(base.tokens)) > 50
    assert dict(g.stats.n_drafted_by).get("ngram", 0) > 60 and g.stats.n_accepted > 30, g.stats.n_drafted_by
