"""mgk_cache_step keeps its step terms (MGKStepTerms) per set of buffers while sigma2, shifts and the mixture stay
the same: other arguments, or the same tensor changed in place, give the output of buffers that never kept any."""
from __future__ import annotations

import torch

from mgk.functional import mgk_cache as mgk_cache_module
from mgk.functional import mgk_cache_step

H = 2


def test_the_functional_step_keeps_terms_per_buffer_while_its_arguments_stay_the_same():
    """mgk_cache_step on one set of buffers: another sigma2 (a number, or the same tensor changed in place) gives
    the output of buffers that never kept terms."""
    g = torch.Generator().manual_seed(3)
    B, M, D, T = 1, 2, 8, 6
    keys, key_bias, values = torch.zeros(B, H, M, T, D), torch.zeros(B, H, M, T), torch.zeros(B, H, T, D)
    q, key, v = torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, M, 1, D, generator=g), torch.randn(
        B, H, 1, D, generator=g)
    centre = torch.randn(B, H, D, generator=g)
    sigma2 = torch.tensor([1.0, 2.0])

    def step(bufs, s2):
        return mgk_cache_step(q, key, v, keys=bufs[0], key_bias=bufs[1], values=bufs[2], slot=0, centre=centre,
                              sigma2=s2)

    def fresh(s2):
        return step((keys.clone(), key_bias.clone(), values.clone()), s2)

    bufs = (keys, key_bias, values)
    with torch.no_grad():
        for s2 in (sigma2, 3.0, 0.5):
            torch.testing.assert_close(step(bufs, s2), fresh(s2), rtol=0, atol=0)
        sigma2.mul_(4.0)
        torch.testing.assert_close(step(bufs, sigma2), fresh(sigma2), rtol=0, atol=0)
    assert mgk_cache_module._TERMS_OF.get(keys) is not None  # kept for these buffers
