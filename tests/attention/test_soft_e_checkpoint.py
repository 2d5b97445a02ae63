"""Issue 16.2: Soft-E under activation checkpointing applies the E-step once per forward that produced the loss;
pi and the gradients equal those without checkpointing (reentrant or not, with gradient accumulation)."""
import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import mgk


def _model(seed=0):
    torch.manual_seed(seed)
    return mgk.MGKAttention(16, 2, head_dim=8, num_keys=2, keys="shifted", pi="soft_e", max_len=12,
                            batch_first=True).train()


def _forward(m, x, kpm, mode):
    if mode == "plain":
        return m(x, key_padding_mask=kpm, is_causal=True, need_weights=False)[0]

    def fn(inp):
        return m(inp, key_padding_mask=kpm, is_causal=True, need_weights=False)[0]

    return checkpoint(fn, x, use_reentrant=(mode == "reentrant"))


def _train(mode, micro_batches, steps=3):
    """`steps` SGD steps, each accumulating `micro_batches` forwards before one backward; returns (pi history,
    gradient history, parameters)."""
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(1)
    pis, grads = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = 0.0
        for _ in range(micro_batches):
            x = torch.randn(3, 10, 16, generator=gen).requires_grad_()
            kpm = torch.zeros(3, 10, dtype=torch.bool)
            kpm[1, 7:] = True
            loss = loss + _forward(m, x, kpm, mode).square().mean()
        loss.backward()
        pis.append(m.pi.clone())
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
        opt.step()
    return pis, grads, copy.deepcopy(m.state_dict())


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
@pytest.mark.parametrize("micro_batches", [1, 2], ids=["one_forward", "accumulate_two"])
def test_checkpointed_soft_e_equals_plain(mode, micro_batches):
    ref_pis, ref_grads, ref_state = _train("plain", micro_batches)
    pis, grads, state = _train(mode, micro_batches)
    for step in range(3):
        assert torch.equal(pis[step], ref_pis[step]), f"pi differs after step {step + 1}"
        for name, g in ref_grads[step].items():
            torch.testing.assert_close(grads[step][name], g, rtol=1e-5, atol=1e-7, msg=f"grad {name} step {step}")
    for name, value in ref_state.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_e_step_once_per_forward_and_recomputation_reads_the_forwards_pi(mode):
    """The E-step runs in the forward (pi changes before backward) and backward changes pi no further."""
    m = _model()
    x = torch.randn(2, 9, 16, requires_grad=True)
    before = m.pi.clone()
    out = _forward(m, x, None, mode)
    after_forward = m.pi.clone()
    assert not torch.equal(after_forward, before)
    out.square().mean().backward()
    assert torch.equal(m.pi, after_forward)
    ref = _model()
    ref(x.detach(), is_causal=True, need_weights=False)[0]
    assert torch.equal(ref.pi, after_forward)


def test_checkpoint_under_no_grad_or_eval_leaves_pi():
    m = _model()
    x = torch.randn(2, 9, 16)
    before = m.pi.clone()
    with torch.no_grad():
        _forward(m, x, None, "non_reentrant")
    m.eval()
    _forward(m, x.requires_grad_(), None, "reentrant").sum().backward()
    assert torch.equal(m.pi, before)
