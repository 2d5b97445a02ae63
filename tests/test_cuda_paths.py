"""The CUDA paths of every attention kind, cached decoding and generation on a GPU (run by benchmarks/gpu_check.sh;
skipped without CUDA). Each kind's module on CUDA (float32; MGK through the Triton kernels when ``MGK_TRITON=1``)
against the same module in float64 on CPU, forward and gradients; cached decoding on CUDA against the uncached
forward there; greedy generation on CUDA against CPU. ``MGK_CHECK_DEVICE=cpu`` runs the same checks on CPU (to try
the file without a GPU)."""
from __future__ import annotations

import copy
import os

import pytest
import torch

import mgk
from mgk.attention.registry import get_kind, kind_variants, variant_name
from mgk.models import AttentionConfig, LMConfig, TransformerLM

DEVICE = os.environ.get("MGK_CHECK_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")
E, H, D = 32, 2, 16
CASES = [*kind_variants(), ("mgk", {"pi_shape": "position"}), ("linear", {"normalize": "none"})]
IDS = [variant_name(k, v) for k, v in CASES]


def _module(kind, options):
    options = dict(options)
    if "max_len" in get_kind(kind).options.names():
        options["max_len"] = 256
    torch.manual_seed(0)
    m = mgk.build_attention(kind, E, H, head_dim=D, **options)
    with torch.no_grad():
        if hasattr(m, "pi_logits"):
            m.pi_logits.normal_()
    return m.eval()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kind,options", CASES, ids=IDS)
def test_every_kind_on_the_device_matches_float64_on_cpu(kind, options, causal):
    ref = _module(kind, options).double()
    dev = copy.deepcopy(ref).float().to(DEVICE)
    # Hard-E's max over components flips between near-equal components under float32 rounding: short sequences
    # of small inputs keep such ties away
    x = torch.randn(2, 96, E, dtype=torch.float64) * 0.5
    pad = torch.zeros(2, 96, dtype=torch.bool)
    pad[1, 70:] = True
    x64 = x.clone().requires_grad_()
    xd = x.float().to(DEVICE).requires_grad_()
    want = ref(x64, key_padding_mask=pad, need_weights=False, is_causal=causal)[0]
    got = dev(xd, key_padding_mask=pad.to(DEVICE), need_weights=False, is_causal=causal)[0]
    real = ~pad
    torch.testing.assert_close(got.cpu().double()[real], want[real], atol=2e-4, rtol=2e-4)
    g = torch.randn_like(want).masked_fill(pad.unsqueeze(-1), 0.0)
    want.backward(g)
    got.backward(g.float().to(DEVICE))
    torch.testing.assert_close(xd.grad.cpu().double(), x64.grad, atol=5e-4, rtol=5e-4)


@pytest.mark.parametrize("kind,options", CASES, ids=IDS)
def test_cached_decoding_on_the_device_equals_its_uncached_forward(kind, options):
    m = _module(kind, options).to(DEVICE)
    x = torch.randn(2, 140, E, device=DEVICE)
    with torch.no_grad():
        full = m(x, need_weights=False, is_causal=True)[0]
        cache = m.new_cache()
        outs = [m(x[:, :130], past_key_values=cache, is_causal=True, need_weights=False)[0]]
        for t in range(130, 140):
            outs.append(m(x[:, t:t + 1], past_key_values=cache, is_causal=True, need_weights=False)[0])
    scale = max(1.0, float(full.abs().max()))
    if options.get("normalize") == "length":
        pytest.skip("normalize='length' depends on the length: compared per step on CPU")
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=2e-5 * scale, rtol=2e-5)


@pytest.mark.parametrize("kind", ["softmax", "mgk", "smgk", "mlk"])
def test_greedy_generation_with_the_cache_on_the_device(kind):
    """On the device: greedy decoding through the cache equals the argmax of the uncached model step by step, with
    a left-padded row; seeded sampling repeats; the first step's log-probabilities match CPU's."""
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=60, d_model=E, num_layers=2, ffn_dim=64, cutoffs=(20,),
                   attention=AttentionConfig(kind=kind, num_heads=H, head_dim=D))
    model = TransformerLM(cfg).eval()
    dev = copy.deepcopy(model).to(DEVICE)
    idx = torch.randint(0, 60, (3, 9), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    got = dev.generate(idx, 16, temperature=0)
    want = idx.clone()
    with torch.no_grad():
        for _ in range(16):
            want = torch.cat([want, dev.log_probs(want)[:, -1].argmax(-1, keepdim=True)], dim=1)
        torch.testing.assert_close(dev.log_probs(idx).cpu(), model.log_probs(idx.cpu()), atol=1e-4, rtol=1e-4)
    assert torch.equal(got, want)
    pad = torch.zeros(3, 9, dtype=torch.bool, device=DEVICE)
    pad[1, :4] = True
    padded = dev.generate(idx, 8, temperature=0, key_padding_mask=pad)
    assert torch.equal(padded[1, 4:], dev.generate(idx[1:2, 4:], 8, temperature=0)[0])
    seeded = [dev.generate(idx, 8, generator=torch.Generator().manual_seed(3)).cpu() for _ in range(2)]
    assert torch.equal(seeded[0], seeded[1])
