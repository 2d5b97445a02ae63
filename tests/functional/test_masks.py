"""Mask conventions (bool only, True = may attend; a float 0/1 mask is never taken as an additive bias) and argument
validation of the functional attention API."""
from __future__ import annotations

import pytest
import torch

from mgk.functional import (
    MaskError,
    causal_mask,
    mgk_attention,
    mgk_responsibilities,
    softmax_attention,
    softmax_attention_reference,
)

from .reference import causal_allowed, make_inputs, padding_mask

F64 = torch.float64


def softmax_fast(q, k, v, **kw):
    return softmax_attention(q, k[:, :, 0], v, **kw)


def softmax_twin(q, k, v, **kw):
    return softmax_attention_reference(q, k[:, :, 0], v, **kw)


def mgk_fast(q, k, v, **kw):
    return mgk_attention(q, k, v, **kw)


def mgk_explicit(q, k, v, **kw):
    return mgk_attention(q, k, v, backend="explicit", **kw)


def mgk_weights(q, k, v, **kw):
    return mgk_attention(q, k, v, return_weights=True, **kw)[0]


def mgk_max(q, k, v, **kw):
    return mgk_attention(q, k, v, mixture="max", **kw)


def mgk_resp(q, k, v, **kw):
    return mgk_responsibilities(q, k, **kw)[0]


FNS = [softmax_fast, softmax_twin, mgk_fast, mgk_explicit, mgk_weights, mgk_max]
FN_IDS = [f.__name__ for f in FNS]


# ---- causal_mask --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("L,S", [(1, 1), (4, 4), (3, 6), (6, 3), (1, 5), (5, 1), (0, 3)])
def test_causal_mask_bottom_right(L, S):
    m = causal_mask(L, S)
    assert m.dtype == torch.bool and m.shape == (L, S)
    assert torch.equal(m, causal_allowed(L, S))
    if L and S:
        assert m[-1].all()  # the last query sees every key


def test_causal_mask_square_is_lower_triangular():
    assert torch.equal(causal_mask(5, 5), torch.ones(5, 5, dtype=torch.bool).tril())


# ---- mask dtypes ------------------------------------------------------------------------------------------------

def test_mask_error_is_value_error():
    assert issubclass(MaskError, ValueError)


@pytest.mark.parametrize("fn", FNS + [mgk_resp], ids=FN_IDS + ["mgk_resp"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int64, torch.float32, torch.float64, torch.int32])
def test_non_bool_masks_raise_naming_attn_mask(fn, dtype):
    q, k, v = make_inputs(B=1, H=1, L=6, S=6, M=2, D=4, seed=0)
    mask = padding_mask([4], 6).to(dtype)
    with pytest.raises(MaskError, match="attn_mask"):
        fn(q, k, v, attn_mask=mask)
    with pytest.raises(ValueError, match="attn_mask"):
        fn(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("fn", FNS + [mgk_resp], ids=FN_IDS + ["mgk_resp"])
@pytest.mark.parametrize("shape", [(2, 1, 1, 6), (1, 1, 6, 5), (1, 3, 6, 6), (6,  7), (1, 1, 1, 1, 6)])
def test_mask_of_wrong_shape_raises(fn, shape):
    q, k, v = make_inputs(B=1, H=1, L=6, S=6, M=2, D=4, seed=0)
    with pytest.raises(ValueError, match="attn_mask"):
        fn(q, k, v, attn_mask=torch.ones(shape, dtype=torch.bool))


@pytest.mark.parametrize("fn", FNS, ids=FN_IDS)
@pytest.mark.parametrize("causal", [False, True])
def test_all_true_mask_equals_none(fn, causal):
    q, k, v = make_inputs(B=2, H=2, L=6, S=6, M=2, D=4, dtype=F64, seed=1)
    base = fn(q, k, v, is_causal=causal)
    for shape in [(6, 6), (2, 1, 1, 6), (2, 2, 6, 6), (1,)]:
        torch.testing.assert_close(fn(q, k, v, attn_mask=torch.ones(shape, dtype=torch.bool), is_causal=causal),
                                   base, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("fn", FNS, ids=FN_IDS)
def test_polarity_probe(fn):
    """Polarity: the mask's real set is 0-3. Changing a padded key changes nothing; changing a real key changes
    outputs."""
    q, k, v = make_inputs(B=1, H=2, L=6, S=6, M=2, D=4, dtype=F64, seed=2)
    mask = padding_mask([4], 6)
    base = fn(q, k, v, attn_mask=mask)
    k_pad, v_pad = k.clone(), v.clone()
    k_pad[:, :, :, 5] += 3.0
    v_pad[:, :, 5] -= 7.0
    assert torch.equal(fn(q, k_pad, v_pad, attn_mask=mask), base)
    k_real, v_real = k.clone(), v.clone()
    k_real[:, :, :, 2] += 3.0
    v_real[:, :, 2] -= 7.0
    assert (fn(q, k_real, v_real, attn_mask=mask) - base).abs().max() > 1e-3
    # and the masked result really differs from the unmasked one (mask is not ignored)
    assert (fn(q, k, v) - base).abs().max() > 1e-3


@pytest.mark.parametrize("fn", FNS, ids=FN_IDS)
def test_mask_broadcast_over_heads_and_batch(fn):
    q, k, v = make_inputs(B=2, H=2, L=4, S=5, M=2, D=3, dtype=F64, seed=3)
    m = torch.rand(2, 1, 4, 5, generator=torch.Generator().manual_seed(0)) < 0.6
    torch.testing.assert_close(fn(q, k, v, attn_mask=m), fn(q, k, v, attn_mask=m.expand(2, 2, 4, 5).clone()),
                               atol=1e-12, rtol=1e-12)


# ---- argument validation ---------------------------------------------------------------------------------------

def _base(dtype=torch.float32):
    return make_inputs(B=2, H=2, L=4, S=5, M=2, D=3, Dv=3, dtype=dtype, seed=4)


def _bad_cases_mgk():
    q, k, v = _base()
    yield "query", dict(query=q[0])                                    # rank 3
    yield "query", dict(query=q.to(torch.int64))                       # integer dtype
    yield "query", dict(query=q.numpy())                               # not a tensor
    yield "key", dict(key=k[:, :, 0])                                  # softmax-shaped key (rank 4)
    yield "key", dict(key=k.to(torch.int32))
    yield "key", dict(key=k[..., :2])                                  # head_dim mismatch
    yield "key", dict(key=k[:1])                                       # batch mismatch
    yield "key", dict(key=k[:, :1])                                    # heads mismatch
    yield "value", dict(value=v[:, :, :4])                             # S mismatch
    yield "value", dict(value=v[0])                                    # rank 3
    yield "value", dict(value=v.to(torch.bool))
    yield "value", dict(value=v[:1])                                   # batch mismatch
    yield "log_pi", dict(log_pi=torch.zeros(2, 3, 5))                  # M mismatch
    yield "log_pi", dict(log_pi=torch.zeros(1, 1, 1, 2, 5))            # rank 5
    yield "log_pi", dict(log_pi=torch.zeros(2, 2, 5, dtype=torch.int64))
    yield "log_pi", dict(log_pi=torch.zeros(3, 2, 1))                  # heads mismatch
    yield "sigma2", dict(sigma2=torch.ones(3))                         # wrong number of components
    yield "sigma2", dict(sigma2=torch.tensor([1.0, -1.0]))
    yield "sigma2", dict(sigma2=torch.tensor([1.0, 0.0]))
    yield "sigma2", dict(sigma2=torch.tensor([1.0, float("nan")]))
    yield "sigma2", dict(sigma2=-2.0)
    yield "sigma2", dict(sigma2=0.0)
    yield "sigma2", dict(sigma2=float("inf"))
    yield "sigma2", dict(sigma2="1.0")
    yield "mixture", dict(mixture="mean")
    yield "log_pi", dict(mixture="max", log_pi=torch.zeros(2, 2, 1))  # pi is unused by Hard-E: refuse it


BAD_MGK = list(_bad_cases_mgk())


@pytest.mark.parametrize("case", range(len(BAD_MGK)), ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_MGK)])
@pytest.mark.parametrize("path", ["fast", "explicit", "weights"])
def test_mgk_bad_arguments_raise_value_error_naming_argument(case, path):
    name, over = BAD_MGK[case]
    q, k, v = _base()
    kw = dict(query=q, key=k, value=v)
    kw.update(over)
    args = (kw.pop("query"), kw.pop("key"), kw.pop("value"))
    if path == "explicit":
        kw["backend"] = "explicit"
    elif path == "weights":
        kw["return_weights"] = True
    with pytest.raises(ValueError, match=name):
        mgk_attention(*args, **kw)


def _bad_cases_softmax():
    q, k, v = _base()
    k = k[:, :, 0]
    yield "query", dict(query=q[0])
    yield "query", dict(query=q.to(torch.int64))
    yield "key", dict(key=k[None])
    yield "key", dict(key=k.to(torch.int64))
    yield "key", dict(key=k[..., :2])
    yield "key", dict(key=k[:1])
    yield "key", dict(key=k[:, :1])
    yield "value", dict(value=v[:, :, :3])
    yield "value", dict(value=v[0])
    yield "value", dict(value=v.to(torch.int64))


BAD_SOFTMAX = list(_bad_cases_softmax())


@pytest.mark.parametrize("case", range(len(BAD_SOFTMAX)), ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_SOFTMAX)])
def test_softmax_bad_arguments_raise_value_error_naming_argument(case):
    name, over = BAD_SOFTMAX[case]
    q, k, v = _base()
    kw = dict(query=q, key=k[:, :, 0], value=v)
    kw.update(over)
    with pytest.raises(ValueError, match=name):
        softmax_attention(kw.pop("query"), kw.pop("key"), kw.pop("value"), **kw)


def test_valid_arguments_do_not_raise():
    """Counterpart of the bad-argument tests: the base arguments themselves are accepted on every path."""
    q, k, v = _base()
    mgk_attention(q, k, v, log_pi=torch.zeros(2, 2, 1), sigma2=torch.tensor([1.0, 2.0]))
    mgk_attention(q, k, v, sigma2=2.0, backend="explicit")
    mgk_attention(q, k, v, mixture="max", return_weights=True)
    softmax_attention(q, k[:, :, 0], v)


def test_query_mask_validation_in_responsibilities():
    q, k, _ = _base()
    with pytest.raises(ValueError, match="query_mask"):
        mgk_responsibilities(q, k, query_mask=torch.ones(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="query_mask"):
        mgk_responsibilities(q, k, query_mask=torch.ones(2, 5, dtype=torch.bool))


def _bad_cases_resp():
    q, k, _ = _base()
    yield "query", dict(query=q[0])
    yield "query", dict(query=q.to(torch.int64))
    yield "key", dict(key=k[:, :, 0])                                  # rank 4
    yield "key", dict(key=k[0, 0])                                     # rank 3
    yield "key", dict(key=k[0, 0, 0])                                  # rank 2
    yield "key", dict(key=k[:, :, :0])                                 # M = 0 components
    yield "key", dict(key=k[..., :2])                                  # head_dim mismatch
    yield "log_pi", dict(log_pi=torch.zeros(3, 2, 5))
    yield "sigma2", dict(sigma2=torch.ones(3))
    yield "sigma2", dict(sigma2=-1.0)


BAD_RESP = list(_bad_cases_resp())


@pytest.mark.parametrize("case", range(len(BAD_RESP)), ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_RESP)])
def test_responsibilities_bad_arguments_raise_value_error_naming_argument(case):
    name, over = BAD_RESP[case]
    q, k, _ = _base()
    kw = dict(query=q, key=k)
    kw.update(over)
    with pytest.raises(ValueError, match=name):
        mgk_responsibilities(kw.pop("query"), kw.pop("key"), **kw)


@pytest.mark.parametrize("path", ["fast", "explicit", "weights"])
def test_mgk_zero_components_raise_value_error(path):
    q, k, v = _base()
    kw = {"explicit": dict(backend="explicit"), "weights": dict(return_weights=True), "fast": {}}[path]
    with pytest.raises(ValueError, match="key"):
        mgk_attention(q, k[:, :, :0], v, **kw)
