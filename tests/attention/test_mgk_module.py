"""MGKAttention / MultiheadAttention modules: mask plumbing, options, Soft-E semantics. Padding, causality, batch
invariance and returned weights of every kind are in test_properties.py."""
import math

import pytest
import torch

import mgk
from mgk.attention.registry import attention_options
from mgk.functional import MaskError

KINDS = [("softmax", "learned"), ("mgk", "learned"), ("mgk", "soft_e"), ("mgk", "hard_e"), ("smgk", "learned"),
         ("smgk", "soft_e"), ("smgk", "hard_e")]


def make(kind, pi, E=16, H=2, D=8, max_len=16, dropout=0.0, **kw):
    torch.manual_seed(0)
    options = {k: v for k, v in dict(pi=pi, max_len=max_len).items() if k in attention_options(kind)}
    return mgk.build_attention(kind, E, H, head_dim=D, dropout=dropout, **options, **kw)


def test_mask_conventions_match_nn_multihead_attention():
    m = make("mgk", "learned").eval()
    x = torch.randn(2, 5, 16)
    kpm = torch.tensor([[False] * 5, [False, False, False, True, True]])
    am = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1)  # True = not allowed (nn.MHA)
    a, _ = m(x, key_padding_mask=kpm, attn_mask=am, need_weights=False)
    b, _ = m(x, key_padding_mask=kpm, is_causal=True, need_weights=False)
    torch.testing.assert_close(a, b)
    per_head = am.expand(2 * 2, 5, 5)
    c, _ = m(x, key_padding_mask=kpm, attn_mask=per_head, need_weights=False)
    torch.testing.assert_close(a, c)
    with pytest.raises(MaskError, match="key_padding_mask"):
        m(x, key_padding_mask=kpm.long(), need_weights=False)
    with pytest.raises(MaskError, match="attn_mask"):
        m(x, attn_mask=am.long(), need_weights=False)
    with pytest.raises(MaskError, match="attn_mask"):
        m(x, attn_mask=am[:4], need_weights=False)
    # Float masks are added to the logits, as in nn.MultiheadAttention: -inf where bool is True gives the same.
    minus_inf = torch.zeros(5, 5).masked_fill(am, float("-inf"))
    kpm_inf = torch.zeros(2, 5).masked_fill(kpm, float("-inf"))
    torch.testing.assert_close(m(x, key_padding_mask=kpm_inf, attn_mask=minus_inf, need_weights=False)[0], a)


def test_shape_errors_name_the_argument():
    m = make("mgk", "learned")
    with pytest.raises(ValueError, match="query"):
        m(torch.randn(2, 5, 15), need_weights=False)
    with pytest.raises(ValueError, match="query"):
        m(torch.randn(16), need_weights=False)
    with pytest.raises(ValueError, match="query"):
        m(torch.randn(1, 2, 5, 16), need_weights=False)
    with pytest.raises(ValueError, match="num_keys"):
        mgk.MGKAttention(16, 2, num_keys=0, batch_first=True)
    with pytest.raises(ValueError, match="max_len"):
        mgk.MGKAttention(16, 2, pi="soft_e", batch_first=True)
    with pytest.raises(ValueError, match="pi"):
        mgk.MGKAttention(16, 2, pi="soft", batch_first=True)


def test_head_dim_independent_of_embed_dim():
    m = mgk.MGKAttention(64, 3, head_dim=32, batch_first=True)
    assert m.q_proj.out_features == 96 and m.k_proj.out_features == 2 * 96
    out, _ = m(torch.randn(2, 7, 64), need_weights=False)
    assert out.shape == (2, 7, 64)


def test_sequence_longer_than_max_len_is_a_clear_error():
    m = make("mgk", "soft_e", max_len=16)
    m(torch.randn(1, 16, 16), need_weights=False)
    with pytest.raises(ValueError, match=r"17.*max_len=16"):
        m(torch.randn(1, 17, 16), need_weights=False)


def _hand_soft_e(q, k, sigma2, pi, valid):
    """Float64 loops for the paper's "+Soft-E" E-step: gamma then the masked average over (b, i)."""
    B, H, L, D = q.shape
    M, S = k.shape[2], k.shape[3]
    new = pi.clone()
    for h in range(H):
        for j in range(S):
            total = torch.zeros(M, dtype=torch.float64)
            count = 0
            for b in range(B):
                for i in range(L):
                    if not valid[b, i, j]:
                        continue
                    w = torch.tensor([float(pi[h, r, j]) * math.exp(
                        -float(((q[b, h, i] - k[b, h, r, j]) ** 2).sum()) / (2 * sigma2[r])) for r in range(M)],
                        dtype=torch.float64)
                    total += w / w.sum()
                    count += 1
            if count:
                new[h, :, j] = total / count
    return new


@pytest.mark.parametrize("keys", ["separate", "shifted"])
def test_soft_e_update_equals_hand_computation(keys):
    torch.manual_seed(1)
    m = mgk.MGKAttention(4, 1, head_dim=2, num_keys=2, keys=keys, pi="soft_e", max_len=6,
                         sigma2=[1.5, 0.5], batch_first=True).double()
    with torch.no_grad():
        m.pi[:, :, :] = torch.tensor([0.3, 0.7], dtype=torch.float64).view(1, 2, 1)
    x = torch.randn(2, 4, 4, dtype=torch.float64)
    kpm = torch.tensor([[False, False, False, True], [False, False, False, False]])
    q = m._split(m.q_proj(x)).detach()
    k = m._keys(x).detach()
    causal = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    valid = (~kpm)[:, None, :] & (~kpm)[:, :, None] & causal  # key real, query real, causal
    expected = _hand_soft_e(q, k, [1.5, 0.5], m.pi.clone(), valid)
    before = m.pi.clone()
    ptr = m.pi.data_ptr()
    m.train()
    out, _ = m(x, key_padding_mask=kpm, is_causal=True, need_weights=False)
    out.sum().backward()
    assert torch.equal(m.pi, before)  # forward and backward only gather: pi is the buffer until the step
    assert mgk.soft_e_step(m) == 1
    assert m.pi.data_ptr() == ptr  # updated in place, not rebound
    torch.testing.assert_close(m.pi[:, :, :4], expected[:, :, :4], atol=1e-12, rtol=1e-10)
    assert torch.equal(m.pi[:, :, 4:], before[:, :, 4:])  # positions beyond L untouched
    torch.testing.assert_close(m.pi.sum(1), torch.ones(1, 6, dtype=torch.float64))
    assert not torch.equal(m.pi, before)
    updated = m.pi.clone()
    m.soft_e_step()  # the statistics were reset: a step without a new backward changes nothing
    assert torch.equal(m.pi, updated)
    assert mgk.soft_e_step(make("mgk", "learned")) == 0  # nothing to update in other modules


def test_soft_e_never_changes_in_eval_or_no_grad_and_is_saved():
    m = make("mgk", "soft_e")
    x = torch.randn(2, 5, 16)
    before = m.pi.clone()
    m.eval()
    m(x, need_weights=False)[0].sum().backward()
    mgk.soft_e_step(m)
    m.train()
    with torch.no_grad():
        m(x, need_weights=False)
    mgk.soft_e_step(m)
    assert torch.equal(m.pi, before)
    assert "mixture.pi" in m.state_dict()  # saved (under the shared mixture-keys submodule)
    # the statistics between steps are not module state: the keys are those of a module never trained
    assert m.state_dict().keys() == make("mgk", "soft_e").state_dict().keys()
    m(x, need_weights=False)[0].sum().backward()
    mgk.soft_e_step(m)
    assert not torch.equal(m.pi, before)


def test_soft_e_forward_twice_backward_once_is_one_e_step_over_both():
    """Two forwards (two views, or a micro-batch pair) and one backward: no in-place autograd error, and the step
    averages over both forwards, as one forward over their concatenation does."""
    m, ref = make("mgk", "soft_e").train(), make("mgk", "soft_e").train()
    x1, x2 = torch.randn(2, 5, 16), torch.randn(3, 5, 16)
    (m(x1, need_weights=False)[0].sum() + m(x2, need_weights=False)[0].sum()).backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())
    ref(torch.cat([x1, x2]))[0].sum().backward()
    mgk.soft_e_step(m)
    mgk.soft_e_step(ref)
    assert not torch.equal(m.pi, torch.full_like(m.pi, 0.5))
    torch.testing.assert_close(m.pi, ref.pi, atol=1e-6, rtol=0)
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_soft_e_step_keeps_pi_a_distribution_after_a_non_finite_forward():
    """A forward whose inputs hold NaN (its loss is NaN too, which the Trainer reports) gives NaN statistics: the step
    leaves pi as it was (finite, summing to 1) at the positions they reach, and the next finite step updates it."""
    m = make("mgk", "soft_e").train()
    x = torch.randn(2, 5, 16)
    x[1, 2] = float("nan")
    before = m.pi.clone()
    m(x, need_weights=False)[0].sum().backward()
    mgk.soft_e_step(m)
    assert torch.equal(m.pi, before)
    m.zero_grad()
    m(torch.randn(2, 5, 16), need_weights=False)[0].sum().backward()
    mgk.soft_e_step(m)
    assert torch.isfinite(m.pi).all() and not torch.equal(m.pi, before)
    torch.testing.assert_close(m.pi.sum(1), torch.ones(2, 16))


def test_learned_pi_at_the_boundary_still_learns():
    """The authors' code clamps pi to [0, 1], which freezes it at the boundary; log-softmax logits keep a gradient."""
    torch.manual_seed(0)
    m = mgk.MGKAttention(8, 1, head_dim=8, num_keys=2, pi="learned", batch_first=True)
    with torch.no_grad():
        m.pi_logits[:] = torch.tensor([[0.0, -12.0]])  # pi = (1, ~6e-6)
        W = m.k_proj.weight.view(2, 8, 8)
        W[1] = m.q_proj.weight  # component 2 aligned with the queries
        m.k_proj.bias.view(2, 8)[1] = m.q_proj.bias
    opt = torch.optim.SGD([m.pi_logits], lr=1.0)
    x = torch.randn(4, 6, 8)

    def loss():
        _, w = m(x, need_weights=True, average_attn_weights=False)
        eye = torch.eye(6).expand_as(w)
        return ((w - eye) ** 2).sum()  # prefers attending to oneself: component 2 (k = q)

    start = torch.softmax(m.pi_logits, 1)[0, 1].item()
    for _ in range(10):
        opt.zero_grad()
        loss().backward()
        g = m.pi_logits.grad
        assert torch.isfinite(g).all() and g.abs().sum() > 0
        opt.step()
    pi = torch.softmax(m.pi_logits, 1)
    assert pi[0, 1] > start
    torch.testing.assert_close(pi.sum(1), torch.ones(1))


@pytest.mark.parametrize("kind,pi", KINDS)
def test_dropout_is_train_only(kind, pi):
    m = make(kind, pi, dropout=0.5).eval()
    x = torch.randn(2, 6, 16)
    a, _ = m(x, need_weights=False)
    b, _ = m(x, need_weights=False)
    assert torch.equal(a, b)
    m.train()
    torch.manual_seed(3)
    c, _ = m(x, need_weights=False)
    assert not torch.allclose(a, c)
