"""Per-position mixture weights (pi_shape="position", Soft-E) are read at each row's own positions, counted from its
first real key as the decoding cache counts them: a left-padded row gives what it gives alone in the uncached
forward, and its Soft-E statistics land at its own positions."""
import pytest
import torch

from mgk.attention.registry import build_attention

E, H, PAD, N = 16, 2, 3, 6
PRIORS = [("mgk", {"pi_shape": "position"}), ("mgk", {"pi": "soft_e"}), ("smgk", {"pi_shape": "position"}),
          ("mlk", {"pi_shape": "position"})]


def _module(kind, options):
    torch.manual_seed(0)
    m = build_attention(kind, E, H, batch_first=True, max_len=16, **options)
    with torch.no_grad():  # weights that differ by position (fresh ones are uniform, which hides the position)
        if m.pi_mode == "soft_e":
            pi = torch.rand(m.pi.shape) + 0.1
            m.pi.copy_(pi / pi.sum(1, keepdim=True))
        else:
            m.pi_logits.normal_()
    return m


def _rows():
    """x (2, PAD + N, E): row 0 is N real tokens after PAD padding ones, row 1 is PAD + N real tokens; padding mask."""
    x = torch.randn(2, PAD + N, E, generator=torch.Generator().manual_seed(1))
    pad = torch.zeros(2, PAD + N, dtype=torch.bool)
    pad[0, :PAD] = True
    return x, pad


@pytest.mark.parametrize("kind, options", PRIORS, ids=lambda v: v if isinstance(v, str) else "-".join(v.values()))
@pytest.mark.parametrize("float_mask", (False, True), ids=("bool", "float"))
@pytest.mark.parametrize("causal", (True, False), ids=("causal", "bidirectional"))
def test_a_left_padded_row_gives_what_it_gives_alone(kind, options, float_mask, causal):
    m = _module(kind, options).eval()
    x, pad = _rows()
    mask = torch.zeros(pad.shape).masked_fill(pad, float("-inf")) if float_mask else pad
    out = m(x, key_padding_mask=mask, need_weights=False, is_causal=causal)[0]
    alone = m(x[:1, PAD:], need_weights=False, is_causal=causal)[0]
    torch.testing.assert_close(out[0, PAD:], alone[0], atol=1e-5, rtol=0)
    unpadded = m(x[1:], need_weights=False, is_causal=causal)[0]  # a row without padding is unchanged
    torch.testing.assert_close(out[1], unpadded[0], atol=1e-5, rtol=0)


def test_soft_e_statistics_of_a_left_padded_row_land_at_its_own_positions():
    """One step on the padded row alone changes pi as one step on it alone, and pi past its length is untouched."""
    x, pad = _rows()
    pis = []
    for inputs, mask in ((x[:1], pad[:1]), (x[:1, PAD:], None)):
        m = _module("mgk", {"pi": "soft_e"}).train()
        m(inputs, key_padding_mask=mask, need_weights=False, is_causal=True)[0].sum().backward()
        before = m.pi.clone()
        m.soft_e_step()
        assert not torch.equal(m.pi[:, :, :N], before[:, :, :N])
        torch.testing.assert_close(m.pi[:, :, N:], before[:, :, N:])
        pis.append(m.pi.detach())
    torch.testing.assert_close(pis[0], pis[1], atol=1e-6, rtol=0)
