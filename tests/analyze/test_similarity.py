"""Head similarity for merging (mgk.analyze.similarity): the pairwise JS matrix agrees with the mean the analysis
reports, and greedy matching groups the most alike heads."""
from __future__ import annotations

import pytest
import torch

from mgk.analyze import stats
from mgk.analyze.similarity import greedy_groups


def _maps(H, L, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(H, L, L, generator=g, dtype=torch.float64), dim=-1)


def test_js_matrix_is_symmetric_zero_on_the_diagonal_and_means_to_pairwise_js():
    maps = _maps(5, 6)
    m = stats.js_matrix(maps)
    assert torch.equal(m, m.T) and torch.all(m.diagonal() == 0)
    i, j = torch.triu_indices(5, 5, offset=1)
    assert float(m[i, j].mean()) == pytest.approx(stats.pairwise_js(maps), rel=1e-12)
    assert float(m[1, 3]) == pytest.approx(float(stats.js_divergence(maps[1], maps[3]).mean()), rel=1e-12)


def test_greedy_groups_pair_copies_of_the_same_head():
    base = _maps(4, 8)
    maps = base[[2, 0, 3, 0, 2, 1, 3, 1]]  # heads (0, 4), (1, 3), (2, 6), (5, 7) attend identically
    maps = maps + 1e-3 * _maps(8, 8, seed=1)
    maps = maps / maps.sum(-1, keepdim=True)
    assert sorted(greedy_groups(stats.js_matrix(maps), 2)) == [[0, 4], [1, 3], [2, 6], [5, 7]]


def test_greedy_groups_of_four_and_of_one():
    d = torch.ones(8, 8, dtype=torch.float64)
    for a in (0, 2, 5, 7):
        for b in (0, 2, 5, 7):
            d[a, b] = 0.1
    d.fill_diagonal_(0)
    assert sorted(greedy_groups(d, 4)) == [[0, 2, 5, 7], [1, 3, 4, 6]]
    assert greedy_groups(d, 1) == [[h] for h in range(8)]
    with pytest.raises(ValueError, match="groups of 3 do not split 8 heads"):
        greedy_groups(d, 3)
