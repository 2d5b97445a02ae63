"""The two-tower retrieval model: shared encoder, head on [x0, x1, x0*x1, x0-x1], padding-independence."""
from __future__ import annotations

import pytest
import torch

from mgk.attention import attention_kinds
from mgk.models import AttentionConfig, EncoderConfig, RetrievalModel


def _model(kind, pooling="mean"):
    torch.manual_seed(0)
    attention = AttentionConfig(kind=kind, num_heads=2, head_dim=8, dropout=0.1)
    return RetrievalModel(EncoderConfig(257, 2, 32, pooling=pooling, d_model=16, num_layers=2, ffn_dim=32,
                                        attention=attention, classifier_dim=16)).eval()


def _pad(tokens, L):
    out = torch.zeros(L, dtype=torch.long)
    out[:len(tokens)] = tokens
    mask = torch.arange(L) >= len(tokens)
    return out, mask


@pytest.mark.parametrize("kind", attention_kinds())
def test_a_pairs_logits_do_not_depend_on_its_batch(kind):
    model = _model(kind)
    g = torch.Generator().manual_seed(1)
    a1, a2 = torch.randint(1, 257, (7,), generator=g), torch.randint(1, 257, (5,), generator=g)
    b1, b2 = torch.randint(1, 257, (20,), generator=g), torch.randint(1, 257, (20,), generator=g)
    with torch.no_grad():
        alone = model(a1[None], torch.zeros(1, 7, dtype=torch.bool), a2[None], torch.zeros(1, 5, dtype=torch.bool))
        t1, m1 = zip(*(_pad(a1, 20), _pad(b1, 20)))
        t2, m2 = zip(*(_pad(a2, 20), _pad(b2, 20)))
        batched = model(torch.stack(t1), torch.stack(m1), torch.stack(t2), torch.stack(m2))
    assert alone.shape == (1, 2) and torch.isfinite(batched).all()
    torch.testing.assert_close(batched[0:1], alone, atol=1e-5, rtol=0)


def test_towers_share_one_encoder_and_the_head_sees_four_vectors():
    model = _model("mgk")
    assert model.head[0].in_features == 4 * 16
    names = [n for n, _ in model.named_parameters()]
    assert sum(n.startswith("encoder.token_embedding") for n in names) == 1
    t = torch.randint(1, 257, (3, 6))
    with torch.no_grad():
        feats = []
        model.head.register_forward_hook(lambda m, i, o: feats.append(i[0]))
        model(t, None, t.flip(1), None)
        pooled1, pooled2 = model.encode(t), model.encode(t.flip(1))
    expect = torch.cat([pooled1, pooled2, pooled1 * pooled2, pooled1 - pooled2], dim=-1)
    torch.testing.assert_close(feats[0], expect, atol=1e-6, rtol=0)


def test_cls_pooling_and_argument_checks():
    model = _model("softmax", pooling="cls")
    t = torch.randint(1, 257, (2, 5))
    assert model(t, None, t, None).shape == (2, 2)
    with pytest.raises(ValueError, match="one B"):
        model(t, None, t[:1], None)
    with pytest.raises(ValueError, match="pooling"):
        RetrievalModel(EncoderConfig(257, 2, 8, pooling="max"))
