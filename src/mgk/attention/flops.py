"""Analytic FLOP counts of one attention call, per family, as our implementation computes it.

Multiply-adds count 2; backward counts 2 x forward. For N queries and S = N keys, embed width E, H heads of size D and
M mixture components: the q, v and output projections are ``2 N E (H D)`` each, the key projections ``2 N E (H D)``
times M for separate keys (MGK, MLK) and once for shifted keys (sMGK, sMLK, whose offsets cost nothing). The core
per head:

- softmax: ``4 N S D`` (scores and the value product);
- MGK summed before the value product (our CPU kernel, and always for Hard-E, whose max over components is taken
  on M distance matrices): ``2 N M S D + 2 N S D``; otherwise SDPA over M * S keys with one column more,
  ``2 N M S (D + 1) + 2 N M S D``; Soft-E in training adds the E-step's distances, ``2 N M S D`` (forward only);
- linear: ``4 S D D + 4 N D D`` (key-value sums and their use, with denominators); MLK adds the mixture of the M
  key features, ``2 M S D``.

A causal mask halves the quadratic terms. Each function takes the kind's options and the call's shape.
"""
from __future__ import annotations

__all__ = ["softmax", "mixture", "linear", "mlk"]


def _total(core: float, key_projections: int, *, heads: int, length: int, batch: int, embed_dim: int,
           head_dim: int, backward: bool) -> int:
    projections = 2 * length * embed_dim * heads * head_dim * (3 + key_projections)
    return int(batch * (projections + heads * core) * (3 if backward else 1))


def softmax(options, *, heads: int, length: int, batch: int, embed_dim: int, head_dim: int, causal: bool,
            backward: bool, mixture_kernel: bool = False) -> int:
    """Softmax attention (``mixture_kernel`` unused)."""
    core = 4 * length * length * head_dim * (0.5 if causal else 1.0)
    return _total(core, 1, heads=heads, length=length, batch=batch, embed_dim=embed_dim, head_dim=head_dim,
                  backward=backward)


def mixture(options, *, separate: bool, heads: int, length: int, batch: int, embed_dim: int, head_dim: int,
            causal: bool, backward: bool, mixture_kernel: bool = False) -> int:
    """MGK (``separate`` keys) or sMGK; ``mixture_kernel``: the call runs our CPU kernel (or a path with its count)."""
    N = S = length
    M, D = options.num_keys, head_dim
    if mixture_kernel or options.pi == "hard_e":
        core = 2 * N * M * S * D + 2 * N * S * D
    else:
        core = 2 * N * M * S * (D + 1) + 2 * N * M * S * D
    if options.pi == "soft_e" and backward:
        core += 2 * N * M * S * D / 3  # the E-step runs in the forward only (x 3 below)
    core *= 0.5 if causal else 1.0
    return _total(core, M if separate else 1, heads=heads, length=length, batch=batch, embed_dim=embed_dim,
                  head_dim=head_dim, backward=backward)


def linear(options, *, heads: int, length: int, batch: int, embed_dim: int, head_dim: int, causal: bool,
           backward: bool, mixture_kernel: bool = False) -> int:
    """Linear attention (the count does not depend on ``causal``)."""
    core = 4 * length * head_dim * head_dim * 2
    return _total(core, 1, heads=heads, length=length, batch=batch, embed_dim=embed_dim, head_dim=head_dim,
                  backward=backward)


def mlk(options, *, separate: bool, heads: int, length: int, batch: int, embed_dim: int, head_dim: int,
        causal: bool, backward: bool, mixture_kernel: bool = False) -> int:
    """MLK (``separate`` keys) or sMLK: linear attention plus the mixture of the M key features."""
    M, D = options.num_keys, head_dim
    core = 4 * length * D * D * 2 + 2 * M * length * D
    return _total(core, M if separate else 1, heads=heads, length=length, batch=batch, embed_dim=embed_dim,
                  head_dim=head_dim, backward=backward)
