"""The per-key bias ``b_jr = log pi_jr - |k~_jr|^2 / (2 sigma_r^2)`` and the scaled keys exist once
(``_mixture_terms.key_bias_inv`` / ``scaled_keys_inv``, which ``key_bias`` / ``scaled_keys`` call): every decoding
step writes what they make, whichever backend writes and attends (the C++ step copies the entries it is given and
computes none itself)."""
from __future__ import annotations

import pytest
import torch

from mgk.functional import _mixture_flash, mgk_cache_step
from mgk.functional import mgk_cache as module

from .test_decode_step import _at_slot, _case

F64 = torch.float64


@pytest.mark.parametrize("backend", ["kernel", "explicit"])
@pytest.mark.parametrize("shifted,mixture", [(False, "sum"), (True, "sum"), (False, "max")],
                         ids=["mgk", "smgk", "hard"])
@pytest.mark.parametrize("at_slot", [False, True], ids=["int-slot", "slot-tensor"])
def test_a_step_writes_the_entries_the_one_formula_makes(backend, shifted, mixture, at_slot, monkeypatch):
    """The formula's functions are replaced by marked ones (+0.25 on the bias, x2 on MGK's scaled keys): the slot a
    step writes must hold the marked entries on every backend, so no backend has a formula of its own."""
    if backend == "kernel" and _mixture_flash._load() is None:
        pytest.skip(f"the CPU kernel could not be built here: {_mixture_flash.build_error()}")
    T = 20
    q, key, value, buffers, step, _ = _case(shifted=shifted, mixture=mixture, T=T, seed=11)
    old = step["slot"]
    want_keys, want_bias = module.mgk_cache_entries(key, centre=step["centre"], log_pi=step["log_pi"],
                                                    sigma2=step["sigma2"], mixture=mixture, shifts=step["shifts"])
    bias_of, scaled_of = module.mixture_terms.key_bias_inv, module.mixture_terms.scaled_keys_inv
    monkeypatch.setattr(module.mixture_terms, "key_bias_inv", lambda *a, **k: bias_of(*a, **k) + 0.25)
    monkeypatch.setattr(module.mixture_terms, "scaled_keys_inv", lambda *a, **k: scaled_of(*a, **k) * 2.0)
    bufs = {n: b.clone() for n, b in buffers.items()}
    args = _at_slot(step, T, True) if at_slot else step
    mgk_cache_step(q, key, value, **bufs, **args, backend=backend)
    torch.testing.assert_close(bufs["key_bias"][..., old:old + 1], want_bias + 0.25, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(bufs["keys"][..., old:old + 1, :], want_keys * (1.0 if shifted else 2.0), atol=1e-12,
                               rtol=1e-12)
