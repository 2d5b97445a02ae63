"""Run configuration: one typed dataclass, presets as instances, ``--set key=value`` overrides.

Presets live beside their tasks (``mgk.tasks.<task>.PRESETS``); one that reproduces the paper cites its source.
Every field can be overridden from the command line; unknown keys and values that do not parse as the field's
type are errors.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Optional, get_args, get_origin, get_type_hints

# Fields that define the model's shape: a checkpoint whose values differ is refused on resume.
MODEL_FIELDS = ("task", "attention", "num_heads", "head_dim", "d_model", "num_layers", "ffn_dim", "num_keys", "pi",
                "pi_shape", "sigma2", "max_len", "pooling", "classifier_dim", "vocab_size", "num_classes")


@dataclass
class RunConfig:
    """Everything a run needs. Lengths are in tokens, learning rates per optimiser step, steps are optimiser steps."""

    # task and data
    task: str = "listops"
    data: Optional[str] = None  # folder with the release files; None = generate the embedded default
    max_len: int = 128  # longest input in tokens (a longer one is an error unless truncate)
    truncate: bool = False
    gen_train: int = 6000  # sizes of the generated default data (used when data is None)
    gen_val: int = 1000
    gen_test: int = 1000
    gen_max_depth: int = 3
    gen_max_args: int = 5
    gen_min_length: int = 10
    gen_max_length: int = 100
    val_fraction: float = 0.1  # share of train carved out as validation where a release has no val split
    split_seed: int = 0  # seed of such carved splits (fixed, documented, independent of the training seed)
    level: str = "curv_contour_length_14"  # Pathfinder difficulty folder
    cache_dir: Optional[str] = None  # tokenised-array cache: None = <data dir>/.mgk-cache when writable, else
    # $XDG_CACHE_HOME/mgk (~/.cache/mgk); "off" disables caching
    # language modelling (SPEC section 2: WikiText-103 small setting)
    segment_len: int = 256  # training/eval segment length in tokens
    adaptive_cutoffs: Optional[list] = None  # adaptive input/softmax cutoffs; None = [20000, 40000, 200000]
    eval_context: int = 0  # sliding-window context for final evaluation (0 = segment mode)
    eval_stride: int = 0  # sliding-window stride (0 = segment mode)
    # model (SPEC section 2: LRA encoder)
    attention: str = "mgk"
    num_heads: int = 4
    head_dim: int = 32
    d_model: int = 64
    num_layers: int = 2
    ffn_dim: int = 128
    dropout: float = 0.1
    attn_dropout: float = 0.1
    num_keys: int = 2
    pi: str = "learned"
    pi_shape: str = "head"
    sigma2: Optional[list] = None  # per-component variances; None = sqrt(head_dim)
    pooling: str = "mean"
    classifier_dim: int = 128
    vocab_size: int = 0  # filled in by the task
    num_classes: int = 0  # filled in by the task
    # optimisation
    steps: int = 1500
    batch_size: int = 32  # global batch (split across ranks)
    grad_accum: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.0
    adam_eps: float = 1e-6
    warmup_steps: int = 100
    schedule: str = "linear"  # linear warm-up then "linear" decay, "cosine" decay or "constant"
    grad_clip: float = 0.0  # 0 = off
    precision: str = "32"  # "32", "bf16" or "fp16"
    nonfinite: str = "stop"  # "stop" the run, or "skip" the step and count it
    seed: int = 0
    # bookkeeping
    log_every: int = 25
    eval_every: int = 250
    eval_batch_size: int = 64
    checkpoint_every: int = 250
    progress: bool = True


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


def validate(cfg: RunConfig) -> RunConfig:
    """Raise ValueError naming the field for values out of range."""
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
    choices = {"precision": ("32", "bf16", "fp16"), "schedule": ("linear", "cosine", "constant"),
               "nonfinite": ("stop", "skip"), "pooling": ("mean", "cls"), "pi_shape": ("head", "position"),
               "pi": ("learned", "soft_e", "hard_e")}
    for name, allowed in choices.items():
        if getattr(cfg, name) not in allowed:
            raise ValueError(f"config field {name} must be one of {allowed}, got {getattr(cfg, name)!r}")
    if cfg.batch_size % cfg.grad_accum:
        raise ValueError(f"batch_size ({cfg.batch_size}) must be divisible by grad_accum ({cfg.grad_accum})")
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


def model_differences(a: dict, b: dict) -> list[str]:
    """Names of model-shaping fields whose values differ between two config dicts, with both values."""
    return [f"{k}: {a.get(k)!r} != {b.get(k)!r}" for k in MODEL_FIELDS if a.get(k) != b.get(k)]


__all__ = ["RunConfig", "apply_overrides", "validate", "to_dict", "from_dict", "model_differences",
           "MODEL_FIELDS"]
