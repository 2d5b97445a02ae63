"""The C++ CPU kernel of MGK (component weights summed before the value product) against the formula in float64,
against the SDPA path, and its build fallback."""
from __future__ import annotations

import warnings

import pytest
import torch

from mgk.functional import _mixture_flash, mgk_attention

from .reference import make_inputs, mgk_reference, normalised_log_pi, padding_mask

F64 = torch.float64

pytestmark = pytest.mark.skipif(not _mixture_flash.available(torch.zeros(1), 0.0),
                                reason=f"the C++ MGK kernel could not be built: {_mixture_flash.build_error()}")


def formula(q, k, bias, v, rowbias, causal):
    """out_i = sum_{j,r} softmax_{(j,r)}(q_i.k_jr + bias_jr + rowbias_ir) v_j, differentiable, bottom-right causal;
    rows that see no key are 0."""
    s = torch.einsum("bhld,bhmsd->bhlms", q, k) + bias.unsqueeze(2)
    if rowbias is not None:
        s = s + rowbias.transpose(-1, -2).unsqueeze(-1)
    B, H, L, M, S = s.shape
    if causal:
        allowed = torch.ones(L, S, dtype=torch.bool).tril(S - L)
        s = s.masked_fill(~allowed[:, None, :], float("-inf"))
    w = torch.softmax(s.reshape(B, H, L, M * S), dim=-1).reshape(B, H, L, M, S).sum(3)
    return torch.nan_to_num(w, nan=0.0) @ v



def formula_hard(q, k, bias, v, rowbias, causal):
    """Hard-E: out_i = sum_j softmax_j(max_r (q_i.k_jr + bias_jr)) v_j, bottom-right causal; rows that see no key 0.
    (rowbias is constant along a row and cancels; accepted for the signature of :func:`formula`.)"""
    s = (torch.einsum("bhld,bhmsd->bhlms", q, k) + bias.unsqueeze(2)).amax(dim=3)
    L, S = s.shape[-2:]
    if causal:
        s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(S - L), float("-inf"))
    return torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0) @ v

def inputs(B, H, L, S, M, D, Dv, rowbias, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = [torch.randn(*shape, generator=g, dtype=F64) for shape in
         [(B, H, L, D), (B, H, M, S, D), (B, H, M, S), (B, H, S, Dv)] + ([(B, H, M, L)] if rowbias else [])]
    t[1] = t[1] * 0.5
    return [x.to(dtype).requires_grad_() for x in t]


# Shapes cross the kernel's block sizes (128 queries, 512 keys) with partial last blocks.
CASES = [
    dict(B=2, H=3, L=130, S=700, M=2, D=8, Dv=5),
    dict(B=1, H=2, L=300, S=300, M=3, D=16, Dv=16),
    dict(B=2, H=1, L=7, S=9, M=1, D=4, Dv=3),
    dict(B=1, H=1, L=600, S=1030, M=2, D=32, Dv=32),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(str(v) for v in c.values()))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rowbias", [False, True])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_kernel_matches_formula_with_gradients(case, causal, rowbias, dtype):
    ins = inputs(**case, rowbias=rowbias, dtype=dtype)
    q, k, bias, v = ins[:4]
    rb = ins[4] if rowbias else None
    out = _mixture_flash.mixture_flash(q, k, bias, v, rb, causal)
    ref_ins = [x.detach().to(F64).requires_grad_() for x in ins]
    ref = formula(*ref_ins[:4], ref_ins[4] if rowbias else None, causal)
    tol = dict(atol=1e-11, rtol=1e-10) if dtype == F64 else dict(atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out.to(F64), ref, **tol)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    grads = torch.autograd.grad(out, ins, g.to(dtype))
    ref_grads = torch.autograd.grad(ref, ref_ins, g)
    for name, a, b in zip(["q", "k", "bias", "v", "rowbias"], grads, ref_grads):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a.to(F64), b, **tol, msg=lambda m, n=name: f"grad of {n}: {m}")



def _laid_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The values of ``t`` (B, H, rows, cols) or (B, H, M, rows, cols) in another memory layout: "heads inside" as a
    projection leaves them ((B, rows, H, cols) or (B, rows, M, H, cols) seen through a permute), "row gaps" (a slice
    of wider rows), "broadcast" (size-1 batch expanded: stride 0), "columns strided" (transposed storage, which the
    kernel cannot read by rows: the caller copies it), "contiguous"."""
    t = t.detach()
    if layout == "heads inside":
        order = list(range(t.dim()))
        order[1], order[-2] = order[-2], order[1]  # swap H and rows in storage, then view them back
        return t.permute(order).contiguous().permute(order)
    if layout == "row gaps":
        wide = torch.zeros(*t.shape[:-1], t.shape[-1] + 3, dtype=t.dtype)
        wide[..., : t.shape[-1]] = t
        return wide[..., : t.shape[-1]]
    if layout == "broadcast":
        return t[:1].expand_as(t)
    if layout == "columns strided":
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    return t.contiguous()


LAYOUTS = ["contiguous", "heads inside", "row gaps", "broadcast", "columns strided"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("L,S", [(1, 9), (140, 140), (7, 600)])
@pytest.mark.parametrize("hard", [False, True])
def test_the_kernel_reads_and_writes_any_layout_of_q_k_v(layout, L, S, hard):
    """q, k and v are read in place whatever their strides (the projections' (B, L, H, D) layout among them, so no
    copy in either direction); out and the gradients must equal the float64 formula's for every layout, the
    gradient of out arriving in a layout of its own too (stride 0 from a sum; transposed)."""
    B, H, M, D, Dv = 2, 3, 2, 8, 5
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(*shape, generator=g, dtype=F64) for shape in ((B, H, L, D), (B, H, M, S, D),
                                                                        (B, H, S, Dv)))
    if layout == "broadcast":  # one batch row's values, repeated
        q, k, v = q[:1].expand_as(q), k[:1].expand_as(k), v[:1].expand_as(v)
    bias = torch.randn(B, H, M, S, generator=g, dtype=F64)
    ins = [_laid_out(t, layout).requires_grad_() for t in (q, k, v)]
    out = _mixture_flash.mixture_flash(ins[0], ins[1], bias, ins[2], None, True, hard)
    ref_ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = (formula_hard if hard else formula)(ref_ins[0], ref_ins[1], bias, ref_ins[2], None, True)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-11)
    for grad_out in (torch.ones(()).expand(out.shape), torch.randn(B, H, Dv, L, generator=g, dtype=F64).mT):
        grads = torch.autograd.grad(out, ins, grad_out, retain_graph=True)
        ref_grads = torch.autograd.grad(ref, ref_ins, grad_out, retain_graph=True)
        for name, a, b, x in zip("qkv", grads, ref_grads, ins):
            torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-10, msg=lambda m, n=name: f"grad of {n}: {m}")
            if layout in ("contiguous", "heads inside"):  # dense inputs: read in place, gradients in their layout
                assert a.stride() == x.stride(), name
            assert a.stride() == _mixture_flash._grad_like(x).stride(), name  # torch.compile's fake: same layout
    assert out.transpose(1, 2).is_contiguous()  # (B, L, H, Dv) storage: merging the heads is a view


def _overlapping(shape, strides, seed):
    """A float64 tensor of ``shape`` over a small storage with ``strides``: rows that overlap (a batch or head
    dimension of stride 1), which the kernel reads in place."""
    size = 1 + sum((n - 1) * st for n, st in zip(shape, strides))
    return torch.randn(size, generator=torch.Generator().manual_seed(seed), dtype=F64).as_strided(shape, strides)


def test_gradients_of_inputs_whose_rows_overlap_are_written_where_they_belong():
    """A q, k or v whose batch or head rows overlap (stride 1 along them; read in place) must get its gradient in a
    layout whose columns are adjacent: zeros_like would order the dimensions by stride and the kernel wrote rows
    into the wrong places (a gradient error of 1.4, found by an adversarial check)."""
    q = _overlapping((2, 3, 5, 4), (7, 1, 4, 1), 0).requires_grad_()
    k = _overlapping((2, 3, 2, 6, 4), (1, 50, 24, 4, 1), 1).requires_grad_()
    v = _overlapping((2, 3, 6, 3), (1, 40, 5, 1), 2).requires_grad_()
    bias = torch.randn(2, 3, 2, 6, generator=torch.Generator().manual_seed(3), dtype=F64)
    for causal, hard in ((False, False), (True, False), (True, True)):
        out = _mixture_flash.mixture_flash(q, k, bias, v, None, causal, hard)
        ref_ins = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
        ref = (formula_hard if hard else formula)(ref_ins[0], ref_ins[1], bias, ref_ins[2], None, causal)
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-11)
        g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(4), dtype=F64)
        grads = torch.autograd.grad(out, (q, k, v), g)
        for name, a, b, x in zip("qkv", grads, torch.autograd.grad(ref, ref_ins, g), (q, k, v)):
            torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-10, msg=lambda m, n=name: f"grad of {n}: {m}")
            assert a.stride() == _mixture_flash._grad_like(x).stride(), name
    torch.testing.assert_close(
        torch.autograd.grad(mgk_attention(q, k, v, backend="kernel").sum(), v)[0],
        torch.autograd.grad(mgk_attention(q, k, v, backend="explicit").sum(), v)[0], atol=1e-12, rtol=1e-11)


@pytest.mark.parametrize("B,H,L,S", [(0, 2, 5, 6), (2, 0, 5, 6), (2, 2, 0, 6), (1, 2, 3, 0)])
def test_empty_inputs_give_zero_gradients_not_a_stride_error(B, H, L, S):
    """A batch, head, query or key count of 0: zero outputs and zero gradients (the gradient of a sum over an empty
    tensor has stride 0 everywhere, which a row check must not refuse), as the explicit backend gives."""
    q = torch.randn(B, H, L, 4, requires_grad=True)
    k = torch.randn(B, H, 2, S, 4, requires_grad=True)
    v = torch.randn(B, H, S, 3, requires_grad=True)
    for backend in ("kernel", "explicit"):
        out = mgk_attention(q, k, v, backend=backend, is_causal=L <= S)
        assert out.shape == (B, H, L, 3) and not out.any()
        if out.requires_grad:  # (with L or S = 0 the call returns new zeros, before any backend runs)
            grads = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True)
            assert all(g is None or not g.any() for g in grads), backend
    bias = torch.zeros(B, H, 2, S)
    out = _mixture_flash.mixture_flash(q, k, bias, v, None, False)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert out.shape == (B, H, L, 3) and all(g.shape == t.shape and not g.any() for g, t in zip(grads, (q, k, v)))

@pytest.mark.parametrize("L,S", [(5, 5), (3, 6), (6, 3)])
def test_gradcheck(L, S):
    ins = inputs(B=1, H=2, L=L, S=S, M=2, D=3, Dv=2, rowbias=True, dtype=F64, seed=3)
    for causal in (False, True):
        assert torch.autograd.gradcheck(lambda *t, c=causal: _mixture_flash.mixture_flash(*t, c), tuple(ins))


def test_causal_rows_without_keys_are_zero_with_finite_gradients():
    q, k, bias, v = inputs(B=1, H=1, L=9, S=4, M=2, D=4, Dv=3, rowbias=False, dtype=torch.float32)
    out = _mixture_flash.mixture_flash(q, k, bias, v, None, True)
    assert torch.equal(out[0, 0, :5], torch.zeros(5, 3))  # query i sees keys j <= i - 5
    assert out[0, 0, 5:].abs().sum() > 0
    out.sum().backward()
    for t in (q, k, bias, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[0, 0, :5], torch.zeros(5, 4))


def test_backward_is_deterministic():
    """dQ collects contributions of every key block; they are added in a fixed order, not in thread order."""
    ins = inputs(B=1, H=2, L=700, S=1500, M=2, D=16, Dv=16, rowbias=True, dtype=torch.float32, seed=5)
    runs = []
    for _ in range(3):
        out = _mixture_flash.mixture_flash(*ins, False)
        runs.append(torch.autograd.grad(out, ins, torch.ones_like(out)))
    for grads in runs[1:]:
        for a, b in zip(runs[0], grads):
            assert torch.equal(a, b)


@pytest.mark.parametrize("B,H,L,S", [(2, 2, 400, 1100), (1, 1, 700, 200), (1, 1, 90, 1500)])
def test_thread_count_changes_only_rounding(B, H, L, S):
    """Including one head with few queries or keys, where tasks are split into smaller blocks to use the threads."""
    ins = inputs(B=B, H=H, L=L, S=S, M=2, D=8, Dv=8, rowbias=False, dtype=F64, seed=6)
    results = []
    n = torch.get_num_threads()
    try:
        for threads in (1, max(2, n)):
            torch.set_num_threads(threads)
            out = _mixture_flash.mixture_flash(*ins, None, True)
            results.append((out, *torch.autograd.grad(out, ins, torch.ones_like(out))))
    finally:
        torch.set_num_threads(n)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-11)


MGK_CASES = [
    dict(L=200, S=200, causal=False, padding=True, sigma="default", log_pi=False),
    dict(L=200, S=200, causal=True, padding=True, sigma="unequal", log_pi=True),
    dict(L=150, S=620, causal=True, padding=False, sigma="learned", log_pi=False),
    dict(L=620, S=150, causal=True, padding=True, sigma="default", log_pi=True),
    dict(L=64, S=700, causal=False, padding=True, sigma="learned", log_pi=True),
]


@pytest.mark.parametrize("case", MGK_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_mgk_attention_kernel_equals_sdpa_path_and_reference(case):
    """mgk_attention's fast path with the kernel and without it (SDPA), gradients included, plus the float64
    literal reference on the output."""
    L, S = case["L"], case["S"]
    q, k, v = make_inputs(B=2, H=2, L=L, S=S, M=2, D=8, Dv=6, dtype=F64, seed=7)
    kw = dict(is_causal=case["causal"])
    if case["padding"]:
        kw["attn_mask"] = padding_mask([S, S // 3], S, left=case["causal"])
    if case["sigma"] == "unequal":
        kw["sigma2"] = torch.tensor([0.7, 2.0], dtype=F64)
    elif case["sigma"] == "learned":
        kw["sigma2"] = torch.tensor([1.3, 0.9], dtype=F64, requires_grad=True)
    if case["log_pi"]:
        kw["log_pi"] = normalised_log_pi((2, 2, 2, S), dim=2, seed=3).requires_grad_()
    leaves = [t.requires_grad_() for t in (q, k, v)] + [t for t in kw.values()
                                                        if isinstance(t, torch.Tensor) and t.requires_grad]
    g = torch.randn(2, 2, L, 6, dtype=F64, generator=torch.Generator().manual_seed(2))
    out = mgk_attention(q, k, v, **kw)
    grads = torch.autograd.grad(out, leaves, g)
    out_sdpa = mgk_attention(q, k, v, backend="sdpa", **kw)
    grads_sdpa = torch.autograd.grad(out_sdpa, leaves, g)
    torch.testing.assert_close(out, out_sdpa, atol=1e-11, rtol=1e-10)
    for a, b in zip(grads, grads_sdpa):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)
    ref_kw = {("mask" if key == "attn_mask" else key): val for key, val in kw.items()}
    ref, _ = mgk_reference(q.detach(), k.detach(), v, **{key: (val.detach() if isinstance(val, torch.Tensor) else val)
                                                         for key, val in ref_kw.items()}, log_space=True)
    torch.testing.assert_close(out.detach(), ref, atol=1e-10, rtol=1e-9)


def test_padding_poison_does_not_leak_through_the_kernel():
    q, k, v = make_inputs(B=2, H=2, L=150, S=600, M=2, D=8, Dv=4, dtype=torch.float32, seed=9)
    mask = padding_mask([600, 250], 600)
    base = mgk_attention(q, k, v, attn_mask=mask)
    k2, v2 = k.clone(), v.clone()
    k2[1, :, :, 250:] = float("nan")
    v2[1, :, 250:] = 1e30
    assert _mixture_flash.available(q, 0.0)
    torch.testing.assert_close(mgk_attention(q, k2, v2, attn_mask=mask), base, atol=0, rtol=0)


def test_build_failure_falls_back_to_sdpa_with_a_warning(monkeypatch):
    import torch.utils.cpp_extension as cpp

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(_mixture_flash, "_module", None)
    monkeypatch.setattr(_mixture_flash, "_failed", None)
    monkeypatch.setattr(cpp, "load", broken)
    q, k, v = make_inputs(B=1, H=2, L=20, S=20, M=2, D=4, Dv=3, dtype=torch.float32)
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        assert not _mixture_flash.available(q, 0.0)
    assert "no compiler here" in _mixture_flash.build_error()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, not on every call
        out = mgk_attention(q, k, v, is_causal=True)
    ref, _ = mgk_reference(q, k, v, is_causal=True)
    torch.testing.assert_close(out.to(F64), ref, atol=1e-5, rtol=1e-5)


def test_environment_variable_disables_the_kernel(monkeypatch):
    monkeypatch.setattr(_mixture_flash, "_module", None)
    monkeypatch.setattr(_mixture_flash, "_failed", None)
    monkeypatch.setenv("MGK_CPU_KERNEL", "0")
    with pytest.warns(RuntimeWarning, match="MGK_CPU_KERNEL=0"):
        assert not _mixture_flash.available(torch.zeros(2), 0.0)
    assert "MGK_CPU_KERNEL" in _mixture_flash.build_error()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, as README says
        assert not _mixture_flash.available(torch.zeros(2), 0.0)


def test_used_with_dropout_not_for_half_precision_or_dropout_one():
    """Dropout runs inside the kernel (its own tests: test_kernel_dropout.py); p = 1 and 16-bit do not."""
    assert _mixture_flash.available(torch.zeros(2), 0.1)
    assert not _mixture_flash.available(torch.zeros(2), 1.0)
    assert not _mixture_flash.available(torch.zeros(2, dtype=torch.bfloat16), 0.0)


@pytest.mark.parametrize("where", ["query", "key_first_block", "log_pi", "query_inf"])
def test_nan_and_inf_in_real_inputs_propagate_like_the_reference(where):
    """A NaN score must not be dropped by the running maximum (the row would look empty, or a whole key block
    would vanish): the kernel gives NaN where the explicit path does."""
    q, k, v = make_inputs(B=1, H=1, L=4, S=600, M=2, D=4, Dv=3, dtype=F64, seed=11)
    log_pi = normalised_log_pi((1, 1, 2, 600), dim=2, seed=1)
    if where == "query":
        q[0, 0, 1, 0] = float("nan")
    elif where == "key_first_block":
        k[0, 0, 1, 3, 0] = float("nan")
    elif where == "log_pi":
        log_pi[0, 0, 0, 5] = float("nan")
    else:
        q[0, 0, 2, 1] = float("inf")
    assert _mixture_flash.usable(q, v, 0.0)
    out = mgk_attention(q, k, v, log_pi=log_pi)
    ref = mgk_attention(q, k, v, log_pi=log_pi, backend="explicit")
    assert torch.isnan(ref).any()
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    torch.testing.assert_close(out.nan_to_num(0.0), ref.nan_to_num(0.0), atol=1e-12, rtol=1e-10)


def test_double_backward_is_refused_not_wrong():
    q, k, v = make_inputs(B=1, H=1, L=3, S=4, M=2, D=3, dtype=F64)
    q.requires_grad_()
    (g,) = torch.autograd.grad(mgk_attention(q, k, v).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad|no autograd formula"):
        torch.autograd.grad((g ** 2).sum(), q)


@pytest.mark.parametrize("D,Dv", [(0, 3), (4, 0)])
def test_zero_head_sizes_skip_the_kernel(D, Dv, capfd):
    q, k, v = make_inputs(B=1, H=1, L=4, S=5, M=2, D=D, Dv=Dv, dtype=torch.float32)
    assert not _mixture_flash.usable(q, v, 0.0)
    explicit = mgk_attention(q, k, v, sigma2=1.0, backend="explicit")
    torch.testing.assert_close(mgk_attention(q, k, v, sigma2=1.0), explicit)
    assert "MKL ERROR" not in capfd.readouterr().out


def test_padding_loses_even_to_scores_below_minus_1e30():
    """Padded keys get -inf, not a finite sentinel: real keys whose scores are astronomically low still win."""
    q, k, v = make_inputs(B=1, H=1, L=3, S=4, M=1, D=2, Dv=2, dtype=F64, seed=4)
    k = k * 1e16
    mask = padding_mask([3], 4)
    out = mgk_attention(q, k, v, attn_mask=mask, sigma2=1.0)
    torch.testing.assert_close(out, mgk_attention(q, k, v, attn_mask=mask, sigma2=1.0, backend="explicit"))
    assert out.abs().sum() > 0


def test_build_failure_warning_shows_the_end_of_the_compiler_output(monkeypatch):
    import torch.utils.cpp_extension as cpp

    def broken(*args, **kwargs):
        raise RuntimeError("Error building extension: " + "c++ -O3 -flag " * 100 + "\nc++: not found")

    monkeypatch.setattr(_mixture_flash, "_module", None)
    monkeypatch.setattr(_mixture_flash, "_failed", None)
    monkeypatch.setattr(cpp, "load", broken)
    with pytest.warns(RuntimeWarning, match="c\\+\\+: not found"):
        _mixture_flash._load()


@pytest.mark.parametrize("value", ["0", "false", "OFF"])
def test_environment_variable_spellings(monkeypatch, value):
    monkeypatch.setattr(_mixture_flash, "_module", None)
    monkeypatch.setattr(_mixture_flash, "_failed", None)
    monkeypatch.setenv("MGK_CPU_KERNEL", value)
    with pytest.warns(RuntimeWarning, match="MGK_CPU_KERNEL"):
        assert _mixture_flash._load() is None


HARD_CASES = [
    dict(L=200, S=700, causal=False, padding=True, sigma="default"),
    dict(L=300, S=300, causal=True, padding=True, sigma="unequal"),
    dict(L=620, S=150, causal=True, padding=False, sigma="learned"),
]


@pytest.mark.parametrize("case", HARD_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_hard_e_kernel_equals_explicit_path_with_gradients(case):
    L, S = case["L"], case["S"]
    q, k, v = make_inputs(B=2, H=2, L=L, S=S, M=3, D=8, Dv=6, dtype=F64, seed=21)
    kw = dict(is_causal=case["causal"], mixture="max")
    if case["padding"]:
        kw["attn_mask"] = padding_mask([S, S // 3], S, left=case["causal"])
    if case["sigma"] == "unequal":
        kw["sigma2"] = torch.tensor([0.7, 2.0, 1.1], dtype=F64)
    elif case["sigma"] == "learned":
        kw["sigma2"] = torch.tensor([1.3, 0.9, 2.2], dtype=F64, requires_grad=True)
    leaves = [t.requires_grad_() for t in (q, k, v)] + [t for t in kw.values()
                                                        if isinstance(t, torch.Tensor) and t.requires_grad]
    assert _mixture_flash.usable(q, v, 0.0)
    g = torch.randn(2, 2, L, 6, dtype=F64, generator=torch.Generator().manual_seed(3))
    out = mgk_attention(q, k, v, **kw)
    ref = mgk_attention(q, k, v, backend="explicit", **kw)
    torch.testing.assert_close(out, ref, atol=1e-11, rtol=1e-10)
    for a, b in zip(torch.autograd.grad(out, leaves, g), torch.autograd.grad(ref, leaves, g)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)


def test_hard_e_ties_split_the_gradient_like_amax():
    """Two identical components tie everywhere: each gets half of the gradient, as torch.amax's backward gives.
    (The reference computes each component's scores by the same ops, so its ties are exact too; the explicit path's
    batched einsum can round the two components differently and break ties.)"""
    q, k, v = make_inputs(B=1, H=2, L=40, S=50, M=2, D=4, Dv=3, dtype=F64, seed=5)
    k = torch.cat([k[:, :, :1], k[:, :, :1]], dim=2).contiguous().requires_grad_()
    q.requires_grad_()
    s2 = 2.0
    out = mgk_attention(q, k, v, mixture="max", sigma2=s2)
    scores = torch.stack([q @ k[:, :, r].transpose(-1, -2) / s2 - (k[:, :, r] ** 2).sum(-1).unsqueeze(-2) / (2 * s2)
                          for r in range(2)], dim=2)  # (B, H, M, L, S), exact ties
    ref = torch.softmax(scores.amax(dim=2), dim=-1) @ v
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    gk, gq = torch.autograd.grad(out.sum(), (k, q))
    rk, rq = torch.autograd.grad(ref.sum(), (k, q))
    torch.testing.assert_close(gk, rk, atol=1e-11, rtol=1e-10)
    torch.testing.assert_close(gq, rq, atol=1e-11, rtol=1e-10)
    torch.testing.assert_close(gk[:, :, 0], gk[:, :, 1], atol=0, rtol=0)


def test_hard_e_with_a_query_dependent_mask_takes_the_explicit_path():
    q, k, v = make_inputs(B=1, H=1, L=6, S=7, M=2, D=4, Dv=3, dtype=F64, seed=6)
    mask = torch.rand(1, 1, 6, 7, generator=torch.Generator().manual_seed(0)) < 0.6
    ref, _ = mgk_reference(q, k, v, mask=mask, mixture="max")
    torch.testing.assert_close(mgk_attention(q, k, v, attn_mask=mask, mixture="max"), ref, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("mixture", ["sum", "max"])
def test_forward_mode_ad_takes_a_path_that_has_tangents(mixture):
    """The kernel has no forward-mode rule (a custom op would drop the tangent silently): jvp must be exact."""
    import torch.autograd.forward_ad as fwAD

    q, k, v = make_inputs(B=1, H=2, L=5, S=6, M=2, D=4, Dv=3, dtype=F64, seed=8)
    for which in range(3):
        args = [q, k, v]
        tangent = torch.ones_like(args[which])

        def fn(x, backend=None, args=args, which=which):
            a = list(args)
            a[which] = x
            return mgk_attention(*a, mixture=mixture, backend=backend)

        got = torch.func.jvp(fn, (args[which],), (tangent,))[1]
        want = torch.func.jvp(lambda x: fn(x, backend="explicit"), (args[which],), (tangent,))[1]
        assert want.abs().sum() > 0
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
        with fwAD.dual_level():
            a = list(args)
            a[which] = fwAD.make_dual(args[which], tangent)
            dual = fwAD.unpack_dual(mgk_attention(*a, mixture=mixture)).tangent
        torch.testing.assert_close(dual, want, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("causal,L,S", [(False, 300, 700), (True, 600, 600), (True, 150, 620), (True, 620, 150)])
@pytest.mark.parametrize("sigma", ["default", "unequal"])
def test_soft_e_statistics_kernel_equals_chunked_path(causal, L, S, sigma):
    """The E-step's responsibilities through the kernel equal the chunked explicit computation, with key padding,
    padded queries (poisoned with NaN) and bottom-right causality."""
    from mgk.functional import mgk_responsibilities

    q, k, _ = make_inputs(B=2, H=2, L=L, S=S, M=3, D=8, Dv=1, dtype=F64, seed=31)
    key_mask = padding_mask([S, S // 3], S, left=causal)
    query_mask = torch.ones(2, L, dtype=torch.bool)
    query_mask[1, L // 2:] = False
    q[1, :, L // 2:] = float("nan")
    k[1, :, :, S // 3:] = float("nan") if not causal else k[1, :, :, S // 3:]
    kw = dict(attn_mask=key_mask, is_causal=causal, query_mask=query_mask,
              log_pi=normalised_log_pi((2, 2, 3, S), dim=2, seed=2),
              sigma2=torch.tensor([0.7, 2.0, 1.1], dtype=F64) if sigma == "unequal" else None)
    assert _mixture_flash.usable(q, k[:, :, 0], 0.0)
    resp, count = mgk_responsibilities(q, k, backend="kernel", **kw)
    ref, ref_count = mgk_responsibilities(q, k, backend="explicit", **kw)
    assert torch.isfinite(resp).all()
    torch.testing.assert_close(count, ref_count)
    torch.testing.assert_close(resp, ref, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(resp.sum(1), count, atol=1e-8, rtol=1e-10)  # responsibilities sum to 1 per pair


@pytest.mark.parametrize("bad,message", [
    (dict(k=(2, 3, 2, 6, 3)), "k's head size"), (dict(v=(2, 3, 5, 3)), "one row per key position"),
    (dict(bias=(6, 1, 6)), "bias must be"), (dict(dtype_v=torch.float32), "share one dtype"),
    (dict(rowbias=(6, 2, 4)), "rowbias must be")])
def test_the_private_kernel_refuses_sizes_that_do_not_agree(bad, message):
    """mgk_attention checks its arguments; the C++ functions under it are also reached directly (the custom op), and
    must refuse sizes that disagree instead of reading past a tensor's end (found by an adversarial check: a k of
    head size 3 against a q of 4 returned numbers). The well-formed call runs."""
    good = dict(k=(2, 3, 2, 6, 4), v=(2, 3, 6, 3), bias=(6, 2, 6), rowbias=None)

    def call(k, v, bias, rowbias, dtype_v=F64):
        rb = q.new_empty(0) if rowbias is None else torch.randn(*rowbias, dtype=F64)
        return _mixture_flash._load().forward(q, torch.randn(*k, dtype=F64), torch.randn(*bias, dtype=F64),
                                              torch.randn(*v, dtype=dtype_v), rb, q.new_empty(0),
                                              torch.empty(0, dtype=torch.bool), False, False, 0.0, 0, 0, False)

    q = torch.randn(2, 3, 5, 4, dtype=F64)
    assert call(**good)[0].shape == (2, 3, 5, 3)
    with pytest.raises(RuntimeError, match=message):
        call(**{**good, **bad})
