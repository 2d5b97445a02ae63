"""The one check of a run config: every field against its declared type, choices and range (table-driven, from the
fields' own declarations), then the few rules that tie fields together."""
from __future__ import annotations

from .. import fields
from ..attention.registry import get_kind
from .groups import GROUPS, RunConfig
from .keys import flat_name

__all__ = ["validate"]


def _name(path: str) -> str:
    return f"config field {flat_name(path)}"


def validate(cfg: RunConfig) -> RunConfig:
    """``cfg`` when valid; ValueError naming the first field (by its ``--set`` name) that is out of its range or
    choices, and for combinations that cannot run (a batch that does not split into micro-batches, OneCycle
    without room for its warm-up, num_kv_heads not dividing num_heads)."""
    fields.check(cfg, name=_name, skip=(*GROUPS, "attention_forms"))
    for group in GROUPS:
        if group == "attention":
            get_kind(cfg.attention.kind)  # ValueError listing the registered kinds
            cfg.attention.check(name=lambda p: _name(f"attention.{p}"))
        else:
            fields.check(getattr(cfg, group), name=lambda n, g=group: _name(f"{g}.{n}"))
    _check_heads(cfg)
    o = cfg.optim
    if o.batch_size % o.grad_accum:
        raise ValueError(f"batch_size ({o.batch_size}) must be divisible by grad_accum ({o.grad_accum})")
    if o.schedule == "onecycle" and not 2 <= o.warmup_steps < o.steps:  # OneCycleLR divides by warmup - 1
        raise ValueError(f"schedule onecycle needs 2 <= warmup_steps < steps (its pct_start is warmup_steps/steps), "
                         f"got warmup_steps={o.warmup_steps}, steps={o.steps}")
    return cfg



def _check_heads(cfg: RunConfig) -> None:
    """The head counts the attention module is built with, checked here so that a bad ``--set`` is named by its
    field before any data is read (the module would refuse them later, naming its own arguments)."""
    a = cfg.attention
    groups = getattr(a.options, "num_kv_heads", None)  # grouped kinds (gqa, gmgk): a group serves H / G query heads
    if groups is not None and a.num_heads % groups:
        raise ValueError(f"config field num_kv_heads must divide num_heads ({a.num_heads}), got {groups}")
    if a.head_dim is None and cfg.model.d_model % a.num_heads:
        raise ValueError(f"config field head_dim is None, so num_heads ({a.num_heads}) must divide d_model "
                         f"({cfg.model.d_model}); set head_dim")
