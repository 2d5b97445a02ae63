"""Attention kinds by name: the one place a kind is declared, and that every model, table, report, benchmark and test
reads, with what a declaration is made of.

:func:`register` declares a kind (:class:`AttentionKind`): its family, display label, options dataclass (a subclass
of :class:`Options`), factory, FLOP formula (ending with :func:`total`), decoding-cache layout (:class:`CacheSpec`)
and the option variants worth testing and benchmarking. An option the kind does not take is an error naming the
option and the kind, never silently dropped (a dropped ``pi="soft_e"`` would train softmax attention while the run's
records claimed Soft-E). Each kind is declared in its own file, which calls :func:`register` at its bottom (module,
options, FLOPs, cache layout and conversion rule together, as fast-transformers does); :mod:`mgk.attention` (its
``__init__``) is the index that imports them.

Options: each field is declared with :func:`mgk.fields.spec`; :meth:`Options.check` validates an instance (types,
choices, ranges, and options that apply only under another option's value, such as ``pi_shape`` under
``pi="learned"``). Each kind declares its own dataclass in its own file (``SoftmaxOptions`` in
:mod:`mgk.attention.softmax`, ``MGKOptions`` in :mod:`mgk.attention.mgk`, ...; the mixture keys' shared
``MixtureOptions`` in :mod:`mgk.attention.mixture_keys`), with the module's own constants as choices, so a value the
module accepts is a value the options accept.

FLOPs (:func:`total`, the sum every kind's formula ends with): analytic counts of one call as our implementation
computes it. Multiply-adds count 2; backward counts 2 x forward. For N queries and S = N keys, embed width E, H heads
of size D: each projection of width H * D costs ``2 N E (H D)``; a causal mask halves the quadratic terms of the core.

What a decoding cache holds for one layer (:class:`CacheSpec`), in two forms. A *key/value* cache grows with the
sequence: per token and head it stores ``keys_per_token`` key vectors of size D (M for separate-key MGK, whose M
projections must all be kept; 1 for softmax, and for sMGK, whose learned offsets are applied when the cache is read),
``values_per_token`` value vectors of size Dv and ``scalars_per_token`` numbers (MGK and sMGK: one per component,
``log pi_jr - |k_jr|^2 / (2 sigma_r^2)`` with the shifts folded in for sMGK, which saves a second pass over the keys
at every step). A *recurrent* state (linear attention and MLK) has a fixed size per head whatever the length: the
key-value sum ``sum_j phi(k_j) v_j^T`` (D x Dv) and the normaliser ``sum_j phi(k_j)`` (D). A kind whose keys and
values have fewer heads than its queries (grouped-query attention) names the option that gives that number
(``heads``): its cache stores those heads only. This is the formula; :meth:`mgk.attention.cache.LayerCache.nbytes`
measures the buffers a layer actually filled, and the tests hold the two equal for every kind. Per token, layer and
head dim D = Dv at b bytes an element: softmax with 2H heads stores ``4 H D b``; MGK with H heads and M = 2
``H (3 D + 2) b``, i.e. ``0.75 + M / (4 D)`` of it; sMGK ``H (2 D + 2) b``, ``0.5 + M / (4 D)``.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Callable

from torch import nn

from .. import fields

__all__ = ["FAMILIES", "AttentionKind", "CacheSpec", "Options", "register", "get_kind", "attention_kinds",
           "attention_options", "make_options", "check_options", "build_attention", "kind_variants", "variant_name",
           "option_labels", "run_label", "display_label", "total"]

FAMILIES = ("softmax", "mixture", "linear")


@dataclass(frozen=True)
class Options:
    """Base of every kind's options (softmax attention takes none). A list given for a tuple option is kept as a
    tuple (options are frozen and hashable)."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if isinstance(getattr(self, f.name), list):
                object.__setattr__(self, f.name, tuple(getattr(self, f.name)))

    def check(self, kind: str) -> "Options":
        """``self`` when every field is valid; ValueError naming the first bad option and ``kind``."""
        fields.check(self, name=lambda n: f"attention option {n!r} of kind {kind!r}")
        return self

    @classmethod
    def merged(cls, options: "Options | None", values: dict) -> "Options":
        """The options a module constructor runs with, from its ``options`` (an instance, or None) and its option
        keywords ``values``: ``cls(**values)`` without ``options``; with it, ``options`` itself when every keyword
        agrees with it (a list agrees with the equal tuple). ValueError naming both values of the first keyword that
        differs: one of them would be silently ignored; TypeError naming ``options`` as :meth:`check_own`."""
        if options is None:
            return cls(**values)
        cls.check_own(options)
        given = dataclasses.replace(options, **values)  # normalised as options are (a list held as a tuple)
        for name in values:
            if getattr(given, name) != getattr(options, name):
                raise ValueError(f"{name}={values[name]!r} conflicts with options.{name}="
                                 f"{getattr(options, name)!r}; give one")
        return options

    @classmethod
    def check_own(cls, options) -> None:
        """TypeError in one line naming ``options`` unless it is an instance of ``cls`` with no fields of its own: a
        dict, a string, or another kind's options subclassing ours (gmgk's GMGKOptions given to MGKAttention, MLK's
        to LinearAttention), whose own fields (num_kv_heads, num_keys) a module of ``cls`` would silently leave
        unread. A subclass that only changes defaults is ``cls``'s options and is taken."""
        if not isinstance(options, cls):
            raise TypeError(f"options must be a {cls.__name__} or None, got {type(options).__name__}")
        unread = [name for name in options.names() if name not in cls.names()]
        if unread:
            raise TypeError(f"options is a {type(options).__name__}, whose {', '.join(unread)} a module taking "
                            f"{cls.__name__} would not read: give a {cls.__name__}, or build the kind that takes "
                            f"{type(options).__name__}")

    def as_kwargs(self) -> dict:
        """The options as keyword arguments of the kind's module constructor."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The option names, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def reset_inapplicable(self, keep=()) -> "Options":
        """A copy with every option whose ``only_if`` condition fails set back to its default, except those named
        in ``keep`` (a user set them: :meth:`check` then reports them)."""
        resets = {n: type(self).__dataclass_fields__[n].default for n in fields.inapplicable(self) if n not in keep}
        return dataclasses.replace(self, **resets) if resets else self


@dataclass(frozen=True)
class CacheSpec:
    """A layer's decoding cache per head.

    ``keys_per_token``: key vectors stored per token: an int, the name of the kind's option that gives the count
    (``"num_keys"``), or a function ``options -> int`` for a count that depends on more than one option (a kind whose
    key mode decides whether it stores M keys or one). ``values_per_token``: value vectors per token.
    ``scalars_per_token``: single numbers per token (an int, an option's name or such a function). ``recurrent``: a
    fixed state of D * Dv + D numbers instead (then nothing is stored per token). ``heads``: the name of the option
    that gives the number of cached heads (None: every head; so too when that option is None)."""

    keys_per_token: int | str | Callable[..., int] = 1
    values_per_token: int = 1
    scalars_per_token: int | str | Callable[..., int] = 0
    recurrent: bool = False
    heads: str | None = None

    def cached_heads(self, options, num_heads: int) -> int:
        """Heads whose entries are cached under ``options``, for a layer of ``num_heads`` query heads."""
        named = getattr(options, self.heads) if self.heads is not None else None
        return num_heads if named is None else named

    def stored_per_token(self, options) -> tuple[int, int, int]:
        """(key vectors, value vectors, scalars) kept per token and head under ``options`` ((0, 0, 0) for a
        recurrent state)."""
        if self.recurrent:
            return 0, 0, 0

        def count(n):
            """A count given as a number, as the name of the option that holds it, or as a function of the
            options."""
            if callable(n):
                return n(options)
            return getattr(options, n) if isinstance(n, str) else n

        return count(self.keys_per_token), self.values_per_token, count(self.scalars_per_token)

    def cache_bytes(self, options, *, num_heads: int, head_dim: int, length: int, element_size: int = 4,
                    value_dim: int | None = None) -> int:
        """Bytes of one layer's cache for one sequence after ``length`` tokens (``value_dim`` defaults to
        ``head_dim``; ``element_size`` 4 for float32, 2 for bfloat16)."""
        dv = head_dim if value_dim is None else value_dim
        heads = self.cached_heads(options, num_heads)
        if self.recurrent:
            return heads * (head_dim * dv + head_dim) * element_size
        keys, values, scalars = self.stored_per_token(options)
        return heads * length * (keys * head_dim + values * dv + scalars) * element_size


def total(core: float, projections: float, *, heads: int, length: int, batch: int, embed_dim: int, head_dim: int,
          backward: bool) -> int:
    """FLOPs of one call: ``projections`` linear maps of width H * D from the E inputs of each of N tokens (3 for
    the query, value and output projections plus the key projections; fewer for kinds whose keys or values have
    fewer heads, e.g. ``2 + 2 G / H`` for grouped-query attention) and the attention ``core`` of each head."""
    projections = 2 * length * embed_dim * heads * head_dim * projections
    return int(batch * (projections + heads * core) * (3 if backward else 1))

_REGISTRY: dict[str, "AttentionKind"] = {}


@dataclass(frozen=True)
class AttentionKind:
    """One attention kind.

    name: what ``--attention`` and :func:`build_attention` take ("mgk").
    family: "softmax", "mixture" (Gaussian mixture keys) or "linear" (linear attention, with or without mixture keys).
    label: display name in tables and reports ("sMGK").
    options: the frozen dataclass of the kind's options (an :class:`Options` subclass).
    factory: ``factory(embed_dim, num_heads, *, head_dim, dropout, bias, batch_first, **options) -> nn.Module``;
        also ``kdim``, ``vdim``, ``device`` and ``dtype`` when a caller gives them.
    flops: ``flops(options, *, heads, length, batch, embed_dim, head_dim, causal, backward, mixture_kernel) -> int``,
        FLOPs of one call (:func:`total`).
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
