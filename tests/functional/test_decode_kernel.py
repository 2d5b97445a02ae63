"""The C++ decoding step (functional/csrc/mixture_decode.cpp) behind mgk_attention_cached, against the float64
formula (reference.py): head sizes that are not multiples of the vector width, up to its 16 new queries, float32 and
float64, strided views of a cache's buffers, threads, dead keys, empty rows and NaN; and the calls it must leave to
the GEMM form (gradients, dropout, query-dependent masks, long chunks)."""
from __future__ import annotations

import math

import pytest
import torch

from mgk.functional import _mixture_decode, _mixture_flash, mgk_attention_cached, mgk_cache_entries

from .reference import make_inputs, mgk_reference, normalised_log_pi

F64 = torch.float64


@pytest.fixture
def kernel_calls(monkeypatch):
    """The number of steps the kernel served (a list that grows by one per call)."""
    if _mixture_flash._load() is None:
        pytest.skip(f"the CPU kernel could not be built here: {_mixture_flash.build_error()}")
    calls = []
    original = _mixture_decode.mixture_decode
    monkeypatch.setattr(_mixture_decode, "mixture_decode", lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


def _case(B, H, L, S, M, D, Dv, shifted, mixture, seed):
    """float64 inputs: queries, the component keys, values, the cache's entries and the arguments of a step."""
    q, k, v = make_inputs(B=B, H=H, L=L, S=S, M=M, D=D, Dv=Dv, dtype=F64, seed=seed)
    base, shifts = k, None
    if shifted:
        g = torch.Generator().manual_seed(seed + 1)
        base = torch.randn(B, H, S, D, generator=g, dtype=F64)
        shifts = torch.randn(M, H, D, generator=g, dtype=F64) * 0.5
        k = base.unsqueeze(2) - shifts.transpose(0, 1).unsqueeze(0).unsqueeze(3)
    sigma2 = torch.linspace(0.7, 1.9, H * M, dtype=F64).reshape(H, M)  # unequal: the |q|^2 term is kept
    log_pi = None if mixture == "max" else normalised_log_pi((B, H, M, S), dim=2, seed=seed)
    mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
    mask[-1, ..., :2] = False  # the last row: two padded keys
    centre = q.mean(dim=2) + 0.2  # any centre gives the same numbers
    keys, key_bias = mgk_cache_entries(base, centre=centre, log_pi=log_pi, sigma2=sigma2, mixture=mixture,
                                       shifts=shifts)
    step = dict(centre=centre, sigma2=sigma2, shifts=shifts, mixture=mixture, attn_mask=mask, is_causal=True)
    want, _ = mgk_reference(q, k, v, log_pi=log_pi, sigma2=sigma2, mixture=mixture, mask=mask, is_causal=True,
                            log_space=True)
    return q, keys, key_bias, v, step, want


def _cast(step, dtype):
    return {name: (x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x)
            for name, x in step.items()}


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("mixture", ["sum", "max"])
@pytest.mark.parametrize("shifted", [False, True], ids=["separate", "shifted"])
@pytest.mark.parametrize("L", [1, 16])
@pytest.mark.parametrize("D,Dv", [(3, 3), (13, 69), (40, 8)])
@pytest.mark.parametrize("S", [37, 2100], ids=["dot-loop", "gemm"])
def test_kernel_step_is_the_formula(S, D, Dv, L, shifted, mixture, dtype, kernel_calls):
    """Every tail of the vector loops (D, Dv below, between and above multiples of 4, 8 and 16 lanes; Dv = 69 takes
    the 8-vector chunks and a remainder), one query and the most the kernel takes (causal among them), per-head
    unequal variances, per-key priors and a padded row; with few keys (dot products in the slice's loop) and with
    2,100 (L M S >= 2,048: one batched GEMM of every slice's dot products first)."""
    q, keys, key_bias, v, step, want = _case(2, 3, L, S, 2, D, Dv, shifted, mixture, seed=D + Dv + L)
    got = mgk_attention_cached(q.to(dtype), keys.to(dtype), key_bias.to(dtype), v.to(dtype), **_cast(step, dtype))
    assert kernel_calls and got.dtype == dtype
    tol = 1e-12 if dtype == F64 else 2e-5
    torch.testing.assert_close(got.to(F64), want, atol=tol, rtol=tol)


def test_a_step_large_enough_for_the_thread_pool_is_the_formula_and_the_same_on_one_thread(kernel_calls):
    q, keys, key_bias, v, step, want = _case(2, 4, 1, 700, 2, 32, 32, False, "sum", seed=7)
    f32 = [t.float() for t in (q, keys, key_bias, v)]
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = mgk_attention_cached(*f32, **_cast(step, torch.float32))
        torch.set_num_threads(max(2, previous))
        many = mgk_attention_cached(*f32, **_cast(step, torch.float32))
    finally:
        torch.set_num_threads(previous)
    assert len(kernel_calls) == 2
    assert torch.equal(one, many)  # each slice is computed by one thread, in one order
    torch.testing.assert_close(many.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("shifted", [False, True], ids=["separate", "shifted"])
def test_the_kernel_reads_strided_views_of_a_larger_buffer(shifted, kernel_calls):
    """A cache's entries are views of buffers with room for more tokens (their slot strides are the capacity's):
    read in place, they give the bits the same entries give when contiguous."""
    q, keys, key_bias, v, step, _ = _case(2, 2, 1, 20, 3, 8, 8, shifted, "sum", seed=3)
    slot = 2 if shifted else 3

    def in_buffer(x, dim):
        shape = list(x.shape)
        shape[dim] = 64
        buf = torch.full(shape, float("nan"), dtype=x.dtype)  # slots beyond the ones in use must never be read
        buf.narrow(dim, 0, x.shape[dim]).copy_(x)
        return buf.narrow(dim, 0, x.shape[dim])

    views = in_buffer(keys, slot), in_buffer(key_bias, 3), in_buffer(v, 2)
    assert not any(t.is_contiguous() for t in views)
    got = mgk_attention_cached(q, *views, **step)
    want = mgk_attention_cached(q, keys, key_bias, v, **step)
    assert len(kernel_calls) == 2 and torch.equal(got, want)


@pytest.mark.parametrize("S", [6, 2100], ids=["dot-loop", "gemm"])
def test_dead_keys_empty_rows_and_nan_in_the_kernel(S, kernel_calls):
    """A key with every component switched off (log pi = -inf) gets no weight, a row whose every key is padding is
    zero, and a NaN in a live key makes its row NaN (never a silently finite number)."""
    B, H, L, M, D = 3, 1, 1, 2, 4
    q, k, v = make_inputs(B=B, H=H, L=L, S=S, M=M, D=D, Dv=3, dtype=F64, seed=11)
    log_pi = torch.full((B, H, M, S), -math.log(2), dtype=F64)
    log_pi[..., 1] = float("-inf")  # key 1 off in every row
    log_pi[..., 0, 3] = float("-inf")  # key 3: one component off
    c = torch.zeros(B, H, D, dtype=F64)
    keys, bias = mgk_cache_entries(k, centre=c, log_pi=log_pi)
    mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
    mask[1] = False  # row 1 sees nothing
    keys[2, :, 1, 4] = float("nan")  # row 2: a NaN in a live key
    got = mgk_attention_cached(q, keys, bias, v, centre=c, attn_mask=mask, is_causal=True)
    assert kernel_calls
    allowed = mask.clone()
    allowed[..., 1] = False
    want, _ = mgk_reference(q[:1], k[:1], v[:1], log_pi=log_pi[:1], mask=allowed[:1], log_space=True)
    torch.testing.assert_close(got[:1], want, atol=1e-12, rtol=1e-12)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert torch.isnan(got[2]).all()


@pytest.mark.parametrize("why", ["gradient", "dropout", "query mask", "long chunk"])
def test_calls_the_kernel_cannot_serve_take_the_gemm_form(why, kernel_calls):
    """Gradients (the kernel has no backward), dropout, a mask that differs between queries and more new queries
    than the kernel takes go through the GEMM form, which gives the formula too."""
    L = 17 if why == "long chunk" else 2
    q, keys, key_bias, v, step, want = _case(1, 2, L, 30, 2, 8, 8, False, "sum", seed=5)
    if why == "gradient":
        q.requires_grad_(True)
    if why == "query mask":
        step["attn_mask"] = step["attn_mask"].expand(1, 1, L, 30).clone()
    dropout = 0.5 if why == "dropout" else 0.0
    torch.manual_seed(0)
    got = mgk_attention_cached(q, keys, key_bias, v, dropout_p=dropout, **step)
    assert not kernel_calls
    if why == "gradient":
        got.sum().backward()
        assert q.grad is not None and torch.isfinite(q.grad).all()
    if why != "dropout":
        torch.testing.assert_close(got.detach(), want, atol=1e-12, rtol=1e-12)


_GRAD_ARGS = [(shifted, name) for shifted in (False, True)
              for name in ("query", "keys", "key_bias", "value", "sigma2", "shifts")[:6 if shifted else 5]]


@pytest.mark.parametrize("shifted,name", _GRAD_ARGS,
                         ids=[f"{'shifted' if s else 'separate'}-{n}" for s, n in _GRAD_ARGS])
def test_a_step_with_any_argument_in_an_autograd_graph_takes_the_gemm_form_and_gives_its_gradient(
        shifted, name, kernel_calls, monkeypatch):
    """Whichever argument requires grad (the step's tensors, or the variances or shifts, which reach the scores
    through the query terms; the centre is detached by design), the kernel (no backward) is left out: the output has
    the GEMM form's gradient, which is the step's finite-difference gradient (the cache's entries held fixed)."""
    q, keys, key_bias, v, step, _ = _case(1, 2, 2, 9, 2, 3, 3, shifted, "sum", seed=13)
    args = dict(query=q, keys=keys, key_bias=key_bias, value=v)

    def out(x, use_kernel=True):
        with monkeypatch.context() as patch:
            if not use_kernel:
                patch.setattr(_mixture_decode, "unserved", lambda *a, **k: "switched off by the test")
            given = {**args, **step, name: x}
            return mgk_attention_cached(given.pop("query"), given.pop("keys"), given.pop("key_bias"),
                                        given.pop("value"), **given)

    x = {**args, **step}[name].clone().requires_grad_(True)
    got = out(x)
    assert not kernel_calls and got.requires_grad
    weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    grad, = torch.autograd.grad((got * weights).sum(), x)
    want, = torch.autograd.grad((out(x, use_kernel=False) * weights).sum(), x)
    torch.testing.assert_close(grad, want, atol=1e-12, rtol=1e-12)
    assert torch.autograd.gradcheck(lambda t: out(t), (x,))
    assert not kernel_calls


def _bad_steps():
    """(what is wrong, the call's arguments' changes, the name the error must carry): user errors of a step."""
    B, H, M, S, D = 2, 2, 3, 5, 4
    g = torch.Generator().manual_seed(0)
    return B, H, M, S, D, [
        ("no components", dict(keys=torch.zeros(B, H, 0, S, D), key_bias=torch.zeros(B, H, 0, S)), "key_bias"),
        ("components differ", dict(key_bias=torch.zeros(B, H, M - 1, S)), "key_bias"),
        ("head_dim differs", dict(keys=torch.randn(B, H, M, S, D + 1, generator=g)), "keys"),
        ("S differs", dict(value=torch.randn(B, H, S + 1, 3, generator=g)), "value"),
        ("integer keys", dict(keys=torch.zeros(B, H, M, S, D, dtype=torch.int64)), "keys"),
        ("float mask", dict(attn_mask=torch.ones(B, 1, 1, S)), "attn_mask"),
        ("mask shape", dict(attn_mask=torch.ones(B, 1, 1, S + 1, dtype=torch.bool)), "attn_mask"),
        ("sigma2 shape", dict(sigma2=torch.ones(H + 1, M)), "sigma2"),
        ("centre shape", dict(centre=torch.zeros(B, H, D + 1)), "centre"),
        ("shifts shape", dict(shifts=torch.zeros(M, H, D + 1), keys=torch.randn(B, H, S, D, generator=g)), "shifts"),
    ]


@pytest.mark.parametrize("what", [case[0] for case in _bad_steps()[-1]])
def test_user_errors_in_a_step_are_named_errors_raised_before_the_kernel(what, kernel_calls):
    """A wrong shape, dtype or mask is a ValueError (MaskError) naming the argument, raised in Python: never the
    kernel's own checks nor a RuntimeError from deep inside (no mixture components used to be one)."""
    B, H, M, S, D, cases = _bad_steps()
    change, name = next((c, n) for w, c, n in cases if w == what)
    g = torch.Generator().manual_seed(1)
    args = dict(query=torch.randn(B, H, 1, D, generator=g), keys=torch.randn(B, H, M, S, D, generator=g),
                key_bias=torch.randn(B, H, M, S, generator=g), value=torch.randn(B, H, S, 3, generator=g),
                centre=torch.zeros(B, H, D))
    args.update(change)
    with pytest.raises(ValueError, match=name):
        mgk_attention_cached(args.pop("query"), args.pop("keys"), args.pop("key_bias"), args.pop("value"), **args)
    assert not kernel_calls


@pytest.mark.parametrize("shifted", [False, True], ids=["separate", "shifted"])
def test_cache_entries_of_no_components_are_refused_naming_the_argument(shifted):
    B, H, S, D = 2, 2, 5, 4
    key = torch.randn(B, H, S, D) if shifted else torch.randn(B, H, 0, S, D)
    with pytest.raises(ValueError, match=f"{'shifts' if shifted else 'key'} must hold at least one"):
        mgk_cache_entries(key, centre=torch.zeros(B, H, D), shifts=torch.zeros(0, H, D) if shifted else None)


@pytest.mark.parametrize("how", ["vmap", "compile"])
def test_a_step_under_vmap_or_a_full_graph_compile_masks_dead_keys_without_reading_values(how, kernel_calls):
    """torch.func.vmap (over stacked decoding batches) and torch.compile(fullgraph=True) see tensors with no values
    to read: the GEMM form then folds keys whose every component is off (log pi = -inf, NaN keys there) into the
    mask without a data-dependent branch, and gives the formula; the kernel is not used under them."""
    N, B, H, L, S, M, D = 2, 2, 1, 1, 6, 2, 4
    q, k, v = make_inputs(B=N * B, H=H, L=L, S=S, M=M, D=D, Dv=3, dtype=F64, seed=17)
    log_pi = torch.full((N * B, H, M, S), -math.log(M), dtype=F64)
    log_pi[1, ..., 2] = float("-inf")  # key 2 of row 1 is off
    c = torch.zeros(N * B, H, D, dtype=F64)
    keys, bias = mgk_cache_entries(k, centre=c, log_pi=log_pi)
    keys[1, :, :, 2] = float("nan")
    allowed = torch.ones(N * B, 1, 1, S, dtype=torch.bool)
    allowed[1, ..., 2] = False
    want, _ = mgk_reference(q, k, v, log_pi=log_pi, mask=allowed, log_space=True)

    def step(q, keys, bias, v, c):
        return mgk_attention_cached(q, keys, bias, v, centre=c, is_causal=True)

    args = (q, keys, bias, v, c)
    if how == "vmap":
        got = torch.func.vmap(step)(*(t.reshape(N, B, *t.shape[1:]) for t in args)).reshape(want.shape)
    else:
        torch.compiler.reset()
        got = torch.compile(step, backend="eager", fullgraph=True)(*args)
    assert not kernel_calls
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
