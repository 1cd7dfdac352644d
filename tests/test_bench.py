"""Tests for the statistics bench.py's learning claims rest on, on examples whose answer is known.

Run: python -m pytest -q tests/test_bench.py
"""
import pytest

import bench


def test_paired_difference_on_a_known_example():
    """100 tasks, 30 solved before; after, 10 more solved and none lost: +10 points, McNemar's exact
    p = 2 * 0.5^10, and a 95% interval that excludes 0 and holds 0.10 (its sd is about 3 points)."""
    before = [1] * 30 + [0] * 70
    after = [1] * 40 + [0] * 60
    mean, (low, high), p = bench.paired_difference(before, after)
    assert mean == pytest.approx(0.10) and p == pytest.approx(2 / 1024)
    assert 0.02 < low < 0.10 < high < 0.18


def test_paired_difference_sees_no_gain_when_gains_and_losses_cancel():
    """Ten tasks gained and ten lost: the mean is 0, the interval straddles it, McNemar's p is 1.
    The same accuracies unpaired would say nothing either, but pairing is what makes it exact."""
    before = [1] * 10 + [0] * 10 + [1] * 20 + [0] * 60
    after = [0] * 10 + [1] * 10 + [1] * 20 + [0] * 60
    mean, (low, high), p = bench.paired_difference(before, after)
    assert mean == 0 and low < 0 < high and p == pytest.approx(1.0)


def test_paired_difference_needs_the_same_tasks():
    with pytest.raises(AssertionError, match="paired"):
        bench.paired_difference([1, 0], [1])


@pytest.mark.parametrize("n, c, k, expected", [
    (8, 0, 8, 0.0), (8, 8, 1, 1.0), (8, 1, 1, 1 / 8), (8, 1, 8, 1.0),
    (4, 2, 2, 1 - 1 / 6),          # C(2, 2) / C(4, 2): both draws among the 2 wrong ones
])
def test_pass_at_k(n, c, k, expected):
    assert bench.pass_at_k(n, c, k) == pytest.approx(expected)


def test_chosen_variants_keep_the_order_asked_and_refuse_unknown_names():
    from types import SimpleNamespace
    variants = {"a": 1, "b": 2, "c": 3}
    assert bench.chosen_variants(SimpleNamespace(variants=None), variants) == ["a", "b", "c"]
    assert bench.chosen_variants(SimpleNamespace(variants="c,a"), variants) == ["c", "a"]
    with pytest.raises(SystemExit, match="unknown"):
        bench.chosen_variants(SimpleNamespace(variants="a,z"), variants)
