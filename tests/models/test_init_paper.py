"""init="paper" (the authors' initialisation), the LRA head's activation and the attention projection bias."""
import pytest
import torch
from torch import nn

from mgk.models import AttentionConfig, EncoderConfig, LMConfig, LRAClassifier, TransformerLM


def _lm(**kw):
    torch.manual_seed(0)
    attention = AttentionConfig(kind="mgk", num_heads=2, head_dim=16, options={"pi_shape": "position", "max_len": 16})
    return TransformerLM(LMConfig(3000, d_model=32, num_layers=2, ffn_dim=64, cutoffs=(1000, 2000), attention=attention,
                                  **kw))


def _classifier(vocab_size, num_classes, max_len, attn_bias=True, **kw):
    attention = AttentionConfig(kind="softmax", num_heads=2, head_dim=8, dropout=0.1, bias=attn_bias)
    return LRAClassifier(EncoderConfig(vocab_size, num_classes, max_len, d_model=16, ffn_dim=32, classifier_dim=16,
                                       attention=attention, **kw))


@pytest.mark.parametrize("adaptive", ["authors", "torch"])
def test_lm_paper_init(adaptive):
    lm = _lm(init="paper", adaptive_softmax=adaptive)
    linears = [m for m in lm.modules() if isinstance(m, nn.Linear)]
    weights = torch.cat([m.weight.flatten() for m in linears])
    assert abs(weights.std().item() - 0.02) < 1e-3 and abs(weights.mean().item()) < 1e-3
    assert all(float(m.bias.detach().abs().sum()) == 0 for m in linears if m.bias is not None)
    norms = [m for m in lm.modules() if isinstance(m, nn.LayerNorm)]
    nw = torch.cat([m.weight for m in norms])
    assert abs(nw.mean().item() - 1.0) < 0.01 and 0.01 < nw.std().item() < 0.03
    assert all(float(m.bias.detach().abs().sum()) == 0 for m in norms)
    if adaptive == "authors":
        a = lm.adaptive
        assert abs(a.weight.std().item() - 0.02) < 1e-3
        assert float(a.bias.detach().abs().sum()) == 0 and float(a.cluster_bias.detach().abs().sum()) == 0
    # mixture weights keep their own initial values (the authors' weights_init does not touch them)
    torch_lm = _lm(init="torch", adaptive_softmax=adaptive)
    for (name, p), (_, q) in zip(lm.named_parameters(), torch_lm.named_parameters()):
        if name.endswith("pi_logits"):
            assert torch.equal(p, q), name


def test_lra_paper_init_touches_only_the_embeddings():
    torch.manual_seed(0)
    base = _classifier(512, 3, 4096)
    torch.manual_seed(0)
    paper = _classifier(512, 3, 4096, init="paper")
    for (name, p), (_, q) in zip(base.named_parameters(), paper.named_parameters()):
        if "embedding" in name:
            assert abs(q.std().item() - 0.02) < 2e-3 and not torch.equal(p, q), name
        else:
            assert torch.equal(p, q), name  # PyTorch's defaults elsewhere, as in lra/model.py
    with pytest.raises(ValueError, match="init"):
        _classifier(10, 2, 8, init="xavier")


def test_classifier_activation_and_attention_bias():
    assert isinstance(_classifier(10, 2, 8, classifier_activation="relu").head[1], nn.ReLU)
    assert isinstance(_classifier(10, 2, 8).head[1], nn.GELU)
    with pytest.raises(ValueError, match="classifier_activation"):
        _classifier(10, 2, 8, classifier_activation="tanh")
    no_bias = _classifier(10, 2, 8, attn_bias=False)
    assert not any(n.endswith("bias") for b in no_bias.encoder.blocks for n, _ in b.attn.named_parameters())
    lm = TransformerLM(LMConfig(100, d_model=16, num_layers=1, ffn_dim=32, cutoffs=(50,),
                                attention=AttentionConfig(num_heads=2, head_dim=8, bias=False)))
    assert not any(n.endswith("bias") for b in lm.blocks for n, _ in b.attn.named_parameters())
    assert lm.num_attention_parameters() == 4 * 16 * 16
