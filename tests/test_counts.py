"""Draft counts: every draft token the target verified counts as drafted (llama.cpp's n_drafted), except past the
point where the generation ended inside a step; accept_rate = accepted ÷ drafted, alpha = accepted ÷ positions
reached. The expected counts come from each step as the target verified it (a spy on the speculative step,
runtime/step.py), not from the counting code."""

from __future__ import annotations

import pytest

from specq.native.runtime.engine import Engine
from specq.native.core.settings import GenerationSettings
from beside import Pair, beside, spy_steps
from tinymodels import write_tiny_gguf

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def tiny_contrary(models_dir, tiny_target):
    """tiny_target with its output matrix negated: its greedy choice is the target's least likely token, so at
    temperature 0 not one of its drafts is ever accepted."""
    return write_tiny_gguf(models_dir / "contrary.gguf", seed=1,
                           edit_weights=lambda w: {**w, "output.weight": -w["output.weight"]})


@pytest.fixture
def steps_seen(monkeypatch):
    """Each step's (tokens drafted and verified, tokens emitted), as the speculative step returned it (one
    sequence: sequence 0)."""
    return spy_steps(monkeypatch, 0)


def test_a_draft_never_accepted_counts_every_token_it_drafted(tiny_target, tiny_contrary, steps_seen):
    k, n = 4, 24
    with Engine(tiny_target, tiny_contrary, ctx=256, threads=1) as e:
        toks = e.tokenize(PROMPT)
        base = e.session().generate(toks, GenerationSettings(n_predict=n), speculative=False).run()
        g = e.session().generate(toks, GenerationSettings(n_predict=n, draft_max=k)).run()
    st = g.stats
    assert g.tokens == base.tokens and len(set(g.tokens)) > 3  # exact, and not one token repeated
    assert st.n_steps == n and all(emitted == 1 for _, emitted in steps_seen)  # every draft rejected at once
    # k tokens a step after the first (the target's prefill's own token), fewer only where n_predict leaves less
    # room (a step drafts at most what it may emit)
    assert steps_seen[0] == (0, 1)
    assert st.n_drafted == sum(min(k, n - 1 - i) for i in range(1, n)) == sum(d for d, _ in steps_seen) > n
    assert st.n_accepted == 0 and st.accept_rate == 0.0
    assert st.n_tried == sum(1 for d, _ in steps_seen if d) and st.alpha == 0.0  # one position reached a step


def test_a_step_rejected_at_position_i_counts_all_k(tiny_target, tiny_close, steps_seen):
    k = 6
    with Engine(tiny_target, tiny_close, ctx=256, threads=1) as e:
        g = e.session().generate(e.tokenize(PROMPT), GenerationSettings(n_predict=64, draft_max=k)).run()
    st = g.stats
    assert st.stop_reason == "n_predict"
    rejected_inside = [(d, m) for d, m in steps_seen if 1 < m < d]  # accepted m-1 of d, rejected at position m
    assert rejected_inside, steps_seen
    assert st.n_drafted == sum(d for d, _ in steps_seen)
    assert st.n_accepted == sum(m - 1 for d, m in steps_seen if d)
    assert st.accept_rate == pytest.approx(st.n_accepted / st.n_drafted)
    # alpha: accepted over the positions reached (the accepted ones, plus the rejected one where a step stopped)
    reached = sum(min(d, m) for d, m in steps_seen if d)
    assert st.n_tried == reached and st.alpha == pytest.approx(st.n_accepted / reached)
    assert st.alpha > st.accept_rate


def test_a_generation_stopped_inside_a_step_counts_only_the_positions_kept(tiny_target, steps_seen):
    """A consumer that stops reading inside a step (a server's stop string, Ctrl-C between tokens): the draft
    positions past the last token it read count nowhere."""
    k, stop_after = 6, 10
    with Engine(tiny_target, tiny_target, ctx=256, threads=1) as e:  # the draft is the target: all accepted
        g = e.session().generate(e.tokenize(PROMPT), GenerationSettings(n_predict=64, draft_max=k))
        it = iter(g)
        read = [next(it) for _ in range(stop_after)]
        it.close()
    st = g.stats
    assert st.stop_reason == "interrupted" and len(read) == stop_after and len(set(t.token for t in read)) > 3
    # the prefill's token, a whole step (k accepted + the target's own token), then 2 tokens read of the second
    # drafting step's k + 1
    assert [m for _, m in steps_seen] == [1, k + 1, k + 1]
    assert st.n_drafted == st.n_accepted == k + 2
    assert st.n_tried == st.n_drafted and st.accept_rate == st.alpha == 1.0
    assert dict(st.n_drafted_by) == {"model": k + 2} and dict(st.n_accepted_by) == {"model": k + 2}


# ---- the same counts for a sequence stepped beside another (one step, one verify decode for both) -----------
def test_beside_another_a_draft_never_accepted_counts_every_token_it_drafted(tiny_target, tiny_contrary,
                                                                             monkeypatch):
    seen = spy_steps(monkeypatch, 1)
    with Engine(tiny_target, tiny_contrary, ctx=256, threads=1, parallel=2) as e:
        toks = e.tokenize(PROMPT)
        g = beside(e, toks, GenerationSettings(n_predict=24, draft_max=4))
    st = g.stats
    assert len(set(g.tokens)) > 3 and all(m == 1 for _, m in seen)  # every draft rejected at once
    assert st.n_drafted == sum(d for d, _ in seen) > 24 and st.n_accepted == 0 and st.accept_rate == 0.0
    assert st.n_tried == sum(1 for d, _ in seen if d) and st.alpha == 0.0


def test_beside_another_a_step_rejected_at_position_i_counts_all_k(tiny_target, tiny_close, monkeypatch):
    seen = spy_steps(monkeypatch, 1)
    with Engine(tiny_target, tiny_close, ctx=256, threads=1, parallel=2) as e:
        g = beside(e, e.tokenize(PROMPT), GenerationSettings(n_predict=64, draft_max=6))
    st = g.stats
    assert [(d, m) for d, m in seen if 1 < m < d], seen  # accepted m-1 of d, rejected at position m
    assert st.n_drafted == sum(d for d, _ in seen)
    assert st.n_accepted == sum(m - 1 for d, m in seen if d)
    assert st.n_tried == sum(min(d, m) for d, m in seen if d) and st.alpha > st.accept_rate


def test_beside_another_a_generation_stopped_inside_a_step_counts_only_the_positions_kept(tiny_target,
                                                                                          monkeypatch):
    """A stop string inside a step (the server's: Generation.keep, then Batch.cancel): the draft positions past
    the last token used count nowhere."""
    seen = spy_steps(monkeypatch, 1)
    k, stop_after = 6, 10
    with Engine(tiny_target, tiny_target, ctx=256, threads=1, parallel=2) as e:  # draft = target: all accepted
        pair = Pair(e, e.tokenize(PROMPT), GenerationSettings(n_predict=64, draft_max=k))
        got: list = []
        while len(got) < stop_after:
            new = pair.step()
            got += new
        used = len(new) - (len(got) - stop_after)
        assert 0 < used < len(new)  # the stop fell inside the last step
        pair.g.keep(used)
        pair.batch.cancel(pair.g)
        pair.check_shared()
    st = pair.g.stats
    d_last, m_last = seen[-1]
    assert m_last == len(new) and d_last >= used
    assert st.n_drafted == st.n_accepted == sum(d for d, _ in seen[:-1]) + used < sum(d for d, _ in seen)
    assert st.accept_rate == st.alpha == 1.0
