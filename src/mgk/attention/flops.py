"""Analytic FLOP counts of one attention call, as our implementation computes it: the conventions, and the sum every
kind's formula ends with (each formula lives in its kind's file, registered with it).

Multiply-adds count 2; backward counts 2 x forward. For N queries and S = N keys, embed width E, H heads of size D:
each projection of width H * D costs ``2 N E (H D)``; a causal mask halves the quadratic terms of the core.
"""
from __future__ import annotations

__all__ = ["total"]


def total(core: float, projections: float, *, heads: int, length: int, batch: int, embed_dim: int, head_dim: int,
          backward: bool) -> int:
    """FLOPs of one call: ``projections`` linear maps of width H * D from the E inputs of each of N tokens (3 for
    the query, value and output projections plus the key projections; fewer for kinds whose keys or values have
    fewer heads, e.g. ``2 + 2 G / H`` for grouped-query attention) and the attention ``core`` of each head."""
    projections = 2 * length * embed_dim * heads * head_dim * projections
    return int(batch * (projections + heads * core) * (3 if backward else 1))
