"""Model configurations: one frozen dataclass per model family, built from the run configuration in one place
(:func:`mgk.config.encoder_config`, :func:`mgk.config.lm_config`) and passed whole to the model
(``LRAClassifier(cfg)``), as nanoGPT's ``GPT(GPTConfig)``. The attention of every block is an
:class:`mgk.attention.AttentionConfig`.

Equal model configs give models with the same parameter shapes and the same computation; a checkpoint is resumed
only into a model of an equal config.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..attention import AttentionConfig

__all__ = ["AttentionConfig", "EncoderConfig", "LMConfig"]


@dataclass(frozen=True)
class EncoderConfig:
    """The LRA encoder classifier and the two-tower retrieval model (Nguyen et al. 2022, Section 4.1, the model
    setting of Nystromformer, Xiong et al. 2021): token + learned position embeddings, pre-LN blocks with a GELU FFN,
    pooling over real tokens, an MLP head ``head_inputs * d_model -> classifier_dim -> num_classes``.

    An attention kind with per-position mixture weights gets ``max_len`` as their length unless its options set
    one."""

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

    def __post_init__(self):
        options = self.attention.options
        if "max_len" in type(options).names() and options.max_len is None:
            object.__setattr__(self, "attention", self.attention.with_options(max_len=self.max_len))


@dataclass(frozen=True)
class LMConfig:
    """The causal decoder LM of the WikiText-103 experiment (Nguyen et al. 2022, Section 4.2; the small setting of
    Schlag et al. 2021): tied adaptive input/softmax with ``cutoffs`` (None = 20000, 40000, 200000), sinusoidal
    positions, post-LN blocks with a ReLU FFN. Per-position mixture weights need ``max_len`` in the attention's
    options (:func:`mgk.config.lm_config` sets it to the segment length)."""

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

    def __post_init__(self):
        if isinstance(self.cutoffs, list):
            object.__setattr__(self, "cutoffs", tuple(self.cutoffs))
