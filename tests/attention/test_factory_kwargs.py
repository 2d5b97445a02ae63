"""Every attention kind takes torch's factory keywords ``device=`` and ``dtype=``, as ``nn.MultiheadAttention`` does:
its parameters and floating buffers are created on that device in that dtype (no cast afterwards), through the
module classes and through ``mgk.build_attention``; a bad value is a one-line ValueError naming the argument."""
import pytest
import torch

import mgk
from mgk.attention.registry import get_kind, kind_variants, variant_name

E, H, D, MAX_LEN = 16, 2, 8, 64
VARIANTS = kind_variants()


def _build(kind, options, **factory):
    options = dict(options)
    if "max_len" in get_kind(kind).options.names():
        options.setdefault("max_len", MAX_LEN)
    return mgk.build_attention(kind, E, H, head_dim=D, **options, **factory)


def _floating_tensors(module):
    """(name, tensor) of every parameter and floating-point buffer."""
    return [*module.named_parameters(), *((n, b) for n, b in module.named_buffers() if b.is_floating_point())]


@pytest.mark.parametrize("kind,options", VARIANTS, ids=[variant_name(k, v) for k, v in VARIANTS])
def test_float64_modules_are_created_in_float64_and_run_on_float64_input(kind, options):
    torch.manual_seed(0)
    m = _build(kind, options, dtype=torch.float64, device="cpu")
    wrong = [(n, t.dtype) for n, t in _floating_tensors(m) if t.dtype != torch.float64]
    assert not wrong, wrong
    x = torch.randn(2, 5, E, dtype=torch.float64)
    out, w = m.eval()(x, x, x, need_weights=True)
    assert out.dtype == torch.float64 and w.dtype == torch.float64 and torch.isfinite(out).all()
    m.train()(x, x, x, need_weights=False, is_causal=True)[0].sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float64 for p in m.parameters() if p.requires_grad)


@pytest.mark.parametrize("kind", mgk.attention_kinds())
def test_meta_device_builds_every_kind_without_memory_and_bfloat16_applies_to_every_tensor(kind):
    """device="meta" (a torch.device or its name): every parameter and buffer on meta; an explicit dtype reaches
    every floating tensor, as Module.to(dtype) would (MGK's variances too)."""
    for device in (torch.device("meta"), "meta"):
        m = _build(kind, {}, device=device)
        assert {t.device.type for t in [*m.parameters(), *m.buffers()]} == {"meta"}
    m = _build(kind, {}, device=torch.device("cpu"), dtype=torch.bfloat16)
    assert {t.dtype for _, t in _floating_tensors(m)} == {torch.bfloat16}
    assert {t.device for t in m.parameters()} == {torch.device("cpu")}


@pytest.mark.parametrize("kind", ["softmax", "mgk", "gqa"])
@pytest.mark.parametrize("factory,match", [
    ({"dtype": torch.int64}, "dtype must be None or a floating-point torch.dtype"),
    ({"dtype": "float64"}, "dtype must be None or a floating-point torch.dtype"),
    ({"device": "nowhere"}, "device must be a torch.device or device name"),
])
def test_a_bad_dtype_or_device_is_one_line_naming_it(kind, factory, match):
    with pytest.raises(ValueError, match=match) as info:
        _build(kind, {}, **factory)
    assert "\n" not in str(info.value)
    cls = type(_build(kind, {}))
    with pytest.raises(ValueError, match=match):
        cls(E, H, batch_first=True, **factory)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_device_this_machine_lacks_is_one_line_naming_it():
    with pytest.raises(ValueError, match=r"device must be .*got 'cuda'") as info:
        _build("mgk", {}, device="cuda")
    assert "\n" not in str(info.value)
