"""control/expected.py: E(k), written once, and what is built on it."""

import pytest

from specq.native.control.expected import (best_draft_length, expected_tokens, expected_tokens_each,
                                           expected_tokens_per_pass, ideal_speedup)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.76, 0.99, 1.0])
@pytest.mark.parametrize("k", [0, 1, 4, 16])
def test_the_closed_form_is_the_product_sum_with_one_alpha(alpha, k):
    assert expected_tokens([alpha] * k) == pytest.approx(expected_tokens_per_pass(alpha, k))


def test_expected_tokens_by_position():
    alphas = [0.9, 0.5, 0.2]
    assert expected_tokens(alphas, 0) == 1.0
    assert expected_tokens(alphas, 2) == pytest.approx(1 + 0.9 + 0.45)
    assert expected_tokens(alphas) == expected_tokens(alphas, 10) == pytest.approx(1 + 0.9 + 0.45 + 0.09)
    assert [p for p, _ in expected_tokens_each(alphas)] == pytest.approx([0.9, 0.45, 0.09])


def test_best_draft_length_maximises_expected_tokens_per_second():
    verify = lambda b: 0.010 + 0.001 * b  # noqa: E731
    alphas = [0.9, 0.8, 0.1, 0.1]
    k, rate = best_draft_length(alphas, 0.002, verify)
    rates = [expected_tokens(alphas, j) / ((0.002 * j) + verify(j + 1)) for j in range(1, 5)]
    assert rate == pytest.approx(max(rates)) and k == 1 + rates.index(max(rates))
    assert best_draft_length([0.0] * 4, 0.002, verify)[0] == 0  # nothing accepted: plain decoding


def test_ideal_speedup_is_expected_tokens_over_the_step_cost():
    assert ideal_speedup(0.8, 4, 0.1) == pytest.approx((1 - 0.8 ** 5) / (0.2 * 1.4))
