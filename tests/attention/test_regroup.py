"""Changing the heads of a multi-head layer before conversion (mgk.convert.regroup): pruning keeps exactly the
kept heads' outputs; merging pairs of heads into MGK components keeps each head's logits in its component and the
group's value-output product, exactly where the group's queries and values allow it (float64)."""
from __future__ import annotations

import pytest
import torch

from mgk.attention import build_attention
from mgk.convert.regroup import merge_heads, select_heads

E, H, D = 12, 4, 3


def _softmax_layer(seed=0):
    torch.manual_seed(seed)
    return build_attention("softmax", E, H, head_dim=D, batch_first=True).double().eval()


def _load(module, weights):
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, value in module.load_projections(weights).items():
            params[name].copy_(value)
    return module


@pytest.mark.parametrize("keep", [[0, 1, 2, 3], [2], [3, 0], [1, 3]])
def test_select_heads_is_the_layer_with_the_other_heads_switched_off(keep):
    old = _softmax_layer()
    new = _load(build_attention("softmax", E, len(keep), head_dim=D, batch_first=True).double().eval(),
                select_heads(old.per_head_projections(), keep, D))
    x = torch.randn(2, 5, E, dtype=torch.float64)
    old.head_gate = torch.tensor([1.0 if h in keep else 0.0 for h in range(H)], dtype=torch.float64)
    want, _ = old(x, x, x, need_weights=False, is_causal=True)
    got, _ = new(x, x, x, need_weights=False, is_causal=True)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def _shared_within_groups(groups, seed=1):
    """A float64 softmax layer's projections where the heads of each group share their query and value projections
    (and biases): the case in which merging them loses nothing but the attention's own differences."""
    w = {k: v.double().clone() for k, v in _softmax_layer(seed).per_head_projections().items()}
    for g in groups:
        for h in g[1:]:
            for name in ("q_proj.weight", "q_proj.bias", "v_proj.weight", "v_proj.bias"):
                w[name][h * D:(h + 1) * D] = w[name][g[0] * D:(g[0] + 1) * D]
    return w


def _rows(t, index):
    return t[index * D:(index + 1) * D]


@pytest.mark.parametrize("groups", [[[0, 1], [2, 3]], [[0, 2], [3, 1]], [[1, 2], [0, 3]]])
def test_merged_components_score_as_their_heads_and_outputs_keep_the_group_product(groups):
    """Component r of merged head i (row block r * heads + i: component-major) gives head groups[i][r]'s logits,
    biases included; the merged value-output product is the group's sum."""
    w = _shared_within_groups(groups)
    merged = merge_heads(w, groups, D)
    x, y = torch.randn(5, E, dtype=torch.float64), torch.randn(6, E, dtype=torch.float64)

    def proj(t, name, index, inputs):
        return inputs @ _rows(t[f"{name}.weight"], index).T + _rows(t[f"{name}.bias"], index)

    for i, g in enumerate(groups):
        for r, h in enumerate(g):
            want = proj(w, "q_proj", h, x) @ proj(w, "k_proj", h, y).T
            got = proj(merged, "q_proj", i, x) @ proj(merged, "k_proj", r * len(groups) + i, y).T
            torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9)
        ov = sum(w["out_proj.weight"][:, h * D:(h + 1) * D] @ proj(w, "v_proj", h, y).T for h in g)
        got = merged["out_proj.weight"][:, i * D:(i + 1) * D] @ proj(merged, "v_proj", i, y).T
        torch.testing.assert_close(got, ov, atol=1e-9, rtol=1e-9)
    assert torch.equal(merged["out_proj.bias"], w["out_proj.bias"])


def test_merged_keys_are_shorter_than_the_queries_by_the_shrink_factor_squared():
    """The key-norm term of MGK, which softmax lacks, is made small without changing a logit."""
    from mgk.convert.regroup import MERGE_KEY_SHRINK

    merged = merge_heads(_shared_within_groups([[0, 1], [2, 3]]), [[0, 1], [2, 3]], D)
    q, k = merged["q_proj.weight"].norm(), merged["k_proj.weight"].norm() / 2 ** 0.5
    assert float(q / k) > 0.5 * MERGE_KEY_SHRINK ** 2


@pytest.mark.parametrize("call, match", [
    (lambda w: merge_heads(w, [[0, 1], [2]], D), "one size"),
    (lambda w: merge_heads(w, [[0, 1], [1, 2]], D), "named twice"),
    (lambda w: merge_heads(w, [[0, 4], [1, 2]], D), "head 4 is not one of the layer's 4 heads"),
    (lambda w: merge_heads(w, [], D), "non-empty"),
    (lambda w: select_heads(w, [], D), "at least one head"),
    (lambda w: select_heads(w, [-1], D), "head -1"),
    (lambda w: select_heads(w, [0], 5), "head_dim=5 does not divide"),
    (lambda w: select_heads({"q_proj.weight": w["q_proj.weight"]}, [0], D), "lack k_proj.weight"),
])
def test_bad_groups_and_heads_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call(_softmax_layer().per_head_projections())


def test_shifted_keys_refuse_merged_components():
    w = merge_heads(_softmax_layer().per_head_projections(), [[0, 1], [2, 3]], D)
    smgk = build_attention("smgk", E, 2, head_dim=D, batch_first=True, num_keys=2)
    with pytest.raises(ValueError, match="cannot take 2 key components"):
        smgk.load_projections(w)
