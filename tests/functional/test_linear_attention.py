"""Linear and MLK attention (mgk.functional.linear) against an explicit float64 quadratic form written from the
formula, plus linear attention's own faults: float16 sums past 65504, padding that enters the denominators
(elu(0) + 1 = 1 at a zero padded key), causal alignment when L != S, determinism of causal MLK; and the invariants
(row-stochastic, padding and batch invariance, causality, linear = quadratic, precision, gradients)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from mgk.functional import LinearAttentionState, MaskError, linear_attention, linear_attention_step, mlk_attention


def elu1(x):
    return F.elu(x) + 1


def allowed_pairs(L, S, causal):
    """Explicit (L, S) bool matrix: query i may see key j (bottom-right causal alignment: j <= i + S - L)."""
    m = torch.zeros(L, S, dtype=torch.bool)
    for i in range(L):
        for j in range(S):
            m[i, j] = (j <= i + S - L) if causal else True
    return m


def reference(q, k, v, *, log_pi=None, keep=None, causal=False, eps=1e-6, fm=elu1):
    """o_i = sum_j w_ij v_j / sum_j w_ij (eps only where that sum is exactly 0),
    w_ij = [j visible to i] phi(q_i) . sum_r pi_jr phi(k_jr).

    q (B, H, L, D); k (B, H, M, S, D) or (B, H, S, D); keep (B, S) bool (True = real key) or None. float64."""
    q, k, v = q.double(), k.double(), v.double()
    if k.dim() == 4:
        k = k.unsqueeze(2)
        log_pi = torch.zeros(1, 1, 1, 1, dtype=torch.float64) if log_pi is None else log_pi
    B, H, L, _ = q.shape
    M, S = k.shape[2], k.shape[3]
    pi = torch.full((1, 1, M, 1), 1.0 / M, dtype=torch.float64) if log_pi is None else log_pi.double().exp()
    pi = pi.expand(B, H, M, S)
    phi_q = fm(q)
    phi_k = fm(k)
    out = torch.zeros(B, H, L, v.shape[-1], dtype=torch.float64)
    vis = allowed_pairs(L, S, causal)
    for b in range(B):
        for h in range(H):
            for i in range(L):
                num = torch.zeros(v.shape[-1], dtype=torch.float64)
                den = torch.zeros((), dtype=torch.float64)
                for j in range(S):
                    if not vis[i, j] or (keep is not None and not keep[b, j]):
                        continue
                    feat = sum(pi[b, h, r, j] * phi_k[b, h, r, j] for r in range(M))
                    w = phi_q[b, h, i] @ feat
                    num = num + w * v[b, h, j]
                    den = den + w
                out[b, h, i] = num / (den if den != 0 else (eps or 1.0))
    return out


def randn(*shape, gen, dtype=torch.float64, scale=1.0):
    return torch.randn(*shape, generator=gen, dtype=dtype) * scale


def key_mask(keep):
    """(B, S) True = real  ->  functional attn_mask (B, 1, 1, S)."""
    return keep[:, None, None, :]


# ---------------------------------------------------------------------------------------------------------------
# Linear = quadratic (causal = the masked quadratic form), L != S, M in {1, 2, 3}, chunk sizes, padding
# ---------------------------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(B=st.sampled_from([1, 2, 3]), H=st.sampled_from([1, 2]), L=st.sampled_from([1, 2, 5, 9]),
       S=st.sampled_from([1, 2, 5, 9]), D=st.sampled_from([1, 2, 4, 8]), M=st.sampled_from([0, 1, 2, 3]),
       causal=st.booleans(), pad=st.booleans(), chunk=st.sampled_from([1, 3, 64]), seed=st.integers(0, 2**16))
def test_matches_quadratic_reference(B, H, L, S, D, M, causal, pad, chunk, seed):
    """M = 0 stands for plain linear attention (4-dim keys); M >= 1 is MLK with random per-position priors."""
    g = torch.Generator().manual_seed(seed)
    q, v = randn(B, H, L, D, gen=g), randn(B, H, S, 3, gen=g)
    keep = (torch.rand(B, S, generator=g) > 0.3) if pad else None
    mask = None if keep is None else key_mask(keep)
    if M == 0:
        k = randn(B, H, S, D, gen=g)
        out = linear_attention(q, k, v, attn_mask=mask, is_causal=causal, chunk_size=chunk)
        ref = reference(q, k, v, keep=keep, causal=causal)
    else:
        k = randn(B, H, M, S, D, gen=g)
        log_pi = torch.log_softmax(randn(B, H, M, S, gen=g), dim=2)
        out = mlk_attention(q, k, v, log_pi=log_pi, attn_mask=mask, is_causal=causal, chunk_size=chunk)
        ref = reference(q, k, v, log_pi=log_pi, keep=keep, causal=causal)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("L,S", [(10, 10), (7, 10), (10, 7), (130, 130), (3, 200)])
@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_chunked_causal_matches_reference(L, S, chunk):
    """Chunk sizes 1, 3, 64, lengths not divisible by the chunk, the causal offset both ways."""
    g = torch.Generator().manual_seed(L * 1000 + S)
    q, k, v = randn(1, 2, L, 4, gen=g), randn(1, 2, 2, S, 4, gen=g), randn(1, 2, S, 2, gen=g)
    log_pi = torch.log(torch.tensor([0.3, 0.7], dtype=torch.float64)).view(1, 1, 2, 1)
    out = mlk_attention(q, k, v, log_pi=log_pi, is_causal=True, chunk_size=chunk)
    if L * S <= 2000:
        ref = reference(q, k, v, log_pi=log_pi, causal=True)
    else:  # the explicit path (checked against the loop reference above) keeps this case fast
        ref = mlk_attention(q, k, v, log_pi=log_pi, is_causal=True, return_weights=True)[0]
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    if L > S:
        assert torch.equal(out[:, :, : L - S], torch.zeros_like(out[:, :, : L - S]))  # see no key: exactly 0


def test_last_query_equals_last_row_of_full_causal_run():
    """Bottom-right causal alignment: one query against 6 keys equals row 5 of the full causal run (not attention
    to key 0 only)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 2, 6, 8), torch.randn(2, 2, 2, 6, 8), torch.randn(2, 2, 6, 4)
    full_lin = linear_attention(q, k[:, :, 0], v, is_causal=True)
    last_lin = linear_attention(q[:, :, 5:], k[:, :, 0], v, is_causal=True)
    torch.testing.assert_close(last_lin, full_lin[:, :, 5:], rtol=0, atol=1e-6)
    full = mlk_attention(q, k, v, is_causal=True)
    last = mlk_attention(q[:, :, 5:], k, v, is_causal=True)
    torch.testing.assert_close(last, full[:, :, 5:], rtol=0, atol=1e-6)
    assert not torch.allclose(last, mlk_attention(q[:, :, 5:], k[:, :, :, :1], v[:, :, :1], is_causal=True))


@pytest.mark.parametrize("causal", [False, True])
def test_length_one_gives_v0(causal):
    """Length one: with a single key the weight is 1 (eps=0 to remove its bias)."""
    torch.manual_seed(1)
    q, k, v = torch.randn(3, 2, 1, 4), torch.randn(3, 2, 2, 1, 4), torch.randn(3, 2, 1, 5)
    torch.testing.assert_close(mlk_attention(q, k, v, is_causal=causal, eps=0.0), v, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(linear_attention(q, k[:, :, 0], v, is_causal=causal, eps=0.0), v,
                               rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# Padding: inert content, no padding in the denominators, rows that see no key are zero
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["linear", "mlk"])
@pytest.mark.parametrize("content", ["zero", "huge", "nan"])
def test_right_padding_in_denominator(kind, content):
    """A (5 real, right-padded to 8, padded raw keys 0 / 1e30 / NaN) batched with B (8 real) gives A's
    real outputs equal to A alone. Zero keys have features elu(0)+1 = 1, so masking must act after phi."""
    torch.manual_seed(2)
    H, D = 2, 4
    shape_k = (2, H, 8, D) if kind == "linear" else (2, H, 2, 8, D)
    q, k, v = torch.randn(2, H, 8, D), torch.randn(*shape_k), torch.randn(2, H, 8, 3)
    fill = {"zero": 0.0, "huge": 1e30, "nan": float("nan")}[content]
    k[0, ..., 5:, :] = fill
    v[0, :, 5:] = 1e3 if content == "zero" else fill
    keep = torch.ones(2, 8, dtype=torch.bool)
    keep[0, 5:] = False
    fn = linear_attention if kind == "linear" else mlk_attention
    k.requires_grad_()
    batched = fn(q, k, v, attn_mask=key_mask(keep))
    alone = fn(q[:1, :, :5], k[:1, ..., :5, :], v[:1, :, :5])
    torch.testing.assert_close(batched[:1, :, :5], alone, rtol=0, atol=1e-5)
    torch.testing.assert_close(batched[1:], fn(q[1:], k[1:], v[1:]), rtol=0, atol=1e-6)
    batched[:, :, :5].sum().backward()  # the padding is inert in backward too: zero (not NaN) gradient there
    assert torch.isfinite(k.grad).all() and torch.equal(k.grad[0, ..., 5:, :], torch.zeros_like(k.grad[0, ..., 5:, :]))


@pytest.mark.parametrize("content", ["zero", "nan"])
def test_left_padding_causal_mlk(content):
    """Causal MLK with left padding: A padded at the front equals A alone; rows that see only padding are
    exactly zero, even with v = 1e3 / NaN at the padding."""
    torch.manual_seed(3)
    q, k, v = torch.randn(2, 2, 8, 4), torch.randn(2, 2, 2, 8, 4), torch.randn(2, 2, 8, 3)
    k[0, :, :, :3] = 0.0 if content == "zero" else float("nan")
    v[0, :, :3] = 1e3 if content == "zero" else float("nan")
    if content == "nan":
        q[0, :, :3] = float("nan")  # padded queries: rows 0-2 see only padding
    keep = torch.ones(2, 8, dtype=torch.bool)
    keep[0, :3] = False
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = mlk_attention(q, k, v, attn_mask=key_mask(keep), is_causal=True, chunk_size=4)
    alone = mlk_attention(q[:1, :, 3:], k[:1, :, :, 3:], v[:1, :, 3:], is_causal=True)
    torch.testing.assert_close(out[:1, :, 3:], alone, rtol=0, atol=1e-5)
    assert torch.equal(out[0, :, :3], torch.zeros_like(out[0, :, :3]))
    assert torch.isfinite(out).all()
    out.sum().backward()  # the padded query of row 2 shares a chunk with real keys 3: no NaN may reach them
    assert torch.isfinite(k.grad[0, :, :, 3:]).all() and torch.isfinite(q.grad[0, :, 3:]).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["linear", "mlk"])
def test_fully_padded_row_is_zero_with_finite_grads(kind, causal):
    """Batch 1 has no real key: its outputs are exactly 0 (not the mean of v = 1e3) and every grad is finite."""
    torch.manual_seed(4)
    q = torch.randn(2, 2, 5, 4, requires_grad=True)
    k = (torch.randn(2, 2, 5, 4) if kind == "linear" else torch.randn(2, 2, 2, 5, 4)).requires_grad_()
    v = torch.randn(2, 2, 5, 3)
    v[1] = 1e3
    v.requires_grad_()
    keep = torch.ones(2, 5, dtype=torch.bool)
    keep[1] = False
    if kind == "linear":
        out = linear_attention(q, k, v, attn_mask=key_mask(keep), is_causal=causal)
    else:
        log_pi = torch.zeros(2, 2, requires_grad=True)
        out = mlk_attention(q, k, v, log_pi=torch.log_softmax(log_pi, -1).view(1, 2, 2, 1),
                            attn_mask=key_mask(keep), is_causal=causal)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isfinite(out).all()
    out.sum().backward()
    grads = [q.grad, k.grad, v.grad] + ([] if kind == "linear" else [log_pi.grad])
    assert all(torch.isfinite(g).all() for g in grads)
    assert q.grad[0].abs().sum() > 0


@pytest.mark.parametrize("eps", [1e-6, 0.0])
@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_rows_without_keys_are_inert_whatever_the_query(causal, weights, eps):
    """Rows that see no key are exactly 0 even for a NaN query or eps = 0, and nothing there reaches a gradient."""
    torch.manual_seed(20)
    q, k, v = torch.randn(2, 1, 6, 4), torch.randn(2, 1, 4, 4), torch.randn(2, 1, 4, 3)
    keep = torch.ones(2, 4, dtype=torch.bool)
    keep[1] = False
    q[1] = float("nan")
    if causal:
        q[0, :, :2] = float("nan")  # causal with L = 6 > S = 4: rows 0 and 1 see no key
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = linear_attention(q, k, v, attn_mask=key_mask(keep), is_causal=causal, eps=eps, return_weights=weights)
    out = out[0] if weights else out
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    real = slice(2, 6) if causal else slice(0, 6)
    if causal:
        assert torch.equal(out[0, :, :2], torch.zeros_like(out[0, :, :2]))
    assert torch.isfinite(out[0, :, real]).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()


def test_per_head_key_padding():
    """A (B, H, 1, S) mask pads different keys per head; each head matches its own reference."""
    torch.manual_seed(5)
    q, k, v = torch.randn(2, 2, 4, 3, dtype=torch.float64), torch.randn(2, 2, 6, 3, dtype=torch.float64), \
        torch.randn(2, 2, 6, 2, dtype=torch.float64)
    keep = torch.rand(2, 2, 6) > 0.4
    out = linear_attention(q, k, v, attn_mask=keep[:, :, None, :], is_causal=True)
    for h in range(2):
        ref = reference(q[:, h:h + 1], k[:, h:h + 1], v[:, h:h + 1], keep=keep[:, h], causal=True)
        torch.testing.assert_close(out[:, h:h + 1], ref, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------------------------------
# MLK identities: pi = (1, 0) is linear attention on key 1
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
def test_mlk_with_one_component_equals_linear(causal):
    torch.manual_seed(6)
    q, k, v = torch.randn(2, 2, 9, 4), torch.randn(2, 2, 9, 4), torch.randn(2, 2, 9, 3)
    lin = linear_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(mlk_attention(q, k.unsqueeze(2), v, is_causal=causal), lin, rtol=0, atol=1e-6)
    zero = torch.zeros(1, 1, 1, 1)
    torch.testing.assert_close(mlk_attention(q, k.unsqueeze(2), v, log_pi=zero, is_causal=causal), lin,
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("on", [0, 1])
def test_mlk_with_pi_one_zero_equals_linear_on_that_key(causal, on):
    torch.manual_seed(7)
    q, k, v = torch.randn(2, 2, 7, 4), torch.randn(2, 2, 2, 7, 4), torch.randn(2, 2, 7, 3)
    k[:, :, 1 - on] *= 5.0  # the switched-off component is very different
    log_pi = torch.full((2,), float("-inf"))
    log_pi[on] = 0.0
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[1, 5:] = False
    out = mlk_attention(q, k, v, log_pi=log_pi.view(1, 1, 2, 1), attn_mask=key_mask(keep), is_causal=causal)
    lin = linear_attention(q, k[:, :, on], v, attn_mask=key_mask(keep), is_causal=causal)
    torch.testing.assert_close(out, lin, rtol=0, atol=1e-6)


def test_mlk_mixes_features_not_raw_keys():
    """Paper eq. 14: phi~(k) = sum_r pi_r phi(k_r). Mixing raw keys before phi (the authors' LRA code) differs."""
    torch.manual_seed(8)
    q, k, v = torch.randn(1, 1, 6, 4, dtype=torch.float64), torch.randn(1, 1, 2, 6, 4, dtype=torch.float64) * 2, \
        torch.randn(1, 1, 6, 3, dtype=torch.float64)
    out = mlk_attention(q, k, v)
    torch.testing.assert_close(out, reference(q, k, v), rtol=1e-10, atol=1e-10)
    raw_mix = linear_attention(q, k.mean(dim=2), v)
    assert (out - raw_mix).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------------------------
# Recurrent form
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["linear", "mlk"])
@pytest.mark.parametrize("left_pad", [0, 3])
def test_recurrent_equals_parallel(kind, left_pad):
    torch.manual_seed(9)
    B, H, L, D, M = 2, 2, 9, 4, 3
    q = torch.randn(B, H, L, D, dtype=torch.float64)
    k = torch.randn(B, H, L, D, dtype=torch.float64) if kind == "linear" else \
        torch.randn(B, H, M, L, D, dtype=torch.float64)
    v = torch.randn(B, H, L, 3, dtype=torch.float64)
    log_pi = torch.log_softmax(torch.randn(B, H, M, L, dtype=torch.float64), dim=2)
    keep = torch.ones(B, L, dtype=torch.bool)
    keep[1, :left_pad] = False
    mask = key_mask(keep) if left_pad else None
    if kind == "linear":
        par = linear_attention(q, k, v, attn_mask=mask, is_causal=True, chunk_size=4)
    else:
        par = mlk_attention(q, k, v, log_pi=log_pi, attn_mask=mask, is_causal=True, chunk_size=4)
    state, outs = None, []
    for t in range(L):
        kt = k[:, :, t] if kind == "linear" else k[:, :, :, t]
        lp = None if kind == "linear" else log_pi[..., t]
        km = keep[:, t:t + 1] if left_pad else None
        o, state = linear_attention_step(q[:, :, t], kt, v[:, :, t], state, log_pi_t=lp, key_mask_t=km)
        outs.append(o)
    torch.testing.assert_close(torch.stack(outs, dim=2), par, rtol=1e-10, atol=1e-10)
    assert isinstance(state, LinearAttentionState)
    assert state.kv.shape == (B, H, D, 3) and state.k_sum.shape == (B, H, D)


def test_recurrent_step_16bit_keeps_float32_state():
    torch.manual_seed(10)
    q, k, v = (torch.rand(1, 1, 3, 8) * 5 + 15 for _ in range(3))
    state = None
    for t in range(3):
        o, state = linear_attention_step(q[:, :, t].half(), k[:, :, t].half(), v[:, :, t].half(), state)
    assert o.dtype == torch.float16 and state.kv.dtype == torch.float32
    torch.testing.assert_close(o.float(), linear_attention(q, k, v, is_causal=True)[:, :, 2], rtol=1e-2, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# Precision (float16 sums past 65504, bf16 autocast) and determinism of causal MLK
# ---------------------------------------------------------------------------------------------------------------
def _large_inputs(L, D, M, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(1, 1, L, D, generator=g) * 5 + 15
    k = torch.rand(1, 1, M, L, D, generator=g) * 5 + 15
    v = torch.rand(1, 1, L, D, generator=g) * 5 + 15
    return q, k, v


@pytest.mark.parametrize("kind,causal", [("linear", False), ("mlk", False), ("mlk", True)])
def test_bf16_autocast_long_large_activations(kind, causal):
    """Keys and values ~U(15, 20) at L = 8192: sums ~1e7, denominators ~1e8; bf16 autocast stays finite and
    within rel 2e-2 of float32 (sums are accumulated in float32)."""
    q, k, v = _large_inputs(8192, 16, 2, seed=11)
    if kind == "linear":
        k = k[:, :, 0]
    fn = linear_attention if kind == "linear" else mlk_attention
    ref = fn(q, k, v, is_causal=causal)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fn(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=causal)
    assert out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_float16_inputs_do_not_overflow(causal):
    """On CPU: float16 inputs whose sums pass 65504 give a finite result within rel 1e-2 of float32."""
    q, k, v = _large_inputs(4096, 16, 2, seed=12)
    ref = mlk_attention(q, k, v, is_causal=causal)
    out = mlk_attention(q.half(), k.half(), v.half(), is_causal=causal)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=0)


def test_causal_mlk_is_deterministic():
    """Two causal MLK runs at L = 4096 are bitwise equal on CPU."""
    torch.manual_seed(13)
    q, k, v = torch.randn(1, 2, 4096, 8), torch.randn(1, 2, 2, 4096, 8), torch.randn(1, 2, 4096, 8)
    log_pi = torch.log_softmax(torch.randn(1, 2, 2, 1), dim=2)
    a = mlk_attention(q, k, v, log_pi=log_pi, is_causal=True)
    b = mlk_attention(q, k, v, log_pi=log_pi, is_causal=True)
    assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------------------
# Gradients: gradcheck in float64 at tiny shapes
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal,L,S", [(False, 3, 4), (True, 3, 3), (True, 2, 4), (True, 4, 3)])
def test_gradcheck_linear(causal, L, S):
    torch.manual_seed(14)
    q = torch.randn(2, 1, L, 2, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1, S, 2, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 1, S, 2, dtype=torch.float64, requires_grad=True)
    keep = torch.ones(2, S, dtype=torch.bool)
    keep[1] = False  # a fully masked batch element
    fn = lambda q, k, v: linear_attention(q, k, v, attn_mask=key_mask(keep), is_causal=causal, chunk_size=2)  # noqa
    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_mlk_with_learned_log_pi(causal):
    torch.manual_seed(15)
    q = torch.randn(1, 2, 3, 2, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 2, 3, 2, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 3, 2, dtype=torch.float64, requires_grad=True)
    logits = torch.randn(2, 2, 3, dtype=torch.float64, requires_grad=True)
    keep = torch.tensor([[True, False, True]])

    def fn(q, k, v, logits):
        log_pi = torch.log_softmax(logits, dim=1).unsqueeze(0)
        return mlk_attention(q, k, v, log_pi=log_pi, attn_mask=key_mask(keep), is_causal=causal, chunk_size=2)

    assert torch.autograd.gradcheck(fn, (q, k, v, logits))


def test_gradcheck_coincident_query_and_key_and_step():
    torch.manual_seed(16)
    x = torch.randn(1, 1, 3, 2, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 3, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, v: linear_attention(x, x, v, is_causal=True), (x, v))

    def steps(x, v):
        state, outs = None, []
        for t in range(3):
            o, state = linear_attention_step(x[:, :, t], x[:, :, t], v[:, :, t], state)
            outs.append(o)
        return torch.stack(outs, 2)

    assert torch.autograd.gradcheck(steps, (x, v))


# ---------------------------------------------------------------------------------------------------------------
# Invariants 5 and 6, pluggable feature map, returned weights
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
def test_weights_are_row_stochastic_and_reproduce_output(causal):
    torch.manual_seed(17)
    q, k, v = torch.randn(2, 2, 5, 4), torch.randn(2, 2, 2, 7, 4), torch.randn(2, 2, 7, 3)
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[0, 4:] = False
    out, w = mlk_attention(q, k, v, attn_mask=key_mask(keep), is_causal=causal, return_weights=True)
    assert w.shape == (2, 2, 5, 7) and (w >= 0).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 5), rtol=0, atol=1e-5)
    assert torch.equal(w[0, :, :, 4:], torch.zeros_like(w[0, :, :, 4:]))
    if causal:
        assert torch.equal(w[1, :, 0, 4:], torch.zeros_like(w[1, :, 0, 4:]))  # query 0 sees keys 0..2
    torch.testing.assert_close(out, w @ v, rtol=0, atol=1e-6)
    torch.testing.assert_close(out, mlk_attention(q, k, v, attn_mask=key_mask(keep), is_causal=causal),
                               rtol=0, atol=1e-5)
    const = torch.full_like(v, 2.5)
    torch.testing.assert_close(mlk_attention(q, k, const, attn_mask=key_mask(keep), is_causal=causal),
                               torch.full((2, 2, 5, 3), 2.5), rtol=1e-5, atol=0)


def test_permutation_equivariance():
    torch.manual_seed(18)
    q, k, v = torch.randn(2, 2, 6, 4), torch.randn(2, 2, 2, 6, 4), torch.randn(2, 2, 6, 3)
    keep = torch.rand(2, 6) > 0.3
    keep[:, 0] = True
    perm = torch.randperm(6)
    out = mlk_attention(q, k, v, attn_mask=key_mask(keep))
    out_p = mlk_attention(q[:, :, perm], k[:, :, :, perm], v[:, :, perm], attn_mask=key_mask(keep[:, perm]))
    torch.testing.assert_close(out_p, out[:, :, perm], rtol=0, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_pluggable_feature_map_changes_feature_size(causal):
    fm = lambda x: torch.cat([F.relu(x), F.relu(-x)], dim=-1) + 0.1  # noqa: E731  D' = 2D
    g = torch.Generator().manual_seed(19)
    q, k, v = randn(2, 1, 5, 3, gen=g), randn(2, 1, 2, 5, 3, gen=g), randn(2, 1, 5, 2, gen=g)
    keep = torch.tensor([[True] * 5, [True, True, False, True, False]])
    out = mlk_attention(q, k, v, attn_mask=key_mask(keep), is_causal=causal, feature_map=fm, chunk_size=2)
    ref = reference(q, k, v, keep=keep, causal=causal, fm=fm)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    assert (out - mlk_attention(q, k, v, attn_mask=key_mask(keep), is_causal=causal)).abs().max() > 1e-3
    state = None
    for t in range(5):
        o, state = linear_attention_step(q[:, :, t], k[:, :, :, t], v[:, :, t], state, feature_map=fm)
    assert state.kv.shape == (2, 1, 6, 2)


# ---------------------------------------------------------------------------------------------------------------
# Argument errors
# ---------------------------------------------------------------------------------------------------------------
def _qkv():
    return torch.randn(2, 2, 5, 4), torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 3)


@pytest.mark.parametrize("mask_shape", [(5, 6), (2, 1, 5, 6), (2, 2, 5, 6), (1, 1, 5, 1)])
def test_masks_with_a_query_dimension_are_rejected(mask_shape):
    q, k, v = _qkv()
    mask = torch.ones(mask_shape, dtype=torch.bool)
    for call in (lambda: linear_attention(q, k, v, attn_mask=mask),
                 lambda: mlk_attention(q, k.unsqueeze(2), v, attn_mask=mask, is_causal=True)):
        with pytest.raises(MaskError, match="key-padding"):
            call()


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8, torch.int64])
def test_non_bool_masks_are_rejected(dtype):
    q, k, v = _qkv()
    with pytest.raises(MaskError, match="bool"):
        linear_attention(q, k, v, attn_mask=torch.ones(2, 1, 1, 6, dtype=dtype))


def test_accepted_mask_shapes():
    q, k, v = _qkv()
    keep = torch.rand(2, 6) > 0.3
    a = linear_attention(q, k, v, attn_mask=key_mask(keep))
    b = linear_attention(q, k, v, attn_mask=keep[:, None, None, :].expand(2, 2, 1, 6))
    assert torch.equal(a, b)
    assert torch.equal(linear_attention(q, k, v, attn_mask=torch.ones(6, dtype=torch.bool)),
                       linear_attention(q, k, v))
    with pytest.raises(MaskError, match="broadcast"):
        linear_attention(q, k, v, attn_mask=torch.ones(2, 1, 1, 5, dtype=torch.bool))


def test_wrong_shapes_and_dtypes_name_the_argument():
    q, k, v = _qkv()
    cases = [
        (lambda: linear_attention(q[0], k, v), "query"),
        (lambda: linear_attention(q, k[..., :3], v), "head_dim"),
        (lambda: linear_attention(q, k, v[:, :, :5]), "value"),
        (lambda: linear_attention(q, k.long(), v), "floating"),
        (lambda: linear_attention(q, k.unsqueeze(2), v), "key"),
        (lambda: mlk_attention(q, k, v), "key"),
        (lambda: mlk_attention(q, k.unsqueeze(2), v, log_pi=torch.zeros(3, 1)), "log_pi"),
        (lambda: linear_attention(q, k, v, eps=-1.0), "eps"),
        (lambda: linear_attention(q, k, v, is_causal=True, chunk_size=0), "chunk_size"),
        (lambda: linear_attention(q, k, v, feature_map="relu"), "feature_map"),  # unknown name
        (lambda: linear_attention(q, k, v, feature_map=lambda x: x.sum(-2)), "feature_map"),
        (lambda: linear_attention_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], log_pi_t=torch.zeros(1)), "log_pi_t"),
        (lambda: linear_attention_step(q[:, :, 0], k[:, 0, 0], v[:, :, 0]), "key_t"),
        (lambda: linear_attention_step(q[:, :, 0], k[:, :, 0], v[:, :, 0],
                                       LinearAttentionState(torch.zeros(2, 2, 4, 4), torch.zeros(2, 2, 4))), "state"),
        (lambda: linear_attention_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], key_mask_t=torch.ones(2, 2)),
         "key_mask_t"),
    ]
    for call, name in cases:
        with pytest.raises(ValueError, match=name):
            call()


def test_eps_replaces_only_a_zero_denominator():
    """o = num / den exactly; eps stands in only for a denominator that is exactly 0."""
    q, k, v = (torch.ones(1, 1, 1, 1, dtype=torch.float64) for _ in range(3))
    out = linear_attention(q, k, v, eps=0.5)  # phi(1) = 2: num = 4 v, den = 4
    assert out.item() == 1.0
    zero_features = lambda x: torch.zeros_like(x)  # noqa: E731 - every denominator is 0
    out = linear_attention(q, k, v, eps=0.5, feature_map=zero_features)
    assert out.item() == 0.0
