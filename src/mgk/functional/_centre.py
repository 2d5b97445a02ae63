"""The centre that MGK subtracts from queries and keys before it expands the squared distance.

Why: every fast path computes ``-|q - k|^2 / (2 sigma^2)`` expanded, ``q.k / sigma^2 - |k|^2 / (2 sigma^2)`` (the
``|q|^2`` term is constant along a row and cancels in the softmax), so that it is one matrix product. The scores
depend only on ``q - k``, so any vector ``c`` may be subtracted from every query and key first; in exact arithmetic
nothing changes, and the gradient through ``c`` is exactly zero (it is detached). In float arithmetic the expansion
rounds by about ``eps (|q~| |k~| + |k~|^2) / sigma^2`` for ``q~ = q - c``, ``k~ = k - c`` (the fault of the matrix
form of ``torch.cdist``, pytorch/pytorch#42479). Only keys with a non-negligible weight matter, and those lie within
a few sigma of the query, so the error that reaches an output is about ``3 eps |q_i - c|^2 / (2 sigma^2)``: the
centre must lie near the *queries*. A key far from everything (a beginning-of-sequence token or "attention sink"
with a large norm) gets an inaccurate score, but its weight is ``exp(-|q - k|^2 / (2 sigma^2)) ~ 0`` either way.
A centre built from keys fails exactly there: under causality row 1 sees only keys 0 and 1, so a far key 0 would
pull any key statistic away from the queries.

The choice, per (batch, head), from queries only (never from a key, never from a masked row):

* ``is_causal``: the query of the first row that may attend to two keys or more, else (no such row) of the first
  that may attend to one. A row that sees a single key returns that key's value whatever the centre (its weight is
  exp(s - s) = 1 up to the rounding of a sum of M terms), so rows before the chosen one do not depend on it, and
  the outputs at t depend only on positions <= max(t, r) for the chosen row r (bitwise for t >= r). The first row
  is not chosen because it is the one most likely to be far: a beginning-of-sequence token whose hidden state has
  a large norm ("attention sink") makes both its query and its key far, and centring on that query cost every row
  of the sequence about ``3 eps R^2 / (2 sigma^2)`` (1.8e-2 measured at R = 1000). When the chosen query is not
  finite (its squared norm overflows or is NaN) the centre is 0, which depends on nothing.
* otherwise: among the rows that may attend to some key and whose query has a finite squared norm, the query
  nearest to their mean. A minority of far queries pulls the mean by their share of the distance, but the centre is
  an actual query nearest to it, so it stays inside the bulk. With L == S (self-attention) only the rows whose own
  position is a key some row may attend to are used when there are any, so padded query rows, which a caller may
  fill with anything (1e30, NaN), never set it.

Limits: under ``is_causal`` a far token at the chosen row (position 1 of an unpadded sequence, right after a
beginning-of-sequence token; its query at distance R from the others) costs every row of the sequence up to
``3 eps R^2 / (2 sigma^2)``, uncached and decoding with a cache alike (measured: 1.7e-2 at R = 1000 with
sigma^2 = 4, 2.5e-4 at R = 100; softmax attention: 1e-6). One far token at any other position keeps every row within
1e-4 of float64 (measured 5e-6 up to R = 1000). ``tests/functional/test_centre.py`` (``test_one_far_token_*``) holds
both claims for every position and R up to 1000. Which of the first two tokens is the far one cannot be told from
them alone: a centre that held 1e-4 there would need a third row (the query of the first three nearest the other
two), so that row 1's output would depend on row 2 and a decoding cache would keep queries until three tokens.
Without causality the choice fails only when far queries are about as many as the others. A row whose every
visible key is far from the centre has scores of large magnitude; every path normalises a row by its own computed
sum, so a row that sees one key still gives that key's value, and a query far from every key gets nearly one-hot
weights, which the rounding of such scores does not move.

Decoding: the centre of a prefill (causal) stays valid for every later step once each row has seen two real
tokens: a caller computes it once with :func:`mgk.functional.mgk_centre` and passes it as ``centre=`` to each step
instead of re-centring the cached keys (which would cost more than the attention of one token). A row that has seen
fewer (a prefill of one token) gets its centre from its next real token
(:func:`mgk.functional.mgk_cache_centre`), and only its few cached entries are made anew.

Cost: under ``is_causal`` O(B H (S + L)) for key masks (O(B H L S) bool work, once, for masks that depend on the
query, whose pass the masking makes anyway) and O(B H D) for the chosen row; otherwise about three passes over the
queries, O(B H L D), as cheap as the centring itself.
"""
from __future__ import annotations

import torch
from torch import Tensor


def _visible_counts(mask: Tensor | None, L: int, S: int, device) -> Tensor:
    """(B?, H?, L) int: how many keys each query row may attend to under bottom-right causality (row i sees key j
    iff j <= i + S - L) and ``mask`` (bool, 4 dims broadcastable to (B, H, L, S), True = may attend)."""
    last = torch.arange(L, device=device) + (S - L)  # the last key each row may see
    if mask is None:
        return (last + 1).clamp(0, S).view(1, 1, L)
    if mask.shape[-2] == 1:  # key padding: the live keys up to each row's last
        alive = mask[..., 0, :].expand(*mask.shape[:-2], S)
        if S == 0:
            return torch.zeros(*alive.shape[:-1], L, dtype=torch.int64, device=device)
        seen = alive.to(torch.int64).cumsum(dim=-1)[..., last.clamp(0, S - 1)]
        return torch.where(last >= 0, seen, torch.zeros((), dtype=seen.dtype, device=device))
    causal = torch.arange(S, device=device) <= last.unsqueeze(-1)
    return (mask & causal).sum(dim=-1)


def _first_row(counts: Tensor, n: int, query_ok: Tensor | None) -> Tensor:
    """(B?, H?) int64: the first query row (among ``query_ok`` (B?, H?, L) bool, None = all) whose count of visible
    keys (``counts`` (B?, H?, L), :func:`_visible_counts`) is at least ``n``; L when there is none."""
    sees = counts >= n
    if query_ok is not None:
        sees = sees & query_ok
    row = sees.to(torch.int8).argmax(dim=-1)
    return torch.where(sees.any(dim=-1), row, torch.full((), counts.shape[-1], dtype=row.dtype, device=row.device))


def _row(q: Tensor, index: Tensor) -> Tensor:
    """q[b, h, index[b, h]] for q (B, H, L, D) and index (B, H): (B, H, D). (gather keeps L symbolic under
    torch.compile, where take_along_dim would pin it.)"""
    B, H, _, D = q.shape
    return q.gather(2, index[..., None, None].expand(B, H, 1, D))[:, :, 0]


def _unmasked_causal_row(L: int, S: int) -> int | None:
    """The row :func:`_causal_centre` chooses without a mask or padded queries, where row i sees the
    ``min(S, i + S - L + 1)`` keys j <= i + S - L: the first that sees two keys, else the first that sees one, else
    None. Computed from the sizes, so that the common call (a causal language model's training step) makes no
    tensor work for it; tests/functional/test_centre.py holds it equal to the masked rule."""
    for n in (2, 1):
        row = max(0, L - S + n - 1)
        if S >= n and row < L:
            return row
    return None


def _causal_centre(q: Tensor, mask: Tensor | None, S: int, query_ok: Tensor | None) -> Tensor:
    B, H, L, _ = q.shape
    # (traced with dynamic shapes, the size rule would pin L - S: one graph per difference; the counted rule not)
    if mask is None and query_ok is None and not torch.compiler.is_compiling():
        index = _unmasked_causal_row(L, S)
        if index is None:
            return q.new_zeros(B, H, q.shape[3])
        row, ok = q[:, :, index], None
    else:
        counts = _visible_counts(mask, L, S, q.device)  # once: the mask's pass is O(B H L S) when it has query rows
        second = _first_row(counts, 2, query_ok).expand(B, H)
        first = torch.where(second < L, second, _first_row(counts, 1, query_ok).expand(B, H))
        row, ok = _row(q, first.clamp_max(L - 1)), first < L
    finite = torch.isfinite((row * row).sum(-1))
    ok = finite if ok is None else ok & finite
    return torch.where(ok.unsqueeze(-1), row, torch.zeros((), dtype=q.dtype, device=q.device))


def _central_query(q: Tensor, mask: Tensor | None, S: int, query_ok: Tensor | None) -> Tensor:
    L = q.shape[2]
    qq = (q * q).sum(-1)
    rows = torch.isfinite(qq)  # (B, H, L): NaN, inf and overflowing rows are never chosen
    if query_ok is not None:
        rows = rows & query_ok
    if mask is not None:
        sees = mask.any(dim=-1)  # (B?, H?, L?)
        if L == S:  # self-attention: prefer rows whose own position is a real key
            own = sees & mask.any(dim=-2)
            sees = torch.where(own.any(dim=-1, keepdim=True), own, sees)
        rows = rows & sees
    elif S == 0:
        rows = torch.zeros_like(rows)
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    kept = torch.where(rows.unsqueeze(-1), q, zero)
    n = rows.sum(dim=-1, keepdim=True)  # (B, H, 1)
    mean = kept.sum(dim=2) / n.clamp_min(1).to(q.dtype)  # (B, H, D)
    # |q_i - mean|^2 up to a constant; expanded (one product), which is enough to rank the rows
    d2 = torch.where(rows, qq - 2.0 * (kept @ mean.unsqueeze(-1)).squeeze(-1),
                     torch.full((), float("inf"), dtype=q.dtype, device=q.device))
    row = _row(q, d2.argmin(dim=-1))
    return torch.where(n > 0, row, zero)


def choose_centre(q: Tensor, mask: Tensor | None, is_causal: bool, S: int, query_ok: Tensor | None = None) -> Tensor:
    """The (B, H, D) centre of queries q (B, H, L, D) attending to S keys under ``mask`` (checked, bool, 4 dims or
    None) and bottom-right ``is_causal``; detached, in q's dtype. ``query_ok``: bool broadcastable to (B, H, L), True
    = a real query (padded query rows that the mask does not mark are then never chosen), or None. See the module
    docstring for the rule."""
    q = q.detach()
    if q.shape[2] == 0:
        return q.new_zeros(q.shape[0], q.shape[1], q.shape[3])
    with torch.no_grad():
        if query_ok is not None:
            query_ok = query_ok.reshape((1,) * (3 - query_ok.dim()) + tuple(query_ok.shape))
        return (_causal_centre(q, mask, S, query_ok) if is_causal
                else _central_query(q, mask, S, query_ok))


def check_centre(centre, B: int, H: int, D: int, dtype, device) -> Tensor:
    """A caller's centre as a detached (B, H, D) tensor in ``dtype``; ValueError naming ``centre`` otherwise."""
    if not isinstance(centre, Tensor) or not centre.is_floating_point() or centre.dim() > 3 or any(
            a not in (1, b) for a, b in zip((1,) * (3 - centre.dim()) + tuple(centre.shape), (B, H, D))):
        what = tuple(centre.shape) if isinstance(centre, Tensor) else type(centre).__name__
        raise ValueError(f"centre must be None or a floating tensor broadcastable to (B, H, D) = {(B, H, D)}, "
                         f"got {what}")
    return centre.detach().to(device=device, dtype=dtype).expand(B, H, D)


def apply_centre(q: Tensor, k: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """q - c and k - c for q (B, H, L, D), k (B, H, M, S, D), c (B, H, D)."""
    c = c.unsqueeze(2)
    return q - c, k - c.unsqueeze(2)
