"""--drafter auto beside a useless draft model, on a simulated clock: trying the model in place of long n-gram
copies is paid from the exploration budget, priced against the n-gram tokens it displaces."""

from __future__ import annotations

import numpy as np
import pytest

from specq.native.control.chooser import DrafterChooser
from specq.native.control.length import NEW_ANSWER_KEEP, LengthController
from specq.native.control.step import StepOutcome

# As measured on a 2-core Xeon (copy-edit prompts, the demo F32 target, the demo draft cut to its first 10 blocks):
# plain decoding 25 ms a token, verifies of 29 ms + 1.8 ms a row; the draft's first token 3 ms, its catch-up
# 0.25 ms a token; an n-gram lookup 0.1 ms.
PLAIN, FIRST, CATCH, LOOKUP = 0.025, 0.003, 0.00025, 0.0001
MATCH, ALPHA_NGRAM = 0.55, 0.9  # the share of positions with a match to copy from; its acceptance there
# The demo pair's own Q4_1 draft, as measured there: 9 ms a drafted token, 3 ms a token of catch-up (a prefill of
# the draft), 94% of its drafts accepted.
GOOD = {"alpha": 0.94, "first": 0.009, "per": 0.009, "catch": 0.003}


def verify(b: int) -> float:
    return PLAIN if b == 1 else 0.029 + 0.0018 * b


def match_run(match: np.ndarray, at: int, most: int = 16) -> int:
    """How many tokens the n-gram would propose at position `at`: the matched positions from there."""
    run = match[at:at + most]
    return int(run.argmin()) if not run.all() else len(run)


def answers(auto: bool, seed: int, n_answers: int = 3, n_tokens: int = 150, good: bool = False,
            match: np.ndarray | None = None, handover: bool = True) -> tuple[list[float], list[int], object]:
    """Answers of n_tokens over the same text (where a match is and which copied tokens are right is fixed by the
    text position, whoever drafts): auto choosing between the model and n-grams, or n-grams alone (their own
    length controller, plain where nothing matches). The model agrees on nothing (prompt agreement 0 of 32,
    acceptance 0) or, `good`, is the demo pair's draft (GOOD). `match`: where the text has a match (default: each
    position with probability MATCH). `handover`: the model's drafts stop where the chooser's handover says (as
    Session.until stops them), else run on to k. Returns each answer's time, each answer's model-drafted steps,
    and the controller."""
    rng = np.random.default_rng(seed)
    has_match, right = rng.random(n_answers * 1000) < MATCH, rng.random(n_answers * 1000) < ALPHA_NGRAM
    has_match = has_match if match is None else match
    model_right = rng.random(n_answers * 1000) < (GOOD["alpha"] if good else 0.0)
    first, per, catch = (GOOD["first"], GOOD["per"], GOOD["catch"]) if good else (FIRST, FIRST, CATCH)
    c = (DrafterChooser(16, {"model": 0.2, "ngram": 0.01}, model="model", memoryless={"ngram"}) if auto
         else LengthController(16, cost_ratio_prior=0.01))
    times, model_steps = [], []
    for ans in range(n_answers):
        c.new_answer()
        if auto:  # the prefill's calibration and the draft's prompt agreement, as Generation gives them
            c.calibrate(200, PLAIN, first)
            c.per["model"].draft.calibrate_catchup(200, 150, 150 * catch)  # the draft model's read of the prompt
            if c.wants_agreement():
                c.seed_acceptance(32 * GOOD["alpha"] if good else 0, 32)
        behind, tokens, t, n_model = 1, 0, 0.0, 0
        while tokens < n_tokens:
            at = ans * 1000 + tokens
            c.at(200 + tokens, n_tokens - tokens)
            lim = min(16, n_tokens - tokens - 1)
            if auto:
                choice = c.choose({"model": lim, "ngram": lim if has_match[at] else 0})
                name, k, to = choice.drafter, choice.k, choice.handover
                if name == "model" and to is not None and handover:
                    k = next((j for j in range(1, k) if match_run(has_match, at + j) >= to.least), k)
            else:
                k = c.choose(lim)
                name, k = ("ngram", k) if has_match[at] else (None, 0)
            if name is None or k == 0:
                c.observe(StepOutcome(0, 0, None, PLAIN, 0.0))
                tokens, t, behind = tokens + 1, t + PLAIN, behind + 1
                continue
            a = 0
            while a < k and (right if name == "ngram" else model_right)[at + a]:
                a += 1
            if name == "model":
                n_model += 1
                draft_s = first + (k - 1) * per + max(behind - 1, 0) * catch
                out = StepOutcome(k, a, per if k > 1 else None, verify(k + 1), 0.0, draft_s=draft_s,
                                  first_token_s=first if behind <= 2 else None,
                                  catchup=(behind, first + (behind - 1) * catch) if behind > 2 else None,
                                  drafter=name)
                behind = 1
            else:
                draft_s = LOOKUP
                out = StepOutcome(k, a, None, verify(k + 1), 0.0, draft_s=draft_s, drafter=name)
                behind += a + 1
            c.observe(out)
            tokens, t = tokens + a + 1, t + draft_s + verify(k + 1)
        times.append(t)
        model_steps.append(n_model)
    return times, model_steps, c


def test_auto_beside_a_useless_draft_keeps_within_5_percent_of_ngrams_alone():
    """Before, a drafter on thin evidence was tried in the best one's place every other step whatever it cost:
    the useless model displaced nine long n-gram steps in the first answer (auto 0.85-0.92x n-grams alone over
    three answers). Priced against the n-gram tokens it displaces and paid from the exploration budget (a share of
    the run's own pace), it is tried a few times (the model's estimate can still come back) and auto keeps up with
    n-grams alone: the median of five texts at least 0.95x, none below 0.93x."""
    ratios, first_answer, refused = [], [], []
    for seed in range(5):
        auto_s, model_steps, c = answers(True, seed)
        alone_s, _, _ = answers(False, seed)
        ratios.append(sum(alone_s) / sum(auto_s))
        first_answer.append(model_steps[0])
        refused.append(c.shared.budget.n_refused)
    assert sorted(ratios)[2] >= 0.95 and min(ratios) >= 0.93, ratios
    assert max(first_answer) <= 4, first_answer
    assert min(refused) > 0  # the mechanism ran: the budget held tries back


def test_an_exploration_that_gains_pays_back_into_the_budget():
    """A drafter explored in the best one's place books its measured loss against the displaced pace: a try that
    emitted more than the best drafter would have in its time books a gain."""
    c = DrafterChooser(8, {"model": 0.2, "ngram": 0.01}, model="model", memoryless={"ngram"})
    c.exploring = ("model", 0.010)  # the displaced drafter's tokens cost 10 ms each
    c.observe(StepOutcome(4, 4, 0.001, 0.030, 0.0, draft_s=0.004, first_token_s=0.001, drafter="model"))
    assert c.shared.budget.spent_s == pytest.approx(0.034 - 5 * 0.010)
    assert c.exploring is None and c.behind == {"model": 0, "ngram": 5}


def copy_text(n_answers: int = 3, seed: int = 0) -> np.ndarray:
    """Where an edited file's text has an n-gram match: each answer opens with a few tokens of its own, then copies
    stretches of 20-60 tokens with a 2-6-token edit between them."""
    rng = np.random.default_rng(seed + 7)
    out = np.zeros(n_answers * 1000, dtype=bool)
    for ans in range(n_answers):
        at = ans * 1000 + 4
        while at < ans * 1000 + 1000:
            n = int(rng.integers(20, 61))
            out[at:at + n] = True
            at += n + int(rng.integers(2, 7))
    return out


def _copy_edit_ratios() -> list[float]:
    """n-grams alone ÷ auto in time, over five copied texts with the good draft, sorted."""
    out = []
    for seed in range(5):
        match = copy_text(seed=seed)
        auto_s, _, _ = answers(True, seed, good=True, match=match)
        alone_s, _, _ = answers(False, seed, good=True, match=match)
        out.append(sum(alone_s) / sum(auto_s))
    return sorted(out)


def test_beside_ngrams_copying_a_good_model_does_not_pay_a_long_catch_up_for_a_few_tokens(monkeypatch):
    """Copy-editing with the demo pair's good draft: n-grams copy the file's stretches, the model could draft at
    each edit, but only after a catch-up on the whole stretch copied since its last draft (a prefill of the draft).
    Priced with that catch-up spread over the tokens its runs last (here a step or two before n-grams take over
    again), it mostly sits out the short edits; spread over the rest of the answer, as if the model would run on,
    it paid the catch-up at nearly every edit and auto lost about a fifth to n-grams alone."""
    _, _, c = answers(True, 0, good=True, match=copy_text(seed=0))
    assert c.run_mean["model"] is not None and c.run_mean["model"] < 20  # the runs were measured: short
    runs = _copy_edit_ratios()
    assert runs[2] >= 0.93 and runs[0] >= 0.88, runs
    monkeypatch.setattr(DrafterChooser, "_end_run", lambda self, name: None)  # no run measured: the rest
    rest = _copy_edit_ratios()
    assert rest[2] < runs[2] - 0.1, (rest, runs)



def next_answer_opening(first: float | None) -> tuple[float, float]:
    """The good draft beside n-grams: three answers of long copies teach the n-gram's acceptance, then a fourth
    whose edits the n-gram missed at once, six times, while the model drafted the rest. At the first step of a
    fifth answer: the n-gram's position-1 estimate and its best expected tokens/s. `first`: position 1's weight
    kept across an answer for the n-gram (None: the chooser's own rule)."""
    c = DrafterChooser(16, {"model": 0.2, "ngram": 0.01}, model="model", memoryless={"ngram"})

    def new_answer() -> None:
        c.new_answer()
        if first is not None:  # the rule replaced: undo the chooser's own weakening, apply `first`
            acc = c.per["ngram"].acceptance
            acc.succ[0] = acc.succ[0] / NEW_ANSWER_KEEP * first
            acc.trials[0] = acc.trials[0] / NEW_ANSWER_KEEP * first
        c.calibrate(200, PLAIN, GOOD["first"])

    def ngram(a: int) -> StepOutcome:
        return StepOutcome(15, a, None, verify(16), 0.0, draft_s=LOOKUP, drafter="ngram")

    for _ in range(3):
        new_answer()
        for _ in range(8):
            c.observe(ngram(15))
    new_answer()
    for _ in range(6):
        c.observe(ngram(0))
        c.observe(StepOutcome(15, 12, GOOD["per"], verify(16), 0.0, draft_s=GOOD["first"] + 14 * GOOD["per"],
                              first_token_s=GOOD["first"], drafter="model"))
    new_answer()
    c.at(200, 150)
    return c.per["ngram"].alphas()[0], c._best("ngram", 15)[1]


def test_an_answers_missed_copies_weigh_little_in_the_next_answer():
    """An n-gram's position-1 acceptance belongs to the prompt it copies from: a new answer weakens it (a quarter
    kept, as positions >= 2 are), so one answer's missed edits weigh little when the next file is copied. Kept
    whole, as a draft model's is (its agreement is the pair's), they priced n-grams at two thirds of their rate
    into the next answer, where the model, whose runs in free text are long, held them off: on the copy-edit
    benchmark auto drifted from 0.94x to 0.76x n-grams alone over five rounds; weakened, it held 0.90-0.94x."""
    weakened_alpha, weakened_rate = next_answer_opening(None)
    kept_alpha, kept_rate = next_answer_opening(1.0)
    assert weakened_alpha > kept_alpha + 0.03 and weakened_rate > 1.3 * kept_rate, (
        weakened_alpha, kept_alpha, weakened_rate, kept_rate)


def edited_copy(n_tokens: int, seed: int) -> np.ndarray:
    """Where an edited copy has an n-gram match: stretches of 15-39 copied tokens, each followed by an edit of 1-3
    tokens of the answer's own (nothing there matches)."""
    rng = np.random.default_rng(seed)
    match = np.ones(n_tokens + 64, dtype=bool)
    at = int(rng.integers(15, 40))
    while at < n_tokens:
        gap = int(rng.integers(1, 4))
        match[at:at + gap] = False
        at += gap + int(rng.integers(15, 40))
    return match


def edited_copy_answers(mode: str, seed: int, n_answers: int = 3, n_tokens: int = 200,
                        catch: float = 0.001) -> tuple[float, int]:
    """Answers that copy a text with edits (edited_copy), the good draft (right at every position, GOOD's costs,
    its catch-up `catch` a token) beside n-grams, whose copy is right up to the next edit. `mode`: "ngram" (alone,
    its own length controller), "auto" (the model's drafts stop where the chooser's handover says) or "auto
    drafting on" (every draft runs to its k). Returns the answers' time and the model's steps cut by a handover."""
    match = edited_copy(n_answers * n_tokens, seed)
    auto = mode != "ngram"
    c = (DrafterChooser(16, {"model": 0.2, "ngram": 0.01}, model="model", memoryless={"ngram"}) if auto
         else LengthController(16, cost_ratio_prior=0.01))
    t, n_cut = 0.0, 0
    for ans in range(n_answers):
        c.new_answer()
        if auto:
            c.calibrate(200, PLAIN, GOOD["first"])
            c.per["model"].draft.calibrate_catchup(200, 150, 150 * catch)
            if c.wants_agreement():
                c.seed_acceptance(32, 32)
        behind, tokens = 1, 0
        while tokens < n_tokens:
            at = ans * n_tokens + tokens
            c.at(200 + tokens, n_tokens - tokens)
            lim = min(16, n_tokens - tokens - 1)
            ng = min(lim, match_run(match, at))
            if auto:
                choice = c.choose({"model": lim, "ngram": ng})
                name, k, to = choice.drafter, choice.k, choice.handover
                if name == "model" and to is not None and mode == "auto":
                    cut = next((j for j in range(1, k) if match_run(match, at + j) >= to.least), k)
                    n_cut, k = n_cut + (cut < k), cut
            else:
                k = min(c.choose(lim), ng)
                name = "ngram" if k else None
            if name is None or k == 0:
                c.observe(StepOutcome(0, 0, None, PLAIN, 0.0))
                tokens, t, behind = tokens + 1, t + PLAIN, behind + 1
                continue
            if name == "model":
                a, draft_s = k, GOOD["first"] + (k - 1) * GOOD["per"] + max(behind - 1, 0) * catch
                out = StepOutcome(k, a, GOOD["per"] if k > 1 else None, verify(k + 1), 0.0, draft_s=draft_s,
                                  first_token_s=GOOD["first"] if behind <= 2 else None,
                                  catchup=(behind, GOOD["first"] + (behind - 1) * catch) if behind > 2 else None,
                                  drafter="model")
                behind = 1
            else:
                a, draft_s = min(k, match_run(match, at)), LOOKUP
                out = StepOutcome(k, a, None, verify(k + 1), 0.0, draft_s=draft_s, drafter="ngram")
                behind += a + 1
            c.observe(out)
            tokens, t = tokens + a + 1, t + draft_s + verify(k + 1)
    return t, n_cut


def test_at_an_edit_the_model_drafts_only_until_the_copy_resumes():
    """Copy-editing with a good draft: at an edit nothing matches and the model is chosen; a token or two later the
    copy resumes, where a lookup drafts a long, right stretch for almost nothing. The model's step stops there
    (DrafterChooser._handover, Session.until); drafting on through the copy at the model's own pace, its steps
    grew to the cap and auto ran at 0.74-0.79x n-grams alone over five texts (0.91-0.93x with the handover)."""
    for seed in range(5):
        alone, _ = edited_copy_answers("ngram", seed)
        handed, n_cut = edited_copy_answers("auto", seed)
        drafting_on, _ = edited_copy_answers("auto drafting on", seed)
        assert n_cut > 0  # the mechanism ran
        assert alone / handed >= 0.88 and drafting_on > 1.12 * handed, (seed, alone / handed, alone / drafting_on)
