"""Changing the heads of a multi-head layer before conversion (mgk.attention.regroup): pruning keeps exactly the
kept heads' outputs; merging pairs of heads into MGK components computes the mixture of the paper's eq. 9-10 with
the group's keys as components, checked against a float64 reference written from the formula."""
from __future__ import annotations

import math

import pytest
import torch

from mgk.attention import build_attention
from mgk.attention.regroup import merge_heads, select_heads

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


def _mgk_reference(x, w, groups, sigma2):
    """MGK output from the formula (float64): per merged head, q = mean of the group's queries, components k_r =
    the keys of head g[r], pi_r = 1/M, A_ij proportional to sum_r pi_r exp(-|q_i - k_rj|^2 / (2 sigma2)), values the
    mean of the group's, output projection the sum of the group's columns."""
    def head(t, h):
        return t[h * D:(h + 1) * D]

    def proj(name, h):
        return x @ head(w[f"{name}.weight"], h).T + head(w[f"{name}.bias"], h)

    out = w["out_proj.bias"].expand(x.shape[0], E).clone()
    for g in groups:
        q = sum(proj("q_proj", h) for h in g) / len(g)
        v = sum(proj("v_proj", h) for h in g) / len(g)
        score = sum((1 / len(g)) * torch.exp(-((q[:, None, :] - proj("k_proj", h)[None]) ** 2).sum(-1)
                                            / (2 * sigma2)) for h in g)
        a = score / score.sum(-1, keepdim=True)
        wo = sum(w["out_proj.weight"][:, h * D:(h + 1) * D] for h in g)
        out = out + (a @ v) @ wo.T
    return out


@pytest.mark.parametrize("groups", [[[0, 1], [2, 3]], [[0, 2], [3, 1]], [[1, 2], [0, 3]]])
def test_merged_heads_compute_the_mixture_of_the_groups_keys(groups):
    old = _softmax_layer(1)
    w = {k: v.double() for k, v in old.per_head_projections().items()}
    new = build_attention("mgk", E, 2, head_dim=D, batch_first=True, num_keys=2).double().eval()
    _load(new, merge_heads(w, groups, D))
    x = torch.randn(7, E, dtype=torch.float64)
    got, _ = new(x[None], x[None], x[None], need_weights=False)
    want = _mgk_reference(x, w, groups, sigma2=math.sqrt(D))
    torch.testing.assert_close(got[0], want, atol=1e-10, rtol=1e-10)


def test_merged_key_projection_is_component_major():
    w = _softmax_layer().per_head_projections()
    merged = merge_heads(w, [[3, 1], [0, 2]], D)
    k = w["k_proj.weight"].reshape(H, D, E)
    want = torch.cat([k[3], k[0], k[1], k[2]])  # component 1 of heads 0, 1, then component 2 of heads 0, 1
    assert torch.equal(merged["k_proj.weight"], want)
    assert merged["q_proj.weight"].shape == (2 * D, E) and merged["out_proj.weight"].shape == (E, 2 * D)
    assert torch.equal(merged["out_proj.bias"], w["out_proj.bias"])


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
