"""Soft-E gathers its E-step statistics in forward, commits them in backward and applies them in
``mgk.soft_e_step``: under activation checkpointing (reentrant or not), torch.compile and gradient accumulation, pi
and the gradients equal those of the plain run, and each forward whose backward ran counts exactly once."""
import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import mgk

MODES = ["plain", "non_reentrant", "reentrant", "compiled"]


def _model(seed=0):
    torch.manual_seed(seed)
    return mgk.MGKAttention(16, 2, head_dim=8, num_keys=2, keys="shifted", pi="soft_e", max_len=12,
                            batch_first=True).train()


def _runner(m, mode):
    """``run(x, kpm) -> output`` of ``m`` as ``mode`` runs it (causal self-attention)."""
    if mode == "compiled":
        torch._dynamo.reset()
        compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
        return lambda x, kpm: compiled(x, key_padding_mask=kpm, is_causal=True, need_weights=False)[0]

    def fn(inp, kpm):
        return m(inp, key_padding_mask=kpm, is_causal=True, need_weights=False)[0]

    if mode == "plain":
        return fn
    return lambda x, kpm: checkpoint(fn, x, kpm, use_reentrant=(mode == "reentrant"))


def _batches(steps, micro_batches, rows=3):
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(micro_batches):
            x = torch.randn(rows, 10, 16, generator=gen)
            kpm = torch.zeros(rows, 10, dtype=torch.bool)
            kpm[1, 7:] = True  # one padded row: its padded queries and keys contribute nothing
            step.append((x, kpm))
        out.append(step)
    return out


def _train(mode, batches, backward_per_micro_batch=False):
    """SGD steps over ``batches`` (a list of steps, each a list of micro-batches (x, kpm)); one backward per step
    (or per micro-batch, as the Trainer does), then ``soft_e_step``. Returns (pi after each step, gradients of each
    step, final state dict)."""
    m = _model()
    run = _runner(m, mode)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    elements = sum(x.numel() for x, _ in batches[0])  # the loss is the mean square over the global batch
    pis, grads = [], []
    for step in batches:
        opt.zero_grad()
        loss = 0.0
        for x, kpm in step:
            part = run(x.clone().requires_grad_(), kpm).square().sum() / elements
            if backward_per_micro_batch:
                part.backward()
            else:
                loss = loss + part
        if not backward_per_micro_batch:
            loss.backward()
        assert mgk.soft_e_step(m) == 1
        pis.append(m.pi.clone())
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
        opt.step()
    return pis, grads, copy.deepcopy(m.state_dict())


def _assert_same_run(got, ref, pi_exact):
    (pis, grads, state), (ref_pis, ref_grads, ref_state) = got, ref
    for step, (pi, ref_pi) in enumerate(zip(pis, ref_pis)):
        if pi_exact:
            assert torch.equal(pi, ref_pi), f"pi differs after step {step + 1}"
        else:
            torch.testing.assert_close(pi, ref_pi, rtol=0, atol=1e-6, msg=f"pi after step {step + 1}")
        for name, g in ref_grads[step].items():
            torch.testing.assert_close(grads[step][name], g, rtol=1e-5, atol=1e-7, msg=f"grad {name} step {step}")
    for name, value in ref_state.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("mode", MODES[1:])
@pytest.mark.parametrize("micro_batches", [1, 2], ids=["one_forward", "accumulate_two"])
def test_soft_e_run_equals_plain(mode, micro_batches):
    """Checkpointing replays the forward's own arithmetic, so pi is bitwise that of the plain run; a compiled
    module computes the statistics in a traced graph (another order of float32 sums)."""
    batches = _batches(3, micro_batches)
    ref = _train("plain", batches)
    assert not torch.equal(ref[0][-1], torch.full_like(ref[0][-1], 0.5))  # the E-step did run
    _assert_same_run(_train(mode, batches), ref, pi_exact=(mode != "compiled"))


@pytest.mark.parametrize("mode", MODES)
def test_accumulated_micro_batches_equal_one_batch(mode):
    """Two micro-batches, each with its own backward (as the Trainer does), then one step: pi is the E-step over
    the whole global batch and the gradients are those of one forward over both (the paper's batch mean)."""
    batches = _batches(3, 2)
    whole = [[(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]]))] for a, b in batches]
    _assert_same_run(_train(mode, batches, backward_per_micro_batch=True), _train("plain", whole), pi_exact=False)


@pytest.mark.parametrize("mode", MODES)
def test_forward_and_backward_leave_pi_until_the_step_which_applies_it_once(mode):
    m, ref = _model(), _model()
    x = torch.randn(2, 9, 16, requires_grad=True)
    before = m.pi.clone()
    out = _runner(m, mode)(x, None)
    assert torch.equal(m.pi, before)
    out.square().mean().backward()
    assert torch.equal(m.pi, before)  # the backward commits statistics; pi is still the buffer
    mgk.soft_e_step(m)
    assert not torch.equal(m.pi, before)
    ref(x.detach(), is_causal=True, need_weights=False)[0].square().mean().backward()
    mgk.soft_e_step(ref)
    torch.testing.assert_close(m.pi, ref.pi, rtol=0, atol=0 if mode != "compiled" else 1e-6)
    updated = m.pi.clone()
    mgk.soft_e_step(m)
    assert torch.equal(m.pi, updated)


def test_checkpoint_under_no_grad_or_eval_leaves_pi():
    m = _model()
    x = torch.randn(2, 9, 16)
    before = m.pi.clone()
    with torch.no_grad():
        _runner(m, "non_reentrant")(x, None)
    mgk.soft_e_step(m)
    m.eval()
    _runner(m, "reentrant")(x.requires_grad_(), None).sum().backward()
    mgk.soft_e_step(m)
    assert torch.equal(m.pi, before)


def test_two_towers_sharing_the_module_give_one_update_over_both():
    """Retrieval's two towers call one encoder twice per step: both forwards' statistics go into one update."""
    m, ref = _model(), _model()
    a, b = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    (m(a, is_causal=True)[0] * m(b, is_causal=True)[0]).sum().backward()
    ref(torch.cat([a, b]), is_causal=True)[0].sum().backward()
    mgk.soft_e_step(m)
    mgk.soft_e_step(ref)
    torch.testing.assert_close(m.pi, ref.pi, rtol=0, atol=1e-6)
    assert not torch.equal(m.pi, torch.full_like(m.pi, 0.5))
