"""The draft length of a batched step (control/batch_plan.py, --parallel): one cost model for the batch, each
sequence's own acceptance. On costs where every verify row costs (a CPU) the length falls as the batch grows, to
plain decoding; where rows are nearly free (a GPU's width) it stays at what each sequence would draft alone.
End to end on a simulated clock: the batch's planner makes the same tokens (exact) in less time than the
sequences' own lengths would."""

from __future__ import annotations

import pytest

from beside import draft_memory
from specq.native.control.batch_plan import DRAFT_MARGIN, LONE_PLAIN, BatchPlanner, Wish
from specq.native.control.expected import expected_tokens
from specq.native.control.length import LengthController
from specq.native.control.step import StepOutcome
from specq.native.runtime.batch import Batch
from specq.native.runtime.engine import Engine, SimulatedClock
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
    for b, c in chosen.items():  # each choice is the best common cap, by the costs themselves, where it clears
        best = max(range(k1 + 1), key=lambda k: rate([k] * b, cpu_verify))  # the margin over plain decoding
        clears = rate([best] * b, cpu_verify) >= (1 + DRAFT_MARGIN) * rate([0] * b, cpu_verify)
        assert c == (best if clears else 0)
    assert p.n_plain > 0 and p.n_capped > 0


@pytest.mark.parametrize("gain", [0.04, 0.08, 0.15, 0.4])
def test_a_batch_drafts_only_where_drafting_clears_the_margin_over_plain_decoding(gain):
    """Four sequences, drafting one token each: a verify of 8 rows priced so that the step emits `gain` more
    tokens a second than a plain step of 4 rows. A few percent is within what the step model leaves out (served
    on a CPU, such steps lost): the batch stays plain; a clear gain drafts."""
    ws = [Wish(1, adaptive=True, decodes=True, alphas=[0.8]) for _ in range(4)]
    plain_ms, tokens = 80.0, 4 * expected_tokens([0.8], 1)
    step_ms = tokens / (4 / plain_ms * (1 + gain))  # what a drafted step may cost for that gain

    def verify(r: int) -> float:  # a line: V(4) = plain_ms, V(8) what the drafted step may spend verifying
        return plain_ms + (r - 4) * (step_ms - draft(4) - plain_ms) / 4

    p = planner_with(verify, draft)
    p.probe_gap = 10**6  # (no probes: the choice itself)
    assert p.rate(ws, 1) / p.rate(ws, 0) == pytest.approx(1 + gain, rel=0.01)
    assert p.plan(ws) == ([1] * 4 if gain >= DRAFT_MARGIN else [0] * 4)


def test_on_a_gpu_the_length_stays_what_each_sequence_wants():
    p = planner_with(gpu_verify, draft)
    k1 = best_alone(gpu_verify)
    assert k1 >= 4
    for b in (1, 4, 8):
        assert p.plan(wishes(b, k1)) == [k1] * b
    assert p.n_capped == 0


def test_a_plain_batch_drafts_again_only_where_drafting_pays_its_catch_ups_back():
    """Rows nearly free and a draft that pays once caught up; but a draft decode's cost grows with its rows, and
    after a plain stretch every sequence's draft must first read the tokens it missed. Four sequences 150 tokens
    behind each: the first step would read 600 rows (0.6 s, 30 plain steps), which SWITCH_STEPS steps of drafting do
    not pay back, so the batch stays plain; caught up, it drafts."""
    def steep_draft(m: int) -> float:
        return 1.0 + 1.0 * m

    good = [0.9] * 8

    def ws(behind: int) -> list[Wish]:
        return [Wish(6, adaptive=True, decodes=True, alphas=good, behind=behind) for _ in range(4)]

    p = planner_with(gpu_verify, steep_draft)
    assert p.rate(ws(1), 6) > p.rate(ws(1), 0)  # caught up, drafting pays
    assert max(p.plan(ws(1))) > 0
    assert p.rate(ws(150), 6) < p.rate(ws(150), 0) and p.plan(ws(150)) == [0] * 4  # not paid back in SWITCH_STEPS
    # steady, every drafting step would still beat plain decoding (the catch-up is what tips it)
    ks = p.capped(ws(150), 6)
    assert sum(w.expected(k) for w, k in zip(ws(150), ks)) / p.step_s(ws(150), ks, steady=True) \
        > 4 / p.step_s(ws(150), [0] * 4, steady=True)


def test_fixed_lengths_are_kept_and_counted():
    p = planner_with(cpu_verify, draft)
    fixed = Wish(4, adaptive=False, decodes=True, tokens=3.0)
    ks = p.plan([fixed] + wishes(15, 6))
    assert ks[0] == 4 and len(set(ks[1:])) == 1 and ks[1] <= 1  # one cap for the adaptive ones


def test_plain_batch_probes_one_sequence_within_a_budget_and_backs_off():
    p = planner_with(cpu_verify, draft)
    p.probe_min = p.probe_gap = 4
    p.elapsed_s = 100.0  # the batch has run 100 s: 3 s of probes fit
    ws = [Wish(6, adaptive=True, decodes=True, alphas=ALPHAS, behind=20 + i % 5) for i in range(16)]
    ws[9] = Wish(6, adaptive=True, decodes=True, alphas=ALPHAS, behind=2)  # its draft is nearly caught up
    seen = [p.plan(ws) for _ in range(12)]
    probes = [ks for ks in seen if any(ks)]
    assert len(probes) == 2 and p.n_probes == 2  # after 4 plain steps, then again
    assert all(ks == [0] * 9 + [1] + [0] * 6 for ks in probes)  # one token, by the sequence least behind
    # a probe that lost doubles the gap and books its extra
    p.probing, p._plain_s = True, cpu_verify(16) / 1e3
    p.observe(ws, [0] * 9 + [1] + [0] * 6, [1] * 16, draft(2) / 1e3, cpu_verify(17) / 1e3, 0.0)
    assert p.probe_gap == 8 and p.spent_s > 0
    # with the budget spent, no probe runs
    p.spent_s = 3.0
    for _ in range(40):
        assert not any(p.plan(ws))
    assert p.n_refused > 0


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
    assert sum(g.stats.n_drafted for g in gens) > 0
    assert rate_planned > 1.03 * rate_own


def test_where_rows_are_cheap_the_batch_keeps_drafting(tiny_target, tiny_close):
    toks, rate_planned, gens, pl = batch_run(tiny_target, tiny_close, per_row=0.02, plan=True)
    _, rate_own, _, _ = batch_run(tiny_target, tiny_close, per_row=0.02, plan=False)
    assert toks == alone(tiny_target, PROMPTS, [48] * 4)
    assert sum(g.stats.n_drafted for g in gens) > 40 and pl.n_plain < pl.n_steps // 10
    assert rate_planned > 1.1 * rate_own  # (the sequences' own lengths were priced on costs measured alone)


def test_a_shared_step_teaches_a_sequence_its_acceptance_not_the_batchs_costs():
    ctrl = LengthController(8)
    ctrl.at(100)
    ctrl.observe(StepOutcome(1, 1, None, 0.020, 0.0))  # alone: a 2-token verify, 20 ms
    tried = ctrl.acceptance.tried
    ctrl.observe(StepOutcome(4, 4, 0.002, 0.500, 0.0, shared=True))  # in a batch: 500 ms for everyone's rows
    assert ctrl.v_mean == {2: pytest.approx(0.020)} and ctrl.acceptance.tried > tried


def test_sequences_joining_a_batch_that_does_not_draft_leave_the_draft_alone(tiny_target, tiny_close):
    """Once the batch's own costs say plain, a joining sequence's prefill takes no calibration timings or prompt
    agreement and its draft does not read the prompt (it would catch up if the batch drafted again): the draft
    model decodes only for the batch's probes. While the batch knows nothing of the draft, one joiner of a burst
    gets its draft ready (its timings price the draft), not all; once the batch has said plain, not even the one
    that joins an empty batch. Output exact."""
    want = alone(tiny_target, PROMPTS, [48] * 4)
    calls = {"draft": 0, "target": 0}
    steep = clock_with(1.0).cost  # every row costs a token: drafting never pays in a batch

    def cost(name: str, n: int, pos0: int = 0) -> float:
        calls[name] += 1
        return steep(name, n, pos0)

    clock = SimulatedClock(cost)
    planner = BatchPlanner()
    with Engine(tiny_target, tiny_close, ctx=512, threads=1, parallel=4, clock=clock) as e:
        for rnd in range(2):
            b = Batch(planner)
            gens = [e.session(i).generate(e.tokenize(p), GenerationSettings(n_predict=48, draft_max="auto"))
                    for i, p in enumerate(PROMPTS)]
            calls.update(draft=0, target=0)
            probes0 = planner.n_probes
            for g in gens:
                b.add(g)
            b.run()
            assert [g.tokens for g in gens] == want
            if rnd == 0:  # the batch knew nothing of the draft: one sequence got its draft ready, to price it
                assert not planner.drafting and planner.knows_draft and b.n_unprepared == 3 and calls["draft"] > 0
        # then the batch's verdict holds for every joiner, the first (an empty batch) too: the draft model
        # decodes only for the probes (a catch-up and a token each)
        assert b.n_unprepared == 4 and calls["draft"] <= 2 * (planner.n_probes - probes0)
        # one prefill decode for each joiner (no timed spans), one verify a step
        assert calls["target"] == 4 + b.n_steps
        assert all(len(draft_memory(g.session).tokens) < len(g.session.history) // 2 for g in gens if not g.stats.n_drafted)


def test_the_last_sequence_left_alone_after_a_plain_batch_stays_plain(tiny_target, tiny_unrelated):
    """Rows up to 4 cost one pass, each further row a token: one sequence gains by drafting 3 tokens alone, four
    together only by plain decoding. When three of four unprepared sequences end, the last one left alone keeps
    the batch's plain verdict (BatchPlanner.settled_plain) instead of having its draft read its whole text for a
    few steps, where its own controller would try the draft (a small one: its cost prior says drafting pays alone);
    after LONE_PLAIN steps alone it drafts on its own again. Output exact."""
    lengths = [24, 24, 24, 40]
    want = alone(tiny_target, PROMPTS, lengths)
    assert all(len(t) == n for t, n in zip(want, lengths)) and all(len(set(t)) > 3 for t in want)
    calls = {"draft": 0}

    def cost(name: str, n: int, pos0: int = 0) -> float:
        if name == "draft":
            calls["draft"] += 1
            return (1.0 + 0.1 * (n - 1)) / 1e3
        return 20.0 * (1.4 + max(n - 4, 0)) / 1e3 if n > 1 else 20.0e-3

    def by_itself(n: int) -> tuple[Batch, object]:
        g = e.session(3).generate(e.tokenize(PROMPTS[3]), GenerationSettings(n_predict=n, draft_max="auto"))
        b = Batch(planner)
        b.add(g)
        b.run()
        assert g.tokens == want[3][:n]
        return b, g

    planner = BatchPlanner()
    with Engine(tiny_target, tiny_unrelated, ctx=512, threads=1, parallel=4, clock=SimulatedClock(cost)) as e:
        for rnd in range(2):
            b = Batch(planner)
            gens = [e.session(i).generate(e.tokenize(p), GenerationSettings(n_predict=n, draft_max="auto"))
                    for i, (p, n) in enumerate(zip(PROMPTS, lengths))]
            calls["draft"], probes0 = 0, planner.n_probes
            for g in gens:
                b.add(g)
            b.run()
            assert [g.tokens for g in gens] == want
        assert b.n_unprepared == 4 and not planner.drafting
        assert b.n_lone_plain == 16  # the last one's steps alone, one token each
        assert gens[3].stats.n_drafted == 0 and calls["draft"] <= 6
        # alone for longer than LONE_PLAIN steps: the verdict lapses, and the sequence drafts on its own
        b, g = by_itself(40)
        assert b.n_lone_plain == LONE_PLAIN - 16 - 1 and g.stats.n_drafted > 0  # (its first step is plain anyway)


def test_draft_decodes_timed_in_a_prefill_price_a_batchs_first_steps(tiny_target):
    """A quantized draft's decode grows with its rows faster than the target's (on a CPU: 11 ms for one row,
    31 for four, where the F32 target takes 28 and 42). Priced from one draft token grown as the target's
    decode grows, four sequences drafting together look cheap and the batch drafts until it has measured
    otherwise; the draft decodes of several rows the first sequence's prefill times (`draft_rows`) price the
    batch's first steps right: plain from the start, exact."""
    want = alone(tiny_target, PROMPTS, [24] * 4)

    def cost(name: str, n: int, pos0: int = 0) -> float:
        if name == "draft":
            return (2.0 + 8.0 * (n - 1)) / 1e3
        return 20.0 * (1.0 + 0.1 * n) / 1e3 if n > 1 else 20.0e-3

    with Engine(tiny_target, tiny_target, ctx=512, threads=1, parallel=4, clock=SimulatedClock(cost)) as e:
        b = Batch()
        gens = [e.session(i).generate(e.tokenize(p), GenerationSettings(n_predict=24, draft_max="auto"))
                for i, p in enumerate(PROMPTS)]
        for g in gens:
            b.add(g)
        assert gens[0].controller.draft_rows == {}  # (read with the prompt, after the first token)
        for _ in range(12):
            b.step()
        assert 2 in gens[0].controller.draft_rows and b.planner.knows_draft  # (a short prompt: no 5-row span)
        assert b.planner.n_steps >= 10 and b.planner.n_plain == b.planner.n_steps
        b.run()
        assert [g.tokens for g in gens] == want
