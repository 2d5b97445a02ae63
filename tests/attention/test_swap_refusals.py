"""Every refusal of swap_attention leaves the model exactly as it was (classes, children, parameters, modes), also
when the refusal comes half way (a calibration batch the model fails on, a later layer that cannot be carried); and
a refusal that names another call names one that is accepted."""
from __future__ import annotations

import ast
import copy
import re
import warnings

import pytest
import torch
from torch import nn

import mgk

pytestmark = pytest.mark.usefixtures("one_thread")

E, H = 32, 8


def _model():
    """Two encoder layers (batch_first) and a bare nn.MultiheadAttention, in eval mode."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "enable_nested_tensor is True, but self.use_nested_tensor is False"
        encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 64, dropout=0.0, batch_first=True), 2)
    return nn.ModuleDict({"encoder": encoder, "attn": nn.MultiheadAttention(E, H, batch_first=True)}).eval()


class _Encoder(nn.Module):
    """The encoder of :func:`_model` as a model called on a batch (what calibration= runs)."""

    def __init__(self, extra: nn.Module | None = None):
        super().__init__()
        self.body = _model()
        if extra is not None:
            self.extra = extra

    def forward(self, x):
        return self.body["encoder"](x)


def _state(model: nn.Module) -> tuple:
    """What a refusal must leave as it was: every module's path, class and mode, the encoder's fast-path flag and
    every tensor of the state_dict (the same objects, and their values)."""
    modules = [(n, type(m), m.training) for n, m in model.named_modules(remove_duplicate=False)]
    flags = [getattr(m, "use_nested_tensor", None) for m in model.modules()]
    tensors = {k: (v, v.clone()) for k, v in model.state_dict(keep_vars=True).items()}
    return modules, flags, tensors


def _assert_unchanged(model: nn.Module, before: tuple) -> None:
    modules, flags, tensors = _state(model)
    assert modules == before[0] and flags == before[1]
    assert tensors.keys() == before[2].keys()
    for name, (value, _) in tensors.items():
        was, copy_ = before[2][name]
        assert value is was and torch.equal(value, copy_), name


def _hint(message: str) -> dict | None:
    """The keywords of the other call a refusal names (``...; instead: head_dim=4, heads='slice'``), or None."""
    match = re.search(r"; instead: (.*)$", message)
    if match is None:
        return None
    return {k: ast.literal_eval(v) for k, v in (item.split("=", 1) for item in match[1].split(", "))}


def _fails_in_forward(out):
    raise RuntimeError("loss_fn failed")


CALL_REFUSALS = [  # (kind, keywords, a hint is expected)
    ("mgkk", {}, False),
    ("mlk", {"sigma2": 1.0}, False),
    ("mgk", {"num_heads": 0}, False),
    ("mgk", {"seed": -1}, False),
    ("mgk", {"num_heads": 3, "heads": "slice"}, True),
    ("softmax", {"num_heads": 16}, True),
    ("softmax", {"num_heads": 4, "head_dim": 2}, True),
    ("softmax", {"num_heads": 4, "heads": "cut"}, False),
    ("softmax", {"num_heads": 4, "heads": "merge"}, True),
    ("mgk", {"num_heads": 3}, True),
    ("gqa", {"num_heads": 3, "heads": "pool"}, True),
    ("gqa", {"num_kv_heads": 3}, False),
    ("mgk", {"calibration": torch.randn(2, 5, E)}, False),
    ("mgk", {"num_heads": 4, "loss_fn": sum}, False),
    ("mgk", {"num_heads": 4, "calibration": "text"}, False),
    ("mgk", {"num_heads": 4, "calibration": torch.randn(2, 5, E - 4)}, False),  # the model's forward fails on it
    ("softmax", {"num_heads": 4, "heads": "prune", "calibration": torch.randn(2, 5, E), "loss_fn": _fails_in_forward},
     False),
]


@pytest.mark.parametrize("kind, keywords, hinted", CALL_REFUSALS,
                         ids=[f"{k}-{'-'.join(map(str, kw))}" for k, kw, _ in CALL_REFUSALS])
def test_a_refused_swap_changes_nothing_and_its_hint_is_accepted(kind, keywords, hinted):
    model = _Encoder()
    before = _state(model)
    with pytest.raises(ValueError) as err:
        mgk.swap_attention(model, kind, **keywords)
    message = str(err.value)
    assert "\n" not in message
    _assert_unchanged(model, before)
    hint = _hint(message)
    assert (hint is not None) == hinted, message
    if hint is not None:  # the call it names goes through
        mgk.swap_attention(_Encoder(), kind, **{**keywords, **hint})


@pytest.mark.parametrize("extra", [nn.MultiheadAttention(E, H, add_bias_kv=True), nn.Linear(E, E)])
@pytest.mark.parametrize("calibrated", [False, True])
def test_a_module_refused_after_others_were_converted_leaves_them_all(extra, calibrated):
    """The layers before the one refused are converted first (and with calibration=, every torch layer became mgk
    softmax before the heads were measured): all of them come back."""
    if isinstance(extra, nn.Linear):
        extra = nn.Sequential(nn.MultiheadAttention(E, H, batch_first=True))
        extra[0].out_proj = nn.Sequential(extra[0].out_proj)  # not an nn.Linear: refused
    model = _Encoder(copy.deepcopy(extra))
    before = _state(model)
    keywords = {"num_heads": 4, "calibration": torch.randn(2, 5, E)} if calibrated else {}
    with pytest.raises(ValueError, match="swap_attention: extra"):
        mgk.swap_attention(model, "mgk", **keywords)
    _assert_unchanged(model, before)
    x = torch.randn(2, 5, E)
    with torch.no_grad():
        torch.testing.assert_close(model(x), _Encoder(copy.deepcopy(extra))(x), atol=0, rtol=0)


def test_a_bare_module_refused_on_its_calibration_batch_is_left_as_it_was():
    old = nn.MultiheadAttention(E, H, batch_first=True)
    before = _state(old)
    with pytest.raises(ValueError, match="calibration batch fails"):
        mgk.swap_attention(old, "mgk", num_heads=4, calibration=torch.randn(2, 5, E - 1))
    _assert_unchanged(old, before)


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["self_attn"]], ids=["mgk-projections", "torch-module"])
def test_a_peft_adapter_in_or_around_an_attention_module_is_refused_before_anything_changes(targets):
    """peft's LoRA on an mgk module's projections (a torch model swapped before) or around an nn.MultiheadAttention:
    the new module would be built from the base weights alone, dropping the adapter."""
    peft = pytest.importorskip("peft", reason="the LoRA tests need peft")
    model = _Encoder()
    if targets[0] == "q_proj":
        mgk.swap_attention(model, "softmax")
    base = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=targets)).get_base_model()
    before = _state(base)
    with pytest.raises(ValueError, match=r"is peft's \w+ \(an adapter\), which the new attention would drop") as err:
        mgk.swap_attention(base, "mgk")
    assert "\n" not in str(err.value)
    _assert_unchanged(base, before)
