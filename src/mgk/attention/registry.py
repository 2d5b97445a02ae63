"""Attention kinds by name, so that every model and the CLI choose attention the same way."""
from __future__ import annotations

from typing import Callable

from torch import nn

from .linear import LinearAttention, MLKAttention
from .mgk import MGKAttention
from .softmax import MultiheadAttention

_REGISTRY: dict[str, Callable[..., nn.Module]] = {
    "softmax": MultiheadAttention,
    "mgk": lambda e, h, **kw: MGKAttention(e, h, keys="separate", **kw),
    "smgk": lambda e, h, **kw: MGKAttention(e, h, keys="shifted", **kw),
}

# Options that only some kinds understand; the others drop them, so one model config can name any kind.
_KIND_OPTIONS = {
    "softmax": set(),
    "mgk": {"num_keys", "pi", "pi_shape", "sigma2", "max_len"},
    "smgk": {"num_keys", "pi", "pi_shape", "sigma2", "max_len"},
}


def register(name: str, factory: Callable[..., nn.Module], options: set[str]) -> None:
    """Add an attention kind: ``factory(embed_dim, num_heads, **common, **options) -> nn.Module``."""
    _REGISTRY[name] = factory
    _KIND_OPTIONS[name] = set(options)


def attention_kinds() -> tuple[str, ...]:
    """Names accepted by :func:`build_attention` (and ``mgk train --attention``)."""
    return tuple(_REGISTRY)


def build_attention(kind: str, embed_dim: int, num_heads: int, *, head_dim: int | None = None,
                    dropout: float = 0.0, bias: bool = True, **options) -> nn.Module:
    """Build the attention module ``kind`` ("softmax", "mgk", "smgk", "linear", "mlk", "smlk").

    ``options`` (num_keys, pi, pi_shape, sigma2, max_len, ...) reach the kinds that accept them and are ignored by
    the others (softmax has no mixture). Raises ValueError for an unknown kind.
    """
    if kind not in _REGISTRY:
        raise ValueError(f"unknown attention kind {kind!r}; choose one of {attention_kinds()}")
    accepted = {k: v for k, v in options.items() if k in _KIND_OPTIONS[kind]}
    return _REGISTRY[kind](embed_dim, num_heads, head_dim=head_dim, dropout=dropout, bias=bias, **accepted)


_MLK_OPTIONS = {"num_keys", "pi", "pi_shape", "max_len"}  # "pi" so that soft_e / hard_e reach MLK and are rejected
register("linear", LinearAttention, set())
register("mlk", lambda e, h, **kw: MLKAttention(e, h, keys="separate", **kw), _MLK_OPTIONS)
register("smlk", lambda e, h, **kw: MLKAttention(e, h, keys="shifted", **kw), _MLK_OPTIONS)
