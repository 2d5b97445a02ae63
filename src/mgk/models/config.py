"""Model configurations: one frozen dataclass per model family, built from the run configuration in one place
(:func:`mgk.config.encoder_config`, :func:`mgk.config.lm_config`) and passed whole to the model
(``LRAClassifier.from_config(cfg)``), as nanoGPT's ``GPT(GPTConfig)``.

Equal model configs give models with the same parameter shapes and the same computation; a checkpoint is resumed
only into a model of an equal config.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

__all__ = ["AttentionConfig", "EncoderConfig", "LMConfig", "config_differences"]


@dataclass(frozen=True)
class AttentionConfig:
    """The attention of every block: :func:`mgk.attention.build_attention` ``(kind, embed_dim, num_heads,
    head_dim=, dropout=, **options)``.

    ``options`` holds only options ``kind`` takes (e.g. no ``pi`` for "softmax"; see
    :func:`mgk.attention.registry.attention_options`)."""

    kind: str = "softmax"
    num_heads: int = 4
    head_dim: int = 32
    dropout: float = 0.0
    options: dict = field(default_factory=dict)
    bias: bool = True  # biases of the q/k/v/output projections (the authors' LM has none)


@dataclass(frozen=True)
class EncoderConfig:
    """The LRA encoder classifier and the two-tower retrieval model (Nguyen et al. 2022, Section 4.1, the model
    setting of Nystromformer, Xiong et al. 2021): token + learned position embeddings, pre-LN blocks with a GELU FFN,
    pooling over real tokens, an MLP head ``head_inputs * d_model -> classifier_dim -> num_classes``."""

    vocab_size: int
    num_classes: int
    max_len: int
    d_model: int = 64
    num_layers: int = 2
    ffn_dim: int = 128
    dropout: float = 0.1
    pooling: str = "mean"
    classifier_dim: int = 128
    attention: AttentionConfig = AttentionConfig()
    classifier_activation: str = "gelu"  # "relu" in the authors' code (lra/model_wrapper.py:35-39)
    init: str = "torch"  # "paper": embeddings from N(0, 0.02) (lra/model.py:20-24); see mgk.models.init


@dataclass(frozen=True)
class LMConfig:
    """The causal decoder LM of the WikiText-103 experiment (Nguyen et al. 2022, Section 4.2; the small setting of
    Schlag et al. 2021): tied adaptive input/softmax with ``cutoffs`` (None = 20000, 40000, 200000), sinusoidal
    positions, post-LN blocks with a ReLU FFN."""

    vocab_size: int
    d_model: int = 128
    num_layers: int = 16
    ffn_dim: int = 2048
    dropout: float = 0.1
    cutoffs: tuple | None = None
    div_value: float = 1.0
    attention: AttentionConfig = AttentionConfig(kind="softmax", num_heads=8, head_dim=16)
    adaptive_softmax: str = "torch"  # "authors": mgk.models.adaptive_authors (per-word and cluster biases)
    init: str = "torch"  # "paper": the authors' N(0, 0.02) initialisation (mgk.models.init)


# Model-config names -> the run-config keys a user sets (``--set KEY=...``), for messages.
_RUN_KEYS = {"kind": "attention", "dropout": "dropout", "attention.dropout": "attn_dropout",
             "cutoffs": "adaptive_cutoffs", "attention.bias": "attn_bias"}


def _flat(cfg) -> dict:
    out = {}
    for key, value in dataclasses.asdict(cfg).items():
        if key != "attention":
            out[_RUN_KEYS.get(key, key)] = value
            continue
        options = value.pop("options")
        for k, v in {**value, **options}.items():
            out[_RUN_KEYS.get(f"attention.{k}", _RUN_KEYS.get(k, k))] = v
    return out


def config_differences(a, b, *, ignore=("dropout", "attn_dropout", "init")) -> list[str]:
    """``"key: a != b"`` for every field of two model configs (attention options included) that differs, named by
    its run-config key (``attention``, ``num_heads``, ``pi``, ...). Dropout rates and the initialisation are ignored
    by default: they do not change any parameter's shape or the computation of trained weights, so a run may be
    resumed with others."""
    fa, fb = _flat(a), _flat(b)
    keys = [k for k in dict.fromkeys([*fa, *fb]) if k not in ignore]
    return [f"{k}: {fa.get(k)!r} != {fb.get(k)!r}" for k in keys if fa.get(k) != fb.get(k)]
