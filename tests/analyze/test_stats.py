"""Statistics of `mgk analyze` on tiny synthetic maps with hand-computed answers."""
import math

import pytest
import torch

from mgk.analyze import stats


def random_maps(H, L, S, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(H, L, S, generator=g, dtype=torch.float64) * 2, dim=-1)


def test_copies_of_one_head_are_fully_redundant():
    maps = random_maps(1, 7, 7).expand(4, 7, 7).clone()
    assert stats.pairwise_js(maps) == 0.0
    assert stats.pairwise_l2(maps) == 0.0
    assert stats.effective_heads(maps) == pytest.approx(1.0, abs=1e-9)


def test_distinct_heads_are_not_redundant():
    maps = random_maps(4, 7, 7)
    assert stats.pairwise_js(maps) > 0.01 and stats.pairwise_l2(maps) > 0.01
    assert 1.5 < stats.effective_heads(maps) <= 4.0


def test_effective_heads_counts_groups_of_copies():
    eye = torch.eye(5, dtype=torch.float64)
    shift = torch.roll(eye, 1, dims=1)  # disjoint support from eye: orthogonal maps
    assert stats.effective_heads(torch.stack([eye, shift])) == pytest.approx(2.0, abs=1e-9)
    assert stats.effective_heads(torch.stack([eye, eye, shift, shift])) == pytest.approx(2.0, abs=1e-9)
    three = torch.stack([eye, shift, torch.roll(eye, 2, dims=1)])
    assert stats.effective_heads(three) == pytest.approx(3.0, abs=1e-9)
    assert stats.effective_heads(eye[None]) == pytest.approx(1.0)


def test_js_divergence_hand_computed():
    p = torch.tensor([1.0, 0.0])
    assert float(stats.js_divergence(p, torch.tensor([0.0, 1.0]))) == pytest.approx(1.0)  # disjoint: 1 bit
    # m = (0.75, 0.25): KL(p|m) = log2(4/3); KL(q|m) = 0.5 log2(2/3) + 0.5 log2(2)
    expected = (math.log2(4 / 3) + 0.5 * math.log2(2 / 3) + 0.5) / 2
    assert float(stats.js_divergence(p, torch.tensor([0.5, 0.5]))) == pytest.approx(expected, abs=1e-12)
    assert float(stats.js_divergence(p, p)) == 0.0


def test_pairwise_means_hand_computed():
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    b = torch.tensor([[0.0, 1.0], [0.0, 1.0]], dtype=torch.float64)
    # row 0 disjoint (JS 1, distance sqrt 2), row 1 equal (0): means 0.5 and sqrt(2 / 2) = 1
    assert stats.pairwise_js(torch.stack([a, b])) == pytest.approx(0.5)
    assert stats.pairwise_l2(torch.stack([a, b])) == pytest.approx(1.0)
    # three heads a, a, b: pairs (a,a) 0, (a,b) twice
    assert stats.pairwise_js(torch.stack([a, a, b])) == pytest.approx(1 / 3)
    assert math.isnan(stats.pairwise_js(a[None])) and math.isnan(stats.pairwise_l2(a[None]))


def test_rank_of_a_rank_one_head_and_of_identity_like_maps():
    g = torch.Generator().manual_seed(1)
    row = torch.softmax(torch.randn(9, generator=g, dtype=torch.float64), 0)
    rank_one = row.expand(9, 9)  # every query attends the same way
    for mode in stats.RANK_MODES:
        assert int(stats.numerical_rank(rank_one, mode=mode)) == 1
        assert int(stats.numerical_rank(torch.eye(9), mode=mode)) == 9
        peaked = torch.softmax(torch.eye(9, dtype=torch.float64) * 8, dim=-1)  # identity-like, every row dense
        assert int(stats.numerical_rank(peaked, mode=mode)) == 9
    ranks = stats.numerical_rank(torch.stack([rank_one, torch.eye(9, dtype=torch.float64)]))
    assert ranks.tolist() == [1, 9]


def test_rank_threshold_absolute_and_relative():
    d = torch.diag(torch.tensor([1.0, 1e-4, 1e-8], dtype=torch.float64))
    assert int(stats.numerical_rank(d)) == 2  # 1e-8 dropped at the default 1e-6
    assert int(stats.numerical_rank(d, tol=1e-3)) == 1
    small = d * 1e-3  # singular values 1e-3, 1e-7, 1e-11
    assert int(stats.numerical_rank(small, mode="absolute")) == 1
    assert int(stats.numerical_rank(small, mode="relative")) == 2  # relative to 1e-3: 1e-7 > 1e-9 kept
    with pytest.raises(ValueError, match="rank mode"):
        stats.numerical_rank(d, mode="loose")
    with pytest.raises(ValueError, match="tolerance"):
        stats.numerical_rank(d, tol=-1)


def test_summary():
    s = stats.summary([1, 2, 3, float("nan")])
    assert s == {"n": 3, "mean": 2.0, "std": 1.0, "min": 1.0, "median": 2.0, "max": 3.0}
    assert stats.summary([]) == {"n": 0}
    assert stats.summary([4])["std"] == 0.0
