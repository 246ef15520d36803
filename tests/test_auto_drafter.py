"""--drafter auto: the adaptive controller chooses the drafter (or plain decoding) and the length each step."""

from __future__ import annotations

import numpy as np
import pytest

from specq.native.control.chooser import DrafterChooser
from specq.native.control.length import LengthController
from specq.native.control.step import StepOutcome
from specq.native.runtime.engine import Engine, SimulatedClock
from specq.native.core.sampling import Sampling
from specq.native.core.settings import GenerationSettings
from specq.native.drafters.base import pick, pick_loop
from test_adaptive import cpu_like_costs


def simulate(alphas: dict[str, float], draft_ms: dict[str, float], verify_ms, steps: int = 400, seed: int = 0):
    """The controller against synthetic drafters: i.i.d. acceptance per drafter, fixed costs; how often each
    was chosen over the last half of the steps (None: plain decoding)."""
    rng = np.random.default_rng(seed)
    c = DrafterChooser(16, {n: 0.1 for n in alphas}, memoryless={"ngram"})
    chosen: dict = {}
    for i in range(steps):
        name, k = c.choose({n: 16 for n in alphas})[:2]
        a = 0
        if name is not None:
            while a < k and rng.random() < alphas[name]:
                a += 1
        c.observe(StepOutcome(k, a, draft_ms[name] / 1e3 if name and k > 1 else None, verify_ms(k + 1) / 1e3, 0.0,
                              draft_ms[name] * k / 1e3 if name else 0.0, draft_ms[name] / 1e3 if name else None,
                              drafter=name))
        if i >= steps // 2:
            chosen[name] = chosen.get(name, 0) + 1
    return chosen


def test_the_controller_settles_on_the_drafter_that_pays():
    flat = lambda b: 10.0 + 0.5 * b  # noqa: E731
    # a cheap drafter that is right 80% of the time beats a dear one that is right 90% of the time
    got = simulate({"ngram": 0.8, "model": 0.9}, {"ngram": 0.05, "model": 4.0}, flat)
    assert got.get("ngram", 0) > 0.9 * 200, got
    # a useless drafter next to a good one is left alone (but for rare probes)
    got = simulate({"good": 0.85, "useless": 0.0}, {"good": 1.0, "useless": 1.0}, flat)
    assert got.get("good", 0) > 0.9 * 200 and got.get("useless", 0) < 10, got
    # no drafter pays: plain decoding, with rare probes
    got = simulate({"a": 0.0, "b": 0.05}, {"a": 2.0, "b": 2.0}, flat)
    assert got.get(None, 0) > 0.9 * 200, got


def test_auto_with_a_useless_draft_model_ends_up_drafting_from_ngrams(tiny_target, tiny_unrelated):
    """The text repeats; the draft model never agrees. auto tries both, measures, and keeps the n-grams."""
    clock = SimulatedClock(cpu_like_costs(target_one_ms=10.0, draft_ms=3.0))
    with Engine(tiny_target, tiny_unrelated, ctx=1024, threads=1, clock=clock) as e:
        toks = e.tokenize("def fibonacci(n):")
        base = e.session().generate(toks, GenerationSettings(n_predict=200), speculative=False).run()
        ses = e.session()
        s = GenerationSettings(n_predict=200, drafter="auto")
        first = ses.generate(toks, s).run()
        more = e.tokenize(" and")
        second = ses.generate(more, s).run()  # the controller lives as long as the session: it remembers
        hist = list(ses.history)
    assert first.tokens == base.tokens and len(set(base.tokens)) > 50
    by1, acc1 = dict(first.stats.n_drafted_by), dict(first.stats.n_accepted_by)
    assert by1.get("model", 0) > 0 and acc1.get("model", 0) == 0  # the model was tried and never agreed
    by2, acc2 = dict(second.stats.n_drafted_by), dict(second.stats.n_accepted_by)
    assert by2.get("ngram", 0) > 60 and by2.get("model", 0) <= second.stats.n_probes, by2
    # most positions the drafts reach are accepted (per-position α; a long n-gram proposal's rejected tail
    # counts in accept_rate, accepted ÷ drafted, but not here)
    assert acc2["ngram"] > 0 and second.stats.alpha > 0.5, (second.stats.alpha, second.stats.accept_rate)
    assert second.stats.n_plain_steps > 0  # where the text has no match, plain decoding (not the model)
    with Engine(tiny_target, None, ctx=1024, threads=1) as ref:
        alone = ref.session().generate(hist[:-200], GenerationSettings(n_predict=200), speculative=False).run()
    assert alone.tokens == second.tokens


def test_auto_is_deterministic_under_a_simulated_clock(tiny_target, tiny_unrelated):
    runs = []
    for _ in range(2):
        clock = SimulatedClock(cpu_like_costs(target_one_ms=10.0, draft_ms=3.0))
        with Engine(tiny_target, tiny_unrelated, ctx=512, threads=1, clock=clock) as e:
            g = e.session().generate(e.tokenize("def fibonacci(n):"),
                                     GenerationSettings(n_predict=120, drafter="auto")).run()
            runs.append((g.stats.n_drafted_by, g.stats.steps_by_k, g.stats.n_plain_steps, clock.now))
    assert runs[0] == runs[1]


def test_auto_includes_the_mtp_head_where_the_target_has_one(mtp_target):
    def cost(name: str, n: int, pos0: int) -> float:
        return {"target": 10.0 + 0.5 * n, "mtp": 0.5 + 0.05 * n}.get(name, 1.0) / 1e3

    with Engine(mtp_target, None, ctx=256, threads=1, mtp=None, clock=SimulatedClock(cost)) as e:
        assert e.mtp_ctx is not None
        toks = e.tokenize("Once upon a time")
        base = e.session().generate(toks, GenerationSettings(n_predict=60), speculative=False).run()
        g = e.session().generate(toks, GenerationSettings(n_predict=60, drafter="auto")).run()
    assert g.tokens == base.tokens
    assert dict(g.stats.n_drafted_by).get("mtp", 0) > 10 and dict(g.stats.n_accepted_by)["mtp"] > 0


# ---- the drafter on the command line: bench, tune, the pair manifest, presets ----------------------------------
def test_bench_and_tune_take_the_mtp_and_auto_drafters(mtp_target, tiny_target):
    import json

    from typer.testing import CliRunner

    from specq.cli.app import app

    runner = CliRunner()
    base = ["--target", str(mtp_target), "--threads", "1", "--ctx", "256"]
    r = runner.invoke(app, ["bench", *base, "--n-predict", "24", "--drafter", "mtp", "--draft-max", "3",
                            "--json", "-", "-q"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    spec = next(x for x in doc["runs"] if x["mode"] == "speculative")
    assert doc["settings"]["drafter"] == "mtp" and doc["draft"] is None
    assert spec["n_drafted_by"]["mtp"] == spec["n_drafted"] > 0 and doc["summary"]["identical_output"] is True
    r = runner.invoke(app, ["bench", *base, "--n-predict", "24", "--drafter", "auto", "--json", "-", "-q"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["settings"]["drafter"] == "auto"
    r = runner.invoke(app, ["tune", *base, "--n-predict", "16", "--draft-max", "2", "--drafter", "mtp", "--json", "-"])
    assert r.exit_code == 0, r.output
    tuned = json.loads(r.stdout)
    assert tuned["drafter"] == "mtp" and tuned["accept_rate"] is not None and tuned["draft_ms"] > 0
    r = runner.invoke(app, ["tune", "--target", str(tiny_target), "--drafter", "mtp", "--threads", "1"])
    assert r.exit_code == 1 and "no MTP layers" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_pair_manifest_and_a_preset_may_name_the_drafter(tiny_target, tmp_path):
    import json
    import shutil

    from typer.testing import CliRunner

    from specq.cli.app import app
    from specq.manifest import sha256_file, write_manifest
    from specq.convert.presets import parse_preset
    from test_presets import raw
    from specq.errors import ManifestError

    shutil.copy(tiny_target, tmp_path / "t.gguf")
    write_manifest(tmp_path, {"file": "t.gguf", "sha256": sha256_file(tmp_path / "t.gguf")}, None,
                   {"draft_max": 3, "drafter": "ngram"})
    base = ["bench", "--pair", str(tmp_path), "--threads", "1", "--ctx", "256", "--n-predict", "8", "--json", "-",
            "-q"]
    r = CliRunner().invoke(app, base)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["settings"]["drafter"] == "ngram"  # no --draft needed: the manifest's drafter
    write_manifest(tmp_path, {"file": "t.gguf", "sha256": sha256_file(tmp_path / "t.gguf")}, None,
                   {"drafter": "sometimes"})
    r = CliRunner().invoke(app, base)
    assert r.exit_code == 1 and "bad drafter in the pair manifest" in r.stderr, r.output

    doc = raw("qwen2.5-7b")
    assert "drafter" not in parse_preset(doc, "x").settings  # optional
    doc["settings"]["drafter"] = "model,ngram"
    assert parse_preset(doc, "x").settings["drafter"] == "model,ngram"
    doc["settings"]["drafter"] = "mtp,auto"
    with pytest.raises(ManifestError, match="drafter"):
        parse_preset(doc, "x")


def simulated_step(c: DrafterChooser, rng, name: str | None, k: int, alpha: dict, draft_ms: dict) -> None:
    """A step the chooser chose (name, k), run on paper: each drafted token accepted with the drafter's alpha in
    a row, drafting at draft_ms a token, the verify 10 ms + 0.5 ms a row; the chooser told the outcome."""
    a = 0
    while a < k and rng.random() < alpha.get(name, 0.0):
        a += 1
    ms = draft_ms.get(name, 0.0)
    c.observe(StepOutcome(k, a, ms / 1e3 if name and k > 1 else None, (10.0 + 0.5 * (k + 1)) / 1e3, 0.0,
                          ms * k / 1e3, ms / 1e3 if name else None, drafter=name))


def test_a_drafter_that_lost_early_is_tried_again_when_the_text_changes():
    # The model drafter pays all along (90%, dear); the n-grams are useless for 100 steps (a text with nothing
    # to copy), then right 95% of the time (the answer starts quoting the prompt), where they beat the model.
    # Plain decoding never wins, so plain-step probes never run: the n-grams must be re-tried while the model
    # wins, or their early estimate keeps them out for good. A re-try is one step every ~70 and may fail by
    # chance, so each of five runs has 400 steps to take the n-grams back.
    for seed in range(5):
        rng = np.random.default_rng(seed)
        c = DrafterChooser(16, {"ngram": 0.01, "model": 0.3}, model="model", memoryless={"ngram"})
        late = {}
        for i in range(500):
            name, k = c.choose({"ngram": 8, "model": 16})[:2]
            simulated_step(c, rng, name, k, {"model": 0.9, "ngram": 0.0 if i < 100 else 0.95},
                           {"model": 4.0, "ngram": 0.05})
            if i >= 400:
                late[name] = late.get(name, 0) + 1
        assert late.get("ngram", 0) > 0.8 * 100, (seed, late)
        assert c.n_probes > 0


def test_auto_learns_a_drafters_acceptance_by_its_evidence_key():
    # The suffix drafter's proposals come in two kinds, told by its evidence key: a long match (a copy, 97%
    # accepted) and a 3-token match (a guess, 20%), mixed at random from step to step; the draft model is right
    # 90% of the time at 1 ms a token. Learnt apart, the copies beat the model (13 tokens in 18 ms against 8 in
    # 35) and the guesses lose to it. Pooled (one estimate for both kinds) both are priced alike: the same drafter
    # takes both kinds of step (the suffix drafter, the mutant auto-evidence-pooled showed).
    rng = np.random.default_rng(0)
    c = DrafterChooser(16, {"suffix": 0.01, "model": 0.1}, model="model", memoryless={"suffix"})
    picked: dict[str, dict] = {"text:24": {}, "text:3": {}}
    for i in range(600):
        key = "text:24" if rng.random() < 0.5 else "text:3"
        name, k = c.choose({"suffix": 16 if key == "text:24" else 3, "model": 16}, {"suffix": key, "model": None})[:2]
        simulated_step(c, rng, name, k, {"model": 0.9, "suffix": 0.97 if key == "text:24" else 0.2},
                       {"model": 1.0, "suffix": 0.05})
        if i >= 300:
            picked[key][name] = picked[key].get(name, 0) + 1
    long, short = picked["text:24"], picked["text:3"]
    assert long.get("suffix", 0) > 0.8 * sum(long.values()), picked
    assert short.get("model", 0) > 0.8 * sum(short.values()), picked
    assert {key for _, key in c.keyed} == {"text:24", "text:3"}


def _controller_after_mixed_steps() -> DrafterChooser:
    """A controller that measured a good, dear draft model (99%+ of 8 accepted; 11 ms to its first token, 10 ms
    per further one, 4 ms per token of a long catch-up) and n-grams right about 70% of the time, at no drafting
    cost; verify 20 ms + 2 ms per row. On its own costs an n-gram step of 3 (2.5 tokens in 28 ms) beats the model
    (8.6 tokens in 119 ms); charged the 4 ms per token the model will spend catching up, it loses."""
    c = DrafterChooser(16, {"model": 0.5, "ngram": 0.01}, model="model", memoryless={"ngram"})
    verify = lambda b: (20.0 + 2.0 * b) / 1e3  # noqa: E731
    ngram_accepted = [3, 1, 0, 2, 3, 1, 3, 2, 0, 3]
    backlog = 1
    for i in range(40):
        c.choose({"model": 16, "ngram": 3})
        if i % 4 == 3:
            a = ngram_accepted[(i // 4) % len(ngram_accepted)]
            c.observe(StepOutcome(3, a, None, verify(4), 0.0, 0.0, None, drafter="ngram"))
            backlog += a + 1
        else:
            catchup = (backlog, 0.011 + (backlog - 1) * 0.004) if backlog > 2 else None
            c.observe(StepOutcome(8, 8, 0.010, verify(9), 0.0, 0.081, None if catchup else 0.011, catchup,
                                  drafter="model"))
            backlog = 2
    return c


def test_an_ngram_step_is_charged_the_draft_models_catch_up():
    c = _controller_after_mixed_steps()
    model = c.per["model"]
    assert model.n_catchups > 0 and model.catchup_s() == pytest.approx(0.004)
    assert c.choose({"model": 16, "ngram": 3})[0] == "model"
    assert c.n_charged > 0


def test_without_the_catch_up_charge_the_ngram_step_would_win(monkeypatch):
    # the counterpart of the test above: the same evidence with the charge taken away picks the n-grams, so the
    # choice above is the charge's doing
    monkeypatch.setattr(LengthController, "catchup_s", lambda self: 0.0)
    c = _controller_after_mixed_steps()
    assert c.choose({"model": 16, "ngram": 3})[0] == "ngram"


def test_auto_measures_the_draft_models_catch_up_in_the_engine(tiny_target):
    """Draft = target (all accepted) on a text that repeats: n-gram steps leave the model tokens to catch up on,
    and the engine hands their cost to the controller; the output stays the target's."""
    clock = SimulatedClock(cpu_like_costs(target_one_ms=10.0, draft_ms=3.0))
    with Engine(tiny_target, tiny_target, ctx=1024, threads=1, clock=clock) as e:
        toks = e.tokenize("def fibonacci(n):")
        base = e.session().generate(toks, GenerationSettings(n_predict=160), speculative=False).run()
        g = e.session().generate(toks, GenerationSettings(n_predict=160, drafter="auto")).run()
    assert g.tokens == base.tokens and len(set(base.tokens)) > 50
    by, acc = dict(g.stats.n_drafted_by), dict(g.stats.n_accepted_by)
    assert by.get("model", 0) > 0 and acc["model"] == by["model"]
    assert by.get("ngram", 0) > 0
    assert g.controller.per["model"].n_catchups > 0 and g.controller.n_charged > 0


def test_auto_spaces_its_probes_on_thin_evidence_when_they_cost():
    # As test_adaptive's test of the same name, with the drafter chosen by auto: a useless, dear draft model
    # (8 ms a token against 20 ms plain). Every-other-step probing would spend ~30 probes in 60 steps; spaced by
    # the drafter's measured probe cost, a few.
    c = DrafterChooser(8, {"model": 0.4}, model="model")
    for _ in range(60):
        name, k = c.choose({"model": 8})[:2]
        c.observe(StepOutcome(k, 0, 0.008 if k > 1 else None, (20.0 if k == 0 else 26.0 + k) / 1e3, 0.0,
                              0.008 * k if k else None, 0.008 if k else None, drafter=name))
    assert 0 < c.n_probes <= 4 and c.n_plain_steps >= 50
    assert c.per["model"].schedule.thin_gap > 1  # the mechanism ran: the last probe set a gap


def test_every_drafters_controller_prices_the_verify_on_one_shared_model():
    # The target's cost does not depend on the drafter: a verify measured on any step prices every drafter's
    # next choice, and every probe is paid from one exploration budget.
    c = DrafterChooser(16, {"model": 0.5, "ngram": 0.01}, model="model", memoryless={"ngram"})
    c.observe(StepOutcome(0, 0, None, 0.020, 0.0))  # a plain step
    assert c.per["model"].verify_s(1) == c.per["ngram"].verify_s(1) == 0.020
    c.observe(StepOutcome(8, 8, 0.010, 0.050, 0.0, 0.081, 0.011, drafter="model"))
    assert c.per["ngram"].verify_s(9) == c.shared.verify_s(9) == 0.050
    assert c.per["model"].budget is c.per["ngram"].budget is c.shared.budget


def test_a_prefills_timed_draft_batches_stay_batches_under_auto():
    """A prefill times the draft model on a 5-token batch as well as on one token: under --drafter auto the model
    drafter keeps the batch as a batch (draft_rows, what a batch of sequences would pay), not as the price of one
    drafted token, which would be five times too dear."""
    c = DrafterChooser(16, {"model": 0.3, "ngram": 0.01}, model="model", memoryless={"ngram"})
    c.calibrate(600, 0.060, 0.025, 5)
    model = c.per["model"]
    model.at(600)
    assert model.draft_rows == {5: 0.025} and model.t_first is None
    c.calibrate(600, 0.030, 0.006)
    assert model.t_first == pytest.approx(0.006)


def test_the_draft_models_read_of_the_prompt_prices_its_catch_up(tiny_target, tiny_close):
    """Before any catch-up is measured, the draft's price per token of one comes from its read of the prompt (a
    catch-up without a first drafted token), not from a prior scaled from the target's batches."""
    clock = SimulatedClock(cpu_like_costs(target_one_ms=10.0, draft_ms=3.0))
    with Engine(tiny_target, tiny_close, ctx=1024, threads=1, clock=clock) as e:
        ses = e.session()
        it = iter(ses.generate(e.tokenize("def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + "
                                          "fibonacci(n - 2) # the classic, slow and recursive" * 2),
                               GenerationSettings(n_predict=8, drafter="auto")))
        next(it), next(it)  # the first token, then the read of the prompt and a step
        pos, n, seconds = ses.read_timing
        model = ses.controller(GenerationSettings(n_predict=8, drafter="auto")).per["model"]
        assert n >= 16 and model.n_catchups == 0
        assert model.catchup_s() == pytest.approx(seconds / n)
        assert seconds / n == pytest.approx((3.0 + 0.3 * (n - 1)) / 1e3 / n)  # one decode of the n tokens
        it.close()



def test_the_model_is_told_to_hand_over_only_to_ngrams_that_copy_well():
    """At a step the model drafts, the chooser says where to stop: once an n-gram would propose enough tokens to
    beat the model's pace (Handover.least); n-grams that copied well need few, n-grams that never copied none."""
    def chooser(ngram_accepts: int) -> DrafterChooser:
        c = DrafterChooser(16, {"model": 0.2, "ngram": 0.01}, model="model", memoryless={"ngram"})
        c.calibrate(200, 0.025, 0.009)
        for _ in range(8):
            c.observe(StepOutcome(15, ngram_accepts, None, 0.056, 0.0, draft_s=0.0001, drafter="ngram"))
            c.observe(StepOutcome(8, 8, 0.009, 0.043, 0.0, draft_s=0.072, first_token_s=0.009, drafter="model"))
        c.at(300, 100)
        return c

    good = chooser(15).choose({"model": 16, "ngram": 0})
    assert good.drafter == "model" and good.handover is not None and good.handover.to == "ngram"
    assert 1 <= good.handover.least <= 4, good
    useless = chooser(0).choose({"model": 16, "ngram": 0})
    assert useless.drafter == "model" and useless.handover is None, useless
    # n-grams chosen: nothing to hand over to
    assert chooser(15).choose({"model": 16, "ngram": 15}).handover is None


def test_the_pick_loop_stops_where_until_holds_for_the_drafts_so_far():
    rows = iter(np.eye(8)[[3, 4, 5, 6, 7, 1]] * 10)
    fed = []
    samp = Sampling(GenerationSettings(), True)
    drafts, _ = pick_loop(lambda d: pick(samp.draft_row(next(rows), d), 0.0, samp, 8, lambda: 0.0),
                          lambda tok, i: fed.append(tok), 6, until=lambda d: d[-1] == 5)
    assert drafts == [3, 4, 5] and fed == [3, 4]  # stopped after the draft it held for, without feeding it


@pytest.mark.slow
def test_a_draft_models_step_hands_over_to_the_copy_on_the_demo_pair():
    """Copy-editing on the demo pair under --drafter auto (a simulated clock: the choices do not depend on the
    machine): the model's drafts stop where the copy resumes, the n-gram copies from there, and the output is the
    target's."""
    from specq.native.commands.demo import demo_pair

    def cost(name: str, n: int, pos0: int = 0) -> float:  # as measured on a 2-core Xeon
        return (6.0 + 3.0 * n if name == "draft" else 25.0 if n == 1 else 29.0 + 1.8 * n) / 1e3

    code = ("def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n\n"
            "def spread(xs):\n    lo = min(xs)\n    hi = max(xs)\n    return hi - lo\n")
    target, draft = demo_pair()
    prompt = f"Rename the variable `total` to `acc` and print the whole code back:\n\n{code}\nThe code:\n"
    with Engine(target, None, ctx=1024, threads=2) as e:
        toks = e.tokenize(prompt)
        base = e.session().generate(toks, GenerationSettings(n_predict=96), speculative=False).run()
    with Engine(target, draft, ctx=1024, threads=2, clock=SimulatedClock(cost)) as e:
        g = e.session().generate(toks, GenerationSettings(n_predict=96, drafter="auto")).run()
    by, acc = dict(g.stats.n_drafted_by), dict(g.stats.n_accepted_by)
    assert g.tokens == base.tokens and len(set(base.tokens)) > 20
    assert g.stats.n_handovers > 0 and acc.get("model", 0) > 0 and acc.get("ngram", 0) > 0, (g.stats.n_handovers, by)
