"""Attention kinds by name: the one place a kind is declared, and that every model, table, report, benchmark and test
reads.

:func:`register` declares a kind (:class:`AttentionKind`): its family, display label, options dataclass
(:mod:`mgk.attention.options`), factory, FLOP formula (:mod:`mgk.attention.flops`), decoding-cache layout
(:class:`mgk.attention.cache_spec.CacheSpec`) and the option variants worth testing and benchmarking. An option the
kind does not take is an error naming the option and the kind, never silently dropped (a dropped ``pi="soft_e"``
would train softmax attention while the run's records claimed Soft-E). Each kind is declared in its own file, which
calls :func:`register` at its bottom (module, options, FLOPs, cache layout and conversion rule together, as
fast-transformers does); :mod:`mgk.attention.kinds` is the index that imports them.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Callable

from torch import nn

from .. import fields
from .cache_spec import CacheSpec
from .options import Options

__all__ = ["FAMILIES", "AttentionKind", "register", "get_kind", "attention_kinds", "attention_options",
           "make_options", "check_options", "build_attention", "kind_variants", "variant_name", "option_labels",
           "run_label", "display_label"]

FAMILIES = ("softmax", "mixture", "linear")

_REGISTRY: dict[str, "AttentionKind"] = {}


@dataclass(frozen=True)
class AttentionKind:
    """One attention kind.

    name: what ``--attention`` and :func:`build_attention` take ("mgk").
    family: "softmax", "mixture" (Gaussian mixture keys) or "linear" (linear attention, with or without mixture keys).
    label: display name in tables and reports ("sMGK").
    options: the frozen dataclass of the kind's options (an :class:`~mgk.attention.options.Options` subclass).
    factory: ``factory(embed_dim, num_heads, *, head_dim, dropout, bias, batch_first, **options) -> nn.Module``;
        also ``kdim``, ``vdim``, ``device`` and ``dtype`` when a caller gives them.
    flops: ``flops(options, *, heads, length, batch, embed_dim, head_dim, causal, backward, mixture_kernel) -> int``,
        FLOPs of one call (:mod:`mgk.attention.flops`).
    cache: what a decoding cache of one layer holds.
    variants: option values (dicts) that give distinct behaviour worth covering in tests, benchmarks and docs; the
        first is ``{}`` (the defaults).
    display: ``display(num_heads, options) -> str``, the name of a setting in reports when it is not
        ``"{label} x {num_heads}"`` plus the labelled options (GQA: "MQA x 8" for one key/value head); None for that
        default.
    """

    name: str
    family: str
    label: str
    options: type
    factory: Callable[..., nn.Module]
    flops: Callable[..., int]
    cache: CacheSpec
    variants: tuple = ({},)
    display: Callable[[int, Options], str] | None = None

    def make_options(self, **values) -> Options:
        """The kind's options with ``values``, checked. ValueError naming an option the kind does not take, or a
        value of the wrong type, outside its choices or range."""
        for name in values:
            self.require_option(name)
        return self.options(**values).check(self.name)

    def require_option(self, name: str) -> None:
        """ValueError naming ``name`` and the kind unless the kind takes option ``name``."""
        takes = self.options.names()
        if name not in takes:
            raise ValueError(f"attention option {name!r} does not apply to attention kind {self.name!r} "
                             f"({self.name} takes {', '.join(takes) or 'no options'})")

    def parse_option(self, name: str, text: str):
        """The value of option ``name`` written as ``text`` (``--set``, bench names): by the option's type
        (:func:`mgk.fields.parse`). ValueError naming an option the kind does not take or text that does not
        parse."""
        self.require_option(name)
        return fields.parse(text, typing.get_type_hints(self.options)[name], name)

    def build(self, embed_dim: int, num_heads: int, options: Options, *, head_dim: int | None = None,
              dropout: float = 0.0, bias: bool = True, batch_first: bool = True, kdim: int | None = None,
              vdim: int | None = None, device=None, dtype=None) -> nn.Module:
        """The module of this kind with ``options`` (an instance of :attr:`options`, checked here). ``batch_first``:
        the layout (True: (B, T, E), mgk's models; False: (T, B, E), torch's default); ``kdim`` / ``vdim``: widths
        of the key and value inputs (default embed_dim); ``device`` / ``dtype``: where and in which floating dtype
        its parameters and buffers are created (torch's factory keywords). Those four are passed on only when
        given; the module raises ValueError naming a bad one."""
        try:
            self.options.check_own(options)  # another kind's options, even a subclass of ours, are refused
        except TypeError:
            raise ValueError(f"attention kind {self.name!r} takes {self.options.__name__}, got "
                             f"{type(options).__name__}") from None
        options.check(self.name)
        given = {k: v for k, v in (("kdim", kdim), ("vdim", vdim), ("device", device), ("dtype", dtype))
                 if v is not None}
        return self.factory(embed_dim, num_heads, head_dim=head_dim, dropout=dropout, bias=bias,
                            batch_first=batch_first, **given, **options.as_kwargs())


def register(kind: AttentionKind) -> AttentionKind:
    """Add ``kind``. ValueError when its name is taken, its family unknown or its first variant not the defaults."""
    if kind.name in _REGISTRY:
        raise ValueError(f"attention kind {kind.name!r} is already registered")
    if kind.family not in FAMILIES:
        raise ValueError(f"attention kind {kind.name!r}: family must be one of {FAMILIES}, got {kind.family!r}")
    if not (isinstance(kind.options, type) and issubclass(kind.options, Options)):
        raise ValueError(f"attention kind {kind.name!r}: options must be an Options dataclass")
    if not kind.variants or kind.variants[0] != {}:
        raise ValueError(f"attention kind {kind.name!r}: the first variant must be {{}} (the defaults)")
    for variant in kind.variants:
        kind.make_options(**variant)
    _REGISTRY[kind.name] = kind
    return kind


def get_kind(name: str) -> AttentionKind:
    """The registered kind ``name``; ValueError listing the names otherwise."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention kind {name!r}; choose one of {attention_kinds()}")
    return _REGISTRY[name]


def attention_kinds() -> tuple[str, ...]:
    """Names accepted by :func:`build_attention` (and ``mgk train --attention``), in registration order."""
    return tuple(_REGISTRY)


def attention_options(kind: str) -> dict:
    """The options ``kind`` takes: name -> type annotation (empty for "softmax"). ValueError for an unknown kind."""
    cls = get_kind(kind).options
    return {f.name: f.type for f in dataclasses.fields(cls)}


def make_options(kind: str, **values) -> Options:
    """``get_kind(kind).make_options(**values)``."""
    return get_kind(kind).make_options(**values)


def check_options(kind: str, options) -> None:
    """ValueError naming the first option of the mapping ``options`` that ``kind`` does not take or that is bad."""
    make_options(kind, **options)


def build_attention(kind: str, embed_dim: int, num_heads: int, *, head_dim: int | None = None,
                    dropout: float = 0.0, bias: bool = True, batch_first: bool = True, kdim: int | None = None,
                    vdim: int | None = None, device=None, dtype=None, **options) -> nn.Module:
    """Build the attention module ``kind`` (any name :func:`attention_kinds` lists) with ``num_heads`` heads of
    ``head_dim`` (default ``embed_dim // num_heads``).

    ``options`` are the kind's own (:func:`attention_options`, each kind's options dataclass in its file): num_keys,
    pi, pi_shape, pi_norm, sigma2, max_len for MGK / sMGK (Nguyen et al. 2022, Sections 2-3); normalize,
    feature_map, output_scale, eps, eps_mode for linear attention (:func:`mgk.functional.linear_attention`), and
    those plus num_keys, pi, pi_shape, pi_norm, max_len and mix for MLK / sMLK; num_kv_heads for GQA / MQA; MGK's
    plus num_kv_heads and keys for gMGK; none for softmax.
    ``batch_first`` (default True, mgk's models), ``kdim``, ``vdim``, ``device`` and ``dtype`` (torch's factory
    keywords, as ``nn.MultiheadAttention``: ``device="meta"`` builds without memory) as :meth:`AttentionKind.build`.
    Raises ValueError for an unknown kind, an option the kind does not take (naming both), a bad value, or a
    ``dtype`` that is not floating-point or a ``device`` not available here.
    """
    spec = get_kind(kind)
    return spec.build(embed_dim, num_heads, spec.make_options(**options), head_dim=head_dim, dropout=dropout,
                      bias=bias, batch_first=batch_first, kdim=kdim, vdim=vdim, device=device, dtype=dtype)


def kind_variants() -> list[tuple[str, dict]]:
    """``(kind, option values)`` of every registered kind's :attr:`~AttentionKind.variants`, in registration order:
    what the tests and benchmarks cover."""
    return [(name, dict(v)) for name, kind in _REGISTRY.items() for v in kind.variants]


def variant_name(kind: str, values: dict) -> str:
    """``kind`` with option ``values`` as one name, ``"mgk"``, ``"mgk+pi=soft_e"`` (what ``mgk bench attention
    --kinds`` reads, and the tests' ids)."""
    return "".join([kind, *(f"+{k}={v}" for k, v in values.items())])


def option_labels(options: Options) -> list[tuple[str, str]]:
    """(short, long) texts of the options whose value differs from the default and whose field declares a
    :class:`~mgk.fields.Label`, in declaration order (e.g. ``[("soft_e", "Soft-E")]``)."""
    out = []
    for f in dataclasses.fields(options):
        value, label = getattr(options, f.name), f.metadata.get("label")
        if label is not None and value != f.default and (texts := label.texts(f.name, value)) is not None:
            out.append(texts)
    return out


def run_label(kind: str, num_heads: int | None, options: Options, *, sep: str = " ") -> str:
    """Short name of a setting: ``"mgk-4 soft_e"``, ``"mlk-4 mix=keys"``; without heads ``"smgk+hard_e"`` style
    when ``sep="+"`` and ``num_heads`` is None."""
    head = kind if num_heads is None else f"{kind}-{num_heads}"
    return sep.join([head, *(short for short, _ in option_labels(options))])


def display_label(kind: str, num_heads: int, options: Options) -> str:
    """Name of a setting in reports: ``"MGK x 4"``, ``"sMGK x 4 (Soft-E)"``, ``"MLK x 4 (mix=keys)"``, or the kind's
    own :attr:`AttentionKind.display`."""
    spec = get_kind(kind)
    if spec.display is not None:
        return spec.display(num_heads, options)
    extra = [long for _, long in option_labels(options)]
    return f"{spec.label} x {num_heads}" + (f" ({', '.join(extra)})" if extra else "")
