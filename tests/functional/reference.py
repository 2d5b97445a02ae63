"""Independent float64 references for the functional attention tests, written literally from the formulas.

Nothing here imports the library: every quantity is spelled out from the paper (Nguyen et al., ICML 2022, eq. 9-10
for MGK; Vaswani et al., 2017, eq. 1 for softmax attention). :func:`refusal` states, independently of the library's
selector, which inputs each ``mgk_attention`` backend is documented to refuse.

Shapes: q (B, H, L, D); MGK keys k (B, H, M, S, D); softmax keys (B, H, S, D); v (B, H, S, Dv).
Masks are bool, True = query i may attend to key j, broadcastable to (B, H, L, S).
"""
from __future__ import annotations

import math

import torch

F64 = torch.float64


def causal_allowed(L: int, S: int) -> torch.Tensor:
    """Bottom-right causal alignment by explicit loops: query i sees key j iff j <= i + S - L."""
    m = torch.zeros(L, S, dtype=torch.bool)
    for i in range(L):
        for j in range(S):
            m[i, j] = j <= i + S - L
    return m


def _allowed(B, H, L, S, mask, is_causal):
    allowed = torch.ones(B, H, L, S, dtype=torch.bool)
    if mask is not None:
        allowed = allowed & mask.to(torch.bool)
    if is_causal:
        allowed = allowed & causal_allowed(L, S)
    return allowed


def _sigma2(sigma2, M, D, grad=False):
    """Variances as (H', M) float64, H' = 1 (shared by the heads) or H (per head and component)."""
    if sigma2 is None:
        return torch.full((1, M), math.sqrt(D), dtype=F64)
    if isinstance(sigma2, (int, float)):
        return torch.full((1, M), float(sigma2), dtype=F64)
    s = (sigma2 if grad else sigma2.detach()).to(F64)
    return s.reshape(1, 1).expand(1, M) if s.numel() == 1 else s.reshape(-1, M)


def _log_pi(log_pi, B, H, M, S, grad=False):
    if log_pi is None:
        return torch.full((B, H, M, S), -math.log(M), dtype=F64)
    lp = (log_pi if grad else log_pi.detach()).to(F64)
    lp = lp.reshape((1,) * (4 - lp.dim()) + tuple(lp.shape))
    return lp.expand(B, H, M, S)


def _apply(weights, v, allowed):
    """out_i = sum_j A_ij v_j with masked pairs skipped by selection (never 0 * x), so NaN padding is inert."""
    terms = weights[..., None] * v[:, :, None, :, :]  # (B, H, L, S, Dv)
    terms = torch.where(allowed[..., None], terms, torch.zeros((), dtype=F64))
    return terms.sum(-2)


def squared_distances(q, k, grad=False):
    """|q_i - k_jr|^2 by broadcasting the differences: (B, H, L, M, S)."""
    q = (q if grad else q.detach()).to(F64)
    k = (k if grad else k.detach()).to(F64)
    diff = q[:, :, :, None, None, :] - k[:, :, None, :, :, :]  # (B, H, L, M, S, D)
    return (diff * diff).sum(-1)


def mgk_reference(q, k, v, *, log_pi=None, sigma2=None, mixture="sum", mask=None, is_causal=False,
                  log_space=False, bias=None, grad=False):
    """MGK attention in float64. Returns (out (B,H,L,Dv), weights (B,H,L,S)).

    log_space=False: the literal formula A_ij = sum_r pi_jr exp(-|q_i-k_jr|^2/(2 s_r)) exp(b_ij) / sum_j' (same).
    log_space=True: A_ij = softmax_j(logsumexp_r(log pi_jr - |q_i-k_jr|^2/(2 s_r)) + b_ij) (for underflowing inputs).
    mixture="max": the kernel is max_r exp(-|q_i-k_jr|^2/(2 s_r)) (pi unused). sigma2: a float, (M,) or (H, M).
    bias: float broadcastable to (B, H, L, S) (finite), or None. grad=True keeps the graph to q, k, v, log_pi,
    sigma2 and bias (for gradient comparisons). Rows with no allowed key give zero weights and zero output.
    """
    B, H, L, D = q.shape
    M, S = k.shape[2], k.shape[3]
    v = (v if grad else v.detach()).to(F64)
    s2 = _sigma2(sigma2, M, D, grad)
    s2 = s2.view(1, s2.shape[0], 1, M, 1)
    lp = _log_pi(log_pi, B, H, M, S, grad)[:, :, None]  # (B, H, 1, M, S)
    allowed = _allowed(B, H, L, S, mask, is_causal)
    d2 = squared_distances(q, k, grad)
    logk = -d2 / (2.0 * s2)  # (B, H, L, M, S)
    b = None if bias is None else (bias if grad else bias.detach()).to(F64).expand(B, H, L, S)
    if log_space:
        if mixture == "max":
            s = logk.max(dim=-2).values
        else:
            s = torch.logsumexp(lp + logk, dim=-2)
        if b is not None:
            s = s + b
        s = torch.where(allowed, s, torch.full((), -math.inf, dtype=F64))
        rowmax = s.max(dim=-1, keepdim=True).values
        rowmax = torch.where(torch.isfinite(rowmax), rowmax, torch.zeros((), dtype=F64))
        e = torch.where(allowed, torch.exp(s - rowmax), torch.zeros((), dtype=F64))
    else:
        if mixture == "max":
            e = torch.exp(logk).max(dim=-2).values
        else:
            e = (torch.exp(lp) * torch.exp(logk)).sum(-2)  # sum_r pi_jr exp(-|q_i - k_jr|^2 / (2 s_r))
        if b is not None:
            e = e * torch.exp(b)
        e = torch.where(allowed, e, torch.zeros((), dtype=F64))
    den = e.sum(-1, keepdim=True)
    has_key = allowed.any(-1, keepdim=True)
    w = torch.where(has_key, e / torch.where(has_key, den, torch.ones((), dtype=F64)),
                    torch.zeros((), dtype=F64))
    return _apply(w, v, allowed), w


def softmax_reference(q, k, v, *, mask=None, is_causal=False, scale=None, bias=None):
    """softmax_j(scale * q_i . k_j + b_ij) v in float64 with the same mask conventions. Returns (out, weights)."""
    B, H, L, D = q.shape
    S = k.shape[2]
    q, k, v = (t.detach().to(F64) for t in (q, k, v))
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    allowed = _allowed(B, H, L, S, mask, is_causal)
    scores = (q[:, :, :, None, :] * k[:, :, None, :, :]).sum(-1) * scale
    if bias is not None:
        scores = scores + bias.detach().to(F64)
    scores = torch.where(allowed, scores, torch.full((), -math.inf, dtype=F64))
    rowmax = scores.max(dim=-1, keepdim=True).values
    rowmax = torch.where(torch.isfinite(rowmax), rowmax, torch.zeros((), dtype=F64))
    e = torch.where(allowed, torch.exp(scores - rowmax), torch.zeros((), dtype=F64))
    has_key = allowed.any(-1, keepdim=True)
    den = torch.where(has_key, e.sum(-1, keepdim=True), torch.ones((), dtype=F64))
    w = torch.where(has_key, e / den, torch.zeros((), dtype=F64))
    return _apply(w, v, allowed), w


def responsibilities_reference(q, k, *, log_pi=None, sigma2=None, mask=None, is_causal=False, query_mask=None):
    """Soft-E statistics by explicit loops: resp[h, r, j] = sum_{b, i valid} gamma_bijr, count[h, j] = #valid (b, i).

    gamma_bijr = pi_jr exp(-|q_bi - k_bjr|^2 / (2 s_r)) / sum_r' (same), computed in log space.
    """
    B, H, L, D = q.shape
    M, S = k.shape[2], k.shape[3]
    q64, k64 = q.detach().to(F64), k.detach().to(F64)
    s2 = _sigma2(sigma2, M, D)
    lp = _log_pi(log_pi, B, H, M, S)
    allowed = _allowed(B, H, L, S, mask, is_causal)
    resp = torch.zeros(H, M, S, dtype=F64)
    count = torch.zeros(H, S, dtype=F64)
    for b in range(B):
        for h in range(H):
            for i in range(L):
                if query_mask is not None and not bool(query_mask[b, i]):
                    continue
                for j in range(S):
                    if not bool(allowed[b, h, i, j]):
                        continue
                    logs = []
                    for r in range(M):
                        diff = q64[b, h, i] - k64[b, h, r, j]
                        var = float(s2[h if s2.shape[0] > 1 else 0, r])
                        logs.append(float(lp[b, h, r, j]) - float((diff * diff).sum()) / (2.0 * var))
                    mx = max(logs)
                    z = sum(math.exp(x - mx) for x in logs)
                    for r in range(M):
                        resp[h, r, j] += math.exp(logs[r] - mx) / z
                    count[h, j] += 1
    return resp, count


def normalised_log_pi(shape, dim, seed=0):
    """Random log priors (float64) normalised over the component dimension ``dim`` (logsumexp = 0 there)."""
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(shape, generator=g, dtype=F64) * 1.5, dim=dim)


def make_inputs(B=2, H=2, L=5, S=5, M=2, D=4, Dv=3, dtype=torch.float32, seed=0, scale=1.0):
    """Seeded random (q, k, v) with q (B,H,L,D), k (B,H,M,S,D), v (B,H,S,Dv)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=g, dtype=F64) * scale
    k = torch.randn(B, H, M, S, D, generator=g, dtype=F64) * scale
    v = torch.randn(B, H, S, Dv, generator=g, dtype=F64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def random_mask(B, H, L, S, p=0.6, seed=0, empty_rows=()):
    """Random bool mask (True = may attend) of shape (B, H, L, S); rows listed as (b, h, i) are fully masked."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(B, H, L, S, generator=g) < p
    for b, h, i in empty_rows:
        m[b, h, i] = False
    return m


def padding_mask(lengths, S, left=False):
    """Key-padding mask (B, 1, 1, S), True = real key; ``lengths[b]`` real keys, right- (or left-) padded."""
    m = torch.zeros(len(lengths), 1, 1, S, dtype=torch.bool)
    for b, n in enumerate(lengths):
        if left:
            m[b, ..., S - n:] = True
        else:
            m[b, ..., :n] = True
    return m


def refusal(backend, *, mixture="sum", mask=None, dropout_p=0.0, return_weights=False, sigma2=None, bias=None):
    """Why ``mgk_attention(..., backend=backend)`` is documented to refuse these inputs (None when it serves them):
    only "explicit" returns weights; Hard-E (mixture="max") has no dot-product form ("sdpa") and no Triton kernel;
    the fused kernels ("kernel", "triton") take masks and biases that are at most per key and dropout 0 <= p < 1;
    the Triton kernels take no learned variances, nor unequal ones within a head. The tests skip a refused
    combination (test_backends checks the refusal)."""
    if backend == "explicit":
        return None
    if return_weights:
        return "only backend='explicit' returns the weights"
    if mixture == "max" and backend in ("sdpa", "triton"):
        return f"Hard-E (mixture='max') has no {backend} form"
    for name, t in (("mask", mask), ("bias", bias)):
        if backend in ("kernel", "triton") and t is not None and t.dim() >= 2 and t.shape[-2] != 1:
            return f"backend={backend!r} takes a {name} that is at most per key, this one depends on the query"
    if backend in ("kernel", "triton") and not 0.0 <= dropout_p < 1.0:
        return f"backend={backend!r} does not take dropout_p={dropout_p}"
    if backend == "triton" and isinstance(sigma2, torch.Tensor):
        s = sigma2.reshape(-1, sigma2.shape[-1]) if sigma2.dim() else sigma2.reshape(1, 1)
        if sigma2.requires_grad or not bool((s == s[:, :1]).all()):
            return "the Triton kernels take fixed variances, equal within each head"
    return None


def skip_if_refused(backend, **kw):
    """``pytest.skip`` naming the reason when :func:`refusal` says ``backend`` cannot serve ``kw``."""
    import pytest

    why = refusal(backend, **kw)
    if why is not None:
        pytest.skip(why)


def assert_checkpoint_regenerates_dropout(f, q, k, v):
    """Gradients of ``f(q, k, v)`` with dropout equal bitwise with and without ``torch.utils.checkpoint``: the
    recomputed forward draws the same (seed, offset) because checkpointing restores the generator state."""
    from torch.utils.checkpoint import checkpoint

    grads = []
    for wrap in (lambda *t: f(*t), lambda *t: checkpoint(f, *t, use_reentrant=False)):
        torch.manual_seed(1)
        out = wrap(q, k, v)
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def tol64(backend):
    """Tolerance of a float64 call on ``backend``: the Triton kernels compute in float32 whatever the input."""
    return dict(atol=1e-5, rtol=1e-5) if backend == "triton" else dict(atol=1e-10, rtol=1e-9)
