"""The mixture algebra every MGK path shares (Nguyen et al., ICML 2022, eq. 9-10), written once: the variances, the
log prior, the per-key bias, the per-row bias, the scaled keys, the log-kernel and the argument checks.

With ``s_ijr = log pi_jr - |q_i - k_jr|^2 / (2 sigma_r^2)`` expanded as
``q_i . k_jr / sigma_r^2 + b_jr + c_ir``, the per-key bias is ``b_jr = log pi_jr - |k_jr|^2 / (2 sigma_r^2)``
(:func:`key_bias`) and the per-row bias ``c_ir = -|q_i|^2 / (2 sigma_r^2)`` (:func:`row_bias`), which cancels in the
softmax over j unless the variances differ within a head (:func:`needs_qnorm`). The uncached backends
(:mod:`._mgk_backends`), the Soft-E statistics (:mod:`._soft_e`) and the decoding cache (:mod:`.mgk_cache`) all
build their scores from these functions.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from . import masks as _masks
from ._checks import check_qkv
from ._dispatch import is_transformed

__all__ = ["MIXTURES", "check_components", "check_mixture", "check_mixture_args", "check_shifts",
           "gaussian_log_kernel", "key_bias", "key_bias_inv", "log_prior", "needs_qnorm", "per_component",
           "query_terms", "row_bias", "scaled_keys", "scaled_keys_inv", "shifted_keys", "to_heads", "variances"]

MIXTURES = ("sum", "max")


# ---- argument checks ---------------------------------------------------------------------------------------------

def check_mixture_args(mixture, log_pi) -> None:
    """ValueError naming ``mixture`` unless it is "sum" or "max", and ``log_pi`` unless it is None under "max"."""
    if mixture not in MIXTURES:
        raise ValueError(f"mixture must be one of {MIXTURES}, got {mixture!r}")
    if mixture == "max" and log_pi is not None:
        raise ValueError("log_pi is unused by mixture='max' (Hard-E takes the nearest component); pass None")


def check_log_pi(log_pi, shape: tuple[int, int, int, int], names: str = "(B, H, M, S)") -> None:
    """ValueError naming ``log_pi`` unless it is None or a floating tensor broadcastable to ``shape`` (its sizes
    called ``names``): the one check of the prior for every mixture entry point (uncached, cache entries, cache
    step)."""
    if log_pi is None:
        return
    if not isinstance(log_pi, Tensor) or not log_pi.is_floating_point():
        what = log_pi.dtype if isinstance(log_pi, Tensor) else type(log_pi).__name__
        raise ValueError(f"log_pi must be None or a floating tensor broadcastable to {names} = {shape}, got {what}")
    if log_pi.dim() > 4 or any(a not in (1, b) for a, b in zip((1,) * (4 - log_pi.dim()) + tuple(log_pi.shape), shape)):
        raise ValueError(f"log_pi of shape {tuple(log_pi.shape)} does not broadcast to {names} = {shape}")


def check_components(M: int, name: str) -> None:
    """ValueError naming ``name`` when it holds no mixture component."""
    if M < 1:
        raise ValueError(f"{name} must hold at least one mixture component (M >= 1), got M = 0")


def check_shifts(shifts, M: int | None, H: int, D: int) -> Tensor | None:
    """``shifts`` (M, H, D) floating (sMGK's offsets mu_r), or None; ValueError naming it otherwise."""
    if shifts is None:
        return None
    if not isinstance(shifts, Tensor) or not shifts.is_floating_point() or shifts.dim() != 3 or tuple(
            shifts.shape[1:]) != (H, D) or (M is not None and shifts.shape[0] != M):
        what = tuple(shifts.shape) if isinstance(shifts, Tensor) else type(shifts).__name__
        raise ValueError(f"shifts must be a floating tensor (M, H, D) = ({M or 'M'}, {H}, {D}) of the components' "
                         f"offsets mu_r (sMGK's k_r = k - mu_r), got {what}")
    return shifts


def check_mixture(query, key, value, log_pi, mixture, attn_mask):
    """The checks of an uncached mixture call (MGK, MLK): query (B, H, L, D), key (B, H, M, S, D), value
    (B, H, S, Dv) or None, ``log_pi`` broadcastable to (B, H, M, S), ``mixture``, a bool ``attn_mask``.
    Returns ``(B, H, L, S, M, D, mask)``; ValueError (MaskError for the mask) naming the argument."""
    B, H, L, S, M, D = check_qkv(query, key, value, mixture=True)
    check_mixture_args(mixture, log_pi)
    check_log_pi(log_pi, (B, H, M, S))
    mask = _masks.check_mask(attn_mask, "attn_mask", B, H, L, S)
    return B, H, L, S, M, D, mask


# ---- the terms ---------------------------------------------------------------------------------------------------

def variances(sigma2, H: int, M: int, D: int, dtype, device) -> Tensor:
    """Variances as an (H', M) tensor, H' = 1 (shared by the heads) or H; default sqrt(D), the 1/sqrt(D) scale of
    dot-product attention. ``sigma2``: None, a float, or a tensor of one value, (M,) or (H, M) (gradients kept).

    Values are checked (positive, finite) for Python numbers and CPU tensors. Tensors on an accelerator are not:
    reading them back would synchronise the device on every call, and the modules check theirs at construction.
    ValueError naming ``sigma2`` otherwise."""
    # One value for every component is expanded (stride 0 along M): equal by construction, which needs_qnorm reads
    # from the strides, also where values cannot be read (a trace, an accelerator).
    if sigma2 is None:
        return torch.full((1, 1), math.sqrt(D), dtype=dtype, device=device).expand(1, M)
    if isinstance(sigma2, (int, float)) and not isinstance(sigma2, bool):
        if isinstance(sigma2, int) and abs(sigma2) > 2 ** 1023:
            raise ValueError("sigma2 must be a positive finite variance, got an int too large for a float")
        if not sigma2 > 0 or not math.isfinite(sigma2):
            raise ValueError(f"sigma2 must be a positive finite variance, got {sigma2}")
        return torch.full((1, 1), float(sigma2), dtype=dtype, device=device).expand(1, M)
    shape = tuple(sigma2.shape) if isinstance(sigma2, Tensor) else None
    if shape is None or not (sigma2.is_floating_point() and (sigma2.numel() == 1 or shape in ((M,), (1, M), (H, M)))):
        raise ValueError(f"sigma2 must be None, a positive float or a floating tensor of one value, shape (M,) = "
                         f"({M},) or (H, M) = ({H}, {M}); got {shape or type(sigma2).__name__}")
    s = sigma2.to(device=device, dtype=dtype)
    s = s.reshape(1, 1).expand(1, M) if s.numel() == 1 else s.reshape(-1, M)
    if s.device.type != "cpu" or torch.compiler.is_compiling() or is_transformed(s):
        return s  # a traced or torch.func-wrapped tensor has no values to read (a module checked its own)
    # One read of the values instead of four reductions: this runs on every call.
    if not all(x > 0 and math.isfinite(x) for x in s.reshape(-1).tolist()):
        raise ValueError(f"sigma2 must be positive and finite, got {sigma2.tolist()}")
    return s


def log_prior(log_pi, M: int, dtype, device) -> Tensor:
    """log pi as a 4-dim tensor broadcastable to (B, H, M, S), -inf kept (a switched-off component); default
    uniform 1/M."""
    if log_pi is None:
        return torch.full((1, 1, M, 1), -math.log(M), dtype=dtype, device=device)
    lp = log_pi.to(dtype)
    return lp.reshape((1,) * (4 - lp.dim()) + tuple(lp.shape))


def per_component(s2: Tensor, *trailing: int) -> Tensor:
    """s2 (M,) or (H', M) viewed as (1, H', M, *trailing) against (B, H, M, ...) tensors."""
    s2 = s2.reshape(-1, s2.shape[-1])
    return s2.view(1, s2.shape[0], s2.shape[1], *trailing)


def needs_qnorm(s2: Tensor) -> bool:
    """Whether the per-row ``-|q|^2 / (2 sigma_r^2)`` term must be kept for s2 (H', M).

    With one component per head, or equal fixed variances within each head, it is constant along a row and cancels
    in the softmax (in the value, and in the gradient of a variance shared by the row's every score). With unequal
    or learned per-component variances it does not (a learned sigma_r^2 moves alone). Reading the values would
    synchronise an accelerator, so off the CPU (and inside a torch.compile trace, or under a torch.func transform,
    whose tensors hold no values to read) the term is kept for M > 1, unless s2 holds one value per head by
    construction (stride 0 along M: :func:`variances` of None, a float or one value). Keeping it is exact in exact
    arithmetic only: with queries far larger than the scores (a converted layer's key_scale c makes them 1/c times
    their size) its rounding reaches every score, so a caller of such a layer gives one variance."""
    M = s2.shape[-1]
    if M == 1 or s2.stride(-1) == 0:
        return False
    if (s2.requires_grad or torch.compiler.is_compiling() or s2.device.type != "cpu"
            or torch._C._functorch.is_functorch_wrapped_tensor(s2)):
        return True
    rows = s2.reshape(-1, M).tolist()  # one read of the H' * M values, on every call
    return any(x != row[0] for row in rows for x in row)


def key_bias(k: Tensor, s2: Tensor, log_pi: Tensor | None = None, *, shifts: Tensor | None = None) -> Tensor:
    """The per-key bias ``b_jr = log pi_jr - |k_jr|^2 / (2 sigma_r^2)``, (B, H, M, S).

    k: (B, H, M, S, D) the component keys; or, with ``shifts`` (M, H, D) (sMGK's ``k_jr = k_j - mu_r``), the one
    unshifted key (B, H, S, D), for which the bias holds the part of ``|k_j - mu_r|^2`` that depends on the key,
    ``|k_j|^2 - 2 k_j . mu_r`` (the ``|mu_r|^2`` term is per component and goes with the query's terms).
    s2: (H', M) variances. log_pi: broadcastable to (B, H, M, S), or None for no prior (Hard-E)."""
    mu = None if shifts is None else shifts.to(k.dtype).transpose(0, 1)  # (H, M, D)
    return key_bias_inv(k, per_component(s2, 1).reciprocal(), log_pi, mu)


def key_bias_inv(k: Tensor, inv: Tensor, log_pi: Tensor | None = None, mu: Tensor | None = None) -> Tensor:
    """:func:`key_bias` from its terms made ahead: ``inv`` (1, H', M, 1) the inverse variances
    (``per_component(s2, 1).reciprocal()``) and ``mu`` (H, M, D) sMGK's shifts per head, or None. A decoding step
    makes them once per cache and this at every token, where each operator's overhead counts: few of them."""
    if mu is None:
        squared = torch.linalg.vecdot(k, k)
    else:  # |k|^2 - 2 k . mu_r as k . (k - 2 mu_r): two operators (a batched matmul per head costs several)
        kr = k.unsqueeze(2)  # (B, H, 1, S, D)
        squared = torch.linalg.vecdot(kr, torch.sub(kr, mu.unsqueeze(2), alpha=2.0))
    return squared * (inv * -0.5) if log_pi is None else torch.addcmul(log_pi, squared, inv, value=-0.5)


def shifted_keys(k: Tensor, shifts: Tensor) -> Tensor:
    """The M components ``k_jr = k_j - mu_r`` (B, H, M, S, D) of sMGK's unshifted key k (B, H, S, D), for shifts
    (M, H, D) (in k's dtype)."""
    return k.unsqueeze(2) - shifts.transpose(0, 1).unsqueeze(0).unsqueeze(3).to(k.dtype)


def query_terms(q, s2, shifts):
    """(scale, rowbias) of the scores ``s_ijr = scale_r * (q~_i . keys_jr) + key_bias_jr + rowbias_ir`` for centred
    queries q (B, H, L, D) against keys of the same heads: scale (1, H', M, 1) for sMGK's unscaled keys
    (1 / sigma_r^2) or None; rowbias (B, H, M, L), the shifts' per-query term
    ``-(q~_i . mu_r) / sigma_r^2 - |mu_r|^2 / (2 sigma_r^2)`` (shifts (M, H, D), the part of ``|k_j - mu_r|^2`` that
    :func:`key_bias` leaves out) and / or the -|q~|^2 / (2 sigma_r^2) term when it does not cancel, or None."""
    scale = rowbias = None
    if shifts is not None:
        scale = 1.0 / per_component(s2, 1)  # (1, H', M, 1)
        mu = shifts.to(q.dtype).transpose(0, 1)  # (H, M, D)
        rowbias = -((mu @ q.transpose(-1, -2)) * scale
                    + ((mu * mu).sum(-1) * 0.5).unsqueeze(-1) * scale)  # (B, H, M, L)
    if needs_qnorm(s2):
        qnorm = row_bias(q, s2)
        rowbias = qnorm if rowbias is None else rowbias + qnorm
    return scale, rowbias


def to_heads(t, groups: int, repeat: int, dim: int = 1):
    """``t`` with its dimension ``dim`` of ``groups`` key groups repeated for the ``repeat`` query heads of each
    (query head h reads group h // repeat); a dimension of another size (1: broadcast over the heads, as the weights
    of pi_shape="layer"), None or anything but a tensor is left as it is."""
    if repeat == 1 or not isinstance(t, Tensor) or t.dim() <= dim or t.shape[dim] != groups:
        return t
    return t.repeat_interleave(repeat, dim=dim)


def row_bias(q: Tensor, s2: Tensor) -> Tensor:
    """The per-row bias ``-|q_i|^2 / (2 sigma_r^2)``, (B, H, M, L), for q (B, H, L, D) and s2 (H', M)."""
    return (q * q).sum(-1).unsqueeze(2) * (-0.5 / per_component(s2, 1))


def scaled_keys(k: Tensor, s2: Tensor) -> Tensor:
    """``k_jr / sigma_r^2`` for k (B, H, M, S, D) and s2 (H', M)."""
    return scaled_keys_inv(k, per_component(s2, 1, 1).reciprocal())


def scaled_keys_inv(k: Tensor, inv: Tensor) -> Tensor:
    """:func:`scaled_keys` from the inverse variances made ahead, ``inv`` (1, H', M, 1, 1)."""
    return k * inv


def gaussian_log_kernel(q: Tensor, k: Tensor, sigma2: Tensor) -> Tensor:
    """``-|q_i - k_jr|^2 / (2 sigma_r^2)`` for q (B, H, L, D), k (B, H, M, S, D) and sigma2 (M,) or (H, M) (per head
    and component); returns (B, H, L, M, S).

    The squared distance is expanded (one matmul) and clamped at 0, so rounding never makes it negative and every
    kernel value is <= 1. The expansion cancels catastrophically when q and k share a large offset; mgk_attention
    centres both first (:mod:`mgk.functional._centre`)."""
    qn = (q * q).sum(-1)[..., :, None, None]  # (B, H, L, 1, 1)
    kn = (k * k).sum(-1).unsqueeze(2)  # (B, H, 1, M, S)
    qk = torch.einsum("bhld,bhmsd->bhlms", q, k)
    d2 = (qn + kn - 2.0 * qk).clamp_min(0.0)
    return d2 * (-0.5 / per_component(sigma2, 1)).unsqueeze(2)
