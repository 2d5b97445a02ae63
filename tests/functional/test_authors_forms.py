"""The attention forms of the Transformer-MGK authors' released code as options of our functional core.

Each form is compared, in float64 to 1e-10, with the oracle in ``tests/reference_authors.py`` (written from the
authors' formulas, docs/authors-protocol.md) on the same queries, keys, values and padding, through every backend
(linear: "chunked", "explicit" and the recurrent step; MGK: every available ``mgk_attention`` backend). Then the
properties of each new option: causality, padding, M = 1 reductions, backend agreement, gradcheck, bad values.
"""
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from mgk.functional import linear_attention, linear_attention_step, mgk_attention, mlk_attention
from reference_authors import lm_linear_type34, lm_mgk, lm_mlk_type400, lra_linear, lra_mgk, lra_mlk

B, H, L, D = 2, 3, 11, 4
TOL = dict(rtol=1e-10, atol=1e-10)
LINEAR_BACKENDS = ("chunked", "explicit")
LM34 = dict(feature_map="elu_sum", output_scale=D ** -0.5, eps=1e-5, eps_mode="add")


def _t(seed, *shape, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


def _qkv(seed=0, n=3, L=L, D=D):
    return [_t(seed + i, B, H, L, D) for i in range(n)]


def _padding(L=L, real=(L, 6)):
    """(B, L) bool, True = padded key (the references' convention)."""
    return torch.arange(L)[None, :] >= torch.tensor(real)[:, None]


def _keep(pad):
    """Our functional mask: bool (B, 1, 1, S), True = real key."""
    return (~pad)[:, None, None, :]


def _replay(query, key, value, log_pi=None, **opts):
    """Causal outputs of the recurrent form, one position at a time (key (B, H, S, D) or (B, H, M, S, D))."""
    state, outs = None, []
    for t in range(query.shape[2]):
        k_t = key[:, :, t] if key.dim() == 4 else key[:, :, :, t]
        lp = None if log_pi is None else log_pi[..., t]
        out, state = linear_attention_step(query[:, :, t], k_t, value[:, :, t], state, log_pi_t=lp, **opts)
        outs.append(out)
    return torch.stack(outs, dim=2)


# --- each authors' form equals its reference --------------------------------------------------------------------

@pytest.mark.parametrize("backend", LINEAR_BACKENDS)
def test_lra_linear_equals_reference(backend):
    q, k, v = _qkv()
    pad = _padding()
    want = lra_linear(q, k, v, pad)
    got = linear_attention(q, k, v, attn_mask=_keep(pad), normalize="length", backend=backend)
    torch.testing.assert_close(got, want, **TOL)
    # padded query rows are not masked in the authors' form, nor here: they attend to the real keys
    assert got[1, :, 6:].abs().sum() > 0


@pytest.mark.parametrize("backend", LINEAR_BACKENDS)
def test_lra_mlk_equals_reference(backend):
    q, k1, k2, v = _qkv(n=4)
    pad = _padding()
    pi = torch.tensor([0.7, 0.35], dtype=torch.float64)  # inside the authors' clamp range, so c(pi) = pi
    want = lra_mlk(q, k1, k2, pi, v, pad)
    log_pi = pi.log()[:, None]  # (M, 1): one pair for every head and position (pi_shape="layer")
    got = mlk_attention(q, torch.stack([k1, k2], dim=2), v, log_pi=log_pi, attn_mask=_keep(pad), mix="keys",
                        normalize="length", backend=backend)
    torch.testing.assert_close(got, want, **TOL)


def test_lra_mgk_equals_reference(backend):
    """The authors' LRA MGK (one clamped pi pair per layer, both variances sqrt(D)) is our MGK with one log-prior
    pair shared by heads and positions (pi_shape="layer"); its scale cancels in the row normalisation."""
    q, k1, k2, v = _qkv(n=4)
    pad = _padding()
    pi = torch.tensor([0.8, 0.3], dtype=torch.float64)
    want = lra_mgk(q, k1, k2, pi, v, pad)
    got = mgk_attention(q, torch.stack([k1, k2], dim=2), v, log_pi=pi.log()[:, None], attn_mask=_keep(pad),
                        backend=backend)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("backend", LINEAR_BACKENDS + ("step",))
def test_lm_type34_equals_reference(backend, normalize):
    q, k, v = _qkv(seed=3)
    want = lm_linear_type34(q, k, v, normalize=normalize)
    opts = dict(LM34, normalize="row" if normalize else "none")
    if backend == "step":
        got = _replay(q, k, v, **opts)
    else:
        got = linear_attention(q, k, v, is_causal=True, chunk_size=4, backend=backend, **opts)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("backend", LINEAR_BACKENDS + ("step",))
def test_lm_type400_equals_reference(backend):
    q, k1, k2, v = _qkv(seed=5, n=4)
    P = 16  # the authors' tables have 256 positions; the first L are used
    pi0, pi1 = torch.rand(H, P, dtype=torch.float64) * 0.9 + 0.05, torch.rand(H, P, dtype=torch.float64) * 0.9 + 0.05
    want = lm_mlk_type400(q, k1, k2, v, pi0, pi1)
    log_pi = torch.stack([pi0[:, :L], pi1[:, :L]], dim=1).log()  # (H, M, S): per head and key position
    key = torch.stack([k1, k2], dim=2)
    if backend == "step":
        got = _replay(q, key, v, log_pi=log_pi, mix="features", **LM34)
    else:
        got = mlk_attention(q, key, v, log_pi=log_pi, is_causal=True, mix="features", chunk_size=4,
                            backend=backend, **LM34)
    torch.testing.assert_close(got, want, **TOL)


def test_lm_mgk_equals_reference(backend):
    """Un-normalised per-position weights (exp of free log-weights = the authors' clamped value inside [0, 1]) and
    sigma_2^2 = sqrt(D)/3. The authors' row normaliser adds 1e-6; ours has none, so eps=0 in the reference."""
    q, k1, k2, v = _qkv(seed=7, n=4)
    pi = torch.rand(2, H, 16, dtype=torch.float64) * 0.9 + 0.05  # (M, H, P)
    sigma2 = torch.tensor([math.sqrt(D), math.sqrt(D) / 3], dtype=torch.float64)
    want = lm_mgk(q, k1, k2, v, pi, eps=0.0)
    log_pi = pi[:, :, :L].log().transpose(0, 1)  # (H, M, S)
    got = mgk_attention(q, torch.stack([k1, k2], dim=2), v, log_pi=log_pi, sigma2=sigma2, is_causal=True,
                        backend=backend)
    torch.testing.assert_close(got, want, **TOL)
    # the authors' + 1e-6 shrinks each row by s / (s + 1e-6), s its kernel sum (their output for constant values
    # 1): the one difference, visible above 1e-10 but exactly accounted for
    with_eps = lm_mgk(q, k1, k2, v, pi)
    shrink = lm_mgk(q, k1, k2, torch.ones_like(v), pi)[..., :1]
    assert (with_eps - got).abs().max() > 1e-10
    torch.testing.assert_close(with_eps, got * shrink, **TOL)


# --- properties of the new options --------------------------------------------------------------------------------

FORMS = [dict(normalize=n, feature_map=f, output_scale=s, eps_mode=e)
         for n, f, s, e in itertools.product(("row", "length", "none"), ("elu", "elu_sum"), (1.0, 0.5),
                                             ("guard", "add"))
         if not (n != "row" and e == "add")]


def _form_id(f):
    return "-".join(str(x) for x in f.values())


def _explicit(q, k, v, *, keep=None, causal=False, log_pi=None, mix="features", normalize="row",
              feature_map="elu", output_scale=1.0, eps=1e-6, eps_mode="guard"):
    """Independent float64 double sum of every form: out_i = s * sum_j w_ij v_j [/ (sum_j w_ij (+ eps))]."""
    fm = {"elu": lambda x: F.elu(x) + 1, "elu_sum": lambda x: (F.elu(x) + 1) / (F.elu(x) + 1).sum(-1, keepdim=True)}
    fm = fm[feature_map]
    k = k if k.dim() == 5 else k.unsqueeze(2)
    M, S, Lq = k.shape[2], k.shape[3], q.shape[2]
    pi = (torch.full((1, 1, M, 1), 1.0 / M, dtype=q.dtype) if log_pi is None
          else log_pi.reshape((1,) * (4 - log_pi.dim()) + tuple(log_pi.shape)).exp())
    pi = pi.expand(q.shape[0], q.shape[1], M, S)[..., None]
    fk = fm((pi * k).sum(2)) if mix == "keys" else (pi * fm(k)).sum(2)
    fq = fm(q)
    if normalize == "length":
        fq, fk = fq * Lq ** -0.25, fk * S ** -0.25
    out = torch.zeros(q.shape[0], q.shape[1], Lq, v.shape[-1], dtype=q.dtype)
    for i in range(Lq):
        num, den = 0.0, 0.0
        for j in range(S):
            if (causal and j > i + S - Lq) or (keep is not None and not bool(keep[0, 0, 0, j])):
                continue
            w = (fq[:, :, i] * fk[:, :, j]).sum(-1, keepdim=True)
            num, den = num + w * v[:, :, j], den + w
        if normalize == "row":
            den = den + eps if eps_mode == "add" else den
            num = num / den
        out[:, :, i] = output_scale * num
    return out


@pytest.mark.parametrize("form", FORMS, ids=_form_id)
def test_every_form_on_every_backend_equals_the_double_sum(form):
    q, k, v = _qkv(seed=11, L=7)
    for causal in (False, True):
        want = _explicit(q, k, v, causal=causal, **form)
        for backend in LINEAR_BACKENDS:
            got = linear_attention(q, k, v, is_causal=causal, chunk_size=3, backend=backend, **form)
            torch.testing.assert_close(got, want, **TOL)
        if causal:  # the recurrent form
            lengths = (7, 7) if form["normalize"] == "length" else None
            torch.testing.assert_close(_replay(q, k, v, lengths=lengths, **form), want, **TOL)


@pytest.mark.parametrize("mix", ["features", "keys"])
@pytest.mark.parametrize("form", [FORMS[0], FORMS[-1], dict(normalize="length"), dict(feature_map="elu_sum")],
                         ids=_form_id)
def test_mlk_mix_on_every_backend_equals_the_double_sum(mix, form):
    q, k1, k2, v = _qkv(seed=13, n=4, L=6)
    key = torch.stack([k1, k2], dim=2)
    log_pi = _t(1, H, 2, 6, scale=0.5)  # un-normalised per-position weights
    for causal in (False, True):
        want = _explicit(q, key, v, causal=causal, log_pi=log_pi, mix=mix, **form)
        for backend in LINEAR_BACKENDS:
            got = mlk_attention(q, key, v, log_pi=log_pi, is_causal=causal, mix=mix, chunk_size=4, backend=backend,
                                **form)
            torch.testing.assert_close(got, want, **TOL)
        if causal:
            lengths = (6, 6) if form.get("normalize") == "length" else None
            torch.testing.assert_close(_replay(q, key, v, log_pi=log_pi, mix=mix, lengths=lengths, **form), want,
                                       **TOL)


@pytest.mark.parametrize("form", FORMS + [dict(normalize="length", mix="keys")], ids=_form_id)
def test_causality(form):
    q, k1, k2, v = _qkv(seed=17, n=4)
    key = torch.stack([k1, k2], dim=2)
    out = mlk_attention(q, key, v, is_causal=True, **form)
    for t in (0, 4, L - 2):
        key2, v2 = key.clone(), v.clone()
        key2[:, :, :, t + 1:] = _t(99, B, H, 2, L - t - 1, D, scale=5.0)
        v2[:, :, t + 1:] = -3.0
        out2 = mlk_attention(q, key2, v2, is_causal=True, **form)
        torch.testing.assert_close(out2[:, :, :t + 1], out[:, :, :t + 1], rtol=0, atol=1e-12)
        assert not torch.allclose(out2[:, :, t + 1:], out[:, :, t + 1:])


@pytest.mark.parametrize("form", [f for f in FORMS if f["normalize"] != "length"], ids=_form_id)
def test_padding_is_invariant_for_row_and_none(form):
    """Padded keys, whatever they hold (NaN included), change nothing, and the real rows equal the unpadded call."""
    q, k, v = _qkv(seed=19)
    pad = _padding(real=(L, 6))
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 6:], v2[1, :, 6:] = float("nan"), 1e30
    for causal, backend in itertools.product((False, True), LINEAR_BACKENDS):
        out = linear_attention(q, k2, v2, attn_mask=_keep(pad), is_causal=causal, backend=backend, **form)
        assert torch.isfinite(out).all()
        short = linear_attention(q[1:, :, :6], k[1:, :, :6], v[1:, :, :6], is_causal=causal, backend=backend,
                                 **form)
        torch.testing.assert_close(out[1:, :, :6], short, **TOL)


@pytest.mark.parametrize("mix", ["features", "keys"])
def test_length_padding_content_is_inert_but_the_scale_uses_the_tensor_length(mix):
    """normalize="length" (the authors' LRA form) is NOT invariant to padding by design: the features are scaled by
    the fourth roots of the *tensor* lengths L and S, padding included. What padding holds never matters."""
    q, k1, k2, v = _qkv(seed=23, n=4)
    key = torch.stack([k1, k2], dim=2)
    pad = _padding(real=(L, 6))
    key2, v2 = key.clone(), v.clone()
    key2[1, :, :, 6:], v2[1, :, 6:] = float("nan"), -1e30
    for backend in LINEAR_BACKENDS:
        out = mlk_attention(q, key, v, attn_mask=_keep(pad), normalize="length", mix=mix, backend=backend)
        out2 = mlk_attention(q, key2, v2, attn_mask=_keep(pad), normalize="length", mix=mix, backend=backend)
        torch.testing.assert_close(out2, out, rtol=0, atol=0)
        short = mlk_attention(q[1:, :, :6], key[1:, :, :, :6], v[1:, :, :6], normalize="length", mix=mix,
                              backend=backend)
        # L = S = 11 against 6: the real rows differ by exactly (6 * 6 / (11 * 11))^(1/4)
        torch.testing.assert_close(out[1:, :, :6], short * (36 / L ** 2) ** 0.25, **TOL)


@pytest.mark.parametrize("mix", ["features", "keys"])
@pytest.mark.parametrize("form", [FORMS[0], FORMS[5], FORMS[-1], FORMS[-3]], ids=_form_id)
def test_one_component_mlk_is_linear_attention(form, mix):
    q, k, v = _qkv(seed=29)
    pad = _padding()
    for causal, backend in itertools.product((False, True), LINEAR_BACKENDS):
        want = linear_attention(q, k, v, attn_mask=_keep(pad), is_causal=causal, backend=backend, **form)
        for log_pi in (None, torch.zeros(1, 1)):
            got = mlk_attention(q, k.unsqueeze(2), v, log_pi=log_pi, attn_mask=_keep(pad), is_causal=causal,
                                mix=mix, backend=backend, **form)
            torch.testing.assert_close(got, want, **TOL)


def test_mix_keys_with_equal_components_is_linear_attention_and_differs_from_mix_features():
    q, k, k2, v = _qkv(seed=31, n=4)
    half = torch.full((2, 1), math.log(0.5), dtype=torch.float64)
    same = mlk_attention(q, torch.stack([k, k], dim=2), v, log_pi=half, mix="keys", normalize="length")
    torch.testing.assert_close(same, linear_attention(q, k, v, normalize="length"), **TOL)
    two = torch.stack([k, k2], dim=2)
    assert not torch.allclose(mlk_attention(q, two, v, mix="keys"), mlk_attention(q, two, v, mix="features"))


def test_eps_modes():
    """"add" divides by den + eps on every row; "guard" only replaces an exactly-zero denominator; neither gives NaN
    for a row whose visible keys all have zero features (a ReLU feature map)."""
    q, k, v = _qkv(seed=37)
    plain = linear_attention(q, k, v, eps=0.0)
    big = linear_attention(q, k, v, eps=0.5, eps_mode="add")
    none = linear_attention(q, k, v, normalize="none")
    den = (F.elu(q) + 1) @ (F.elu(k) + 1).sum(-2).unsqueeze(-1)  # (B, H, L, 1)
    torch.testing.assert_close(big, none / (den + 0.5), **TOL)
    torch.testing.assert_close(linear_attention(q, k, v, eps=0.5), plain, **TOL)
    relu = torch.relu
    qz = -q.abs() - 1.0  # relu(q) = 0: every weight and the denominator are exactly 0
    for mode in ("guard", "add"):
        for eps in (0.0, 1e-5):
            out = linear_attention(qz, k, v, feature_map=relu, eps=eps, eps_mode=mode)
            assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("form", [dict(normalize="length", mix="keys"), dict(normalize="none", mix="features"),
                                  dict(LM34, mix="features"), dict(LM34, mix="keys")], ids=_form_id)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", LINEAR_BACKENDS)
def test_gradcheck(form, causal, backend):
    g = torch.Generator().manual_seed(41)
    q = torch.randn(1, 2, 5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    key = torch.randn(1, 2, 2, 5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    log_pi = torch.randn(2, 2, 5, dtype=torch.float64, generator=g, requires_grad=True)
    keep = torch.tensor([True, True, True, True, False])[None, None, None, :]

    def f(q, key, v, log_pi):
        return mlk_attention(q, key, v, log_pi=log_pi, attn_mask=keep, is_causal=causal, chunk_size=2,
                             backend=backend, **form)

    assert torch.autograd.gradcheck(f, (q, key, v, log_pi))


def test_step_length_needs_the_lengths():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="lengths"):
        linear_attention_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], normalize="length")


@pytest.mark.parametrize("option, value", [("normalize", "rows"), ("feature_map", "relu"), ("feature_map", 3),
                                           ("output_scale", 0.0), ("output_scale", float("nan")),
                                           ("output_scale", True), ("eps_mode", "plus"), ("mix", "raw")])
def test_bad_option_values_name_the_option(option, value):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=option):
        mlk_attention(q, k.unsqueeze(2), v, **{option: value})
    if option != "mix":
        with pytest.raises(ValueError, match=option):
            linear_attention(q, k, v, **{option: value})
