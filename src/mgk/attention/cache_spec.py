"""What a decoding cache holds for one attention layer: the declaration each registered kind makes.

Two forms. A *key/value* cache grows with the sequence: per token and head it stores ``keys_per_token`` key vectors
of size D (M for separate-key MGK, whose M projections must all be kept; 1 for softmax, and for sMGK, whose learned
offsets are applied when the cache is read), ``values_per_token`` value vectors of size Dv and ``scalars_per_token``
numbers (MGK and sMGK: one per component, ``log pi_jr - |k_jr|^2 / (2 sigma_r^2)`` with the shifts folded in for
sMGK, which saves a second pass over the keys at every step). A *recurrent* state (linear attention and MLK) has a
fixed size per head whatever the length: the key-value sum ``sum_j phi(k_j) v_j^T`` (D x Dv) and the normaliser
``sum_j phi(k_j)`` (D). A kind whose keys and values have fewer heads than its queries (grouped-query attention)
names the option that gives that number (``heads``): its cache stores those heads only.

This is the formula; :meth:`mgk.attention.cache.LayerCache.nbytes` measures the buffers a layer actually filled,
and the tests hold the two equal for every kind.

Per token, layer and head dim D = Dv at b bytes an element: softmax with 2H heads stores ``4 H D b``; MGK with H
heads and M = 2 ``H (3 D + 2) b``, i.e. ``0.75 + M / (4 D)`` of it; sMGK ``H (2 D + 2) b``, ``0.5 + M / (4 D)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["CacheSpec"]


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
