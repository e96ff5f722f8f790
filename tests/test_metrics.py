"""Mismatch metrics: values worked out by hand, and their invariants."""

import math

import pytest

from mxfp8_learner_grid.common.metrics import NAMES, mismatch_metrics


def test_identical_logprobs_give_zero_mismatch():
    m = mismatch_metrics([[-1.0, -2.0], [-0.5]], [[-1.0, -2.0], [-0.5]])
    assert set(m) == set(NAMES)
    assert m["kl_k1"] == m["kl_k3"] == m["chi2_token"] == m["chi2_seq"] == m["abs_diff"] == m["prob_diff"] == 0
    assert m["token_mult_prob_err"] == 1.0 and m["ppl_ratio"] == 1.0 and m["tokens"] == 3


def test_hand_values():
    # one sequence, two tokens: d = rollout - train = [0.1, -0.3]
    m = mismatch_metrics([[-1.0, -2.3]], [[-1.1, -2.0]])
    d = [0.1, -0.3]
    assert m["kl_k1"] == pytest.approx(sum(d) / 2)
    assert m["kl_k3"] == pytest.approx(sum(math.exp(-x) + x - 1 for x in d) / 2)
    assert m["chi2_token"] == pytest.approx(sum(math.exp(-2 * x) for x in d) / 2 - 1)
    assert m["chi2_seq"] == pytest.approx(math.exp(-2 * sum(d)) - 1)
    assert m["abs_diff"] == pytest.approx(0.2)
    assert m["token_mult_prob_err"] == pytest.approx((math.exp(0.1) + math.exp(0.3)) / 2)
    assert m["prob_diff"] == pytest.approx((abs(math.exp(-1.1) - math.exp(-1.0)) + abs(math.exp(-2.0) - math.exp(-2.3))) / 2)
    assert m["log_ppl_diff"] == pytest.approx(-0.1) and m["ppl_ratio"] == pytest.approx(math.exp(0.1))
    assert m["frac_gt_ln2"] == 0


def test_k3_is_nonnegative_and_errors():
    m = mismatch_metrics([[-3.0, -0.1, -7.0]], [[-0.2, -4.0, -1.0]])
    assert m["kl_k3"] > 0 and m["frac_gt_ln2"] == 1.0
    with pytest.raises(ValueError, match="sequence 0"):
        mismatch_metrics([[-1.0]], [[-1.0, -2.0]])
    with pytest.raises(ValueError, match="no tokens"):
        mismatch_metrics([[]], [[]])
