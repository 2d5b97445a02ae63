"""Float64 references for the attention forms of the authors' released code, written from the formulas.

Source: github.com/minhtannguyen/transformer-mgk at commit edbf4dcef32c00dee8784cbe44200d40a18312c8
(the code behind Nguyen et al., ICML 2022). Each function states in its docstring the file and line(s) whose
arithmetic it reproduces; ``docs/authors-protocol.md`` gives the formulas and the settings around them. Nothing here
is copied or imported from that repository: the functions are plain tensor algebra, O(L^2) or explicit prefix sums,
meant as test oracles only (float64 in, float64 out; no autocast, no fast paths).

Conventions (ours, not the authors'): tensors are (B, H, L, D) with L the *tensor* length (padding included);
``key_padding_mask`` is a bool (B, L) tensor, True = padded key (the authors pass a float mask with 1 = real token,
built as ``token_id != 0`` in ``lra/dataset.py:33``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def _real_keys(key_padding_mask: Tensor | None, k: Tensor) -> Tensor:
    """(B, 1, S, 1) float mask, 1 for a real key and 0 for a padded one."""
    B, _, S, _ = k.shape
    if key_padding_mask is None:
        return torch.ones(B, 1, S, 1, dtype=k.dtype, device=k.device)
    if key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != (B, S):
        raise ValueError(f"key_padding_mask must be bool (B, S) = {(B, S)}, got "
                         f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}")
    return (~key_padding_mask).to(k.dtype)[:, None, :, None]


def _elu1(x: Tensor) -> Tensor:
    return F.elu(x) + 1.0


def _elu1_sum(x: Tensor) -> Tensor:
    """elu+1 rescaled so that its D entries sum to one (the LM feature map)."""
    y = _elu1(x)
    return y / y.sum(-1, keepdim=True)


def _clamp01(p: Tensor) -> Tensor:
    return p.clamp(0.0, 1.0)


def lra_linear(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
    """The authors' LRA linear attention: no denominator, features scaled by the fourth root of the length.

    ``out_i = sum_j m_j <phi(q_i) L^(-1/4), phi(k_j) S^(-1/4)> v_j`` with ``phi = elu + 1``, ``m_j`` = 1 for a real
    key and 0 for a padded one (applied to both the key features and the values), L = q.shape[-2] and
    S = k.shape[-2] the padded tensor lengths (the same number in self-attention). Query rows are not masked.
    Mirrors ``lra/attention_linear.py:57-64`` (``linear_attn``), called from ``:33-34``.

    Args: q, k, v (B, H, L, D); key_padding_mask bool (B, L), True = padding. Returns (B, H, L, D).
    """
    real = _real_keys(key_padding_mask, k)
    fq = _elu1(q) * q.shape[-2] ** -0.25
    fk = _elu1(k) * real * k.shape[-2] ** -0.25
    state = fk.transpose(-2, -1) @ (v * real)  # (B, H, D, Dv)
    return fq @ state


def lra_mlk(q: Tensor, k1: Tensor, k2: Tensor, pi: Tensor, v: Tensor,
            key_padding_mask: Tensor | None = None) -> Tensor:
    """The authors' LRA "MLK": the two raw keys are mixed *before* the feature map, then :func:`lra_linear`.

    ``k_j = c(pi_0) k1_j + c(pi_1) k2_j`` with ``c`` = clamp to [0, 1] and ``pi`` one learnable pair per layer
    (shape (2,), initialised (0.5, 0.5), shared by all heads and positions). Mirrors
    ``lra/attention_linear.py:20-21`` (pi), ``:38-40`` (the two keys are the two halves of the concatenated key,
    ``lra/attention.py:302-305``), ``:46-47`` (mix, then linear attention).

    Args: q, k1, k2, v (B, H, L, D); pi (2,); key_padding_mask bool (B, L). Returns (B, H, L, D).
    """
    w = _clamp01(pi)
    return lra_linear(q, w[0] * k1 + w[1] * k2, v, key_padding_mask)


def lra_mgk(q: Tensor, k1: Tensor, k2: Tensor, pi: Tensor, v: Tensor,
            key_padding_mask: Tensor | None = None) -> Tensor:
    """The authors' LRA MGK (learned pi): two Gaussian keys of variance sqrt(D), one clamped pi pair per layer.

    ``a_ij = c(pi_0) exp(-|q_i - k1_j|^2 / (2 sqrt D) - 1e6 p_j)
    + c(pi_1) exp(-|q_i - k2_j|^2 / (2 sqrt D) - 1e6 p_j)``,
    ``p_j`` = 1 for a padded key, ``A_ij = a_ij / sum_j a_ij``, ``out = A v``. No log-space shift (a far query
    underflows to 0/0). Mirrors ``lra/attention.py:124`` (variance), ``:139`` (pi of shape (2,)),
    ``:218-223`` (kernels, mixture, normalisation), ``:233`` (value product; attention dropout omitted here).
    """
    real = _real_keys(key_padding_mask, k1)[..., 0][:, :, None, :]  # (B, 1, 1, S)
    var = q.shape[-1] ** 0.5
    w = _clamp01(pi)
    a = 0.0
    for r, k in enumerate((k1, k2)):
        d2 = ((q[..., :, None, :] - k[..., None, :, :]) ** 2).sum(-1)
        a = a + w[r] * torch.exp(-d2 / (2 * var) - 1e6 * (1 - real))
    return (a / a.sum(-1, keepdim=True)) @ v


def _causal_linear(fq: Tensor, fk: Tensor, v: Tensor, scale: float, eps: float, normalize: bool) -> Tensor:
    """``scale * fq_i . S_i / (fq_i . z_i + eps)`` with inclusive prefix sums S_i = sum_{j<=i} fk_j v_j^T."""
    L = fq.shape[-2]
    keep = torch.tril(torch.ones(L, L, dtype=fq.dtype, device=fq.device))
    scores = (fq @ fk.transpose(-2, -1)) * keep  # (B, H, L, L): fq_i . fk_j for j <= i
    num = scores @ v
    if not normalize:
        return scale * num
    return scale * num / (scores.sum(-1, keepdim=True) + eps)


def lm_linear_type34(q: Tensor, k: Tensor, v: Tensor, eps: float = 1e-5, normalize: bool = True) -> Tensor:
    """The authors' LM linear attention (``--attn_type 34``), causal.

    ``phi~(x) = (elu(x) + 1) / sum_d (elu(x) + 1)_d`` for queries and keys;
    ``out_i = (1/sqrt(D)) phi~(q_i)^T sum_{j<=i} phi~(k_j) v_j^T / (phi~(q_i)^T sum_{j<=i} phi~(k_j) + eps)``,
    eps = 1e-5, the sum including j = i. ``normalize=False`` drops the denominator (``--skip_attn_normalization``).
    Mirrors ``language-modeling/lmtool-fwms/src/utils/cuda_fast_weight_layer.py``, class
    ``CudaFastWeightSumLinearTransformerLayer`` (forward: elu+1, sum normalisation, cumulative denominator,
    ``fast_weight_sum``, ``scale * out / (denominator + eps)``); the prefix sum is inclusive
    (``src/utils/fast_transformers/__init__.py``, the reference loop of its self-test).

    Args: q, k, v (B, H, L, D). Returns (B, H, L, D).
    """
    return _causal_linear(_elu1_sum(q), _elu1_sum(k), v, q.shape[-1] ** -0.5, eps, normalize)


def lm_mlk_type400(q: Tensor, k1: Tensor, k2: Tensor, v: Tensor, pi0: Tensor, pi1: Tensor,
                   eps: float = 1e-5, normalize: bool = True) -> Tensor:
    """The authors' LM MLK (``--attn_type 400``, update_mode ``rbf2keys``), causal.

    Key feature ``phi~(k_j) = c(pi0[h, j]) phi~(k1_j) + c(pi1[h, j]) phi~(k2_j)`` (mixing *after* the
    sum-normalised elu+1 map, c = clamp to [0, 1], weights per head and key position, not summing to one), then the
    type-34 formula of :func:`lm_linear_type34` with the same query map, 1/sqrt(D) output scale and eps = 1e-5.
    Mirrors ``language-modeling/lmtool-fwms/src/mem_transformer.py:405-542``: 427 (q, k1, k2, v projection),
    443 (scale), 450-451 (pi0, pi1 of shape (H, 256), 0.5), 498-499 (query map), 502-506 (key maps),
    509 (mix), 517 and 532-533 (denominator), 535-536 and 540 (output).

    Args: q, k1, k2, v (B, H, L, D); pi0, pi1 (H, P) raw, P >= L. Returns (B, H, L, D).
    """
    L = q.shape[-2]
    w0 = _clamp01(pi0[:, :L])[None, :, :, None]
    w1 = _clamp01(pi1[:, :L])[None, :, :, None]
    fk = w0 * _elu1_sum(k1) + w1 * _elu1_sum(k2)
    return _causal_linear(_elu1_sum(q), fk, v, q.shape[-1] ** -0.5, eps, normalize)


def lm_mgk(q: Tensor, k1: Tensor, k2: Tensor, v: Tensor, pi_raw: Tensor,
           sigma2: tuple[float, float] | None = None, causal: bool = True, eps: float = 1e-6,
           clamp: bool = True) -> Tensor:
    """The authors' LM MGK (``--attn_type 200 --update_mode rbf2keys``): unnormalised per-position mixture weights.

    ``a_ij = c(pi_raw[0, h, j]) exp(-|q_i - k1_j|^2 / (2 s_1)) + c(pi_raw[1, h, j]) exp(-|q_i - k2_j|^2 / (2 s_2))``
    with (s_1, s_2) = (sqrt(D), sqrt(D)/3) by default, c = clamp to [0, 1] (``clamp=False`` uses the weights as
    given, e.g. ``exp`` of free log-weights), ``a_ij = 0`` for j > i when causal, and
    ``A_ij = a_ij / (sum_j a_ij + eps)`` with eps = 1e-6, ``out = A v``. The weights are not normalised over the
    two components, so they also act as a learned prior over key positions.
    Mirrors ``language-modeling/lmtool-fwms/src/mem_transformer.py``: 92-94 (q and the k, k1, v projection),
    108 (scale 1/sqrt(D)), 119-120 (pi0, pi1 of shape (H, 1, 1, 256), 0.5), 139 (split k, k1, v),
    150-151 (the two log-kernels: -scale/2 and -1.5 scale times the squared distance), 198 (clamped mixture),
    202-207 (masked entries set to 0 after exp), 209 (normalisation with + 1e-6), 212-216 (dropout, value product).

    Args: q, k1, k2, v (B, H, L, D); pi_raw (2, H, P) with P >= S. Returns (B, H, L, D).
    """
    D = q.shape[-1]
    s = (math.sqrt(D), math.sqrt(D) / 3.0) if sigma2 is None else sigma2
    L, S = q.shape[-2], k1.shape[-2]
    a = 0.0
    for r, k in enumerate((k1, k2)):
        w = pi_raw[r, :, :S]
        w = _clamp01(w) if clamp else w
        d2 = ((q[..., :, None, :] - k[..., None, :, :]) ** 2).sum(-1)  # (B, H, L, S)
        a = a + w[None, :, None, :] * torch.exp(-d2 / (2.0 * s[r]))
    if causal:
        allowed = torch.ones(L, S, dtype=torch.bool, device=q.device).tril(S - L)
        a = a * allowed
    return (a / (a.sum(-1, keepdim=True) + eps)) @ v
