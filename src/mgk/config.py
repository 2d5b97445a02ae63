"""Run configuration: one typed dataclass, presets as instances, ``--set key=value`` overrides, and the one place
where the model configuration is derived from it (:func:`encoder_config`, :func:`lm_config`).

Presets live beside their tasks (``mgk.tasks.<task>.PRESETS``); one that reproduces the paper cites its source.
Every field can be overridden from the command line by its flat name (``--set pi=soft_e``, the keys of 0.1.0 run
directories); unknown keys and values that do not parse as the field's type are errors. Each field belongs to one
group (:func:`fields_of`): "data", "lm", "model", "attention", "attention_option", "optim" or "run". The
"attention_option" fields reach only the attention kinds that take them (:mod:`mgk.attention.registry`).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Iterable, Optional, get_args, get_origin, get_type_hints

from .models.config import AttentionConfig, EncoderConfig, LMConfig

GROUPS = ("data", "lm", "model", "attention", "attention_option", "optim", "run")


def _f(default, group: str):
    """A field with ``default`` in ``group`` (kept in the field's metadata)."""
    return dataclasses.field(default=default, metadata={"group": group})


# Options that parametrise learned mixture weights only (pi="learned").
LEARNED_PI_OPTIONS = ("pi_shape", "pi_norm")
# Learning-rate schedules (mgk.train.schedule implements them).
SCHEDULES = ("linear", "cosine", "constant", "cosine_global", "onecycle")


@dataclass
class RunConfig:
    """Everything a run needs. Lengths are in tokens, learning rates per optimiser step, steps are optimiser steps."""

    # task and data
    task: str = _f("listops", "data")
    data: Optional[str] = _f(None, "data")  # folder with the release files; None = generate the embedded default
    data_as_given: Optional[str] = _f(None, "data")  # --data as typed; ``data`` holds it as an absolute path
    max_len: int = _f(128, "data")  # longest input in tokens (a longer one is an error unless truncate)
    truncate: bool = _f(False, "data")
    gen_train: int = _f(6000, "data")  # sizes of the generated default data (used when data is None)
    gen_val: int = _f(1000, "data")
    gen_test: int = _f(1000, "data")
    gen_max_depth: int = _f(3, "data")
    gen_max_args: int = _f(5, "data")
    gen_min_length: int = _f(10, "data")
    gen_max_length: int = _f(100, "data")
    val_fraction: float = _f(0.1, "data")  # share of train carved out as validation where a release has no val split
    split_seed: int = _f(0, "data")  # seed of such carved splits (fixed, documented, independent of the training seed)
    level: str = _f("curv_contour_length_14", "data")  # Pathfinder difficulty folder
    # ---- begin: generator settings of the synthetic head-count tasks (dretrieval, mqar, cmqar; mgk.data.dretrieval,
    # mgk.data.mqar), used when data is None; the tasks' presets set them ----
    gen_seq_len: int = _f(16, "data")  # dretrieval: T positions (the model also sees a class token); mqar: L tokens
    gen_features: int = _f(4, "data")  # dretrieval: D, the features the target combines
    gen_vocab: int = _f(64, "data")  # dretrieval: V grid points (token values); mqar / cmqar: vocabulary size
    gen_kv_pairs: int = _f(8, "data")  # mqar / cmqar: key-value pairs per sequence (a square for cmqar)
    gen_power_a: float = _f(0.01, "data")  # mqar / cmqar: power-law exponent of the query gaps (Zoology's default)
    # ---- end: generator settings of the synthetic head-count tasks ----
    # tokenised-array cache: None = <data dir>/.mgk-cache when writable, else
    cache_dir: Optional[str] = _f(None, "data")
    # $XDG_CACHE_HOME/mgk (~/.cache/mgk); "off" disables caching
    # language modelling (Nguyen et al. 2022, Section 4.2: WikiText-103, small setting of Schlag et al. 2021)
    segment_len: int = _f(256, "lm")  # training/eval segment length in tokens
    adaptive_cutoffs: Optional[list] = _f(None, "lm")  # adaptive input/softmax cutoffs; None = [20000, 40000, 200000]
    eval_context: int = _f(0, "lm")  # sliding-window context for final evaluation (0 = segment mode)
    eval_stride: int = _f(0, "lm")  # sliding-window stride (0 = segment mode)
    adaptive_softmax: str = _f("torch", "lm")  # "torch" (nn.AdaptiveLogSoftmaxWithLoss: tail projections, no biases)
    # or "authors" (the paper code's tied table with per-word and cluster biases, no projections)
    # model (Nguyen et al. 2022, Section 4.1: the LRA encoder of Nystromformer, Xiong et al. 2021)
    attention: str = _f("mgk", "attention")
    num_heads: int = _f(4, "attention")
    head_dim: int = _f(32, "attention")
    d_model: int = _f(64, "model")
    num_layers: int = _f(2, "model")
    ffn_dim: int = _f(128, "model")
    dropout: float = _f(0.1, "model")
    attn_dropout: float = _f(0.1, "attention")
    attn_bias: bool = _f(True, "attention")  # biases of the attention projections
    num_keys: int = _f(2, "attention_option")
    pi: str = _f("learned", "attention_option")
    pi_shape: str = _f("head", "attention_option")
    sigma2: Optional[list] = _f(None, "attention_option")  # per-component variances; None = sqrt(head_dim)
    pi_norm: str = _f("softmax", "attention_option")  # "none": free log-weights (the authors' LM MGK / MLK)
    # the form of linear / MLK attention (mgk.functional.linear_attention); defaults = eq. 6 / eq. 14
    normalize: str = _f("row", "attention_option")  # "length": the authors' LRA form; "none"
    feature_map: str = _f("elu", "attention_option")  # "elu_sum": the authors' LM form
    output_scale: float = _f(1.0, "attention_option")  # the authors' LM: 1/sqrt(head_dim)
    attn_eps: float = _f(1e-6, "attention_option")  # the denominator's eps (the authors' LM: 1e-5 with eps_mode add)
    eps_mode: str = _f("guard", "attention_option")  # "guard": replaces a zero denominator; "add": den + eps
    mix: str = _f("features", "attention_option")  # MLK: "keys" mixes raw keys before phi (the authors' LRA form)
    pooling: str = _f("mean", "model")
    classifier_dim: int = _f(128, "model")
    classifier_activation: str = _f("gelu", "model")  # "gelu" or "relu" (LRA head)
    init: str = _f("torch", "model")  # "torch" (module defaults) or "paper" (the authors': mgk.models.init)
    vocab_size: int = _f(0, "model")  # filled in by the task
    num_classes: int = _f(0, "model")  # filled in by the task
    # optimisation
    steps: int = _f(1500, "optim")
    batch_size: int = _f(32, "optim")  # global batch (split across ranks)
    grad_accum: int = _f(1, "optim")
    lr: float = _f(1e-3, "optim")
    weight_decay: float = _f(0.0, "optim")
    adam_eps: float = _f(1e-6, "optim")
    warmup_steps: int = _f(100, "optim")
    schedule: str = _f("linear", "optim")  # linear warm-up then "linear" decay, "cosine" decay or "constant";
    # "cosine_global": cosine of step/steps after the warm-up (Transformer-XL's CosineAnnealingLR); "onecycle":
    # torch's OneCycleLR (pct_start = warmup_steps/steps, linear, beta1 cycling 0.85-0.95; the authors' LRA)
    grad_clip: float = _f(0.0, "optim")  # 0 = off
    precision: str = _f("32", "optim")  # "32", "bf16" or "fp16"
    nonfinite: str = _f("stop", "optim")  # "stop" the run, or "skip" the step and count it
    seed: int = _f(0, "run")
    # bookkeeping
    log_every: int = _f(25, "run")
    eval_every: int = _f(250, "run")
    eval_batch_size: int = _f(64, "run")
    eval_batches: int = _f(0, "run")  # batches per validation (0 = the whole split); > 0: a different seeded
    # slice of an endless reshuffled pass over the split each time (the authors' LRA), the whole split at the end
    checkpoint_every: int = _f(250, "run")
    progress: bool = _f(True, "run")


def _coerce(text: str, hint, name: str):
    origin = get_origin(hint)
    if origin is not None and type(None) in get_args(hint):  # Optional[X]
        if text.lower() in ("none", "null", ""):
            return None
        inner = [a for a in get_args(hint) if a is not type(None)][0]
        return _coerce(text, inner, name)
    try:
        if hint is bool:
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if hint is int:
            return int(text)
        if hint is float:
            return float(text)
        if hint is str:
            return text
        if hint is list or origin is list:
            value = json.loads(text) if text.strip().startswith("[") else [float(x) for x in text.split(",")]
            if not isinstance(value, list):
                raise ValueError(text)
            return value
    except ValueError:
        raise ValueError(f"--set {name}={text}: cannot parse {text!r} as {getattr(hint, '__name__', hint)}") from None
    raise ValueError(f"--set {name}: unsupported field type {hint}")


def apply_overrides(cfg: RunConfig, pairs: list[str]) -> RunConfig:
    """Return a copy of ``cfg`` with ``key=value`` strings applied. Raises ValueError naming a bad key or value."""
    hints = get_type_hints(RunConfig)
    changes: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--set expects key=value, got {pair!r}")
        key, text = pair.split("=", 1)
        key = key.strip()
        if key not in hints:
            known = ", ".join(sorted(hints))
            raise ValueError(f"--set {key}: unknown config field (known fields: {known})")
        changes[key] = _coerce(text.strip(), hints[key], key)
    return dataclasses.replace(cfg, **changes)


def override_keys(pairs: list[str]) -> set[str]:
    """The keys of ``key=value`` strings (as :func:`apply_overrides` reads them)."""
    return {pair.split("=", 1)[0].strip() for pair in pairs}


def validate(cfg: RunConfig) -> RunConfig:
    """Raise ValueError naming the field for values out of range."""
    if cfg.eval_batches < 0:
        raise ValueError(f"config field eval_batches must be >= 0 (0 = the whole split), got {cfg.eval_batches}")
    positive = ("max_len", "num_heads", "head_dim", "d_model", "num_layers", "ffn_dim", "num_keys", "steps",
                "batch_size", "grad_accum", "log_every", "eval_every", "eval_batch_size", "checkpoint_every")
    for name in positive:
        if getattr(cfg, name) < 1:
            raise ValueError(f"config field {name} must be >= 1, got {getattr(cfg, name)}")
    for name in ("dropout", "attn_dropout"):
        if not 0.0 <= getattr(cfg, name) < 1.0:
            raise ValueError(f"config field {name} must be in [0, 1), got {getattr(cfg, name)}")
    if not cfg.lr > 0 or cfg.lr == float("inf"):  # also refuses nan
        raise ValueError(f"config field lr must be a positive finite number, got {cfg.lr}")
    from .attention import attention_kinds  # the registry is the one list of names

    if cfg.attention not in attention_kinds():
        raise ValueError(f"config field attention must be one of {attention_kinds()}, got {cfg.attention!r}")
    choices = {"precision": ("32", "bf16", "fp16"), "schedule": SCHEDULES,
               "nonfinite": ("stop", "skip"), "pooling": ("mean", "cls"), "pi_shape": ("head", "position", "layer"),
               "pi": ("learned", "soft_e", "hard_e"), "pi_norm": ("softmax", "none"),
               "normalize": ("row", "length", "none"), "feature_map": ("elu", "elu_sum"), "eps_mode": ("guard", "add"),
               "mix": ("features", "keys"), "init": ("torch", "paper"),
               "classifier_activation": ("gelu", "relu"), "adaptive_softmax": ("torch", "authors")}
    for name, allowed in choices.items():
        if getattr(cfg, name) not in allowed:
            raise ValueError(f"config field {name} must be one of {allowed}, got {getattr(cfg, name)!r}")
    if cfg.batch_size % cfg.grad_accum:
        raise ValueError(f"batch_size ({cfg.batch_size}) must be divisible by grad_accum ({cfg.grad_accum})")
    if cfg.schedule == "onecycle" and not 2 <= cfg.warmup_steps < cfg.steps:  # OneCycleLR divides by warmup - 1
        raise ValueError(f"schedule onecycle needs 2 <= warmup_steps < steps (its pct_start is warmup_steps/steps), "
                         f"got warmup_steps={cfg.warmup_steps}, steps={cfg.steps}")
    return cfg


def to_dict(cfg: RunConfig) -> dict:
    """Plain dict of the config (for YAML and checkpoints)."""
    return dataclasses.asdict(cfg)


def from_dict(d: dict) -> RunConfig:
    """Inverse of :func:`to_dict`; unknown keys are an error naming them."""
    known = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"unknown config fields {sorted(unknown)}")
    return RunConfig(**d)


def fields_of(group: str) -> tuple[str, ...]:
    """Names of the RunConfig fields in ``group`` (one of :data:`GROUPS`), in declaration order."""
    if group not in GROUPS:
        raise ValueError(f"unknown config group {group!r}; choose one of {GROUPS}")
    return tuple(f.name for f in dataclasses.fields(RunConfig) if f.metadata["group"] == group)


def explicit_fields(cfg: RunConfig, given: Iterable[str] = (), soft: dict | None = None) -> set[str]:
    """Fields set on purpose: those named in ``given`` (CLI flags, ``--set`` keys) and those whose value differs
    from RunConfig's default (set by the preset), except values listed in ``soft`` ({field: [values]}): attention
    options that a ``*-paper`` preset sets as the authors' form of some kinds
    (:func:`mgk.tasks.authors.authors_option_values`, e.g. ``sigma2`` of the LM's MGK) are defaults for the kinds
    that take them, so ``--attention softmax`` still runs from that preset."""
    default, given = RunConfig(), set(given)
    soft = soft or {}
    return given | {f.name for f in dataclasses.fields(RunConfig)
                    if getattr(cfg, f.name) != getattr(default, f.name)
                    and getattr(cfg, f.name) not in soft.get(f.name, [])}


def check_attention_options(cfg: RunConfig, explicit: Iterable[str]) -> None:
    """ValueError naming the first field of group "attention_option" in ``explicit`` that ``cfg.attention`` does
    not take (e.g. ``pi`` for softmax). Defaults of such options are never refused: they are simply not passed."""
    from .attention.registry import attention_options

    takes = attention_options(cfg.attention)
    for name in fields_of("attention_option"):
        if name in explicit and name not in takes:
            raise ValueError(f"option {name!r} does not apply to attention {cfg.attention!r} "
                             f"({cfg.attention} takes {', '.join(takes) or 'no options'})")
        if name in explicit and name in LEARNED_PI_OPTIONS and cfg.pi != "learned" \
                and getattr(cfg, name) != getattr(RunConfig(), name):
            raise ValueError(f"option {name!r} shapes learned mixture weights (pi='learned'), not pi={cfg.pi!r}")


def attention_config(cfg: RunConfig, *, max_len: int | None = None) -> AttentionConfig:
    """The attention of ``cfg``: kind, heads, head_dim, attn_dropout, and only the options the kind takes
    (``max_len`` overrides ``cfg.max_len`` for per-position mixture weights)."""
    from .attention.registry import attention_options

    values = {**{k: getattr(cfg, k) for k in fields_of("attention_option")},
              "max_len": cfg.max_len if max_len is None else max_len}
    if cfg.pi != "learned":  # Soft-E's buffer and Hard-E have no learned weights to shape (a preset may set them)
        values.update({k: getattr(RunConfig(), k) for k in LEARNED_PI_OPTIONS})
    options = {k: v for k, v in values.items() if k in attention_options(cfg.attention)}
    return AttentionConfig(kind=cfg.attention, num_heads=cfg.num_heads, head_dim=cfg.head_dim,
                           dropout=cfg.attn_dropout, options=options, bias=cfg.attn_bias)


def encoder_config(cfg: RunConfig) -> EncoderConfig:
    """The LRA classifier / retrieval model of ``cfg`` (``vocab_size`` and ``num_classes`` as filled in by the
    task)."""
    return EncoderConfig(vocab_size=cfg.vocab_size, num_classes=cfg.num_classes, max_len=cfg.max_len,
                         d_model=cfg.d_model, num_layers=cfg.num_layers, ffn_dim=cfg.ffn_dim, dropout=cfg.dropout,
                         pooling=cfg.pooling, classifier_dim=cfg.classifier_dim, attention=attention_config(cfg),
                         classifier_activation=cfg.classifier_activation, init=cfg.init)


def lm_config(cfg: RunConfig, vocab_size: int | None = None) -> LMConfig:
    """The decoder LM of ``cfg`` over ``vocab_size`` words (default ``cfg.vocab_size``). The attention's
    ``max_len`` is at least ``segment_len``, so that per-position mixture weights cover a segment."""
    cutoffs = None if cfg.adaptive_cutoffs is None else tuple(int(c) for c in cfg.adaptive_cutoffs)
    return LMConfig(vocab_size=cfg.vocab_size if vocab_size is None else vocab_size, d_model=cfg.d_model,
                    num_layers=cfg.num_layers, ffn_dim=cfg.ffn_dim, dropout=cfg.dropout, cutoffs=cutoffs,
                    attention=attention_config(cfg, max_len=max(cfg.max_len, cfg.segment_len)),
                    adaptive_softmax=cfg.adaptive_softmax, init=cfg.init)


__all__ = ["RunConfig", "GROUPS", "apply_overrides", "validate", "to_dict", "from_dict", "fields_of",
           "explicit_fields", "override_keys", "check_attention_options", "attention_config", "encoder_config",
           "lm_config"]
