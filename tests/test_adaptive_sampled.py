"""draft_max="auto" at temperature > 0: the controller learns from each drafted position's expected acceptance
Σ min(p, q) (StepOutcome.acceptance) rather than from one noisy 0/1 draw, seeds it from the prompt's rows, and a probe
that gains calls the next one at once (explore.ProbeSchedule)."""

from __future__ import annotations

import numpy as np
import pytest

from specq.native.control.length import LengthController
from specq.native.control.step import StepOutcome
from specq.native.core.accept import expected_acceptance, overlap, rejection_emit
from specq.native.runtime.engine import Engine, SimulatedClock
from specq.native.core.sampling import SparseDist
from specq.native.core.settings import GenerationSettings
from test_adaptive import context_costs, deep_target, first_step, long_prompt  # noqa: F401 (a fixture)

T1 = dict(temp=1.0, top_k=40, top_p=0.9)


def test_expected_acceptance_is_the_mean_of_the_0_1_outcomes():
    # Two drafted positions on synthetic distributions: the mean of many rejection_emit runs' outcomes equals
    # reach·expected at each position (reach: the probability of getting there given the drafts before).
    rng = np.random.default_rng(0)
    ids = np.arange(6, dtype=np.int32)
    q = [SparseDist(ids, rng.dirichlet(np.ones(6))) for _ in range(2)]
    p = [SparseDist(ids, rng.dirichlet(np.ones(6))) for _ in range(3)]
    draft = [int(np.argmax(q[0].probs)), int(np.argmax(q[1].probs))]
    got = expected_acceptance(draft, q, p)
    assert got[0][0] == 1.0 and got[0][1] == pytest.approx(overlap(q[0], p[0]))
    n, reached_second, accepted_second = 40000, 0, 0
    for _ in range(n):
        out = rejection_emit(draft, q, p, rng)
        reached_second += out[0] == draft[0] and len(out) >= 2
        accepted_second += len(out) == 3
    # reach of position 2: min(1, p/q) of the first draft; its acceptance given the draft: min(1, p/q) of the second
    r2 = min(1.0, p[0].probs[draft[0]] / q[0].probs[draft[0]])
    assert got[1][0] == pytest.approx(r2)
    a2 = min(1.0, p[1].probs[draft[1]] / q[1].probs[draft[1]])
    assert accepted_second / n == pytest.approx(r2 * a2, abs=0.01)
    # Σ min(p, q) is the acceptance averaged over what the draft would sample: the same law, without one draw's noise
    assert overlap(q[1], p[1]) == pytest.approx(float(np.minimum(q[1].probs, p[1].probs).sum()))


def simulate(phases, seed: int, draft_ms: float = 6.0, verify=lambda b: 20.0 + 2.0 * (b - 1), cap: int = 8,
             soft: bool = True):
    """The controller at temperature > 0 on synthetic costs (a simulated clock): each phase (steps, mean expected
    acceptance) draws every position's expected acceptance around its mean (tokens differ), and the step's 0/1
    outcomes from those. `soft`: the step also reports them (as the engine does under rejection sampling)."""
    rng = np.random.default_rng(seed)
    c = LengthController(cap=cap)
    c.calibrate(0, verify(1) / 1e3, draft_ms / 1e3)  # as a prefill times one token on each model
    ks = []
    for n, mean in phases:
        for _ in range(n):
            k = c.choose(cap)
            betas = rng.beta(mean * 8, (1 - mean) * 8, size=cap)
            a = 0
            while a < k and rng.random() < betas[a]:
                a += 1
            reach = np.concatenate([[1.0], np.cumprod(betas)[:-1]])
            acc = tuple(zip(reach[:k].tolist(), betas[:k].tolist())) if soft and k else None
            c.observe(StepOutcome(k, a, draft_ms / 1e3 if k > 1 else None, verify(k + 1) / 1e3, 0.0,
                                  draft_s=draft_ms * k / 1e3 if k else None,
                                  first_token_s=draft_ms / 1e3 if k else None, acceptance=acc))
            ks.append(k)
    return c, np.array(ks)


def test_at_temperature_1_a_fair_draft_is_not_sent_to_plain_decoding_by_a_few_rejections():
    # Drafting pays at the 70% acceptance this draft has on average (one token: 1.7 tokens in 29 ms against one in
    # 20). Its 0/1 outcomes alone sent the controller before this change to plain decoding for most of an answer on
    # one seed in eight (97 plain steps of 150); the expected acceptance hardly ever does.
    verify = lambda b: 20.0 + 4.0 * (b - 1)  # noqa: E731
    plain = [int((simulate([(150, 0.7)], seed, draft_ms=5.0, verify=verify)[1] == 0).sum()) for seed in range(8)]
    assert sum(plain) <= 8, plain
    old = [int((simulate([(150, 0.7)], seed, draft_ms=5.0, verify=verify, soft=False)[1] == 0).sum())
           for seed in range(8)]
    assert sum(old) >= 40, old  # the counterpart: the same runs with the 0/1 outcomes only


@pytest.mark.parametrize("seed", range(4))
def test_at_temperature_1_a_useless_draft_goes_plain_and_one_that_turns_good_is_picked_up_again(seed):
    # 300 steps of a draft that accepts 5% (useless: plain decoding wins), then 150 of one that accepts 90%. Before
    # this change the controller had not drafted again 100 steps after the change, on any of six seeds.
    c, ks = simulate([(300, 0.05), (150, 0.9)], seed)
    useless, good = ks[:300], ks[300:]
    assert 0 in useless[:4] and max(useless[4:]) <= 1  # plain within a few steps; past them only 1-token probes
    assert (useless == 1).sum() <= 20 and c.n_probes > 0  # probes: spaced out, within the exploration budget
    back = next((i for i, k in enumerate(good) if k > 1), len(good))
    assert back <= 100, back  # picked up again: a probe that gains calls the next one at once
    assert c.schedule.n_gained > 0  # (the mechanism ran)
    assert np.median(good[-40:]) >= 3 and (good[-40:] == 0).sum() == 0


def test_at_temperature_1_a_draft_that_is_the_target_drafts_from_the_first_step(deep_target, tiny_target):
    # deep_target and tiny_target have the same logits: every draft is accepted. At 1,500 tokens (attention 6 ms a
    # token) drafting pays only at high acceptance, and the prior's 75% says plain decoding: the prompt's rows,
    # compared as distributions (each row's Σ min(p, q)), say otherwise before the first step, and no step goes plain.
    auto = GenerationSettings(n_predict=24, draft_max="auto", seed=3, **T1)
    clock = SimulatedClock(context_costs(attn_ms_per_row_token=0.004))
    with Engine(deep_target, tiny_target, ctx=2048, draft_ctx=0, threads=1, clock=clock) as e:
        ses = e.session()
        toks = long_prompt(e, 1500)
        drafted, plain = first_step(ses, toks, auto)
        agree, n = ses.agreement
        assert n >= 16 and agree == pytest.approx(n, rel=1e-3)  # expected acceptance 1 on every row
        assert ses.controller(auto).n_seeds == 1 and drafted > 0 and plain == 0
        ses = e.session()
        g = ses.generate(toks, auto).run()
    assert g.stats.accept_mode == "rejection" and g.stats.n_plain_steps == 0
    # every step drafted but the first (the target's prefill gives the first token), and all was accepted
    assert dict(g.stats.steps_by_k).get(0, 0) == 1 and g.stats.n_steps >= 3
    assert g.stats.n_drafted >= 2 * (g.stats.n_steps - 1) and g.stats.n_accepted == g.stats.n_drafted
