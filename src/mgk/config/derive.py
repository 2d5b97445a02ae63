"""The model configurations of a run config, derived in one place (as nanoGPT's ``GPTConfig -> GPT``): the LRA
encoder's and the LM's (:mod:`mgk.models.config`), and the differences between two of them named by ``--set``
keys."""
from __future__ import annotations

import dataclasses

from ..attention import AttentionConfig
from ..models.config import EncoderConfig, LMConfig
from .groups import RunConfig
from .keys import flat_name

__all__ = ["attention_config", "encoder_config", "lm_config", "model_differences"]

# Model-config fields whose run-config field has another name.
_MODEL_NAMES = {"cutoffs": "adaptive_cutoffs"}


def attention_config(cfg: RunConfig, *, max_len: int | None = None) -> AttentionConfig:
    """``cfg.attention`` with the options' ``max_len`` (where the kind takes it) set to ``max_len`` (default
    ``cfg.data.max_len``), so that per-position mixture weights cover the inputs."""
    attention = cfg.attention
    if "max_len" in type(attention.options).names():
        attention = attention.with_options(max_len=cfg.data.max_len if max_len is None else max_len)
    return attention


def encoder_config(cfg: RunConfig) -> EncoderConfig:
    """The LRA classifier / retrieval model of ``cfg`` (``vocab_size`` and ``num_classes`` as filled in by the
    task)."""
    m = cfg.model
    return EncoderConfig(vocab_size=m.vocab_size, num_classes=m.num_classes, max_len=cfg.data.max_len,
                         d_model=m.d_model, num_layers=m.num_layers, ffn_dim=m.ffn_dim, dropout=m.dropout,
                         pooling=m.pooling, classifier_dim=m.classifier_dim, attention=attention_config(cfg),
                         classifier_activation=m.classifier_activation, init=m.init)


def lm_config(cfg: RunConfig, vocab_size: int | None = None) -> LMConfig:
    """The decoder LM of ``cfg`` over ``vocab_size`` words (default ``cfg.model.vocab_size``). The attention's
    ``max_len`` is at least ``segment_len``, so that per-position mixture weights cover a segment."""
    m = cfg.model
    return LMConfig(vocab_size=m.vocab_size if vocab_size is None else vocab_size, d_model=m.d_model,
                    num_layers=m.num_layers, ffn_dim=m.ffn_dim, dropout=m.dropout, cutoffs=m.adaptive_cutoffs,
                    attention=attention_config(cfg, max_len=max(cfg.data.max_len, cfg.data.segment_len)),
                    adaptive_softmax=m.adaptive_softmax, init=m.init)


def _named(model_cfg) -> dict:
    """A model config's fields (attention and its options included) by their ``--set`` names."""
    out = {}
    for f in dataclasses.fields(model_cfg):
        value = getattr(model_cfg, f.name)
        if f.name != "attention":
            out[_MODEL_NAMES.get(f.name, f.name)] = value
            continue
        for g in dataclasses.fields(value):
            if g.name != "options":
                out[flat_name(f"attention.{g.name}")] = getattr(value, g.name)
        for name, option in value.options.as_kwargs().items():
            out[flat_name(f"attention.options.{name}")] = option
    return out


def model_differences(a, b, *, ignore=("dropout", "attn_dropout", "init")) -> list[str]:
    """``"key: a != b"`` for every field of two model configs (attention options included) that differs, named by
    its ``--set`` key (``attention``, ``num_heads``, ``pi``, ...). Dropout rates and the initialisation are ignored
    by default: they change no parameter's shape and not the computation of trained weights, so a run may be
    resumed with others."""
    fa, fb = _named(a), _named(b)
    keys = [k for k in dict.fromkeys([*fa, *fb]) if k not in ignore]
    return [f"{k}: {fa.get(k)!r} != {fb.get(k)!r}" for k in keys if fa.get(k) != fb.get(k)]
