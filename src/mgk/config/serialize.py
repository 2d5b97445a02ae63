"""config.yaml and the checkpoints' ``"config"``: :func:`to_dict` writes the nested form; :func:`from_dict` reads it
and the flat form of earlier versions (0.1.0 run directories), where every attention option was stored whatever the
kind (those the kind does not take were never used, and are dropped)."""
from __future__ import annotations

import dataclasses

from ..attention import AttentionConfig, get_kind
from .groups import GROUPS, RunConfig
from .keys import _apply, close_matches, flat_keys

__all__ = ["to_dict", "from_dict"]


def _plain(value):
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def to_dict(cfg: RunConfig) -> dict:
    """The nested dict of ``cfg`` (plain YAML types; ``attention_forms`` left out: not part of the run)."""
    out = dataclasses.asdict(cfg)
    out.pop("attention_forms")
    return _plain(out)


def _did_you_mean(unknown, known, prefix: str = "") -> str:
    """"; did you mean ...?" for the unknown keys that have close matches among ``known`` ("" when none has)."""
    hints = [f"{near} for {prefix}{k}" for k in unknown if (near := close_matches(f"{prefix}{k}", known))]
    return f"; did you mean {', '.join(hints)}?" if hints else ""


def _group(cls, values: dict, where: str):
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown config fields {[f'{where}.{k}' for k in unknown]}"
                         + _did_you_mean(unknown, [f"{where}.{k}" for k in known], prefix=f"{where}."))
    return cls(**values)


def _from_nested(d: dict) -> RunConfig:
    top = {f.name: f for f in dataclasses.fields(RunConfig) if f.name != "attention_forms"}
    unknown = sorted(set(d) - set(top))
    if unknown:
        raise ValueError(f"unknown config fields {unknown}" + _did_you_mean(unknown, top))
    values = {k: v for k, v in d.items() if k not in GROUPS}
    for name in GROUPS:
        if name not in d:
            continue
        if not isinstance(d[name], dict):
            raise ValueError(f"config group {name!r} must be a mapping, got {d[name]!r}")
        if name == "attention":
            attention = dict(d[name])
            kind = attention.get("kind", top[name].default_factory().kind)
            options = get_kind(kind).make_options(**(attention.pop("options", None) or {}))
            values[name] = _group(AttentionConfig, {**attention, "options": options}, name)
        else:
            values[name] = _group(top[name].default_factory().__class__, d[name], name)
    return RunConfig(**values)


def _from_flat(d: dict) -> RunConfig:
    keys = flat_keys()
    unknown = sorted(set(d) - set(keys))
    if unknown:
        raise ValueError(f"unknown config fields {unknown}" + _did_you_mean(unknown, keys))
    kind = d.get("attention", RunConfig().attention.kind)
    takes = get_kind(kind).options.names()
    changes = {keys[k]: v for k, v in d.items()
               if not keys[k].startswith("attention.options.") or keys[k].split(".")[-1] in takes}
    return _apply(RunConfig(), changes, keep=set())


def from_dict(d: dict) -> RunConfig:
    """The RunConfig of a dict of :func:`to_dict`, or of the flat form (every key a flat ``--set`` name); fields
    missing from it take their defaults. ValueError naming unknown keys."""
    if not isinstance(d, dict):
        raise ValueError(f"a config must be a mapping, got {type(d).__name__}")
    nested = any(isinstance(d.get(g), dict) for g in GROUPS)
    return _from_nested(d) if nested else _from_flat(d)
