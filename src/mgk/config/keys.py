"""The names of the run-config fields on the command line, and the one way to change a config by them.

Every field has a dotted path (``optim.lr``, ``attention.options.pi``) and a flat name, the key of ``--set`` and of
0.1.0 run directories: the field's own name, with the eval group's prefixed (``eval_every``) and the renames in
:data:`RENAMES` (``attention`` is ``attention.kind``, ``attn_eps`` is ``attention.options.eps``). The attention
options are those of every registered kind, so a new option has its key without an edit here. :func:`replace`
(typed values) and :func:`apply_overrides` (``key=value`` text) take either form.

An attention option is taken only by the kinds that declare it: setting one the chosen kind does not take is an
error naming both. Choosing a kind takes its form from ``attention_forms`` (a preset's per-kind values) or its
defaults; options of that form that do not apply under the values set (``pi_shape`` under ``pi="soft_e"``) go back
to their defaults, while the same options set in the call are reported by :func:`mgk.config.validate`.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing

from .. import fields
from ..attention import get_kind
from ..attention.registry import attention_kinds
from ..choices import did_you_mean
from .groups import GROUPS, RunConfig

__all__ = ["RENAMES", "close_matches", "flat_keys", "flat_name", "field_of", "resolve_key", "replace",
           "apply_overrides", "flat", "run_config", "with_forms"]

# Dotted path -> flat name, where the flat name is not the field's own name (that of 0.1.0 run directories).
RENAMES = {"data.path": "data", "data.path_as_given": "data_as_given", "attention.kind": "attention",
           "attention.dropout": "attn_dropout", "attention.bias": "attn_bias", "attention.options.eps": "attn_eps"}
_PREFIXES = {"eval": "eval_"}
# Filled in from data.max_len by the model configs; not a setting of its own.
_DERIVED = ("attention.options.max_len",)
_KIND = "attention.kind"


def _option_fields() -> dict[str, dataclasses.Field]:
    """Option name -> field, over the options dataclasses of every registered kind."""
    out = {}
    for kind in attention_kinds():
        for f in dataclasses.fields(get_kind(kind).options):
            out.setdefault(f.name, f)
    return out


def _paths() -> list[str]:
    """The dotted path of every settable field, in declaration order."""
    out = []
    for f in dataclasses.fields(RunConfig):
        if f.name == "attention_forms":
            continue
        if f.name not in GROUPS:
            out.append(f.name)
            continue
        group = f.default_factory()
        out += [f"{f.name}.{g.name}" for g in dataclasses.fields(group) if g.name != "options"]
        if f.name == "attention":
            out += [f"attention.options.{n}" for n in _option_fields()]
    return [p for p in out if p not in _DERIVED]


def flat_keys() -> dict[str, str]:
    """Flat name -> dotted path of every settable field. RuntimeError when two fields would share a flat name."""
    out: dict[str, str] = {}
    for path in _paths():
        group, leaf = path.split(".")[0], path.split(".")[-1]
        name = RENAMES.get(path, _PREFIXES.get(group, "") + leaf if "." in path else path)
        if name in out:
            raise RuntimeError(f"config fields {out[name]} and {path} would share the --set name {name!r}: add one "
                               f"to mgk.config.keys.RENAMES")
        out[name] = path
    return out


def flat_name(path: str) -> str:
    """The flat name of dotted ``path`` (the path itself when it has none)."""
    return {p: n for n, p in flat_keys().items()}.get(path, path)


def field_of(path: str) -> dataclasses.Field:
    """The dataclass field at dotted ``path`` (an option: as the first registered kind that takes it declares it)."""
    *parents, leaf = path.split(".")
    if parents[-1:] == ["options"]:
        return _option_fields()[leaf]
    owner = RunConfig() if not parents else _get(RunConfig(), ".".join(parents))
    return {f.name: f for f in dataclasses.fields(owner)}[leaf]


def resolve_key(key: str) -> str:
    """The dotted path of ``key`` (a flat name or a dotted path); ValueError listing the names otherwise."""
    keys = flat_keys()
    if key in keys:
        return keys[key]
    if key in keys.values():
        return key
    if key in _DERIVED:
        raise ValueError(f"--set {key}: filled in from max_len (set max_len)")
    near = close_matches(key, keys.values() if "." in key else keys)  # in the form the key was written
    if near:
        raise ValueError(f"--set {key}: unknown config field; did you mean {near}?")
    raise ValueError(f"--set {key}: unknown config field (known fields: {', '.join(sorted(keys))})")


def close_matches(name: str, known) -> str:
    """The names in ``known`` close to a mistyped ``name``, quoted and joined with " or " ("" when none is close), as
    argparse suggests choices. A name is compared whole and by its last dotted part (``cutoffs`` finds
    ``adaptive_cutoffs``); only those about as close as the closest are kept."""
    leaf = name.rsplit(".", 1)[-1]

    def score(k: str) -> float:
        """Similarity in [0, 1] of key ``k`` to the unknown name, whole or by its last dotted part."""
        return max(difflib.SequenceMatcher(None, name, k).ratio(),
                   difflib.SequenceMatcher(None, leaf, k.rsplit(".", 1)[-1]).ratio())

    scored = sorted(((score(k), k) for k in set(known)), key=lambda sk: (-sk[0], sk[1]))
    best = scored[0][0] if scored else 0.0
    return " or ".join(repr(k) for s, k in scored[:3] if s >= max(0.6, best - 0.1))


def _get(cfg, path: str):
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _hint(cfg: RunConfig, path: str):
    """The type annotation of ``path`` in ``cfg`` (options: of the chosen kind's dataclass)."""
    *parents, leaf = path.split(".")
    owner = _get(cfg, ".".join(parents)) if parents else cfg
    if parents[-1:] == ["options"]:
        get_kind(cfg.attention.kind).require_option(leaf)
    return typing.get_type_hints(type(owner))[leaf]


def _set_hint(cfg: RunConfig, path: str, key: str):
    """:func:`_hint` for ``--set key=...``: an option the chosen kind does not take is named with the flag."""
    try:
        return _hint(cfg, path)
    except ValueError as e:
        raise ValueError(f"--set {key}: {e}") from None


def _set(obj, parts: list[str], value):
    if len(parts) == 1:
        return dataclasses.replace(obj, **{parts[0]: value})
    return dataclasses.replace(obj, **{parts[0]: _set(getattr(obj, parts[0]), parts[1:], value)})


def _choose_kind(cfg: RunConfig, kind: str) -> RunConfig:
    """``cfg`` with attention kind ``kind`` and its form (``attention_forms``) or default options."""
    if kind == cfg.attention.kind:
        return cfg
    if kind not in attention_kinds():
        raise ValueError(f"config field attention must be one of {attention_kinds()}, got {kind!r}"
                         + did_you_mean(kind, attention_kinds()))
    spec = get_kind(kind)
    options = cfg.attention_forms.get(kind) or spec.options()
    return dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, kind=kind, options=options))


def _apply(cfg: RunConfig, changes: dict, *, keep: set) -> RunConfig:
    """``changes`` (dotted path -> value) applied, the kind first; inapplicable options not in ``keep`` reset."""
    if _KIND in changes:
        cfg = _choose_kind(cfg, changes[_KIND])
    for path, value in changes.items():
        if path == _KIND:
            continue
        *parents, leaf = path.split(".")
        if parents[-1:] == ["options"]:
            cfg = dataclasses.replace(cfg, attention=cfg.attention.with_options(**{leaf: value}))
        else:
            cfg = _set(cfg, path.split("."), value)
    if any(p.startswith("attention.") for p in changes):
        options = cfg.attention.options.reset_inapplicable(keep={p.split(".")[-1] for p in keep
                                                                 if p.startswith("attention.options.")})
        cfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, options=options))
    return cfg


def replace(cfg: RunConfig, changes: dict | None = None, /, **values) -> RunConfig:
    """A copy of ``cfg`` with typed ``values`` (flat names as keywords, or ``changes`` keyed by flat names or dotted
    paths) applied at once: the kind first (with its form), then the rest. ValueError naming an unknown key, an
    option the chosen kind does not take, or a field given two different values (``lr`` and ``optim.lr``)."""
    given = [*(changes or {}).items(), *values.items()]
    resolved = _once((resolve_key(k), f"{k}={v!r}", v) for k, v in given)
    return _apply(cfg, resolved, keep=set(resolved))


def apply_overrides(cfg: RunConfig, pairs=(), /, **values) -> RunConfig:
    """A copy of ``cfg`` with ``key=value`` strings (``--set``) and typed ``values`` (flags, by flat name) applied
    at once, as :func:`replace`. A value parses as its field's type (:func:`mgk.fields.parse`; an option's as the
    chosen kind declares it). ValueError naming a bad pair, key or value, or one field given two different values
    (``--set lr=1e-3 --set optim.lr=2e-3``, or a flag and a ``--set``); the same value twice is taken."""
    texts = []  # (path, key, text) in the order given
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--set expects key=value, got {pair!r}")
        key, text = (s.strip() for s in pair.split("=", 1))
        texts.append((resolve_key(key), key, text))
    flags = [(resolve_key(k), f"{k}={v} (a flag)", v) for k, v in values.items()]
    # Two kinds are refused before either decides how the other values parse.
    kinds = _once([*flags, *((path, f"--set {key}={text}", text) for path, key, text in texts)], only=_KIND)
    chosen = _choose_kind(cfg, kinds[_KIND]) if _KIND in kinds else cfg  # options parse as the chosen kind declares
    parsed = [(path, f"--set {key}={text}", fields.parse(text, _set_hint(chosen, path, key), key))
              for path, key, text in texts]
    changes = _once([*flags, *parsed])
    return _apply(cfg, changes, keep=set(changes))


def _once(entries, *, only: str | None = None) -> dict:
    """Dotted path -> value of ``(path, as given, value)`` entries (those of path ``only`` when given); ValueError
    naming both when two give one field different values (a user who gave both meant one of them: taking the later
    would drop the other unseen)."""
    out, given = {}, {}
    for path, shown, value in entries:
        if only is not None and path != only:
            continue
        if path in out and not _same(out[path], value):
            raise ValueError(f"{given[path]} and {shown} give {flat_name(path)} two values; keep one")
        out.setdefault(path, value)
        given.setdefault(path, shown)
    return out


def _same(a, b) -> bool:
    """Whether two values of one field are one setting (``1e-3`` and ``0.001``; NaN and NaN)."""
    return a == b or repr(a) == repr(b)


def flat(cfg: RunConfig) -> dict:
    """``cfg`` as flat name -> value (the chosen kind's options only): the keys results, tables and reports use."""
    out = {}
    takes = type(cfg.attention.options).names()
    for name, path in flat_keys().items():
        if path.startswith("attention.options.") and path.split(".")[-1] not in takes:
            continue
        out[name] = _get(cfg, path)
    return out


def run_config(**values) -> RunConfig:
    """The defaults with ``values`` (by flat name) applied: how presets are written."""
    return replace(RunConfig(), **values)


def with_forms(cfg: RunConfig, forms: dict) -> RunConfig:
    """``cfg`` holding ``forms`` (kind -> option values, checked) as its ``attention_forms``, with the chosen kind's
    form applied. ValueError naming an option a kind does not take."""
    checked = {kind: get_kind(kind).make_options(**values) for kind, values in forms.items()}
    cfg = dataclasses.replace(cfg, attention_forms=checked)
    if cfg.attention.kind in checked:
        cfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention,
                                                                     options=checked[cfg.attention.kind]))
    return cfg
