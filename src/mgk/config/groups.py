"""The run configuration as nested frozen dataclasses: :class:`RunConfig` holds the run's own fields (task, seed,
bookkeeping) and one group each for the data, the attention (:class:`mgk.attention.AttentionConfig`, whose options
are the kind's dataclass), the model, the optimiser and the evaluation.

Every field declares its type, default, documentation, choices and range where it is defined
(:func:`mgk.fields.spec`); :func:`mgk.config.validate` checks them all. Lengths are in tokens, learning rates per
optimiser step, steps are optimiser steps.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..attention import AttentionConfig
from ..fields import spec
from ..models.init import INITS
from ..models.lm import ADAPTIVE_SOFTMAX
from ..models.lra import CLASSIFIER_ACTIVATIONS, POOLINGS
from ..seeds import SEED_MAX

__all__ = ["RunConfig", "DataConfig", "ModelConfig", "OptimConfig", "EvalConfig", "SCHEDULES", "PRECISIONS",
           "GROUPS"]

# Learning-rate schedules (mgk.train.schedule implements them) and training precisions (mgk.train.precision).
SCHEDULES = ("linear", "cosine", "constant", "cosine_global", "onecycle")
PRECISIONS = ("32", "bf16", "fp16")


def _tuples(obj) -> None:
    """Hold list values as tuples (the configs are frozen and hashable; YAML gives lists)."""
    for f in dataclasses.fields(obj):
        if isinstance(getattr(obj, f.name), list):
            object.__setattr__(obj, f.name, tuple(getattr(obj, f.name)))


@dataclass(frozen=True)
class DataConfig:
    """Where the data comes from and how inputs are cut (the generator sizes serve runs without ``path``)."""

    path: str | None = spec(None, doc="folder or archive with the release files; None = generate the default")
    path_as_given: str | None = spec(None, doc="--data as typed (path holds it as an absolute path)")
    max_len: int = spec(128, ge=1, doc="longest input in tokens (a longer one is an error unless truncate)")
    truncate: bool = spec(False, doc="cut inputs longer than max_len instead of refusing them")
    gen_train: int = spec(6000, ge=1, doc="training examples of the generated default data")
    gen_val: int = spec(1000, ge=0, doc="validation examples of the generated default data")
    gen_test: int = spec(1000, ge=0, doc="test examples of the generated default data")
    gen_max_depth: int = spec(3, ge=1, doc="generated ListOps: deepest nesting")
    gen_max_args: int = spec(5, ge=1, doc="generated ListOps: most arguments of an operator")
    gen_min_length: int = spec(10, ge=1, doc="generated ListOps: shortest sequence in tokens")
    gen_max_length: int = spec(100, ge=1, doc="generated ListOps: longest sequence in tokens")
    val_fraction: float = spec(0.1, ge=0, lt=1, doc="share of train carved out as validation where a release has "
                                                    "no validation split (0: none)")
    split_seed: int = spec(0, ge=0, le=SEED_MAX,
                           doc="seed of such carved splits (fixed, independent of the training seed)")
    level: str = spec("curv_contour_length_14", doc="Pathfinder difficulty folder (or easy / intermediate / hard)")
    # The synthetic head-count tasks (mgk.data.dretrieval, mgk.data.mqar); their presets set them.
    gen_seq_len: int = spec(16, ge=1, doc="generated dretrieval: T positions (the model also sees a class token); "
                                          "mqar / cmqar: L tokens")
    gen_features: int = spec(4, ge=1, doc="generated dretrieval: D, the features the target combines")
    gen_vocab: int = spec(64, ge=2, le=32767, doc="generated dretrieval: V grid points (token values); mqar / "
                                                  "cmqar: vocabulary size")
    gen_kv_pairs: int = spec(8, ge=1, doc="generated mqar / cmqar: key-value pairs per sequence (a square for "
                                          "cmqar)")
    gen_power_a: float = spec(0.01, gt=0, le=1, doc="generated mqar / cmqar: power-law exponent of the query gaps "
                                                    "(Zoology's default)")
    cache_dir: str | None = spec(None, doc="tokenised-array cache: None = <data>/.mgk-cache when writable, else "
                                           "$XDG_CACHE_HOME/mgk; 'off' disables caching")
    segment_len: int = spec(256, ge=1, doc="language modelling: training and evaluation segment length")


@dataclass(frozen=True)
class ModelConfig:
    """The model around the attention: the LRA encoder classifier (Nguyen et al. 2022, Section 4.1: the model of
    Nystromformer, Xiong et al. 2021) or the decoder LM (Section 4.2: the small setting of Schlag et al. 2021)."""

    d_model: int = spec(64, ge=1, doc="model width E")
    num_layers: int = spec(2, ge=1, doc="blocks")
    ffn_dim: int = spec(128, ge=1, doc="feed-forward width")
    dropout: float = spec(0.1, ge=0, lt=1, doc="dropout on embeddings, residual branches and the FFN")
    pooling: str = spec("mean", choices=POOLINGS, doc="LRA: 'mean' over real tokens or 'cls' (first position)")
    classifier_dim: int = spec(128, ge=1, doc="LRA: hidden width of the classifier head")
    classifier_activation: str = spec("gelu", choices=tuple(CLASSIFIER_ACTIVATIONS),
                                      doc="LRA head activation ('relu' in the authors' code)")
    init: str = spec("torch", choices=INITS, doc="'torch' (module defaults) or 'paper' (the authors': "
                                                 "mgk.models.init)")
    vocab_size: int = spec(0, ge=0, doc="filled in by the task")
    num_classes: int = spec(0, ge=0, doc="filled in by the task")
    adaptive_softmax: str = spec("torch", choices=tuple(ADAPTIVE_SOFTMAX),
                                 doc="LM output: 'torch' (nn.AdaptiveLogSoftmaxWithLoss: tail projections, no "
                                     "biases) or 'authors' (the paper code's tied table with per-word and cluster "
                                     "biases, no projections)")
    adaptive_cutoffs: tuple[int, ...] | None = spec(None, ge=1, doc="LM adaptive input/softmax cutoffs; None = "
                                                                    "(20000, 40000, 200000)")

    def __post_init__(self):
        _tuples(self)


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with a warm-up and a decay (Nguyen et al. 2022, Section 4; Loshchilov & Hutter 2019)."""

    steps: int = spec(1500, ge=1, doc="optimiser steps")
    batch_size: int = spec(32, ge=1, doc="global batch (split across ranks and accumulation steps)")
    grad_accum: int = spec(1, ge=1, doc="micro-batches per optimiser step")
    lr: float = spec(1e-3, gt=0, doc="peak learning rate")
    weight_decay: float = spec(0.0, ge=0, doc="AdamW weight decay")
    adam_eps: float = spec(1e-6, gt=0, doc="AdamW eps")
    warmup_steps: int = spec(100, ge=0, doc="linear warm-up steps")
    schedule: str = spec("linear", choices=SCHEDULES,
                         doc="after the warm-up: 'linear', 'cosine' or 'constant'; 'cosine_global': cosine of "
                             "step/steps (Transformer-XL's CosineAnnealingLR); 'onecycle': torch's OneCycleLR "
                             "(pct_start = warmup_steps/steps; the authors' LRA)")
    grad_clip: float = spec(0.0, ge=0, doc="gradient-norm clip (0 = off)")
    precision: str = spec("32", choices=PRECISIONS, doc="'32', 'bf16' or 'fp16' (autocast; fp16 with a scaler)")
    nonfinite: str = spec("stop", choices=("stop", "skip"), doc="a non-finite loss: 'stop' the run, or 'skip' the "
                                                                "step and count it")


@dataclass(frozen=True)
class EvalConfig:
    """Validation during training and the LM's final evaluation window (``--set eval_<field>=...``)."""

    every: int = spec(250, ge=1, doc="optimiser steps between validations")
    batch_size: int = spec(64, ge=1, doc="evaluation batch")
    batches: int = spec(0, ge=0, doc="batches per validation (0 = the whole split); > 0: a different seeded slice of "
                                     "an endless reshuffled pass each time (the authors' LRA), the whole split at "
                                     "the end")
    context: int = spec(0, ge=0, doc="LM: sliding-window context of the final evaluation (0 = segments)")
    stride: int = spec(0, ge=0, doc="LM: sliding-window stride (0 = segments)")


def _default_attention() -> AttentionConfig:
    return AttentionConfig(kind="mgk", num_heads=4, head_dim=32, dropout=0.1)


@dataclass(frozen=True)
class RunConfig:
    """Everything a run needs: the task, the seed and bookkeeping, and the groups.

    ``attention.options`` holds the chosen kind's options; its ``max_len`` stays None here (the model configs fill it
    in from ``data.max_len``). ``attention_forms`` maps kinds to the option values a preset gives them (the authors'
    form of each kind, :mod:`mgk.tasks.authors`): choosing a kind (``--attention``, ``--set attention=``) takes its
    form, or the kind's defaults. The forms are not part of the run: not written to config.yaml, not compared.
    """

    task: str = spec("listops", doc="the task (mgk.tasks.TASKS)")
    seed: int = spec(0, ge=0, le=SEED_MAX, doc="seed of the initialisation, the data order and dropout")
    log_every: int = spec(25, ge=1, doc="optimiser steps between logged training metrics")
    checkpoint_every: int = spec(250, ge=1, doc="optimiser steps between checkpoints (last.pt)")
    progress: bool = spec(True, doc="progress bars")
    data: DataConfig = field(default_factory=DataConfig)
    attention: AttentionConfig = field(default_factory=_default_attention)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    attention_forms: dict = field(default_factory=dict, compare=False)


GROUPS = ("data", "attention", "model", "optim", "eval")
