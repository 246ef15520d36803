"""The draft length of a batched step (control/batch_plan.py, --parallel): one cost model for the batch, each
sequence's own acceptance. On costs where every verify row costs (a CPU) the length falls as the batch grows, to
plain decoding; where rows are nearly free (a GPU's width) it stays at what each sequence would draft alone.
End to end on a simulated clock: the batch's planner makes the same tokens (exact) in less time than the
sequences' own lengths would."""

from __future__ import annotations

import pytest

from specq.native.control.batch_plan import BatchPlanner, Wish
from specq.native.control.expected import expected_tokens
from specq.native.control.length import AdaptiveDraft
from specq.native.control.step import StepOutcome
from specq.native.core.batch import Batch
from specq.native.core.engine import Engine, SimulatedClock
from specq.native.core.settings import GenerationSettings
from test_parallel import alone

ALPHAS = [0.7] * 8


def planner_with(verify_ms, draft_ms) -> BatchPlanner:
    """A planner whose costs were measured: V(R) for R = 1..64 rows, d(m) for m = 1..8 sequences."""
    p = BatchPlanner()
    p.at(100)
    for _ in range(3):
        for r in range(1, 65):
            p.verify.observe(r, verify_ms(r) / 1e3)
        for m in range(1, 9):
            p.draft.observe(m, draft_ms(m) / 1e3)
    return p


def cpu_verify(r: int) -> float:
    return 20.0 + 4.0 * r  # every row costs a fifth of a single token's pass


def gpu_verify(r: int) -> float:
    return 20.0 + 0.05 * r  # rows nearly free


def draft(m: int) -> float:
    return 1.0 + 0.01 * m


def wishes(b: int, k: int = 6) -> list[Wish]:
    return [Wish(k, adaptive=True, decodes=True, alphas=ALPHAS) for _ in range(b)]


def rate(ks: list[int], verify_ms) -> float:
    """Tokens per ms of a step drafting ks, computed here from the costs (not the planner's code)."""
    top = max(ks)
    d = sum(draft(sum(1 for k in ks if k >= j)) for j in range(1, top + 1))
    return sum(expected_tokens(ALPHAS, k) for k in ks) / (d + verify_ms(sum(k + 1 for k in ks)))


def best_alone(verify_ms) -> int:
    return max(range(9), key=lambda k: rate([k], verify_ms))


def test_on_a_cpu_the_length_falls_with_the_batch_to_plain():
    p = planner_with(cpu_verify, draft)
    k1 = best_alone(cpu_verify)
    chosen = {b: p.plan(wishes(b, k1))[0] for b in (1, 2, 4, 8, 16)}
    assert chosen[1] == k1 >= 3  # alone, drafting pays
    assert chosen[16] == 0  # sixteen sequences: every row is compute the batch pays
    assert list(chosen.values()) == sorted(chosen.values(), reverse=True) and len(set(chosen.values())) > 2
    for b, c in chosen.items():  # each choice is the best common cap, by the costs themselves
        assert rate([c] * b, cpu_verify) == pytest.approx(max(rate([k] * b, cpu_verify) for k in range(k1 + 1)))
    assert p.n_plain > 0 and p.n_capped > 0


def test_on_a_gpu_the_length_stays_what_each_sequence_wants():
    p = planner_with(gpu_verify, draft)
    k1 = best_alone(gpu_verify)
    assert k1 >= 4
    for b in (1, 4, 8):
        assert p.plan(wishes(b, k1)) == [k1] * b
    assert p.n_capped == 0


def test_fixed_lengths_are_kept_and_counted():
    p = planner_with(cpu_verify, draft)
    fixed = Wish(4, adaptive=False, decodes=True, tokens=3.0)
    ks = p.plan([fixed] + wishes(15, 6))
    assert ks[0] == 4 and len(set(ks[1:])) == 1 and ks[1] <= 1  # one cap for the adaptive ones


def test_plain_batch_probes_again_and_backs_off():
    p = planner_with(cpu_verify, draft)
    p.probe_min = p.probe_gap = 4
    seen = [p.plan(wishes(16))[0] for _ in range(12)]
    assert seen.count(1) == 2 and p.n_probes == 2  # after 4 plain steps, then again
    # a probe that lost doubles the gap
    p.probing = True
    p.observe(wishes(16), [1] * 16, [1] * 16, 16 * draft(16) / 1e3, cpu_verify(32) / 1e3, 0.0)
    assert p.probe_gap == 8


# ---- end to end, on a simulated clock ---------------------------------------------------------------------
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import numpy as np\n", "Once upon a time, there"]


def clock_with(per_row: float) -> SimulatedClock:
    """A 20 ms target token; a batch pays 1.4 tokens plus `per_row` of a token for each row; a 2 ms draft."""
    def cost(name: str, n: int, pos0: int = 0) -> float:
        if name == "draft":
            return (2.0 + 0.2 * (n - 1)) / 1e3
        return (20.0 if n == 1 else 20.0 * (1.4 + per_row * n)) / 1e3
    return SimulatedClock(cost)


def batch_run(target, draft, per_row: float, plan: bool, n: int = 48):
    clock = clock_with(per_row)
    with Engine(target, draft, ctx=512, threads=1, parallel=4, clock=clock) as e:
        b = Batch()
        b.plan_lengths = plan
        gens = [e.session(i).generate(e.tokenize(p), GenerationSettings(n_predict=n, draft_max="auto"))
                for i, p in enumerate(PROMPTS)]
        for g in gens:
            b.add(g)
        t0 = clock.now
        b.run()
        return [g.tokens for g in gens], sum(len(g.tokens) for g in gens) / (clock.now - t0), gens, b.planner


def test_where_rows_cost_the_batch_drafts_less_and_goes_faster_exactly(tiny_target, tiny_close):
    want = alone(tiny_target, PROMPTS, [48] * 4)
    toks, rate_planned, gens, pl = batch_run(tiny_target, tiny_close, per_row=0.3, plan=True)
    toks_own, rate_own, gens_own, _ = batch_run(tiny_target, tiny_close, per_row=0.3, plan=False)
    assert toks == want == toks_own
    assert all(len(set(t)) > 5 for t in want)
    assert pl.n_plain > 0 and pl.n_capped > 0  # it stopped drafting the sequences wished, by its own costs
    assert sum(g.stats.n_drafted for g in gens) < sum(g.stats.n_drafted for g in gens_own)
    assert sum(g.stats.n_drafted for g in gens) > 0  # (its probes)
    assert rate_planned > 1.02 * rate_own


def test_where_rows_are_cheap_the_batch_keeps_drafting(tiny_target, tiny_close):
    toks, rate_planned, gens, pl = batch_run(tiny_target, tiny_close, per_row=0.02, plan=True)
    _, rate_own, _, _ = batch_run(tiny_target, tiny_close, per_row=0.02, plan=False)
    assert toks == alone(tiny_target, PROMPTS, [48] * 4)
    assert sum(g.stats.n_drafted for g in gens) > 40 and pl.n_plain < pl.n_steps // 10
    assert rate_planned >= rate_own


def test_a_shared_step_teaches_a_sequence_its_acceptance_not_the_batchs_costs():
    ctrl = AdaptiveDraft(8)
    ctrl.at(100)
    ctrl.observe(StepOutcome(1, 1, None, 0.020, 0.0))  # alone: a 2-token verify, 20 ms
    tried = ctrl.acceptance.tried
    ctrl.observe(StepOutcome(4, 4, 0.002, 0.500, 0.0, shared=True))  # in a batch: 500 ms for everyone's rows
    assert ctrl.v_mean == {2: pytest.approx(0.020)} and ctrl.acceptance.tried > tried
