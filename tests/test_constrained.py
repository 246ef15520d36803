"""Constrained output in the engine (core/constraint.py): exact under speculation. Greedy output equals constrained
decoding without a draft (one sequence, and in a batch mixed with free sequences); at temperature 1 the law of the
first tokens is the target's masked and renormalised law, computed here in numpy from the target's logits and the
grammar's allowed set written out by hand (no llguidance, no engine code); a proposal is cut at its first token
the grammar forbids; the `after` marker starts the constraint."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specq.native.runtime.batch import Batch
from specq.native.core.constraint import Constraint, compile_constraint
from specq.native.runtime.engine import Engine
from specq.native.core.settings import GenerationSettings
from specq.native.llama import ffi as _ffi
from stats import chi2_pvalue
from test_exactness import target_law

PROMPT = "def fibonacci(n):"
ABC = Constraint("lark", "start: /[abc]+/")  # any run of a, b, c: the tiny vocabulary has exactly those three
# JSON-like objects without free whitespace (a tiny random model would fill JSON's whitespace forever)
OBJECT = Constraint("lark", """start: "{" pair ("," pair)* "}"
pair: KEY ":" VALUE
KEY: /"[a-z]{1,8}"/
VALUE: /[0-9]{1,4}/ | /"[a-z ]{0,12}"/
""")


def constrained(e: Engine, c: Constraint) -> Constraint:
    return compile_constraint(e.target, c)


def abc_law(path, tokens: list[int], depth: int) -> dict:
    """The target's law of its next `depth` tokens at temperature 1 under `start: /[abc]+/`, from its logits with
    numpy (test_exactness.target_law): a token is allowed where its text is one or more of a, b, c; an
    end-of-generation token once at least one token was generated. A generation ends at an end-of-generation
    token (a shorter key)."""
    masks = {}

    def allowed(m, first: bool) -> np.ndarray:
        if first not in masks:
            letters = np.array([len(m.piece(t)) > 0 and set(m.piece(t)) <= set(b"abc") for t in range(m.n_vocab)])
            eog = np.array([m.is_eog(t) for t in range(m.n_vocab)])
            masks[first] = letters | (eog & (not first))
        return masks[first]

    return target_law(path, tokens, depth, allowed=allowed)


def test_rejection_sampling_under_a_grammar_keeps_the_masked_targets_law(tiny_target, tiny_close):
    # the first token comes from the target's prefill (masked), the next two are drafted, the fourth is the bonus
    kw = dict(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, n_predict=4, draft_max=2)
    with Engine(tiny_target, tiny_close, ctx=128, threads=1) as e:
        toks = e.tokenize(PROMPT)
        c = constrained(e, ABC)
        law = abc_law(tiny_target, toks, 4)
        ses, counts, drafted, accepted, masked = e.session(), {}, 0, 0, 0
        for seed in range(3000):
            ses.reset()
            g = ses.generate(toks, GenerationSettings(seed=seed, constraint=c, **kw)).run()
            counts[tuple(g.tokens)] = counts.get(tuple(g.tokens), 0) + 1
            drafted += g.stats.n_drafted_constrained
            accepted += g.stats.n_accepted_constrained
            masked += g.stats.n_masked_rows
            assert g.stats.accept_mode == "rejection"
    assert len(law) > 50 and max(law.values()) < 0.5  # a law with many outcomes, none dominant
    assert drafted > 2000 and 500 < accepted < drafted  # drafted under the grammar, some rejected
    assert masked > 3000 * 4
    assert chi2_pvalue(counts, law) > 0.001


@pytest.mark.parametrize("drafter, prompt", [("model", PROMPT), ("ngram", '{"ab":12,"cd":"x y"} ' * 3)])
def test_greedy_under_a_grammar_equals_constrained_decoding_without_a_draft(tiny_target, tiny_close, drafter,
                                                                             prompt):
    with Engine(tiny_target, tiny_close, ctx=256, threads=1) as e:
        toks = e.tokenize(prompt)
        s = GenerationSettings(n_predict=60, draft_max=4, drafter=drafter, constraint=constrained(e, OBJECT))
        want = e.session().generate(toks, s, speculative=False).run()
        got = e.session().generate(toks, s).run()
    assert got.tokens == want.tokens and len(set(want.tokens)) > 5
    assert want.text.startswith("{") and got.stats.constrained
    assert got.stats.n_drafted_constrained > 0 and got.stats.n_masks > 0


def test_an_ngram_proposal_is_cut_at_the_first_token_the_grammar_forbids(tiny_target):
    # the prompt repeats "abcab" then "xy": an n-gram proposal copies "x…" after "abcab", which [abc]+ forbids
    with Engine(tiny_target, ctx=256, threads=1) as e:
        toks = e.tokenize("abcab xy abcab xy abcab xy abcab")
        ses = e.session()
        g = ses.generate(toks, GenerationSettings(n_predict=12, draft_max=4, drafter="ngram",
                                                  constraint=constrained(e, ABC))).run()
        free = e.session().generate(toks, GenerationSettings(n_predict=12), speculative=False).run()
    assert set(g.text) <= set("abc") and g.text
    assert g.sampling.guide.n_cut > 0 and g.stats.n_drafted_constrained > 0
    assert free.tokens != g.tokens  # the grammar changed the answer


def test_a_constraint_compiled_for_a_closed_model_is_compiled_again_for_the_next(tiny_target):
    # A matcher keeps its model's vocabulary pointer (llguidance tokenizes through it): once that model is closed,
    # a Guide must not use the matcher with another model (a use after free: a segfault in CI, now and then).
    from specq.native.core import constraint
    from specq.native.core.constraint import compiled_for
    from specq.native.llama.guidance import lltokenizer

    with Engine(tiny_target, ctx=128, threads=1) as one:
        c = constrained(one, ABC)
        assert compiled_for(one.target, c)
    with Engine(tiny_target, ctx=128, threads=1) as e:
        assert not compiled_for(e.target, c)
        g = e.session().generate(e.tokenize("abc"), GenerationSettings(n_predict=8, constraint=c),
                                 speculative=False).run()
        key = (id(lltokenizer(e.target)), c.kind, c.text, c.lenient)
        assert key in constraint._COMPILED  # the Guide compiled it for this model
    assert g.text and set(g.text) <= set("abc")


def test_constrained_and_free_sequences_share_a_batch_and_each_equals_its_answer_alone(tiny_target, tiny_close):
    prompts = [PROMPT, "The quick brown fox", "for i in range(10):"]
    with Engine(tiny_target, tiny_close, ctx=256, threads=1) as one:
        cs = [constrained(one, OBJECT), None, constrained(one, ABC)]
        want = [one.session().generate(one.tokenize(p), GenerationSettings(n_predict=30, constraint=c),
                                       speculative=False).run().tokens for p, c in zip(prompts, cs)]
    with Engine(tiny_target, tiny_close, ctx=256, threads=1, parallel=3) as e:
        batch = Batch()
        gens = [e.session(i).generate(e.tokenize(p), GenerationSettings(n_predict=30, draft_max=4, constraint=c))
                for i, (p, c) in enumerate(zip(prompts, cs))]
        for g in gens:
            batch.add(g)
        batch.run()
        assert batch.most_in_a_step == 3
    for g, w in zip(gens, want):
        assert g.tokens == w and g.stats.n_drafted > 0
    assert gens[0].stats.n_drafted_constrained > 0 and not gens[1].stats.constrained
    assert set(gens[2].text) <= set("abc")


def test_the_constraint_starts_after_the_marker(tiny_target, tiny_close):
    with Engine(tiny_target, tiny_close, ctx=256, threads=1) as e:
        toks = e.tokenize(PROMPT)
        free = e.session().generate(toks, GenerationSettings(n_predict=40), speculative=False).run()
        pieces = [e.target.piece(t) for t in free.tokens]
        # the marker: the text of a token (plain ASCII) whose first appearance in the free answer it ends, after 3
        cut = next(i for i in range(4, len(pieces)) if pieces[i - 1].isascii() and pieces[i - 1].strip()
                   and b"".join(pieces[:i]).find(pieces[i - 1]) == len(b"".join(pieces[:i - 1])))
        c = constrained(e, Constraint("lark", "start: /[abc]+/", after=pieces[cut - 1].decode()))
        want = e.session().generate(toks, GenerationSettings(n_predict=40, constraint=c), speculative=False).run()
        got = e.session().generate(toks, GenerationSettings(n_predict=40, draft_max=4, constraint=c)).run()
        after = [e.target.piece(t) for t in want.tokens[cut:] if not e.target.is_eog(t)]
    assert got.tokens == want.tokens and got.stats.n_drafted > 0 and got.stats.n_drafted_constrained > 0
    assert want.tokens[:cut] == free.tokens[:cut]  # free text up to and including the marker
    assert after and all(set(p) <= set(b"abc") for p in after)


def test_a_draft_drafting_under_the_grammar_keeps_the_law_where_the_grammar_allows_much(tiny_target, tiny_close):
    # Under [a-z ]+ a quarter of the vocabulary is allowed: the draft proposes from its own masked, renormalised
    # distribution (from its raw one it would propose a forbidden token, cut, most of the time: the mutant
    # constraint-draft-unmasked drafts a fifth as much). The second token is the first drafted one: its marginal
    # law against numpy's.
    c_text = "start: /[a-z ]+/"
    kw = dict(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, n_predict=3, draft_max=1)
    with Engine(tiny_target, tiny_close, ctx=128, threads=1) as e:
        toks = e.tokenize(PROMPT)
        c = constrained(e, Constraint("lark", c_text))
        ses, counts, drafted = e.session(), {}, 0
        for seed in range(4000):
            ses.reset()
            g = ses.generate(toks, GenerationSettings(seed=seed, constraint=c, **kw)).run()
            counts[g.tokens[1]] = counts.get(g.tokens[1], 0) + 1
            drafted += g.stats.n_drafted_constrained
    with _ffi.Model(tiny_target) as m, _ffi.Context(m, 128, 1) as ctx:
        ok = np.array([len(m.piece(t)) > 0 and set(m.piece(t)) <= set(b"abcdefghijklmnopqrstuvwxyz ")
                       for t in range(m.n_vocab)])
        eog = np.array([m.is_eog(t) for t in range(m.n_vocab)])

        def probs(prefix, allow):
            ctx.clear()
            ctx.decode(prefix, 0)
            z = np.array(ctx.logits(1)[0], np.float64)
            z[~allow] = -np.inf
            w = np.exp(z - z.max())
            return w / w.sum()
        p1 = probs(toks, ok)
        law = np.zeros(m.n_vocab)
        for x in np.flatnonzero(p1 > 0):
            law += p1[x] * probs(toks + [int(x)], ok | eog)
    assert 20 < ok.sum() < m.n_vocab // 2
    assert drafted > 2000
    assert chi2_pvalue(counts, {int(t): float(law[t]) for t in np.flatnonzero(law > 0)}) > 0.001


def test_match_falls_back_to_rejection_under_a_constraint(tiny_target, tiny_close):
    # llama.cpp's chain samples the raw logits: under a grammar "match" (and plain sampling) become rejection
    # sampling on the masked rows, with the draft or without
    with Engine(tiny_target, tiny_close, ctx=128, threads=1) as e:
        toks = e.tokenize(PROMPT)
        s = GenerationSettings(n_predict=12, draft_max=3, temp=0.8, accept="match", constraint=constrained(e, ABC))
        for speculative in (True, False):
            g = e.session().generate(toks, s, speculative=speculative).run()
            pieces = [e.target.piece(t) for t in g.tokens if not e.target.is_eog(t)]
            assert pieces and all(set(p) <= set(b"abc") for p in pieces)
            assert g.sampling.mode == "rejection" and g.stats.n_masked_rows > 0
        assert g.stats.accept_mode == "sample"  # the target alone reports plain sampling


def test_the_request_fields_become_constraints():
    from specq.native.serving.api import ApiError, parse_constraint

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert parse_constraint({}) is None and parse_constraint({"response_format": {"type": "text"}}) is None
    assert parse_constraint({"response_format": {"type": "json_object"}}) == Constraint("json_object")
    got = parse_constraint({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                                      "strict": True}}})
    assert (got.kind, got.lenient, json.loads(got.text)) == ("json_schema", False, schema)
    got = parse_constraint({"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}})
    assert got.lenient  # not strict: keywords the library cannot enforce are ignored
    assert parse_constraint({"grammar": 'root ::= "a"'}) == Constraint("gbnf", 'root ::= "a"')
    for body, param in (({"grammar": "root ::= x", "response_format": {"type": "json_object"}}, "grammar"),
                        ({"grammar": 3}, "grammar"), ({"response_format": {"type": "yaml"}}, "response_format"),
                        ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
                         "response_format"),
                        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "y"}}},
                         "response_format")):
        with pytest.raises(ApiError) as e:
            parse_constraint(body)
        assert (e.value.status, e.value.param) == (400, param)
