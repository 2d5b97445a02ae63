"""Gradients through the functional cached calls. The steps that store their new entries without a graph
(softmax_cache_step, mgk_cache_step) refuse, in one line naming it and before anything is written, an operand whose
gradient they would drop, as the modules refuse ``past_key_values`` with gradients; the query's gradient, which they
keep, is exact. The linear ops' states carry gradients (flash-linear-attention's convention): a prefill, a
continuation and steps give the uncached call's gradients.
"""
from __future__ import annotations

import pytest
import torch

from mgk.functional import (
    KVCacheState,
    linear_attention,
    linear_attention_step,
    mgk_cache_entries,
    mgk_cache_step,
    mlk_attention,
    softmax_attention_reference,
    softmax_cache_step,
)

from .reference import mgk_reference

F64 = torch.float64
SLOTS = {"keys": 2, "values": 2}


def _qkv(B=2, H=2, G=2, L=3, D=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, L, D, generator=g, dtype=F64), torch.randn(B, G, L, D, generator=g, dtype=F64),
            torch.randn(B, G, L, D, generator=g, dtype=F64))


def _snapshot(state: KVCacheState):
    return None if state.seen is None else (state.seen.clone(), {n: t.clone() for n, t in state.entries().items()})


@pytest.mark.parametrize("prefilled", [False, True], ids=["prefill", "step"])
@pytest.mark.parametrize("needs", ["key", "value"])
def test_softmax_cache_step_refuses_a_key_or_value_in_a_graph_and_leaves_the_state(needs, prefilled):
    state = KVCacheState(SLOTS)
    if prefilled:
        softmax_cache_step(*_qkv(seed=1), state)
    before = _snapshot(state)
    q, k, v = _qkv(L=1 if prefilled else 3)
    args = {"key": k, "value": v}
    args[needs] = args[needs].clone().requires_grad_()
    with pytest.raises(ValueError, match=f"^{needs} requires grad") as raised:
        softmax_cache_step(q, args["key"], args["value"], state)
    assert "\n" not in str(raised.value) and "torch.no_grad()" in str(raised.value)
    after = _snapshot(state)
    if before is None:
        assert after is None  # not even started
    else:
        assert torch.equal(after[0], before[0])
        assert all(torch.equal(after[1][n], before[1][n]) for n in before[1])
    with torch.no_grad():  # the same call outside autograd is served
        softmax_cache_step(q, args["key"], args["value"], state)


def test_softmax_cache_step_refuses_keys_projected_by_a_parameter_the_query_shares():
    """The reported case: q, k, v projected by one weight, whose key and value rows got a gradient of exactly 0."""
    x, weight = torch.randn(1, 5, 8), torch.randn(3, 8, 8, requires_grad=True)
    q, k, v = ((x @ weight[i]).view(1, 5, 2, 4).transpose(1, 2) for i in range(3))
    with pytest.raises(ValueError, match="^key requires grad"):
        softmax_cache_step(q, k, v, KVCacheState(SLOTS))


def test_softmax_cache_step_gives_the_query_its_exact_gradient():
    q, k, v = _qkv(L=5, seed=2)
    qr = q.clone().requires_grad_()
    softmax_attention_reference(qr, k, v, is_causal=True).sum().backward()
    state = KVCacheState(SLOTS)
    for a, b in ((0, 3), (3, 4), (4, 5)):
        qa = q[:, :, a:b].clone().requires_grad_()
        # backward before the next call: the next append grows or writes the buffers this graph read
        softmax_cache_step(qa, k[:, :, a:b], v[:, :, a:b], state).sum().backward()
        torch.testing.assert_close(qa.grad, qr.grad[:, :, a:b])


def _mgk_step_case(shifted: bool):
    """A step of 2 tokens after 3 cached ones (float64): query, key, value, the buffers and the step's arguments."""
    g = torch.Generator().manual_seed(5)
    B, H, M, D, old, L, T = 2, 2, 2, 4, 3, 2, 8
    S = old + L
    raw = torch.randn(B, H, S, D, generator=g, dtype=F64) if shifted else \
        torch.randn(B, H, M, S, D, generator=g, dtype=F64)
    v = torch.randn(B, H, S, 3, generator=g, dtype=F64)
    q = torch.randn(B, H, L, D, generator=g, dtype=F64)
    shifts = torch.cat([torch.zeros(1, H, D, dtype=F64), 0.5 * torch.randn(M - 1, H, D, generator=g, dtype=F64)]) \
        if shifted else None
    sigma2 = torch.tensor([[0.7, 1.9], [1.2, 1.5]], dtype=F64)
    log_pi = torch.log_softmax(torch.randn(1, H, M, 1, generator=g, dtype=F64), dim=2)
    centre = raw.mean(dim=-2) if shifted else raw.mean(dim=(2, 3))
    keys, key_bias = mgk_cache_entries(raw[..., :old, :], centre=centre, log_pi=log_pi, sigma2=sigma2,
                                       shifts=shifts)
    buffers = {"keys": torch.zeros(*keys.shape[:-2], T, D, dtype=F64), "key_bias": torch.zeros(B, H, M, T, dtype=F64),
               "values": torch.zeros(B, H, T, 3, dtype=F64)}
    buffers["keys"][..., :old, :] = keys
    buffers["key_bias"][..., :old] = key_bias
    buffers["values"][:, :, :old] = v[:, :, :old]
    step = dict(slot=old, centre=centre, log_pi=log_pi, sigma2=sigma2, shifts=shifts)
    full = dict(k=raw if not shifted else raw.unsqueeze(2) - shifts.transpose(0, 1).unsqueeze(0).unsqueeze(3), v=v,
                log_pi=log_pi, sigma2=sigma2)
    return q, raw[..., old:, :], v[:, :, old:], buffers, step, full


MGK_GRAPHED = [("key", False), ("value", False), ("log_pi", False), ("sigma2", False), ("shifts", True),
               ("keys", False), ("key_bias", False), ("values", True)]


@pytest.mark.parametrize("needs,shifted", MGK_GRAPHED, ids=[n for n, _ in MGK_GRAPHED])
@pytest.mark.parametrize("backend", [None, "explicit"])
def test_mgk_cache_step_refuses_a_stored_operand_in_a_graph_and_writes_nothing(needs, shifted, backend):
    q, key, value, buffers, step, _ = _mgk_step_case(shifted)
    args = dict(key=key, value=value, **{n: b.clone() for n, b in buffers.items()}, **step)
    args[needs] = args[needs].clone().requires_grad_()
    kept = {n: args[n].detach().clone() for n in buffers}
    with pytest.raises(ValueError, match=f"^{needs} requires grad") as raised:
        mgk_cache_step(q, backend=backend, **args)
    assert "\n" not in str(raised.value) and "torch.no_grad()" in str(raised.value)
    assert all(torch.equal(args[n].detach(), kept[n]) for n in buffers)  # nothing was written
    with torch.no_grad():  # the same call outside autograd is served
        mgk_cache_step(q, backend=backend, **args)


@pytest.mark.parametrize("shifted", [False, True], ids=["separate", "shifted"])
def test_mgk_cache_step_gives_the_query_its_exact_gradient(shifted):
    q, key, value, buffers, step, full = _mgk_step_case(shifted)
    qs = q.clone().requires_grad_()
    mgk_cache_step(qs, key, value, **{n: b.clone() for n, b in buffers.items()}, **step).sum().backward()
    L, S = q.shape[2], value.shape[2] + step["slot"]
    qr = torch.cat([torch.zeros(*q.shape[:2], S - L, q.shape[3], dtype=F64), q], dim=2).requires_grad_()
    out, _ = mgk_reference(qr, full["k"], full["v"], log_pi=full["log_pi"], sigma2=full["sigma2"], is_causal=True,
                           log_space=True, grad=True)
    out[:, :, S - L:].sum().backward()
    torch.testing.assert_close(qs.grad, qr.grad[:, :, S - L:])


def _linear_case(mlk: bool):
    g = torch.Generator().manual_seed(7)
    B, H, M, T, D = 2, 2, 2, 7, 3
    q = torch.randn(B, H, T, D, generator=g, dtype=F64)
    k = torch.randn(B, H, M, T, D, generator=g, dtype=F64) if mlk else torch.randn(B, H, T, D, generator=g, dtype=F64)
    v = torch.randn(B, H, T, 2, generator=g, dtype=F64)
    log_pi = torch.randn(B, H, M, T, generator=g, dtype=F64) if mlk else None
    return [t.requires_grad_() for t in (q, k, v, log_pi) if t is not None]


def _linear_grads(op, tensors, pieces: bool, mlk: bool):
    """Gradients of a weighted sum of the outputs: one causal call, or a prefill (output_final_state), a
    continuation (initial_state) and steps (linear_attention_step)."""
    q, k, v = tensors[:3]
    lp = tensors[3] if mlk else None
    extra = (lambda a, b: {"log_pi": lp[..., a:b]}) if mlk else (lambda a, b: {})
    if not pieces:
        out = op(q, k, v, is_causal=True, **extra(0, None))
    else:
        o1, state = op(q[:, :, :3], k[..., :3, :], v[:, :, :3], is_causal=True, output_final_state=True, **extra(0, 3))
        o2, state = op(q[:, :, 3:5], k[..., 3:5, :], v[:, :, 3:5], is_causal=True, initial_state=state,
                       output_final_state=True, **extra(3, 5))
        outs = [o1, o2]
        for t in (5, 6):
            o, state = linear_attention_step(q[:, :, t], k[..., t, :], v[:, :, t], state,
                                             log_pi_t=lp[..., t] if mlk else None)
            outs.append(o.unsqueeze(2))
        out = torch.cat(outs, dim=2)
    weight = torch.linspace(-1.0, 2.0, out.numel(), dtype=F64).view_as(out)  # every output weighs differently
    return out, torch.autograd.grad((out * weight).sum(), tensors)


@pytest.mark.parametrize("mlk", [False, True], ids=["linear", "mlk"])
def test_linear_states_carry_the_gradients_of_the_uncached_call(mlk):
    op = mlk_attention if mlk else linear_attention
    tensors = _linear_case(mlk)
    whole, want = _linear_grads(op, tensors, False, mlk)
    cached, got = _linear_grads(op, tensors, True, mlk)
    torch.testing.assert_close(cached, whole)
    for name, g, w in zip(("query", "key", "value", "log_pi"), got, want):
        assert g.abs().sum() > 0, name
        torch.testing.assert_close(g, w, msg=name)
