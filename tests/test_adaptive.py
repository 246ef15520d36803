"""draft_max="auto": the controller's decisions on synthetic costs, and the engine running it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import tinymodels

import specq.native.runtime.generation as generation_mod
import specq.native.drafters.window as window_mod
from beside import draft_memory
from specq.errors import UsageError
from specq.native.control.length import NEAR_BEST, REACH_STEP, LengthController
from specq.native.control.step import StepOutcome
from specq.native.control.window import paired_acceptance, window_pays, window_pays_at
from specq.native.core.settings import (AGREE_TOKENS, AUTO_DRAFT_CAP, DRAFT_SINK, WINDOW_PROBATION, WINDOW_TRIAL,
                                        GenerationSettings)
from specq.native.runtime.engine import Engine, SimulatedClock


def simulate(alpha: float, draft_ms: float, verify_ms, steps: int = 300, seed: int = 0):
    """Run the controller against a synthetic pair: i.i.d. acceptance alpha, fixed costs."""
    rng = np.random.default_rng(seed)
    c = LengthController(cap=16)
    ks, tokens, time_s = [], 0, 0.0
    for _ in range(steps):
        k = c.choose(16)
        a = 0
        while a < k and rng.random() < alpha:
            a += 1
        v = verify_ms(k + 1) / 1e3
        c.observe(StepOutcome(k, a, draft_ms / 1e3 if k else None, v, 0.0))
        ks.append(k)
        tokens += a + 1
        time_s += k * draft_ms / 1e3 + v
    return c, ks, tokens / time_s


def test_useless_draft_falls_back_to_plain_decoding_with_probes():
    c, ks, tps = simulate(0.0, draft_ms=2.0, verify_ms=lambda b: 20.0 + 3.0 * (b - 1))
    assert c.n_plain_steps > 250 and c.n_probes > 0
    assert tps >= 0.97 * (1 / 0.020)  # within 3% of plain decoding


def test_expensive_draft_is_not_used():
    c, ks, tps = simulate(0.6, draft_ms=16.0, verify_ms=lambda b: 20.0 + 4.0 * (b - 1))
    assert sum(k == 0 for k in ks[20:]) > 0.9 * len(ks[20:])
    assert tps >= 0.95 * (1 / 0.020)


def test_good_cheap_draft_drafts_long_on_flat_verify_cost():
    c, ks, tps = simulate(0.9, draft_ms=1.0, verify_ms=lambda b: 20.0)
    assert np.median(ks[20:]) >= 6
    assert tps > 3 * (1 / 0.020)
    snap = c.snapshot()
    assert snap.alpha[0] > 0.7 and snap.best_k >= 6


def test_verify_cost_growth_shortens_the_draft():
    _, flat, _ = simulate(0.8, draft_ms=1.0, verify_ms=lambda b: 20.0)
    _, steep, _ = simulate(0.8, draft_ms=1.0, verify_ms=lambda b: 20.0 + 8.0 * (b - 1))
    assert np.median(steep[20:]) < np.median(flat[20:])


def test_settings_auto_serialises_and_validates():
    s = GenerationSettings(draft_max="auto").validate()
    assert s.adaptive and s.draft_cap == AUTO_DRAFT_CAP
    assert dataclasses.asdict(s)["draft_max"] == "auto"
    with pytest.raises(UsageError, match="--draft-max"):
        GenerationSettings(draft_max="sometimes").validate()


def _padded(path, n_layer: int, attn_scale: float = 1.0):
    """tiny_target's 2 layers (their attention's output scaled by attn_scale), then n_layer - 2 layers that add
    exactly zero: same logits as the 2-layer model with that scale, ~n_layer/2 times the cost."""
    saved = tinymodels.weights

    def padded(spec, n_rows, seed):
        w = saved(spec, n_rows, seed)  # same seed and draw order: layers 0-1 equal tiny_target's
        for i in range(spec.n_layer):
            if i < 2:
                w[f"blk.{i}.attn_output.weight"][:] *= attn_scale
            else:
                w[f"blk.{i}.attn_output.weight"][:] = 0.0
                w[f"blk.{i}.ffn_down.weight"][:] = 0.0
        return w

    tinymodels.weights = padded
    try:
        return tinymodels.write_tiny_gguf(path, seed=1, spec=tinymodels.TinySpec(n_layer=n_layer))
    finally:
        tinymodels.weights = saved


@pytest.fixture(scope="module")
def deep_target(models_dir, tiny_target):
    """tiny_target's 2 layers plus 22 layers that add exactly zero: same logits, ~8x the cost.

    With tiny_target as its draft this is a perfect, cheap draft (the demo pair's shape, in miniature).
    """
    return _padded(models_dir / "deep_target.gguf", 24)


@pytest.fixture(scope="module")
def recent_pair(models_dir):
    """deep_target and tiny_target with their attention's output scaled by 0.1: a pair whose next token depends
    mostly on the recent tokens, so that a draft window keeps agreeing (running text, for a real small model)."""
    return (_padded(models_dir / "recent_deep.gguf", 24, attn_scale=0.1),
            _padded(models_dir / "recent_draft.gguf", 2, attn_scale=0.1))


def cpu_like_costs(target_one_ms: float, draft_ms: float):
    """Decode costs shaped like a CPU's: one token runs other kernels than a batch, which grows per token;
    the draft's catch-up over a few tokens costs little more than one."""
    def cost(name: str, n: int, pos0: int = 0) -> float:
        if name == "draft":
            return (draft_ms + 0.1 * draft_ms * (n - 1)) / 1e3
        return (target_one_ms if n == 1 else 1.4 * target_one_ms + 0.05 * target_one_ms * n) / 1e3
    return cost


@pytest.fixture(scope="module")
def pairs(tiny_target, tiny_unrelated, deep_target):
    # Simulated clocks: the controller's choices depend on these costs, not on how busy the machine is.
    bad_clock = SimulatedClock(cpu_like_costs(target_one_ms=10.0, draft_ms=3.0))
    good_clock = SimulatedClock(cpu_like_costs(target_one_ms=20.0, draft_ms=2.0))
    with Engine(tiny_target, tiny_unrelated, ctx=512, threads=1, clock=bad_clock) as bad, \
            Engine(deep_target, tiny_target, ctx=512, threads=1, clock=good_clock) as good:
        yield {"unrelated": bad, "good": good}


def test_engine_auto_with_unrelated_draft_is_exact_and_mostly_plain(pairs):
    e = pairs["unrelated"]
    toks = e.tokenize("The quick brown fox")
    base = e.session().generate(toks, GenerationSettings(n_predict=96), speculative=False).run()
    g = e.session().generate(toks, GenerationSettings(n_predict=96, draft_max="auto")).run()
    assert g.tokens == base.tokens
    assert g.stats.n_plain_steps > 0  # the mechanism ran: it chose not to draft
    assert g.stats.n_plain_steps > g.stats.n_steps // 2
    assert e.clock.n_decodes > 0 and g.stats.gen_ms > 0  # the simulated clock timed the run


def test_engine_auto_with_perfect_cheap_draft_drafts_and_accepts(pairs):
    e = pairs["good"]
    toks = e.tokenize("def fibonacci(n):")
    base = e.session().generate(toks, GenerationSettings(n_predict=96), speculative=False).run()
    g = e.session().generate(toks, GenerationSettings(n_predict=96, draft_max="auto")).run()
    assert g.tokens == base.tokens
    assert g.stats.n_drafted > 48 and g.stats.n_accepted == g.stats.n_drafted
    assert len(g.stats.accepted_per_pos) == AUTO_DRAFT_CAP


def test_a_noisy_cheap_reading_of_a_big_verify_does_not_make_drafting_look_free():
    c = LengthController(cap=4, cost_ratio_prior=0.5)
    for _ in range(20):  # plain decoding: one-token verifies at 10 ms
        c.observe(StepOutcome(0, 0, None, 0.010, 0.0))
    # one probe (5 ms of drafting) whose 2-token verify happened to read 6 ms (noise)
    c.observe(StepOutcome(1, 0, None, 0.006, 0.0, draft_s=0.005, first_token_s=0.005))
    assert c.verify_s(2) >= c.verify_s(1)
    # a draft that was just rejected is not worth half a step plus a verify (at 6 ms it would look so)
    assert c.choose(4) == 0


def test_a_single_token_verify_does_not_set_the_slope_of_batch_verifies():
    # CPU-like costs: one token runs other kernels (18 ms); a batch costs 28 ms plus 2.5 ms a token.
    # A line through b=1 and b=2 would price a 9-token verify at ~100 ms and keep the draft at 2; on the batches'
    # line, every length from 6 to 16 is within 4% of the best (8), and the shortest within NEAR_BEST is taken.
    verify = lambda b: 18.0 if b == 1 else 28.0 + 2.5 * (b - 2)  # noqa: E731
    c, ks, tps = simulate(0.98, draft_ms=7.6, verify_ms=verify, steps=60)
    assert np.median(ks[5:]) >= 5, ks
    assert c.verify_s(12) < 0.060  # a line through the batches only: 28 + 2.5·10 = 53 ms


def test_positions_never_tried_inherit_the_last_tried_position_not_the_pooled_rate():
    c = LengthController(cap=8)
    for i in range(20):  # every other step rejects at position 1; past it, every token is accepted
        c.observe(StepOutcome(3, 0 if i % 2 else 3, 0.001, 0.01, 0.0))
    a = c.alphas()
    assert 0.35 < a[0] < 0.65 and a[2] > 0.9
    assert a[5] > 0.85  # the pooled rate (~0.75 here) would give ~0.75


def test_the_controller_outlives_a_generation_and_counts_per_generation(pairs):
    e = pairs["unrelated"]
    ses = e.session()
    toks = e.tokenize("The quick brown fox")
    auto = GenerationSettings(n_predict=48, draft_max="auto")
    g1 = ses.generate(toks, auto).run()
    ctrl = g1.controller
    assert ctrl is not None and ctrl.t_first is not None  # it measured the draft in the first generation
    plain_after_first = ctrl.n_plain_steps
    assert 0 < g1.stats.n_plain_steps == plain_after_first
    ses.reset()  # a new conversation: the caches go, what was measured about the pair stays
    g2 = ses.generate(toks, auto).run()
    assert g2.controller is ctrl
    assert g2.stats.n_plain_steps == ctrl.n_plain_steps - plain_after_first > 0  # its own steps only
    # no first steps spent learning again that the draft is useless (with the probe budget, g1 learns it from one
    # drafted token; g2 may spend one thin-evidence probe, no more)
    assert g2.stats.n_drafted <= g1.stats.n_drafted
    # other sampling settings: acceptance differs, so another controller
    g3 = ses.generate(toks, GenerationSettings(n_predict=8, draft_max="auto", temp=1.0)).run()
    assert g3.controller is not ctrl


@pytest.mark.parametrize("draft_max", [2, 4, 8, "auto"])
def test_the_cost_model_explains_a_run_on_a_simulated_clock(deep_target, tiny_close, draft_max):
    # Costs are exact here (a simulated clock), so the controller's model evaluated on the run's own
    # measurements (native/control/report.py) must reproduce the measured tokens/s: a wrong term (catch-up left out,
    # pooled instead of per-position acceptance, one verify cost for all batch sizes) shows up as a gap.
    from specq.native.commands.bench import run_record
    from specq.native.control.report import pool

    clock = SimulatedClock(cpu_like_costs(target_one_ms=10.0, draft_ms=2.0))
    with Engine(deep_target, tiny_close, ctx=512, threads=1, clock=clock) as e:  # a draft of 1/12 the size
        g = e.session().generate(e.tokenize("def fibonacci(n):"),
                                 GenerationSettings(n_predict=96, draft_max=draft_max)).run()
    row = run_record("speculative", 0, 0, g, g.settings)
    costs = pool([row])
    assert sum(costs.steps_by_k.values()) == g.stats.n_steps == sum(n for n, _ in costs.verify_ms_by_size.values())
    assert sum(costs.accepted_per_pos) == g.stats.n_accepted
    assert min(costs.alphas()) < 1 and g.stats.n_drafted > 0  # a close draft: some drafts rejected
    measured = g.stats.tokens_per_s
    assert costs.predicted_tokens_per_s() == pytest.approx(measured, rel=0.03)
    ideal = costs.ideal_tokens_per_s(10.0)  # a verify pass priced as one single-token decode
    assert ideal >= measured


def context_costs(attn_ms_per_row_token: float):
    """cpu_like_costs (a 20 ms target, a 2 ms draft) plus attention: each row of a decode pays for every token
    before it, on both models alike (a draft of the target's architecture reads a context as long)."""
    base = cpu_like_costs(target_one_ms=20.0, draft_ms=2.0)

    def cost(name: str, n: int, pos0: int = 0) -> float:
        rows_x_context = n * pos0 + n * (n - 1) / 2
        return base(name, n) + attn_ms_per_row_token * rows_x_context / 1e3
    return cost


def through_first_choice(it) -> None:
    """Read a generation's events up to the first of the first step the controller chose (the step after the
    target's prefill's own token)."""
    for ev in it:
        if ev.step >= 1:
            return


def first_step(session, toks, settings):
    """Run the first step the controller chose; (tokens it drafted, plain steps) after it."""
    gen = session.generate(toks, settings)
    it = iter(gen)
    through_first_choice(it)
    snap = gen.snapshot()
    it.close()
    return snap.n_drafted, snap.n_plain_steps


def long_prompt(e, n_tokens: int) -> list[int]:
    words = ("the cat sat on a mat while seven dogs ran past old red barns near green hills "
             "and quiet rivers under grey clouds before rain fell on tall trees").split()
    rng = np.random.default_rng(5)
    toks = e.tokenize(" ".join(rng.choice(words, size=n_tokens)))
    assert len(toks) >= n_tokens
    return toks[:n_tokens]


def test_at_long_context_the_first_step_is_plain_when_the_measured_costs_make_drafting_a_loss(deep_target,
                                                                                                tiny_target):
    # The draft is 1/12 of the target's weights (the prior says: draft), but at 1,500 tokens of context a
    # token's attention (22.5 ms here) makes the draft cost 24.5 ms against the target's 42.5 ms, and a 2-token
    # verify 75 ms: drafting loses even when every draft is accepted (at best, 16 drafted: 20.6 tokens/s
    # against 23.5 plain), and the draft agrees with the target on the prompt. Short prompts still draft.
    clock = SimulatedClock(context_costs(attn_ms_per_row_token=0.015))
    auto = GenerationSettings(n_predict=16, draft_max="auto")
    with Engine(deep_target, tiny_target, ctx=2048, draft_ctx=0, threads=1, clock=clock) as e:
        fresh = e.session()
        drafted, plain = first_step(fresh, long_prompt(e, 1500), auto)
        assert (drafted, plain) == (0, 1)
        ctrl = fresh.controller(auto)
        # it timed a target and a draft token at that context, and at the prompt's start (attention's share)
        assert ctrl.n_calibrations == 2

        # A session that learned its costs at short context (where drafting pays) and then gets a long prompt:
        # the short-context costs must not price the long-context step.
        ses = e.session()
        short = ses.generate(e.tokenize("The quick brown fox"), auto).run()
        assert short.stats.n_drafted > 0
        ses.reset()
        drafted, plain = first_step(ses, long_prompt(e, 1500), auto)
        assert (drafted, plain) == (0, 1)
        ctrl = ses.controller(auto)
        assert ctrl.n_calibrations == 2 and len(ctrl.target.bands) == 2  # one at each context


def test_a_window_pays_where_it_is_cheaper_and_agrees_about_as_well():
    verify = lambda b: (40.0 + 25.0 * (b - 1)) / 1e3  # noqa: E731 -- a CPU at long context: each row pays
    whole, cheap = 0.024, 0.006  # seconds a drafted token: a draft that reads 1,600 tokens, and one that reads 260
    assert window_pays((32, 32), (31, 32), whole, cheap, verify, 0.0, 16)
    assert not window_pays((32, 32), (20, 32), whole, cheap, verify, 0.0, 16)  # cheaper, but it loses acceptance
    assert not window_pays((32, 32), (32, 32), whole, whole, verify, 0.0, 16)  # as dear: nothing to win
    assert not window_pays((32, 32), (32, 32), whole, 0.99 * whole, verify, 0.0, 16)  # within the margin


def recent_costs():
    """Both models pay 0.015 ms per token of context for each token they decode, but the rows of a target's verify
    share most of those reads (a 5-token verify at 1,600 tokens: 76 ms against 44 for one). A draft that reads the
    whole context costs 26 ms a token there (~26 tokens/s at best, plain 22.7); one that reads the last ~260
    tokens costs ~6 ms (~42 tokens/s)."""
    base_cost = cpu_like_costs(target_one_ms=20.0, draft_ms=2.0)

    def cost(name: str, n: int, pos0: int = 0) -> float:
        rows = n if name == "draft" else 1.0 + 0.2 * (n - 1)
        return base_cost(name, n) + 0.015 * pos0 * rows / 1e3
    return cost


def test_paired_agreement_counts_only_a_difference_beyond_its_noise():
    whole = np.ones(32, dtype=bool)
    whole[:5] = False  # 27 of 32 rows
    window = whole.copy()
    window[5:7] = False  # 25: two rows that only the whole context got right
    a_whole, a_window = paired_acceptance(whole, window)
    assert (a_whole + a_window) / 2 == pytest.approx((27 + 25 + 2) / 68)
    assert a_whole - a_window == pytest.approx(2 / 32 * 0.5)  # b = 2, c = 0: half of it is noise
    far = whole.copy()
    far[5:15] = False  # 17: ten rows only the whole context got right, a real difference
    h, w = paired_acceptance(whole, far)
    assert h - w == pytest.approx(10 / 32 * 0.9)
    assert paired_acceptance(whole, np.roll(whole, 1)) == paired_acceptance(whole, whole)  # b = c: no difference
    # The deep pair at 4k tokens on a 2-core CPU (plain 120 ms, verifies of 189 ms + 23 ms a row, a draft token
    # 23 ms on the whole context and 11 ms on the window), on those rows: counted apart, the two rows make the
    # window lose by the margin (it ran 1.59x the target alone against 1.40x for the whole context's best
    # fixed length); paired, it is kept.
    verify = lambda b: 0.120 if b == 1 else 0.189 + 0.023 * (b - 2)  # noqa: E731
    assert not window_pays((27, 32), (25, 32), 0.0233, 0.0108, verify, 0.0, 16)
    assert window_pays_at(a_whole, a_window, 0.0233, 0.0108, verify, 0.0, 16)
    h, w = paired_acceptance(whole, far)
    assert not window_pays_at(h, w, 0.0233, 0.0108, verify, 0.0, 16)


def test_at_long_context_a_draft_window_is_taken_where_it_is_faster(recent_pair):
    # --ctx-draft auto (recent_costs). The window trial times both drafts and takes the window: the first step
    # drafts from the trial's memory with no catch-up over the window, on probation (the whole context's memory
    # waits). The answer's rows confirm it (the pair depends mostly on recent tokens): the draft's context adopts
    # the window's memory, and the output is the target's.
    from specq.native.llama import ffi as _ffi

    auto = GenerationSettings(n_predict=32, draft_max="auto")
    with Engine(*recent_pair, ctx=2048, threads=1, clock=SimulatedClock(recent_costs())) as e:
        toks = long_prompt(e, 1600)
        base = e.session().generate(toks, auto, speculative=False).run()
        assert len(set(base.tokens)) > 3
        ses = e.session()
        gen = ses.generate(toks, auto)
        it = iter(gen)
        through_first_choice(it)
        snap = gen.snapshot()
        trial = ses.reader.trial
        assert trial.n_trials == 1 and ses.reader.window == WINDOW_TRIAL and trial.on_probation() is not None
        assert snap.n_drafted > 0 and snap.n_plain_steps == 0
        assert ses.reader.n_slides == 0  # the trial's memory drafts: it did not slide and catch up
        assert draft_memory(ses).ctx is not e.dft_ctx  # ...from a context of its own, the whole context's memory untouched
        # the controller prices the draft at the window's cost from then on, not at the whole context's 26 ms
        assert ses.controller(auto).first_s() < 0.010
        for _ in it:
            pass
        g = gen
        assert g.tokens == base.tokens
        assert g.stats.n_drafted > 0 and g.stats.draft_window == WINDOW_TRIAL and g.stats.n_window_reverts == 0
        # decided again on the prompt's 32 rows and at least WINDOW_PROBATION of the answer's: the window agrees
        # there as well, and costs a quarter of the whole context's a token: it wins even if the whole context
        # agreed on every row, so the whole context's memory was not caught up to find out
        whole, window = ses.reader.trial.evidence
        assert window[1] >= 32 + WINDOW_PROBATION and window[0] >= 0.9 * window[1]
        assert whole == (32, 32) and ses.reader.trial.n_measures == 0
        assert ses.reader.trial.on_probation() is None and draft_memory(ses).ctx is e.dft_ctx  # kept: adopted
        ses.reset()
        g = ses.generate(toks, auto).run()
        assert g.tokens == base.tokens and g.stats.draft_window == WINDOW_TRIAL
        assert g.stats.n_window_trials == 0  # decided for the session: no second trial at the same length
        # the draft's memory is a window: the history's first tokens, then recent ones, at positions 0..
        dft, hist = draft_memory(ses), ses.history
        assert 0 < dft.offset and len(dft.tokens) <= WINDOW_TRIAL and dft.tokens[:DRAFT_SINK] == hist[:DRAFT_SINK]
        dft.extend(hist[dft.next_index():], logits="last")
        with _ffi.Context(e.draft, 1024, 1, name="fresh") as fresh:
            fresh.decode(hist[:DRAFT_SINK] + hist[dft.offset:], 0, logits="last")
            np.testing.assert_allclose(dft.ctx.logits(1)[0], fresh.logits(1)[0], atol=2e-2)


def test_with_drafter_auto_the_draft_model_is_compared_and_its_window_tried(recent_pair):
    # --drafter auto picks among the n-gram lookup and the draft model each step; the draft model is one of them,
    # so the prefill compares its greedy choices with the target's (the acceptance prior) and, at long context,
    # times its window, as for --drafter model.
    auto = GenerationSettings(n_predict=32, draft_max="auto", drafter="auto")
    with Engine(*recent_pair, ctx=2048, threads=1, clock=SimulatedClock(recent_costs())) as e:
        toks = long_prompt(e, 1600)
        plain = e.session().generate(toks, auto, speculative=False).run()
        ses = e.session()
        g = ses.generate(toks, auto).run()
        assert g.tokens == plain.tokens
        assert ses.agreement is not None and ses.controller(auto).n_seeds == 1
        assert g.stats.n_window_trials == 1 and ses.reader.trial.evidence is not None
        assert dict(g.stats.n_drafted_by).get("model", 0) > 0


def test_a_window_the_answer_does_not_bear_out_is_given_up_without_a_new_prefill(recent_pair, monkeypatch):
    # The trial takes the window (forced here: its first window_pays says yes, as 8 prompt rows that happen to
    # agree can), but the window is no cheaper (the draft costs 2 ms a token at any context). After the answer's
    # first WINDOW_PROBATION rows window_pays, on them too, gives it up: the whole context's memory, which waited
    # as the trial left it, catches up on those rows alone (no new prefill of the 1,600 tokens), the controller
    # forgets the window's acceptance and is seeded from the whole context's agreement, drafting goes on, and the
    # output is the target's.
    base = cpu_like_costs(target_one_ms=20.0, draft_ms=2.0)
    decoded = {"draft": 0, "target": 0}

    def cost(name: str, n: int, pos0: int = 0) -> float:
        decoded[name] += n
        return base(name, n) + (0.015 * pos0 * (1.0 + 0.2 * (n - 1)) / 1e3 if name == "target" else 0.0)

    real, calls = window_mod.window_pays, []

    def first_says_yes(*args, **kw):
        calls.append(args[:2])
        return True if len(calls) == 1 else real(*args, **kw)

    monkeypatch.setattr(window_mod, "window_pays", first_says_yes)
    auto = GenerationSettings(n_predict=40, draft_max="auto")
    with Engine(*recent_pair, ctx=2048, threads=1, clock=SimulatedClock(cost)) as e:
        toks = long_prompt(e, 1600)
        plain = e.session().generate(toks, auto, speculative=False).run()
        ses = e.session()
        decoded["draft"] = 0
        g = ses.generate(toks, auto).run()
        assert g.tokens == plain.tokens and len(set(g.tokens)) > 3
        # the verdict depended on the whole context's rows of the answer (the window agrees there, and is no
        # cheaper): they were measured, and both sides compared on the same rows
        assert ses.reader.trial.n_measures == 1
        whole, window = ses.reader.trial.evidence
        assert len(calls) == 1 and whole[1] == window[1] >= 8 + WINDOW_PROBATION
        assert g.stats.n_window_trials == 1 and g.stats.n_window_reverts == 1 and g.stats.draft_window is None
        assert ses.reader.window is None and draft_memory(ses).ctx is e.dft_ctx and draft_memory(ses).offset == 0
        assert draft_memory(ses).tokens == ses.history[:len(draft_memory(ses).tokens)]  # the whole history, caught up
        # the prompt once (1,600), the trial's window (~300) and the answer's rows: not a second prefill
        assert decoded["draft"] < 1600 + 400 + 3 * auto.n_predict
        ctrl = ses.controller(auto)
        assert ctrl.n_seeds == 2  # the prompt's agreement, then the whole context's again after the revert
        assert g.stats.n_drafted > 0 and ctrl.trials[0] > 0  # it drafts on from the whole context


def test_a_draft_window_is_not_taken_where_it_is_no_cheaper(deep_target, tiny_target):
    # The same pair with attention on the target alone: the draft costs 2 ms a token at any context, so the trial
    # finds nothing to win and the draft keeps the whole context. The trial's decodes are part of the prefill's
    # time; --ctx-draft 0 (the whole context, always) runs no trial.
    base = cpu_like_costs(target_one_ms=20.0, draft_ms=2.0)

    def cost(name: str, n: int, pos0: int = 0) -> float:
        return base(name, n) + (0.015 * (n * pos0 + n * (n - 1) / 2) / 1e3 if name == "target" else 0.0)

    auto = GenerationSettings(n_predict=8, draft_max="auto")
    prompt_ms = {}
    for draft_ctx in ("auto", 0):
        with Engine(deep_target, tiny_target, ctx=2048, threads=1, clock=SimulatedClock(cost),
                    draft_ctx=draft_ctx) as e:
            ses = e.session()
            g = ses.generate(long_prompt(e, 1600), auto).run()
            assert ses.reader.window is None and draft_memory(ses).offset == 0 and g.stats.draft_window is None
            assert g.stats.n_window_trials == ses.reader.trial.n_trials == (1 if draft_ctx == "auto" else 0)
            prompt_ms[draft_ctx] = g.stats.prompt_ms
    assert prompt_ms["auto"] > prompt_ms[0] + 20.0  # the draft decoded ~260 tokens more, 0.2 ms each here


def test_at_long_context_drafting_that_still_pays_starts_at_the_first_step(deep_target, tiny_target):
    # Same pair, attention 10x cheaper: 1.5 ms per token at 1,500 tokens; the draft still pays there.
    clock = SimulatedClock(context_costs(attn_ms_per_row_token=0.001))
    with Engine(deep_target, tiny_target, ctx=2048, draft_ctx=0, threads=1, clock=clock) as e:
        ses = e.session()
        drafted, plain = first_step(ses, long_prompt(e, 1500), GenerationSettings(n_predict=16, draft_max="auto"))
        assert drafted > 0 and plain == 0


def test_at_long_context_verify_batches_timed_in_the_prefill_price_the_first_step(deep_target, tiny_target):
    # The target's single token grows with the context (60 ms of attention at 1,500 tokens) but a batch shares
    # those reads, so its rows cost little more than one (a 5-token verify: 93 ms against 80 for one token).
    # Priced from single tokens alone, each row of a verify would pay the single token's attention and drafting
    # would look like a loss; the batches the prefill decodes alone and times show that it pays, so the first
    # step already drafts.
    base = cpu_like_costs(target_one_ms=20.0, draft_ms=2.0)

    def cost(name: str, n: int, pos0: int = 0) -> float:
        return base(name, n) + (0.04 * pos0 / 1e3 if name == "target" else 0.0)

    with Engine(deep_target, tiny_target, ctx=2048, draft_ctx=0, threads=1, clock=SimulatedClock(cost)) as e:
        ses = e.session()
        drafted, plain = first_step(ses, long_prompt(e, 1500), GenerationSettings(n_predict=16, draft_max="auto"))
        ctrl = ses.controller(GenerationSettings(n_predict=16, draft_max="auto"))
        assert drafted > 0 and plain == 0
        assert ctrl.n_batch_calibrations == 2  # a 5-token and a 2-token batch, at 1,500 tokens
        assert ctrl.verify_s(5) == pytest.approx(0.028 + 0.005 + 0.06, rel=0.02)


def test_a_few_unlucky_first_drafts_do_not_stop_drafting_for_the_whole_answer():
    # Plain 20 ms a token, a 6 ms draft token, verifies of 24 ms + 1 ms a row: a draft that is accepted pays
    # well. The first three drafts are all rejected (a hard opening), everything after is accepted. Plain
    # decoding wins on that thin evidence; one-token probes every other step must bring drafting back within a
    # few steps, not after probe_min (16) plain steps.
    c = LengthController(cap=8)
    ks = []
    for step in range(30):
        k = c.choose(8)
        accepted = 0 if step < 3 else k
        c.observe(StepOutcome(k, accepted, 0.006 if k > 1 else None, (20.0 if k == 0 else 25.0 + k) / 1e3, 0.0,
                              draft_s=0.006 * k if k else None, first_token_s=0.006 if k else None))
        ks.append(k)
    assert 0 < c.n_plain_steps <= 6 and c.n_probes > 0, ks  # it did go plain, and probed its way back
    assert min(ks[15:]) >= 4, ks


def test_probes_on_thin_evidence_are_spaced_out_when_they_cost():
    # A useless draft that is dear (8 ms a token against 20 ms plain, verifies of 27 ms): every probe costs most
    # of a plain token and gains nothing. The every-other-step probing of thin evidence would spend ~7 probes in
    # the first 14 steps; spaced within its budget, it spends a few over 60 steps.
    c = LengthController(cap=8)
    for _ in range(60):
        k = c.choose(8)
        c.observe(StepOutcome(k, 0, 0.008 if k > 1 else None, (20.0 if k == 0 else 26.0 + k) / 1e3, 0.0,
                              draft_s=0.008 * k if k else None, first_token_s=0.008 if k else None))
    assert 0 < c.n_probes <= 4 and c.n_plain_steps >= 50
    assert c.schedule.thin_gap > 1  # the mechanism ran: the last probe set a gap


def test_prompt_agreement_lets_a_pair_that_agrees_draft_from_the_first_step(deep_target, tiny_target, tiny_unrelated,
                                                                            monkeypatch):
    # At 1,500 tokens (attention 6 ms a token here) drafting pays only at high acceptance: at the prior's 75%
    # plain decoding wins (35.6 against 38.5 tokens/s at best), at 97% drafting wins (51.5). The prefill compares
    # the draft's greedy choices with the target's on the prompt's last rows: a draft that agrees drafts at
    # once, an unrelated one does not.
    auto = GenerationSettings(n_predict=16, draft_max="auto")
    clock = SimulatedClock(context_costs(attn_ms_per_row_token=0.004))
    with Engine(deep_target, tiny_target, ctx=2048, draft_ctx=0, threads=1, clock=clock) as e:
        ses = e.session()
        drafted, plain = first_step(ses, long_prompt(e, 1500), auto)
        agree, n = ses.agreement
        assert n == AGREE_TOKENS and agree >= 0.9 * n
        assert ses.controller(auto).n_seeds == 1 and drafted > 0 and plain == 0

        monkeypatch.setattr(generation_mod, "AGREE_TOKENS", 0)  # the mechanism off: the prior alone goes plain
        ses = e.session()
        drafted, plain = first_step(ses, long_prompt(e, 1500), auto)
        assert ses.agreement is None and ses.controller(auto).n_seeds == 0 and (drafted, plain) == (0, 1)
    monkeypatch.undo()

    with Engine(deep_target, tiny_unrelated, ctx=2048, draft_ctx=0, threads=1, clock=clock) as e:
        ses = e.session()
        drafted, plain = first_step(ses, long_prompt(e, 1500), auto)
        agree, n = ses.agreement
        assert agree <= 0.5 * n and ses.controller(auto).n_seeds == 1 and (drafted, plain) == (0, 1)


def test_prompt_agreement_is_measured_when_the_draft_holds_the_historys_last_token(deep_target, tiny_target):
    # A turn that follows another (or a rollback into the prompt) finds the draft one row ahead of the target:
    # it holds the history's last token, which the target evaluates with the next prefill. The agreement rows
    # start where the target stands; the draft's extra row is dropped, not taken as a reason to skip them.
    auto = GenerationSettings(n_predict=4, draft_max="auto")
    clock = SimulatedClock(context_costs(attn_ms_per_row_token=0.004))
    with Engine(deep_target, tiny_target, ctx=2048, draft_ctx=0, threads=1, clock=clock) as e:
        ses = e.session()
        toks = long_prompt(e, 1500)
        ses.prefill(toks[:1476])  # a short turn follows: its agreement rows begin where the target stands
        base = len(ses.history)
        ses.generate(toks[1476:], GenerationSettings(n_predict=4, draft_max=2)).run()
        ses.rollback(base)
        assert draft_memory(ses).next_index() == len(ses.tgt.tokens) + 1  # the case: the draft is a row ahead
        first_step(ses, toks[1476:], auto)
        agree, n = ses.agreement
        assert n == 16 and agree >= 0.9 * n and ses.controller(auto).n_seeds == 1


def simulate_long_context(c, alpha: float, n_tokens: int, seed: int = 0) -> tuple[float, int]:
    """The demo pair at 4k tokens on a 2-core CPU, as measured (benchmarks/long_context.py): plain 36 ms a token,
    a draft token 26 ms, the draft's catch-up 5.6 ms a token, verifies of 41 ms + 5.8 ms a row (a 2-token verify
    1.3 single ones). Drafting gains at most ~8% there, at perfect acceptance; i.i.d. acceptance alpha.
    Generates n_tokens (the controller is told how many are left, as the engine does); returns (time over what
    plain decoding would take for the same tokens, tokens)."""
    rng = np.random.default_rng(seed)
    plain, first, per, catch = 0.036, 0.026, 0.026, 0.0056
    verify = lambda b: plain if b == 1 else 0.041 + 0.0058 * b  # noqa: E731
    behind, tokens, time_s = 1, 0, 0.0
    while tokens < n_tokens:
        c.at(4096, n_tokens - tokens)
        k = c.choose(min(16, n_tokens - tokens - 1))
        if k == 0:
            c.observe(StepOutcome(0, 0, None, plain, 0.0))
            behind, tokens, time_s = behind + 1, tokens + 1, time_s + plain
            continue
        a = 0
        while a < k and rng.random() < alpha:
            a += 1
        draft_s = first + max(behind - 1, 0) * catch + (k - 1) * per
        c.observe(StepOutcome(k, a, per if k > 1 else None, verify(k + 1), 0.0, draft_s=draft_s,
                              first_token_s=first if behind <= 2 else None,
                              catchup=(behind, first + (behind - 1) * catch) if behind > 2 else None))
        behind, tokens, time_s = 1, tokens + a + 1, time_s + draft_s + verify(k + 1)
    return time_s / (tokens * plain), tokens


@pytest.mark.parametrize("alpha", [0.5, 0.9])
def test_probes_cost_at_most_a_few_percent_where_drafting_barely_pays(alpha):
    # At long context a one-token probe loses even when accepted (26 ms of draft and a 47.6 ms verify for two
    # tokens against 72 ms plain, plus the catch-up on every token decoded since the last draft). The controller
    # starts from its 75% prior with single-token costs calibrated (as a prefill does); its probes may cost at
    # most ExploreBudget.share of the time so far, so a 48-token answer ends within ~3% of plain decoding.
    for n_tokens in (48, 400):
        c = LengthController(cap=16)
        c.calibrate(4096, 0.036, 0.026)
        c.calibrate(4096, 0.041 + 0.0058 * 5, None, 5)
        c.calibrate(4096, 0.041 + 0.0058 * 2, None, 2)
        slower, _ = simulate_long_context(c, alpha, n_tokens)
        assert slower <= 1.035, (n_tokens, slower)
    assert c.n_probes > 0 and c.budget.n_refused > 0  # it did probe, and the budget held probes back


def test_without_the_probe_budget_the_probes_cost_more(monkeypatch):
    # The same pair with the budget off: the thin-evidence probes (spaced only by their last measured cost) lose
    # over 4% of a 48-token answer.
    from specq.native.control import explore

    monkeypatch.setattr(explore.ExploreBudget, "allows", lambda self, *args: True)
    c = LengthController(cap=16)
    c.calibrate(4096, 0.036, 0.026)
    c.calibrate(4096, 0.041 + 0.0058 * 5, None, 5)
    c.calibrate(4096, 0.041 + 0.0058 * 2, None, 2)
    slower, _ = simulate_long_context(c, 0.5, 48)
    assert slower > 1.04, slower


def deep_8k_opening(seed: int = 0) -> tuple[LengthController, list[int], float]:
    """The deep pair at 8k tokens on a 2-core CPU, as measured (benchmarks/long_context.py): plain 164 ms a token,
    a draft token 36 ms, verifies of 200 ms + 40 ms a row (17 tokens: 880 ms, five single ones). An answer's
    opening is easy: the first two drafts are accepted whole, then acceptance is i.i.d. 0.7 (drafting at best
    breaks even there). 48 tokens; returns (controller, draft lengths, time over plain decoding's)."""
    rng = np.random.default_rng(seed)
    plain, per = 0.164, 0.036
    verify = lambda b: plain if b == 1 else 0.200 + 0.040 * b  # noqa: E731
    c = LengthController(cap=16)
    c.calibrate(8192, plain, per)
    for b in (5, 2):
        c.calibrate(8192, verify(b), None, b)
    ks, tokens, time_s, drafts = [], 0, 0.0, 0
    while tokens < 48:
        c.at(8192, 48 - tokens)
        k = c.choose(min(16, 48 - tokens - 1))
        a = k if drafts < 2 else 0
        while drafts >= 2 and a < k and rng.random() < 0.7:
            a += 1
        drafts += k > 0
        c.observe(StepOutcome(k, a, per if k > 1 else None, verify(k + 1), 0.0, draft_s=k * per if k else None,
                              first_token_s=per if k else None))
        ks.append(k)
        tokens, time_s = tokens + a + 1, time_s + k * per + verify(k + 1)
    return c, ks, time_s / (tokens * plain)


def test_past_the_positions_tried_a_dear_draft_grows_a_few_positions_at_a_time():
    # The demo pair at 2k tokens on a CPU: plain 37 ms, a draft token 20 ms, a verify 37 ms + 6 ms a row, and the
    # prompt says the draft agrees. The reach keeps the opening drafts at two tokens; once those are in, every
    # position's estimate is near 1, untried ones included, and the best length on them is the cap: a 16-token
    # draft, 0.45 s, twelve plain tokens lost when it fails at its second token (seen on real text). Past the
    # deepest position tried a draft may grow by REACH_STEP positions; drafts that keep being accepted grow until
    # their rate is within NEAR_BEST of the cap's.
    def verify(b):
        return (37.0 + 6.0 * (b - 1)) / 1e3

    c = LengthController(cap=16)
    c.calibrate(2048, verify(1), 0.020)
    for b in (5, 2):
        c.calibrate(2048, verify(b), None, b)
    c.seed_acceptance(8, 8)
    ks = []
    for _ in range(24):
        c.at(2048, 48)
        k = c.choose(16)
        c.observe(StepOutcome(k, k, 0.020 if k > 1 else None, verify(k + 1), 0.0, draft_s=0.020 * k if k else None,
                              first_token_s=0.020 if k else None))
        ks.append(k)
    assert ks[0] > 0 and all(k <= max(ks[:i]) + REACH_STEP for i, k in enumerate(ks) if i), ks
    rate = lambda k: (k + 1) / (0.020 * k + verify(k + 1))  # noqa: E731 (every draft accepted)
    assert rate(ks[-1]) >= (1 - NEAR_BEST) * rate(16) and len(set(ks)) >= 4, ks  # it grew in steps (2, 4, 6, ...)


def test_while_evidence_is_thin_a_step_costs_at_most_a_few_plain_ones():
    # Two whole acceptances put every position's estimate near 1; the best length on those estimates is the cap,
    # a 16-token draft and a 17-token verify: 1.46 s, nine plain tokens. Its reach keeps each step within three
    # plain steps (k <= 3 here) until the evidence is in; over six answers the drafting that does not pay costs
    # a few percent, not the ~11% of drafting to the cap.
    runs = [deep_8k_opening(seed) for seed in range(6)]
    for c, ks, _ in runs:
        assert c.n_reach_limited > 0 and sum(k > 0 for k in ks) >= 2, ks  # it drafted, and the reach held it back
        assert max(ks) <= 4, ks
    assert np.mean([slower for *_, slower in runs]) <= 1.05


def test_without_the_reach_the_opening_drafts_long(monkeypatch):
    from specq.native.control import length

    within = np.mean([slower for *_, slower in (deep_8k_opening(seed) for seed in range(6))])
    monkeypatch.setattr(length, "THIN_STEP_COST", float("inf"))
    runs = [deep_8k_opening(seed) for seed in range(6)]
    assert all(max(ks) >= 6 for _, ks, _ in runs)  # 3 within the reach
    assert np.mean([slower for *_, slower in runs]) > within + 0.015  # 1.048 against 1.025 (1.117 at NEAR_BEST 0)
