"""The base of every attention kind's options: a frozen dataclass whose fields carry types, defaults, choices,
ranges and docs in one place.

Each field is declared with :func:`mgk.fields.spec`; :meth:`Options.check` validates an instance (types, choices,
ranges, and options that apply only under another option's value, such as ``pi_shape`` under ``pi="learned"``).
Each kind declares its own dataclass in its own file (``SoftmaxOptions`` in :mod:`mgk.attention.softmax`,
``MGKOptions`` in :mod:`mgk.attention.mgk`, ...; the mixture keys' shared ``MixtureOptions`` in
:mod:`mgk.attention.mixture_keys`), with the module's own constants as choices, so a value the module accepts is a
value the options accept.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .. import fields

__all__ = ["Options"]


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
