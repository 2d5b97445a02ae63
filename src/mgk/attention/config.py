"""The configuration of an attention layer: kind, heads, head size, dropout, biases and the kind's options."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from .. import fields
from ..fields import spec
from .registry import Options, get_kind

__all__ = ["AttentionConfig"]


@dataclass(frozen=True)
class AttentionConfig:
    """An attention layer: :meth:`build` gives the module of kind ``kind`` (:func:`mgk.attention.attention_kinds`)
    with ``num_heads`` heads of size ``head_dim``, attention-weight ``dropout``, projection ``bias`` and ``options``,
    an instance of the kind's options dataclass (:class:`mgk.attention.registry.Options`). ``options`` may be given
    as a dict of option values, or omitted for the kind's defaults; either way it is held as the dataclass, checked.

    ValueError for an unknown kind or an option the kind does not take (naming both); the ranges of every field are
    checked by :meth:`check`.
    """

    kind: str = spec("softmax", doc="the attention kind")
    num_heads: int = spec(4, ge=1, doc="H, attention heads")
    head_dim: int | None = spec(32, ge=1, doc="D per head (None: embed_dim // num_heads); the attention width H * D "
                                              "need not be the model width")
    dropout: float = spec(0.0, ge=0, lt=1, doc="dropout on the attention weights (training only)")
    bias: bool = spec(True, doc="biases of the q/k/v/output projections (the authors' LM has none)")
    options: Options = None

    def __post_init__(self):
        kind = get_kind(self.kind)
        if self.options is None or isinstance(self.options, dict):
            object.__setattr__(self, "options", kind.make_options(**(self.options or {})))
        elif not isinstance(self.options, kind.options):
            raise ValueError(f"attention kind {self.kind!r} takes {kind.options.__name__}, got "
                             f"{type(self.options).__name__}")

    def check(self, name=str) -> "AttentionConfig":
        """``self`` when every field and option is in range; ValueError naming the first bad one (``name`` maps a
        field's path, e.g. ``"num_heads"`` or ``"options.pi"``, to the name used in the message)."""
        fields.check(self, name=name, skip=("options",))
        fields.check(self.options, name=lambda n: name(f"options.{n}"))
        return self

    def with_options(self, **values) -> "AttentionConfig":
        """A copy whose options have ``values`` (ValueError naming an option the kind does not take)."""
        for key in values:
            get_kind(self.kind).require_option(key)
        return dataclasses.replace(self, options=dataclasses.replace(self.options, **values))

    def build(self, embed_dim: int) -> nn.Module:
        """The attention module for inputs of width ``embed_dim`` (batch-first)."""
        return get_kind(self.kind).build(embed_dim, self.num_heads, self.options, head_dim=self.head_dim,
                                         dropout=self.dropout, bias=self.bias)
