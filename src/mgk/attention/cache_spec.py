"""What a decoding cache holds for one attention layer: the declaration each registered kind makes.

Two forms. A *key/value* cache grows with the sequence: per token and head it stores ``keys_per_token`` key vectors
of size D (M for separate-key MGK, whose M projections must all be kept; 1 for softmax, and for sMGK, whose learned
offsets are applied when the cache is read) and ``values_per_token`` value vectors of size Dv. A *recurrent* state
(linear attention and MLK) has a fixed size per head whatever the length: the key-value sum ``sum_j phi(k_j) v_j^T``
(D x Dv) and the normaliser ``sum_j phi(k_j)`` (D). The cache itself is built on top of this declaration.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CacheSpec"]


@dataclass(frozen=True)
class CacheSpec:
    """A layer's decoding cache per head.

    ``keys_per_token``: key vectors stored per token: an int, or the name of the kind's option that gives the count
    (``"num_keys"``). ``values_per_token``: value vectors per token. ``recurrent``: a fixed state of D * Dv + D
    numbers instead (then no key or value is stored per token)."""

    keys_per_token: int | str = 1
    values_per_token: int = 1
    recurrent: bool = False

    def stored_per_token(self, options) -> tuple[int, int]:
        """(key vectors, value vectors) kept per token and head under ``options`` ((0, 0) for a recurrent state)."""
        if self.recurrent:
            return 0, 0
        keys = self.keys_per_token
        return (getattr(options, keys) if isinstance(keys, str) else keys), self.values_per_token

    def cache_bytes(self, options, *, num_heads: int, head_dim: int, length: int, element_size: int = 4,
                    value_dim: int | None = None) -> int:
        """Bytes of one layer's cache for one sequence after ``length`` tokens (``value_dim`` defaults to
        ``head_dim``; ``element_size`` 4 for float32, 2 for bfloat16)."""
        dv = head_dim if value_dim is None else value_dim
        if self.recurrent:
            return num_heads * (head_dim * dv + head_dim) * element_size
        keys, values = self.stored_per_token(options)
        return num_heads * length * (keys * head_dim + values * dv) * element_size
