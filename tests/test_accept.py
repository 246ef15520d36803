"""Pure unit tests of the acceptance logic on arrays."""

import numpy as np
import pytest

from specq.native.control.expected import expected_tokens_per_pass, ideal_speedup
from specq.native.core.accept import accepted_per_position, greedy_emit, n_accepted_greedy, top_probability


def one_hot_logits(choices, n_vocab=10):
    logits = np.zeros((len(choices), n_vocab), np.float32)
    logits[np.arange(len(choices)), choices] = 5.0
    return logits


@pytest.mark.parametrize("target,draft,expected", [
    ([3, 4, 5, 6], [3, 4, 5], 3),   # all accepted, bonus token follows
    ([3, 9, 5, 6], [3, 4, 5], 1),   # stops at the first mismatch even if later ones agree
    ([1, 4, 5, 6], [3, 4, 5], 0),
    ([7], [], 0),
])
def test_n_accepted_greedy(target, draft, expected):
    assert n_accepted_greedy(np.array(target), draft) == expected


def test_n_accepted_needs_one_more_choice_than_draft():
    with pytest.raises(ValueError):
        n_accepted_greedy(np.array([1, 2]), [1, 2])


def test_greedy_emit_keeps_prefix_and_adds_target_token():
    assert greedy_emit(one_hot_logits([3, 9, 5, 6]), [3, 4, 5]) == [3, 9]
    assert greedy_emit(one_hot_logits([3, 4, 5, 6]), [3, 4, 5]) == [3, 4, 5, 6]
    assert greedy_emit(one_hot_logits([2]), []) == [2]


def test_greedy_emit_tie_takes_lowest_id_like_llama_cpp():
    logits = np.zeros((1, 5), np.float32)
    logits[0, [1, 3]] = 2.0
    assert greedy_emit(logits, []) == [1]


def test_top_probability_matches_softmax():
    row = np.array([1.0, 2.0, 0.5, -1.0], np.float32)
    p = np.exp(row) / np.exp(row).sum()
    assert top_probability(row) == pytest.approx(p.max(), rel=1e-6)


def test_accepted_per_position_counts_steps_reaching_each_position():
    # steps accepted 0, 2, 3, 3, 1 draft tokens (draft_max 4)
    assert accepted_per_position([0, 2, 3, 3, 1], 4) == [4, 3, 2, 0]
    assert accepted_per_position([], 3) == [0, 0, 0]


def test_ideal_speedup_formula_and_the_rejected_claim():
    # BRIEF: at alpha 0.76, k 6 at most 3.6 tokens per pass, so "11.4x" is impossible.
    assert expected_tokens_per_pass(0.76, 6) == pytest.approx(3.6, abs=0.05)
    assert ideal_speedup(0.76, 6, 0.0) < 11.4
    assert expected_tokens_per_pass(1.0, 4) == 5
    assert ideal_speedup(0.0, 4, 0.1) == pytest.approx(1 / 1.4)
