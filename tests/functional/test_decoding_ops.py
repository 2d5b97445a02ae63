"""The functional ops behind decoding caches, against the float64 formula (reference.py) and against one
uncached call: MGK's cache entries and step (separate and shifted keys, sum and max, per-head variances, masks,
causal k-token steps), softmax's step, linear / MLK attention continued from a state (every form), and the recurrent
step used with a module's own feature map and key layout."""
from __future__ import annotations

import math

import pytest
import torch

import mgk
from mgk.functional import (
    LinearAttentionState,
    _mixture_decode,
    _mixture_flash,
    linear_attention,
    linear_attention_step,
    mgk_attention_cached,
    mgk_cache_entries,
    mgk_centre,
    mlk_attention,
    softmax_attention_cached,
)

from .reference import causal_allowed, make_inputs, mgk_reference, normalised_log_pi, softmax_reference

F64 = torch.float64


@pytest.fixture(params=["kernel", "gemm"])
def step_path(request, monkeypatch):
    """Runs a test through each implementation of an MGK step: the C++ decoding kernel (the test fails if no call
    took it) and the GEMM form (the kernel refused)."""
    if request.param == "gemm":
        monkeypatch.setattr(_mixture_decode, "unserved", lambda *a, **k: "switched off by the test")
        yield "gemm"
        return
    if _mixture_flash._load() is None:
        pytest.skip(f"the CPU kernel could not be built here: {_mixture_flash.build_error()}")
    calls = []
    original = _mixture_decode.mixture_decode
    monkeypatch.setattr(_mixture_decode, "mixture_decode", lambda *a, **k: calls.append(1) or original(*a, **k))
    yield "kernel"
    assert calls, "no step took the decoding kernel"


def _shifted(B, H, S, M, D, seed):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(B, H, S, D, generator=g, dtype=F64)
    shifts = torch.randn(M, H, D, generator=g, dtype=F64) * 0.5
    shifts[0] = 0.0
    return base, shifts, base.unsqueeze(2) - shifts.transpose(0, 1).unsqueeze(0).unsqueeze(3)


@pytest.mark.parametrize("shifted", [False, True], ids=["separate", "shifted"])
@pytest.mark.parametrize("mixture", ["sum", "max"])
@pytest.mark.parametrize("M", [1, 2, 3])
@pytest.mark.parametrize("L,S", [(1, 9), (3, 9), (4, 4)])
def test_mgk_step_over_cache_entries_is_the_formula(shifted, mixture, M, L, S, step_path):
    """Queries L at the end of S keys (bottom-right causal), a key-padding mask, per-head unequal variances (the
    |q|^2 term kept) and per-position log priors, any centre: equal to eq. 9-10 computed literally."""
    B, H, D = 2, 2, 4
    q, k, v = make_inputs(B=B, H=H, L=L, S=S, M=M, D=D, Dv=3, dtype=F64, seed=L + S + M)
    base = k
    shifts = None
    if shifted:
        base, shifts, k = _shifted(B, H, S, M, D, seed=M)
    sigma2 = torch.tensor([[1.0, 0.6, 2.0][:M], [0.8, 1.5, 1.1][:M]], dtype=F64)
    log_pi = None if mixture == "max" else normalised_log_pi((B, H, M, S), dim=2, seed=S)
    mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
    mask[1, ..., :2] = False  # row 1: two padded keys
    centre = mgk_centre(q, k, attn_mask=mask, is_causal=True) + 0.3  # any centre gives the same numbers
    keys, key_bias = mgk_cache_entries(base, centre=centre, log_pi=log_pi, sigma2=sigma2, mixture=mixture,
                                       shifts=shifts)
    assert keys.shape == ((B, H, S, D) if shifted else (B, H, M, S, D)) and key_bias.shape == (B, H, M, S)
    got = mgk_attention_cached(q, keys, key_bias, v, centre=centre, sigma2=sigma2, shifts=shifts, mixture=mixture,
                               attn_mask=mask, is_causal=True)
    want, _ = mgk_reference(q, k, v, log_pi=log_pi, sigma2=sigma2, mixture=mixture, mask=mask, is_causal=True,
                            log_space=True)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_mgk_step_equals_the_uncached_call_with_the_same_centre_in_float32(step_path):
    q, k, v = make_inputs(B=2, H=2, L=6, S=40, M=2, D=8, Dv=8, seed=3)
    k = k + 20.0  # a large common offset: only the centre keeps the expanded distances exact
    q = q + 20.0
    c = mgk_centre(q[:, :, :1], k[:, :, :, :1], is_causal=True)
    keys, bias = mgk_cache_entries(k, centre=c)
    got = mgk_attention_cached(q, keys, bias, v, centre=c, is_causal=True)
    want = mgk.functional.mgk_attention(q, k, v, is_causal=True, centre=c)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_switched_off_components_padding_and_empty_rows_in_a_step():
    """A key whose every component has log pi = -inf gets no weight; a row that sees no key is zero; NaN keys in
    masked slots (scores masked) and zero values there change nothing."""
    B, H, L, S, M, D = 1, 1, 2, 5, 2, 4
    q, k, v = make_inputs(B=B, H=H, L=L, S=S, M=M, D=D, Dv=3, dtype=F64, seed=5)
    log_pi = torch.full((B, H, M, S), -math.log(2), dtype=F64)
    log_pi[..., 1] = float("-inf")  # key 1: every component off
    c = torch.zeros(B, H, D, dtype=F64)
    keys, bias = mgk_cache_entries(k, centre=c, log_pi=log_pi)
    mask = torch.ones(B, 1, L, S, dtype=torch.bool)
    mask[..., 0, :] = False  # query 0 sees nothing
    mask[..., 4] = False
    keys[..., 4, :] = float("nan")
    v = v.clone()
    v[..., 4, :] = 0.0
    got = mgk_attention_cached(q, keys, bias, v, centre=c, attn_mask=mask, is_causal=False)
    allowed = mask.clone()
    allowed[..., 1] = False
    want, _ = mgk_reference(q, k, v, mask=allowed, log_space=True)
    assert torch.equal(got[..., 0, :], torch.zeros_like(got[..., 0, :]))
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_softmax_step_over_a_cache_is_the_formula():
    q, k, v = make_inputs(B=2, H=2, L=3, S=8, M=1, D=4, Dv=3, dtype=F64, seed=7)
    k = k[:, :, 0]
    mask = torch.ones(2, 1, 1, 8, dtype=torch.bool)
    mask[0, ..., :6] = False  # row 0: the first query (keys j <= 5) sees no key
    got = softmax_attention_cached(q, k, v, attn_mask=mask, is_causal=True)
    want, _ = softmax_reference(q, k, v, mask=mask, is_causal=True)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert torch.equal(got[0, :, 0], torch.zeros_like(got[0, :, 0]))
    torch.testing.assert_close(softmax_attention_cached(q[:, :, -1:], k, v),
                               softmax_reference(q[:, :, -1:], k, v)[0], atol=1e-12, rtol=1e-12)


_FORMS = [{}, {"normalize": "length"}, {"normalize": "none"},
          {"feature_map": "elu_sum", "output_scale": 0.5, "eps": 1e-5, "eps_mode": "add"}]


@pytest.mark.parametrize("form", _FORMS, ids=["row", "length", "none", "authors_lm"])
@pytest.mark.parametrize("mlk", [False, True], ids=["linear", "mlk"])
def test_chunks_continued_from_states_equal_one_causal_call(form, mlk):
    """flash-linear-attention's convention: a prefill with output_final_state, then calls with initial_state; every
    call gives the last rows of one call over everything so far (normalize='length' included: its lengths are then
    those of the whole sequence so far)."""
    B, H, T, M, D = 2, 2, 40, 2, 4
    q, k, v = make_inputs(B=B, H=H, L=T, S=T, M=M, D=D, Dv=3, dtype=F64, seed=11)
    log_pi = normalised_log_pi((B, H, M, T), dim=2, seed=1)
    fn = mlk_attention if mlk else linear_attention

    def call(a, b, **kw):
        keys = k[:, :, :, a:b] if mlk else k[:, :, 0, a:b]
        extra = {"log_pi": log_pi[..., a:b]} if mlk else {}
        return fn(q[:, :, a:b], keys, v[:, :, a:b], is_causal=True, **extra, **form, **kw)

    state = None
    for a, b in [(0, 13), (13, 14), (14, 17), (17, 40)]:
        out, state = call(a, b, initial_state=state, output_final_state=True)
        torch.testing.assert_close(out, call(0, b)[:, :, a:], atol=1e-10, rtol=1e-10)
    assert isinstance(state, LinearAttentionState) and state.length.tolist() == [[T] * H] * B
    assert state.kv.shape == (B, H, D, 3) and state.k_sum.shape == (B, H, D)


def test_a_state_continues_non_causal_attention_and_counts_real_keys():
    q, k, v = make_inputs(B=2, H=1, L=6, S=6, M=1, D=4, Dv=3, dtype=F64, seed=2)
    k = k[:, :, 0]
    pad = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    pad[1, ..., :2] = False
    _, state = linear_attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], attn_mask=pad[..., :4],
                                output_final_state=True)
    out = linear_attention(q[:, :, 4:], k[:, :, 4:], v[:, :, 4:], initial_state=state)
    torch.testing.assert_close(out, linear_attention(q, k, v, attn_mask=pad)[:, :, 4:], atol=1e-12, rtol=1e-12)
    assert state.length.tolist() == [[4], [2]]


def test_a_state_is_refused_where_it_cannot_serve():
    q, k, v = make_inputs(B=1, H=1, L=3, S=3, M=1, D=4, Dv=3, dtype=F64)
    k = k[:, :, 0]
    _, state = linear_attention(q, k, v, output_final_state=True)
    with pytest.raises(ValueError, match="return_weights"):
        linear_attention(q, k, v, initial_state=state, return_weights=True)
    with pytest.raises(ValueError, match="explicit"):
        linear_attention(q, k, v, output_final_state=True, backend="explicit")
    with pytest.raises(ValueError, match="initial_state has kv"):
        linear_attention(q, k, v[..., :2], initial_state=state)
    with pytest.raises(ValueError, match="initial_state must be"):
        linear_attention(q, k, v, initial_state=(state.kv, state.k_sum))
    with pytest.raises(ValueError, match="initial_state.length"):
        linear_attention(q, k, v, initial_state=LinearAttentionState(state.kv, state.k_sum), normalize="length")
    with pytest.raises(ValueError, match="output_final_state"):
        linear_attention(q, k, v, output_final_state=1)


def test_the_recurrent_step_takes_an_mlk_modules_keys_and_feature_map():
    """The route a user of linear_attention_step takes with an MLKAttention: its keys are module.mixture(x), already
    (B, H, M, S, D), and its feature_map_fn is the callable (calling it with a tensor raised TypeError before)."""
    torch.manual_seed(0)
    m = mgk.build_attention("mlk", 16, 2, head_dim=8, feature_map="elu_sum", output_scale=8 ** -0.5, eps=1e-5,
                            eps_mode="add").eval()
    with torch.no_grad():
        m.pi_logits.normal_()
    x = torch.randn(2, 6, 16)
    with torch.no_grad():
        q, k, v = m._split(m.q_proj(x)), m.mixture(x), m._split(m.v_proj(x))
        log_pi = m.mixture_log_weights(6)[:, :, :, 0]
        state, outs = None, []
        for t in range(6):
            o, state = linear_attention_step(q[:, :, t], k[:, :, :, t], v[:, :, t], state, log_pi_t=log_pi,
                                             feature_map=m.feature_map_fn, eps=m.eps, output_scale=m.output_scale,
                                             eps_mode=m.eps_mode)
            outs.append(o)
        heads = torch.stack(outs, dim=2)
        got = m.out_proj(heads.transpose(1, 2).reshape(2, 6, 16))
        torch.testing.assert_close(got, m(x, need_weights=False, is_causal=True)[0], atol=1e-6, rtol=1e-6)
        assert torch.equal(m.feature_map_fn(k), mgk.functional._linear_forms.elu_sum_feature_map(k))


def test_bottom_right_alignment_of_a_k_token_step_after_a_state():
    """Queries fewer than keys after a state, and more queries than new keys: every row sees the state's keys."""
    q, k, v = make_inputs(B=1, H=1, L=7, S=7, M=1, D=4, Dv=3, dtype=F64, seed=4)
    k = k[:, :, 0]
    _, state = linear_attention(q[:, :, :3], k[:, :, :3], v[:, :, :3], is_causal=True, output_final_state=True)
    out = linear_attention(q[:, :, 5:], k[:, :, 3:], v[:, :, 3:], is_causal=True, initial_state=state)
    torch.testing.assert_close(out, linear_attention(q, k, v, is_causal=True)[:, :, 5:], atol=1e-12, rtol=1e-12)
    both = linear_attention(q[:, :, 1:], k[:, :, 3:5], v[:, :, 3:5], is_causal=True, initial_state=state)
    allowed = torch.cat([torch.ones(6, 3, dtype=torch.bool), causal_allowed(6, 2)], dim=1)  # (6 queries, 5 keys)
    phi = lambda x: torch.nn.functional.elu(x) + 1  # noqa: E731
    w = (phi(q[0, 0, 1:]) @ phi(k[0, 0, :5]).T) * allowed
    torch.testing.assert_close(both[0, 0], (w / w.sum(-1, keepdim=True)) @ v[0, 0, :5], atol=1e-12, rtol=1e-12)
