"""The decoding step (mgk_cache_step): the new tokens' entries, made by the one formula, written into a static
cache and attended (by the C++ kernel, csrc/mixture_decode.cpp, or the GEMMs), against the float64 formula
(reference.py) of the uncached keys, and its kernel against its own explicit form (the composition it replaces):
every buffer slot equal, the slots outside the new ones untouched, padding in the cache, sMGK, Hard-E, unequal
per-head variances, per-token priors, vector tails, up to 16 new queries and the thread pool; then the inputs it
must refuse in one line.
"""
from __future__ import annotations

import pytest
import torch

from mgk.functional import BackendError, _mixture_flash, mgk_cache_entries, mgk_cache_step

from .reference import mgk_reference, normalised_log_pi

F64 = torch.float64


@pytest.fixture
def kernel():
    if _mixture_flash._load() is None:
        pytest.skip(f"the CPU kernel could not be built here: {_mixture_flash.build_error()}")


def _case(*, B=2, H=3, M=2, D=8, Dv=5, old=11, L=1, T=20, shifted=False, mixture="sum", per_token=False,
          padded=True, seed=0):
    """float64 raw keys / values of ``old`` cached tokens and L new ones, the buffers holding the old entries, the
    step's arguments and the float64 formula's output over all old + new keys."""
    g = torch.Generator().manual_seed(seed)
    S = old + L
    raw = torch.randn(B, H, S, D, generator=g, dtype=F64) if shifted else torch.randn(B, H, M, S, D, generator=g,
                                                                                         dtype=F64)
    raw = raw + 3.0  # a shared offset: the centre must take it out
    v = torch.randn(B, H, S, Dv, generator=g, dtype=F64)
    q = torch.randn(B, H, L, D, generator=g, dtype=F64) + 3.0
    shifts = None
    if shifted:
        shifts = torch.cat([torch.zeros(1, H, D, dtype=F64), 0.5 * torch.randn(M - 1, H, D, generator=g, dtype=F64)])
    sigma2 = torch.linspace(0.6, 2.2, H * M, dtype=F64).reshape(H, M)  # unequal: the |q|^2 row term is kept
    log_pi = None
    if mixture == "sum":
        log_pi = normalised_log_pi((B, H, M, S) if per_token else (1, H, M, 1), dim=2, seed=seed)
    centre = raw.mean(dim=-2) if shifted else raw.mean(dim=(2, 3))
    valid = torch.ones(B, S, dtype=torch.bool)
    if padded:
        valid[-1, :3] = False  # the last row: three padded slots in the cache
    old_lp = None if log_pi is None else log_pi[..., :old] if per_token else log_pi
    new_lp = None if log_pi is None else log_pi[..., old:] if per_token else log_pi
    keys, key_bias = mgk_cache_entries(raw[..., :old, :], centre=centre, log_pi=old_lp, sigma2=sigma2,
                                       mixture=mixture, shifts=shifts)
    buffers = {"keys": torch.full((*keys.shape[:-2], T, D), 7.0, dtype=F64),
               "key_bias": torch.full((B, H, M, T), 7.0, dtype=F64), "values": torch.full((B, H, T, Dv), 7.0,
                                                                                       dtype=F64)}
    buffers["keys"][..., :old, :] = keys
    buffers["key_bias"][..., :old] = key_bias
    buffers["values"][:, :, :old] = v[:, :, :old]
    k = raw if not shifted else raw.unsqueeze(2) - shifts.transpose(0, 1).unsqueeze(0).unsqueeze(3)
    want, _ = mgk_reference(q, k, v, log_pi=log_pi, sigma2=sigma2, mixture=mixture,
                            mask=valid[:, None, None, :] if padded else None, is_causal=True, log_space=True)
    step = dict(slot=old, centre=centre, key_valid=valid if padded else None, log_pi=new_lp, sigma2=sigma2,
                shifts=shifts, mixture=mixture)
    return q, raw[..., old:, :], v[:, :, old:], buffers, step, want


def _run(q, key, value, buffers, step, dtype, backend):
    bufs = {n: b.to(dtype).clone() for n, b in buffers.items()}
    cast = {n: (x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x) for n, x in step.items()}
    out = mgk_cache_step(q.to(dtype), key.to(dtype), value.to(dtype), **bufs, **cast, backend=backend)
    return out, bufs


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("mixture", ["sum", "max"])
@pytest.mark.parametrize("shifted", [False, True], ids=["separate", "shifted"])
@pytest.mark.parametrize("L", [1, 3, 16])
@pytest.mark.parametrize("D,Dv", [(3, 5), (13, 69), (32, 32)])
@pytest.mark.parametrize("old", [11, 2100], ids=["dot-loop", "gemm"])
def test_the_fused_step_is_the_formula_and_writes_what_the_composition_writes(old, D, Dv, L, shifted, mixture,
                                                                              dtype, kernel):
    """Output against the float64 formula of the uncached keys; every buffer, the new slots and the untouched ones
    (still 7.0 after slot + L), against the explicit composition of mgk_cache_entries, copy and the cached step;
    with few cached tokens (dot products in the slice's loop) and with 2,100 (one batched GEMM of them first, which
    must read the keys this step writes)."""
    q, key, value, buffers, step, want = _case(D=D, Dv=Dv, L=L, old=old, shifted=shifted, mixture=mixture,
                                               T=old + L + 4, seed=D + Dv + L)
    got, bufs = _run(q, key, value, buffers, step, dtype, "kernel")
    ref, ref_bufs = _run(q, key, value, buffers, step, dtype, "explicit")
    tol = 1e-12 if dtype == F64 else 3e-5
    assert got.dtype == dtype
    torch.testing.assert_close(got.to(F64), want, atol=tol, rtol=tol)
    torch.testing.assert_close(ref.to(F64), want, atol=tol, rtol=tol)
    for name in bufs:
        torch.testing.assert_close(bufs[name], ref_bufs[name], atol=tol, rtol=tol)
        assert bool((bufs[name].narrow(-1 if name == "key_bias" else -2, old + L, 4) == 7.0).all()), name


@pytest.mark.parametrize("shifted", [False, True], ids=["separate", "shifted"])
def test_per_token_priors_and_no_padding(shifted, kernel):
    """Per-position weights (log pi per new token, as pi_shape="position" and Soft-E decode), no padded slot (no
    key_valid)."""
    q, key, value, buffers, step, want = _case(L=2, shifted=shifted, per_token=True, padded=False, seed=5)
    got, _ = _run(q, key, value, buffers, step, F64, "kernel")
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_a_step_large_enough_for_the_thread_pool_is_the_formula_on_one_thread_and_on_two(kernel):
    q, key, value, buffers, step, want = _case(B=3, H=4, D=32, Dv=32, old=900, L=1, T=905, seed=9)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = _run(q, key, value, buffers, step, torch.float32, "kernel")
        torch.set_num_threads(max(2, previous))
        many, _ = _run(q, key, value, buffers, step, torch.float32, "kernel")
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(one.double(), want, atol=3e-5, rtol=3e-5)
    torch.testing.assert_close(many, one, atol=1e-6, rtol=1e-6)


def test_a_switched_off_component_and_a_row_that_sees_no_key(kernel):
    """log pi = -inf for a component (a gated component) keeps the step finite; a row whose every cached and new
    slot is padding gives zeros, as the other backends."""
    q, key, value, buffers, step, _ = _case(L=1, seed=3)
    lp = step["log_pi"].clone()
    lp[:, 0, 1] = float("-inf")
    step = dict(step, log_pi=lp)
    step["key_valid"] = step["key_valid"].clone()
    step["key_valid"][0] = False
    got, _ = _run(q, key, value, buffers, step, F64, "kernel")
    ref, _ = _run(q, key, value, buffers, step, F64, "explicit")
    assert bool(got.isfinite().all())
    assert bool((got[0] == 0).all())
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-12)


def test_the_kernel_is_refused_by_name_where_it_cannot_serve(kernel):
    q, key, value, buffers, step, want = _case(L=1, seed=1)
    with pytest.raises(BackendError, match="one dtype"):
        mgk_cache_step(q.float(), key, value, **{n: b.clone() for n, b in buffers.items()}, **step, backend="kernel")
    needs = q.clone().requires_grad_()
    with pytest.raises(BackendError, match="no backward"):
        mgk_cache_step(needs, key, value, **{n: b.clone() for n, b in buffers.items()}, **step, backend="kernel")
    # the default takes the explicit form there, and it is still the formula
    got = mgk_cache_step(needs, key, value, **{n: b.clone() for n, b in buffers.items()}, **step)
    torch.testing.assert_close(got.detach(), want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("backend", [None, "explicit"])
@pytest.mark.parametrize("change,match", [
    (dict(slot=10 ** 6), "slot must be an int"),
    (dict(slot=-1), "slot must be an int"),
    (dict(slot=2.0), "slot must be an int"),
    (dict(key_valid=torch.ones(2, 3, dtype=torch.bool)), "key_valid must be a bool tensor"),
    (dict(mixture="mean"), "mixture must be one of"),
    (dict(sigma2=0.0), "sigma2 must be"),
    (dict(sigma2=-1.0), "sigma2 must be"),
    (dict(sigma2=torch.tensor([1.0, -2.0], dtype=F64)), "sigma2 must be positive"),
    (dict(sigma2=torch.ones(5, dtype=F64)), "sigma2 must be"),
    (dict(log_pi=torch.zeros(1, 3, 4, 1, dtype=F64)), "log_pi"),
    (dict(centre=torch.zeros(2, 5, 8, dtype=F64)), "centre must be"),
    (dict(shifts=torch.zeros(2, 3, 8, dtype=F64)), "key must have shape"),
])
def test_bad_arguments_are_named(change, match, backend):
    """The kernel's own checks and the explicit form's name the same argument, in one line."""
    q, key, value, buffers, step, _ = _case(L=1, seed=2)
    with pytest.raises(ValueError, match=match) as info:
        mgk_cache_step(q, key, value, **buffers, **dict(step, **change), backend=backend)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("backend", ["kernel", "explicit"])
def test_buffers_that_do_not_match_the_new_tokens_are_named(backend, kernel):
    q, key, value, buffers, step, _ = _case(L=1, seed=2)
    cases = [(dict(buffers, values=buffers["values"][..., :4]), "value size Dv: value has 5 but values has 4"),
             (dict(buffers, key_bias=buffers["key_bias"][..., :15]), "slots T: keys has 20 but key_bias has 15"),
             (dict(buffers, keys=buffers["keys"][:, :, :1]), "mixture components M: keys has 1 but key_bias has 2")]
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            mgk_cache_step(q, key, value, **bad, **step, backend=backend)


def test_the_first_step_of_a_fresh_process_is_served_by_the_kernel():
    """The extension is loaded by the first step's own check (a fresh process once fell back to the explicit form,
    and backend="kernel" was refused, until some other call had loaded it)."""
    import subprocess
    import sys

    code = ("import torch, sys; sys.path.insert(0, 'tests');\n"
            "from mgk.functional import _mixture_flash, mgk_cache_step\n"
            "from functional.test_decode_step import _case\n"
            "assert _mixture_flash._module is None\n"
            "q, key, value, buffers, step, want = _case(L=1, seed=4)\n"
            "got = mgk_cache_step(q, key, value, **buffers, **step, backend='kernel')\n"
            "torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12); print('served')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if "could not be built" in p.stderr:
        pytest.skip("the CPU kernel could not be built here")
    assert p.returncode == 0 and "served" in p.stdout, p.stderr[-2000:]


@pytest.mark.parametrize("backend", ["cuda", "Explicit", "sdpa", 123])
def test_an_unknown_backend_is_named_even_where_the_kernel_could_serve(backend, kernel):
    q, key, value, buffers, step, _ = _case(L=1, seed=2)
    with pytest.raises(ValueError, match="backend must be None or one of"):
        mgk_cache_step(q, key, value, **buffers, **step, backend=backend)


def _unusual(q, key, value, buffers, step):
    """(name, arguments) of inputs of unusual forms: each must get the same answer from the default (kernel where
    it serves) and the explicit form, a ValueError naming the argument or the same numbers (adversarial pass)."""
    B, H, M, D = q.shape[0], q.shape[1], buffers["key_bias"].shape[2], q.shape[3]
    base = dict(query=q, key=key, value=value, **buffers, **step)
    S = step["slot"] + q.shape[2]
    return [
        ("0-d key", dict(base, key=torch.tensor(1.0, dtype=F64))),
        ("0-d values", dict(base, values=torch.tensor(1.0, dtype=F64))),
        ("log_pi a list", dict(base, log_pi=[0.0])),
        ("log_pi integer", dict(base, log_pi=torch.zeros(1, H, M, 1, dtype=torch.int64))),
        ("sigma2 10**400", dict(base, sigma2=10 ** 400)),
        ("sigma2 a bool tensor", dict(base, sigma2=torch.ones(M, dtype=torch.bool))),
        ("sigma2 (1, 1, M)", dict(base, sigma2=torch.ones(1, 1, M, dtype=F64))),
        ("slot 2**63 - 1", dict(base, slot=2 ** 63 - 1)),
        ("slot 2**64", dict(base, slot=2 ** 64)),
        ("key_valid a list", dict(base, key_valid=[[True] * S] * B)),
        ("key_valid (B, 0)", dict(base, key_valid=torch.ones(B, 0, dtype=torch.bool))),
        ("key_valid transposed", dict(base, key_valid=step["key_valid"].t().contiguous().t())),
        ("centre int64", dict(base, centre=torch.zeros(B, H, D, dtype=torch.int64))),
        ("centre (1, H, D)", dict(base, centre=step["centre"][:1])),
        ("sigma2 1e-300 (scores near the float64 limit: both take it, the numbers may differ)",
         dict(base, sigma2=1e-300)),
        ("keys an expanded view", dict(base, keys=buffers["keys"][:1].expand_as(buffers["keys"]))),
    ]


UNUSUAL_CASES = 16  # len(_unusual(...)); the test below fails if the list and this count part


@pytest.mark.parametrize("index", range(UNUSUAL_CASES))
def test_unusual_inputs_get_one_answer_from_every_backend(index, kernel):
    q, key, value, buffers, step, _ = _case(L=1, seed=6)
    cases = _unusual(q, key, value, buffers, step)
    assert len(cases) == UNUSUAL_CASES, "a case was added or removed: update UNUSUAL_CASES"
    name, args = cases[index]
    outcomes = []
    for backend in (None, "explicit"):
        call = {k: (v.clone() if isinstance(v, torch.Tensor) and k in buffers and v.dim() and 0 not in v.stride()
                    else v) for k, v in args.items()}  # each backend writes its own buffers
        try:
            outcomes.append(mgk_cache_step(**call, backend=backend))
        except ValueError as exc:
            assert "\n" not in str(exc), name
            outcomes.append(type(exc))
    if isinstance(outcomes[1], type):
        assert outcomes[0] is ValueError, f"{name}: the explicit form refused it, the default took it"
    else:
        assert isinstance(outcomes[0], torch.Tensor), f"{name}: the explicit form took it, the default refused it"
        if "may differ" in name:
            assert not outcomes[0].isnan().any() and not outcomes[1].isnan().any()
        else:
            torch.testing.assert_close(outcomes[0], outcomes[1], atol=1e-10, rtol=1e-10)


def _at_slot(step, T, padded):
    """The step's arguments with the slot as a (1,) int64 tensor and key_valid over every slot (False past the new
    ones, as a cache of fixed capacity holds it)."""
    old, B = step["slot"], step["centre"].shape[0]
    valid = torch.zeros(B, T, dtype=torch.bool)
    new = 1 if step["key_valid"] is None else step["key_valid"].shape[1] - old  # the new tokens, L
    valid[:, :old + new] = True if step["key_valid"] is None else step["key_valid"]
    return {**step, "slot": torch.tensor([old]), "key_valid": valid}


@pytest.mark.parametrize("backend", ["kernel", "explicit"])
@pytest.mark.parametrize("shifted,mixture,per_token", [(False, "sum", False), (True, "sum", True),
                                                       (False, "max", False)], ids=["mgk", "smgk-token", "hard"])
@pytest.mark.parametrize("padded", [False, True])
def test_a_slot_tensor_writes_and_attends_as_the_int_slot(backend, shifted, mixture, per_token, padded, kernel):
    """The fixed-capacity form (slot a tensor, key_valid over the whole buffers): the custom op (kernel) or the
    index_copy composition (explicit) against the float64 formula, and every buffer equal to the int-slot step's
    (slots past the new one untouched: never read, never written)."""
    T = 20
    q, key, value, buffers, step, want = _case(shifted=shifted, mixture=mixture, per_token=per_token, padded=padded,
                                               T=T)
    got, bufs = _run(q, key, value, buffers, _at_slot(step, T, padded), torch.float64, backend)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    _, ref = _run(q, key, value, buffers, step, torch.float64, "explicit")
    for name in bufs:
        torch.testing.assert_close(bufs[name], ref[name], atol=1e-12, rtol=1e-12, msg=name)


@pytest.mark.parametrize("small_bytes,op", [(0, True), (2 ** 30, False)], ids=["op", "composition"])
@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_a_traced_step_at_a_slot_tensor_keeps_the_kernel_as_one_op(compile_backend, small_bytes, op, kernel,
                                                                    monkeypatch):
    """Under torch.compile the kernel runs as the custom op mgk::cache_step_at (writing the entries made before it
    in the graph) for caches of at least TRACED_EXPLICIT_BYTES of keys, the explicit composition below: the output
    and buffers equal eager's either way, and the traced graph holds the op exactly when it should."""
    from mgk.functional import mgk_cache as module

    monkeypatch.setattr(module, "TRACED_EXPLICIT_BYTES", small_bytes)
    T = 20
    q, key, value, buffers, step, want = _case(padded=True, T=T)
    seen = []

    def backend(gm, example_inputs):
        seen.append(str(gm.graph))
        return torch.compile(gm, backend=compile_backend) if compile_backend == "inductor" else gm

    torch._dynamo.reset()
    bufs = {n: b.float().clone() for n, b in buffers.items()}
    args = {n: (x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x)
            for n, x in _at_slot(step, T, True).items()}
    fn = torch.compile(lambda *a: mgk_cache_step(*a, **bufs, **args), backend=backend, fullgraph=True)
    got = fn(q.float(), key.float(), value.float())
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    eager, ref = _run(q, key, value, buffers, step, torch.float32, "kernel")
    for name in bufs:
        torch.testing.assert_close(bufs[name], ref[name], msg=name)
    assert any("cache_step_at" in g for g in seen) == op


def test_a_slot_tensor_needs_key_valid_over_every_slot_and_an_int64_slot(kernel):
    q, key, value, buffers, step, _ = _case(T=20)
    fixed = _at_slot(step, 20, True)
    with pytest.raises(ValueError, match=r"key_valid must be a bool tensor \(B, T\) = \(2, 20\)"):
        _run(q, key, value, buffers, {**fixed, "key_valid": fixed["key_valid"][:, :12]}, torch.float64, None)
    with pytest.raises(ValueError, match="slot must be an int or a \\(1,\\) int64 tensor"):
        _run(q, key, value, buffers, {**fixed, "slot": torch.tensor([11.0])}, torch.float64, None)


@pytest.mark.parametrize("backend", [None, "explicit"])
def test_a_slot_tensor_out_of_range_or_of_another_shape_is_refused_in_one_line(backend, kernel):
    q, key, value, buffers, step, _ = _case(T=20)
    fixed = _at_slot(step, 20, True)
    with pytest.raises(ValueError, match=r"slot must be in \[0, T - L\] = \[0, 19\]"):
        _run(q, key, value, buffers, {**fixed, "slot": torch.tensor([20])}, torch.float64, backend)
    with pytest.raises(ValueError, match="slot must be an int or a \\(1,\\) int64 tensor"):
        _run(q, key, value, buffers, {**fixed, "slot": torch.tensor([[11]])}, torch.float64, backend)
    q2, key2, value2, buffers2, step2, _ = _case(T=20, L=2)
    with pytest.raises(ValueError, match="one new token a step, got L = 2"):
        _run(q2, key2, value2, buffers2, _at_slot(step2, 20, True), torch.float64, backend)


@pytest.mark.parametrize("backend", ["kernel", "explicit"])
@pytest.mark.parametrize("shifted", [False, True])
def test_no_new_token_gives_an_empty_output_and_leaves_the_buffers(backend, shifted, kernel):
    """An empty chunk (L = 0) of a chunked prefill: a (B, H, 0, Dv) output from the step and from the cached
    attention on every backend (the explicit form concatenated no chunk: a ValueError from torch.cat), nothing
    written."""
    from mgk.functional import mgk_attention_cached

    q, key, value, buffers, step, _ = _case(shifted=shifted, T=20)
    empty = q[:, :, :0], key[..., :0, :], value[:, :, :0]
    bufs = {n: b.clone() for n, b in buffers.items()}
    out = mgk_cache_step(*empty, **bufs, **{**step, "key_valid": step["key_valid"][:, :step["slot"]]},
                         backend=backend)
    assert out.shape == (2, 3, 0, 5)
    for name, buf in bufs.items():
        torch.testing.assert_close(buf, buffers[name], atol=0, rtol=0, msg=name)
    S = step["slot"]
    cached = mgk_attention_cached(q[:, :, :0], bufs["keys"][..., :S, :], bufs["key_bias"][..., :S],
                                  bufs["values"][:, :, :S], centre=step["centre"], sigma2=step["sigma2"],
                                  shifts=step.get("shifts"), backend=backend)
    assert cached.shape == (2, 3, 0, 5) and cached.dtype == q.dtype
