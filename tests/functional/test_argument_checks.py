"""Every public function of mgk.functional checks every option the same way (one rule per argument name,
mgk.functional._checks.check_arguments): a ValueError naming the argument and the accepted range, before any
backend sees the value (dropout_p=-0.5 used to reach SDPA and be reported as "dropout > 0"; chunk_size=0 was taken
as 1)."""
from __future__ import annotations

import math

import pytest
import torch

from mgk import functional as Fm
from mgk.functional.linear import select_linear_backend
from mgk.functional.softmax import select_softmax_backend

from .reference import make_inputs

Q, K, V = make_inputs(B=1, H=2, L=4, S=4, M=2, D=4, Dv=3, seed=0)
K1 = K[:, :, 0]

ENTRY_POINTS = {
    "mgk_attention": lambda **kw: Fm.mgk_attention(Q, K, V, **kw),
    "select_backend": lambda **kw: Fm.select_backend(Q, K, V, **kw),
    "mgk_responsibilities": lambda **kw: Fm.mgk_responsibilities(Q, K, **kw),
    "mgk_centre": lambda **kw: Fm.mgk_centre(Q, K, **kw),
    "softmax_attention": lambda **kw: Fm.softmax_attention(Q, K1, V, **kw),
    "softmax_attention_reference": lambda **kw: Fm.softmax_attention_reference(Q, K1, V, **kw),
    "select_softmax_backend": lambda **kw: select_softmax_backend(Q, K1, V, **kw),
    "linear_attention": lambda **kw: Fm.linear_attention(Q, K1, V, **kw),
    "mlk_attention": lambda **kw: Fm.mlk_attention(Q, K, V, **kw),
    "linear_attention_step": lambda **kw: Fm.linear_attention_step(Q[:, :, 0], K1[:, :, 0], V[:, :, 0], **kw),
    "select_linear_backend": lambda **kw: select_linear_backend(**kw),
}

# argument -> (bad values, the words of the accepted range in the message)
BAD = {
    "dropout_p": ((-0.5, 1.5, math.nan, math.inf, "0.1", None, True), "in \\[0, 1\\]"),
    "chunk_size": ((0, -3, 2.5, "64", None, True), "positive int"),
    "is_causal": (("yes", 1, None), "bool"),
    "return_weights": (("no", 0, None), "bool"),
    "scale": ((0, -1.0, math.nan, math.inf, "1"), "None or a finite float > 0"),
    "eps": ((-1e-6, math.nan, math.inf, "1e-6", None), "finite float >= 0"),
    "backend": (("flash", 3, ""), "backend must be None or one of"),
    "sigma2": ((0.0, -1.0, math.nan, math.inf, "1", torch.ones(3), torch.ones(3, 2), torch.tensor([1.0, -1.0]),
                torch.tensor([1, 2])), "sigma2 must be"),
    "mixture": (("min", None, 1), "mixture must be one of"),
    "log_pi": (("uniform", torch.zeros(3, 2, 2, 4), torch.zeros(1, 2, 2, 4, dtype=torch.int64)), "log_pi"),
    "normalize": (("rows", None), "normalize must be one of"),
    "feature_map": (("relu", 3), "feature_map must be one of"),
    "output_scale": ((0.0, -1.0, math.nan), "output_scale must be a finite float > 0"),
    "eps_mode": (("mul", None), "eps_mode must be one of"),
    "mix": (("values",), "mix must be one of"),
}
NAMED_BY_MESSAGE = ("backend", "sigma2", "mixture", "log_pi", "normalize", "feature_map", "output_scale", "eps_mode",
                    "mix")

# which arguments each entry point takes
TAKES = {
    "mgk_attention": ("dropout_p", "chunk_size", "is_causal", "return_weights", "backend", "sigma2", "mixture",
                      "log_pi"),
    "select_backend": ("dropout_p", "return_weights", "sigma2", "mixture", "log_pi"),
    "mgk_responsibilities": ("chunk_size", "is_causal", "backend", "sigma2", "log_pi"),
    "mgk_centre": ("is_causal",),
    "softmax_attention": ("dropout_p", "is_causal", "scale", "backend"),
    "softmax_attention_reference": ("dropout_p", "is_causal", "scale", "return_weights"),
    "select_softmax_backend": ("dropout_p",),
    "linear_attention": ("chunk_size", "is_causal", "return_weights", "eps", "backend", "normalize", "feature_map",
                         "output_scale", "eps_mode"),
    "mlk_attention": ("chunk_size", "is_causal", "return_weights", "eps", "backend", "normalize", "feature_map",
                      "output_scale", "eps_mode", "mix", "log_pi"),
    "linear_attention_step": ("eps", "normalize", "feature_map", "output_scale", "eps_mode", "mix"),
    "select_linear_backend": ("return_weights",),
}

CASES = [(f, a, bad) for f, args in TAKES.items() for a in args for bad in BAD[a][0]]


@pytest.mark.parametrize("entry,arg,bad", CASES, ids=[f"{f}-{a}-{b!r}" for f, a, b in CASES])
def test_a_bad_option_is_a_value_error_naming_it_and_its_range(entry, arg, bad):
    with pytest.raises(ValueError, match=BAD[arg][1] if arg in NAMED_BY_MESSAGE else f"{arg}.*{BAD[arg][1]}"):
        ENTRY_POINTS[entry](**{arg: bad})


@pytest.mark.parametrize("entry", list(TAKES))
def test_every_accepted_value_still_runs(entry):
    good = {"dropout_p": 1.0, "chunk_size": 1, "is_causal": True, "return_weights": True, "scale": 0.5, "eps": 0.0,
            "backend": None, "sigma2": torch.full((2, 2), 0.7), "mixture": "max", "log_pi": None,
            "normalize": "length", "feature_map": "elu_sum", "output_scale": 0.5, "eps_mode": "add", "mix": "keys"}
    for arg in TAKES[entry]:
        extra = {"lengths": (4, 4)} if entry == "linear_attention_step" and arg == "normalize" else {}
        out = ENTRY_POINTS[entry](**{arg: good[arg]}, **extra)
        if isinstance(out, str):  # the backend selectors name the backend they chose
            assert out, (entry, arg)
            continue
        tensors = [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]
        assert tensors and all(bool(t.isfinite().all()) for t in tensors), (entry, arg)


def test_the_reported_inputs():
    with pytest.raises(ValueError, match="dropout_p must be a probability"):
        Fm.select_backend(Q, K, V, dropout_p=-0.5)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        Fm.mgk_attention(Q, K, V, backend="explicit", chunk_size=0)
    assert (Fm.mgk_attention(Q, K, V, dropout_p=1.0) == 0).all()  # p = 1 drops every weight
