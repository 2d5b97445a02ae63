"""Model configs: derived from the run config in one place, and the models they build equal the hand-built ones."""
import dataclasses

import pytest
import torch

from mgk.attention import attention_kinds, get_kind
from mgk.config import encoder_config, flat_keys, lm_config, model_differences, replace, run_config, with_forms
from mgk.models import AttentionConfig, EncoderConfig, LMConfig, LRAClassifier, RetrievalModel, TransformerLM


@pytest.mark.parametrize("kind", attention_kinds())
def test_encoder_config_builds_the_model_of_the_hand_built_config(kind):
    position = {"pi_shape": "position"} if "pi_shape" in get_kind(kind).options.names() else {}
    cfg = run_config(attention=kind, vocab_size=20, num_classes=3, max_len=12, d_model=16, head_dim=8, num_heads=2,
                     ffn_dim=24, classifier_dim=8, **position)
    torch.manual_seed(0)
    got = LRAClassifier(encoder_config(cfg))
    torch.manual_seed(0)
    attention = AttentionConfig(kind=kind, num_heads=2, head_dim=8, dropout=0.1,
                                options={**position, **({"max_len": 12} if position else {})})
    want = LRAClassifier(EncoderConfig(20, 3, 12, classifier_dim=8, d_model=16, num_layers=2, ffn_dim=24,
                                       attention=attention))
    a, b = got.state_dict(), want.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x = torch.randint(0, 20, (2, 12))
    got.eval(), want.eval()
    torch.testing.assert_close(got(x), want(x), rtol=0, atol=0)


def test_attention_options_only_for_kinds_that_take_them():
    with pytest.raises(ValueError, match="'pi' does not apply to attention kind 'softmax'"):
        run_config(attention="softmax", pi="soft_e")
    # a preset's values for other kinds do not reach the chosen one
    soft = with_forms(run_config(attention="softmax"), {"mgk": {"pi": "soft_e", "sigma2": [1.0, 2.0]}})
    assert encoder_config(soft).attention.options.as_kwargs() == {}
    mgk = encoder_config(replace(soft, attention="mgk", max_len=40)).attention
    assert mgk.options.as_kwargs() == {"num_keys": 2, "pi": "soft_e", "pi_shape": "head", "sigma2": (1.0, 2.0),
                                       "pi_norm": "softmax", "max_len": 40, "key_scale": 1.0}
    assert "sigma2" not in encoder_config(run_config(attention="mlk")).attention.options.as_kwargs()
    options = {name for name, path in flat_keys().items() if path.startswith("attention.options.")}
    assert options == {"num_keys", "pi", "pi_shape", "sigma2", "pi_norm", "normalize", "feature_map",
                       "output_scale", "attn_eps", "eps_mode", "mix", "num_kv_heads", "keys", "key_scale"}


def test_lm_config_covers_a_segment_and_keeps_cutoffs():
    cfg = run_config(task="lm", attention="mgk", max_len=8, segment_len=32, adaptive_cutoffs=[10, 30], d_model=16,
                     head_dim=8, num_heads=2, num_layers=1, ffn_dim=16)
    lm = lm_config(cfg, 50)
    assert isinstance(lm, LMConfig) and lm.vocab_size == 50 and lm.cutoffs == (10, 30)
    assert lm.attention.options.max_len == 32
    model = TransformerLM(lm)
    assert model.vocab_size == 50 and model.adaptive.cutoffs == [10, 30] and len(model.blocks) == 1


def test_retrieval_model_from_the_same_config():
    cfg = encoder_config(run_config(attention="softmax", vocab_size=9, num_classes=2, d_model=8, head_dim=4,
                                    classifier_dim=8))
    assert isinstance(cfg, EncoderConfig)
    model = RetrievalModel(cfg)
    assert model.head[0].in_features == 4 * 8


def test_model_differences_name_run_config_keys():
    a = encoder_config(run_config(vocab_size=5, num_classes=2))
    b = dataclasses.replace(a, attention=dataclasses.replace(a.attention, num_heads=2), d_model=32)
    assert model_differences(a, b) == ["d_model: 64 != 32", "num_heads: 4 != 2"]
    c = dataclasses.replace(a, dropout=0.3, attention=dataclasses.replace(a.attention, kind="softmax", options={}))
    diffs = model_differences(a, c)
    assert "attention: 'mgk' != 'softmax'" in diffs and "pi: 'learned' != None" in diffs
    assert not any(d.startswith("dropout") for d in diffs)  # dropout rates may change on resume
    eps = dataclasses.replace(a, attention=AttentionConfig(kind="linear", options={"eps": 1e-5}))
    assert "attn_eps: 1e-06 != 1e-05" in model_differences(dataclasses.replace(eps, attention=AttentionConfig(
        kind="linear")), eps)
