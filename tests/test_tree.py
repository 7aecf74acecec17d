"""blocks/tree.py: weighted sums and interpolations of weight dicts, checked against numbers
worked out by hand (all exact in binary floating point unless a test says otherwise)."""

import pytest
import torch

from pflkit.primitives.tree import convex_combination, interpolate, weighted_sum


def tree(w, n):
    """A weight dict with one float32 entry and one int64 counter (BatchNorm's kind)."""
    return {"w": torch.tensor(w, dtype=torch.float32), "n": torch.tensor(n, dtype=torch.int64)}


A, B, C = tree([1.0, 2.0], 3), tree([3.0, -2.0], 7), tree([0.5, 4.0], 9)


def test_weighted_sum_by_hand():
    out = weighted_sum([A, B, C], [0.5, 0.25, 0.25], like=A)
    # w: 0.5 * 1 + 0.25 * 3 + 0.25 * 0.5 = 1.375;  0.5 * 2 + 0.25 * -2 + 0.25 * 4 = 1.5
    assert out["w"].tolist() == [1.375, 1.5]
    assert out["w"].dtype == torch.float32
    assert list(out) == ["w", "n"]


def test_weighted_sum_integer_entries_are_a_clone_of_like():
    out = weighted_sum([A, B, C], [0.5, 0.25, 0.25], like=B)
    assert int(out["n"]) == 7 and out["n"].dtype == torch.int64  # B's counter, not a sum
    assert out["n"] is not B["n"]
    out["n"] += 1
    assert int(B["n"]) == 7


def test_weighted_sum_keys_pick_and_order_the_entries():
    out = weighted_sum([A, B], [2.0, -1.0], like=A, keys=["n", "w"])
    assert list(out) == ["n", "w"]
    assert out["w"].tolist() == [-1.0, 6.0]  # 2 * 1 - 3, 2 * 2 + 2
    assert list(weighted_sum([A, B], [2.0, -1.0], like=A, keys=["w"])) == ["w"]


def test_weighted_sum_adds_zero_weights_and_checks_lengths():
    bad = {"w": torch.tensor([float("inf"), 1.0]), "n": torch.tensor(0)}
    out = weighted_sum([A, bad], [1.0, 0.0], like=A)
    assert torch.isnan(out["w"][0]) and out["w"][1] == 2.0  # 0 * inf is added: NaN
    with pytest.raises(ValueError):
        weighted_sum([A, B], [1.0], like=A)


def test_weighted_sum_accumulates_in_dtype():
    big, one, minus = tree([1e8], 0), tree([1.0], 0), tree([-1e8], 0)
    trees, ones = [big, one, minus], [1.0, 1.0, 1.0]
    # float32: 1e8 + 1 rounds back to 1e8 (spacing 8), so the sum is 0
    assert weighted_sum(trees, ones, like=big)["w"].tolist() == [0.0]
    out = weighted_sum(trees, ones, like=big, dtype=torch.float64)
    assert out["w"].tolist() == [1.0] and out["w"].dtype == torch.float32  # exact, cast back
    assert int(out["n"]) == 0 and out["n"].dtype == torch.int64


def test_interpolate_by_hand():
    out = interpolate(A, B, 0.25)
    # 1 + 0.25 (3 - 1) = 1.5;  2 + 0.25 (-2 - 2) = 1
    assert out["w"].tolist() == [1.5, 1.0]
    assert int(out["n"]) == 7 and out["n"] is not B["n"]  # b's counter, cloned
    assert interpolate(A, B, 0.0)["w"].tolist() == [1.0, 2.0]


def test_convex_combination_by_hand():
    out = convex_combination(A, B, 0.25)
    # 0.75 * 1 + 0.25 * 3 = 1.5;  0.75 * 2 + 0.25 * -2 = 1
    assert out["w"].tolist() == [1.5, 1.0]
    assert int(out["n"]) == 7 and out["n"] is not B["n"]


def test_the_two_interpolations_round_differently():
    a, b = tree([1e8], 0), tree([1.0], 0)
    # float32: b - a = 1 - 1e8 rounds to -1e8, so a + 1 (b - a) = 0; (1 - 1) a + 1 b = 1
    assert interpolate(a, b, 1.0)["w"].tolist() == [0.0]
    assert convex_combination(a, b, 1.0)["w"].tolist() == [1.0]


def test_keys_follow_b():
    b = {"n": B["n"], "w": B["w"]}
    assert list(interpolate(A, b, 0.5)) == ["n", "w"]
    assert list(convex_combination(A, b, 0.5)) == ["n", "w"]
