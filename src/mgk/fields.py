"""Dataclass fields that declare their own constraints, and the one check and text parser that read them.

A field made with :func:`spec` carries in its metadata its documentation, allowed ``choices``, a numeric range
(``ge``/``gt``/``le``/``lt``, applied to every element of a tuple or list), ``only_if`` (the field applies only when
another field of the same object has a given value) and ``label`` (how a non-default value names a run, see
:class:`Label`). :func:`check` tests an instance against its annotations and these declarations, so every attention
option (:class:`mgk.attention.registry.Options`) and every run-config field (:mod:`mgk.config`) is validated by the
same code, with a message that names the field and what it accepts.
"""
from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .choices import did_you_mean
from .seeds import INT64_MAX

__all__ = ["Label", "spec", "check", "check_value", "parse", "range_text", "inapplicable", "type_name"]

_NONE_WORDS = ("none", "null")
_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Label:
    """How a field's value names a run when it is not the default.

    ``names``: value -> long text (e.g. ``{"soft_e": "Soft-E"}``); when given, only these values are named.
    ``short``: format of the short form, with ``{name}`` and ``{value}`` (default ``"{name}={value}"``; the long form
    of a value not in ``names`` is the short one)."""

    names: dict | None = None
    short: str = "{name}={value}"

    def texts(self, name: str, value) -> tuple[str, str] | None:
        """(short, long) text of ``value`` of field ``name``, or None when this value is not named."""
        if self.names is not None and value not in self.names:
            return None
        short = self.short.format(name=name, value=value)
        return short, (self.names[value] if self.names is not None else short)


def spec(default=dataclasses.MISSING, *, doc: str, choices: tuple | None = None, ge=None, gt=None, le=None,
         lt=None, only_if: tuple[str, Any] | None = None, label: Label | None = None, **extra) -> Any:
    """A dataclass field with ``default``, its ``doc`` and its constraints (see the module docstring); ``extra``
    metadata such as ``why`` (a reason added to the message of a value outside ``choices``)."""
    metadata = {"doc": doc, "choices": choices, "ge": ge, "gt": gt, "le": le, "lt": lt, "only_if": only_if,
                "label": label, **extra}
    return dataclasses.field(default=default, metadata=metadata)


def type_name(hint) -> str:
    """Readable name of a type annotation (``float or tuple of float``)."""
    if hint is type(None):
        return "None"
    if _is_union(hint):
        return " or ".join(type_name(a) for a in typing.get_args(hint))
    origin = typing.get_origin(hint)
    if origin in (tuple, list):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return f"{origin.__name__} of {type_name(args[0])}" if args else origin.__name__
    return getattr(hint, "__name__", str(hint))


def _is_union(hint) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _type_ok(value, hint) -> bool:
    if hint is Any:
        return True
    if hint is type(None) or hint is None:
        return value is None
    if _is_union(hint):
        return any(_type_ok(value, a) for a in typing.get_args(hint))
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    origin = typing.get_origin(hint)
    if origin in (tuple, list):
        if not isinstance(value, origin):
            return False
        args = typing.get_args(hint)
        if not args:
            return True
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_type_ok(v, args[0]) for v in value)
        return len(args) == len(value) and all(_type_ok(v, a) for v, a in zip(value, args))
    return isinstance(value, hint)


def range_text(meta) -> str | None:
    """``">= 0"``, ``"> 0"``, ``"in [0, 1)"`` ... of a field's declared range, or None when it has none."""
    low = (f"[{meta['ge']}", f">= {meta['ge']}") if meta.get("ge") is not None else \
        (f"({meta['gt']}", f"> {meta['gt']}") if meta.get("gt") is not None else None
    high = (f"{meta['le']}]", f"<= {meta['le']}") if meta.get("le") is not None else \
        (f"{meta['lt']})", f"< {meta['lt']}") if meta.get("lt") is not None else None
    if low and high:
        return f"in {low[0]}, {high[0]}"
    return (low or high or (None, None))[1]


def _in_range(x, meta) -> bool:
    if isinstance(x, float) and not math.isfinite(x):
        return False  # NaN and inf are no setting of any field
    tests = (("ge", lambda b: x >= b), ("gt", lambda b: x > b), ("le", lambda b: x <= b), ("lt", lambda b: x < b))
    return all(meta.get(key) is None or bool(ok(meta[key])) for key, ok in tests)


def _numbers(value) -> list:
    items = value if isinstance(value, (tuple, list)) else [value]
    return [x for x in items if isinstance(x, (int, float)) and not isinstance(x, bool)]


def check_value(value, hint, meta, name: str) -> None:
    """ValueError ``"<name> must be ..., got <value>"`` unless ``value`` fits the annotation ``hint`` and the
    field's ``choices`` and range (``meta``: the field's metadata)."""
    if not _type_ok(value, hint):
        raise ValueError(f"{name} must be {type_name(hint)}, got {value!r}")
    choices = meta.get("choices")
    if choices is not None and isinstance(value, str) and value not in choices:
        allowed = repr(choices[0]) if len(choices) == 1 else "one of " + ", ".join(map(repr, choices))
        why = f" ({meta['why']})" if meta.get("why") else ""
        raise ValueError(f"{name} must be {allowed}, got {value!r}{did_you_mean(value, choices)}{why}")
    text = range_text(meta)
    numbers = _numbers(value)
    if text is not None and not all(_in_range(x, meta) for x in numbers):
        each = " (each value)" if isinstance(value, (tuple, list)) else ""
        finite = all(math.isfinite(x) for x in numbers)
        raise ValueError(f"{name} must be {'' if finite else 'a finite number '}{text}{each}, got {value!r}")
    if meta.get("le") is None and meta.get("lt") is None and any(
            isinstance(x, int) and not -INT64_MAX - 1 <= x <= INT64_MAX for x in numbers):
        # Without a declared bound an int still goes to torch, which holds 64 bits and fails with a message that
        # names nothing ("Overflow when unpacking long").
        raise ValueError(f"{name} must fit a 64-bit integer ({-INT64_MAX - 1} to {INT64_MAX}), got {value!r}")


def inapplicable(obj) -> list[str]:
    """Names of the fields of ``obj`` that hold a non-default value although their ``only_if`` condition fails."""
    out = []
    for f in dataclasses.fields(obj):
        cond = f.metadata.get("only_if")
        if cond and getattr(obj, cond[0]) != cond[1] and getattr(obj, f.name) != f.default:
            out.append(f.name)
    return out


def check(obj, *, name: Callable[[str], str] = str, skip: Iterable[str] = ()) -> None:
    """Check every field of the dataclass instance ``obj`` (those in ``skip`` aside) against its annotation and
    declared constraints; ValueError for the first that fails, naming it by ``name(field name)``."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        if f.name not in skip and f.metadata.get("doc") is not None:
            check_value(getattr(obj, f.name), hints[f.name], f.metadata, name(f.name))
    for f in dataclasses.fields(obj):
        if f.name in inapplicable(obj):
            key, want = f.metadata["only_if"]
            raise ValueError(f"{name(f.name)} applies only with {key}={want!r}, not {key}={getattr(obj, key)!r}")


def _parse_sequence(text: str, hint):
    origin = typing.get_origin(hint) or hint
    args = [a for a in typing.get_args(hint) if a is not Ellipsis]
    item = args[0] if len(args) == 1 else float  # tuple[int, ...]: "20,60" is (20, 60), not (20.0, 60.0)
    if text.strip().startswith("["):
        value = json.loads(text)
    else:
        value = [_parse_one(x.strip(), item) for x in text.split(",")]
    if not isinstance(value, list):
        raise ValueError(text)
    return origin(value)


def _numeric(hint) -> bool:
    """Whether ``hint`` reads numbers: int, float, a sequence of them, or a union holding one."""
    if _is_union(hint):
        return any(_numeric(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) in (tuple, list):
        return not typing.get_args(hint) or _numeric(typing.get_args(hint)[0])
    return hint in (int, float)


def _underscored_number(text: str) -> bool:
    """Whether ``text`` is a number or a comma list of numbers once its underscores are dropped (``2_0``, ``1_0.5``,
    ``[1_0, 2]``)."""
    try:
        for x in text.replace("_", "").strip("[]").split(","):
            float(x)
    except ValueError:
        return False
    return True


def parse(text: str, hint, name: str):
    """``text`` (from ``--set name=text``) as a value of the annotation ``hint``: bool words, numbers, ``none`` for
    an optional field, ``[1, 2]`` or ``1,2`` for a tuple or list; for a union the first alternative that parses, in
    the annotation's order (``str`` parses any text: list it last). ValueError naming ``name`` when nothing fits, for
    a number written with an underscore (``2_0``) where ``hint`` takes numbers, and for empty text, whatever the type
    (a forgotten value must not pass for None or "")."""
    text = text.strip()
    alternatives = typing.get_args(hint) if _is_union(hint) else (hint,)
    if not text:
        spelled = " (write none for None)" if type(None) in alternatives else ""
        raise ValueError(f"--set {name}=: empty value, expected {type_name(hint)}{spelled}")
    if type(None) in alternatives and text.lower() in _NONE_WORDS:
        return None
    if "_" in text and _numeric(hint) and _underscored_number(text):
        # int("2_0") is 20: in a config value the underscore is a slip (20? 2? 2.0?), not a digit separator
        raise ValueError(f"--set {name}={text}: a number with '_' in it (a typo?); write the number without it")
    for alt in (a for a in alternatives if a is not type(None)):
        try:
            return _parse_one(text, alt)
        except (ValueError, TypeError, json.JSONDecodeError):
            continue
    raise ValueError(f"--set {name}={text}: cannot parse {text!r} as {type_name(hint)}")


def _parse_one(text: str, hint):
    if hint is bool:
        if text.lower() in _TRUE_WORDS + _FALSE_WORDS:
            return text.lower() in _TRUE_WORDS
        raise ValueError(text)
    if hint in (int, float):
        return hint(text)  # "2_0" never gets here: parse refuses it first
    if hint is str:
        return text
    origin = typing.get_origin(hint) or hint
    if origin in (tuple, list):
        return _parse_sequence(text, hint)
    raise TypeError(f"unsupported field type {hint}")
