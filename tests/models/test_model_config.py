"""Model configs: derived from the run config in one place, and the models they build equal the hand-built ones."""
import dataclasses

import pytest
import torch

from mgk.attention import attention_kinds
from mgk.config import RunConfig, encoder_config, fields_of, lm_config
from mgk.models import EncoderConfig, LMConfig, LRAClassifier, RetrievalModel, TransformerLM, config_differences


@pytest.mark.parametrize("kind", attention_kinds())
def test_encoder_config_builds_the_model_of_the_explicit_constructor(kind):
    cfg = RunConfig(attention=kind, vocab_size=20, num_classes=3, max_len=12, d_model=16, head_dim=8, num_heads=2,
                    ffn_dim=24, classifier_dim=8, pi_shape="position" if kind != "softmax" else "head")
    torch.manual_seed(0)
    got = LRAClassifier.from_config(encoder_config(cfg))
    torch.manual_seed(0)
    options = {} if kind in ("softmax", "linear") else {"pi_shape": "position", "max_len": 12}
    want = LRAClassifier(20, 3, 12, classifier_dim=8, d_model=16, num_layers=2, ffn_dim=24, attention=kind,
                         num_heads=2, head_dim=8, attention_options=options)
    a, b = got.state_dict(), want.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x = torch.randint(0, 20, (2, 12))
    got.eval(), want.eval()
    torch.testing.assert_close(got(x), want(x), rtol=0, atol=0)


def test_attention_options_only_for_kinds_that_take_them():
    soft = encoder_config(RunConfig(attention="softmax", pi="soft_e", sigma2=[1.0, 2.0]))
    assert soft.attention.options == {}
    mgk = encoder_config(RunConfig(attention="mgk", pi="soft_e", sigma2=[1.0, 2.0], max_len=40)).attention
    assert mgk.options == {"num_keys": 2, "pi": "soft_e", "pi_shape": "head", "sigma2": [1.0, 2.0],
                           "pi_norm": "softmax", "max_len": 40}
    assert "sigma2" not in encoder_config(RunConfig(attention="mlk")).attention.options
    assert set(fields_of("attention_option")) == {"num_keys", "pi", "pi_shape", "sigma2", "pi_norm", "normalize",
                                                  "feature_map", "output_scale", "attn_eps", "eps_mode", "mix"}


def test_lm_config_covers_a_segment_and_keeps_cutoffs():
    cfg = RunConfig(task="lm", attention="mgk", max_len=8, segment_len=32, adaptive_cutoffs=[10, 30], d_model=16,
                    head_dim=8, num_heads=2, num_layers=1, ffn_dim=16)
    lm = lm_config(cfg, 50)
    assert isinstance(lm, LMConfig) and lm.vocab_size == 50 and lm.cutoffs == (10, 30)
    assert lm.attention.options["max_len"] == 32
    model = TransformerLM.from_config(lm)
    assert model.vocab_size == 50 and model.adaptive.cutoffs == [10, 30] and len(model.blocks) == 1


def test_retrieval_model_from_the_same_config():
    cfg = encoder_config(RunConfig(attention="softmax", vocab_size=9, num_classes=2, d_model=8, head_dim=4,
                                   classifier_dim=8))
    assert isinstance(cfg, EncoderConfig)
    model = RetrievalModel.from_config(cfg)
    assert model.head[0].in_features == 4 * 8


def test_config_differences_name_run_config_keys():
    a = encoder_config(RunConfig(vocab_size=5, num_classes=2))
    b = dataclasses.replace(a, attention=dataclasses.replace(a.attention, num_heads=2), d_model=32)
    assert config_differences(a, b) == ["d_model: 64 != 32", "num_heads: 4 != 2"]
    c = dataclasses.replace(a, dropout=0.3, attention=dataclasses.replace(a.attention, kind="softmax", options={}))
    diffs = config_differences(a, c)
    assert "attention: 'mgk' != 'softmax'" in diffs and "pi: 'learned' != None" in diffs
    assert not any(d.startswith("dropout") for d in diffs)  # dropout rates may change on resume
