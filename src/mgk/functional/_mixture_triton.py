"""MGK on CUDA through Triton kernels that sum the component weights before the value product.

The same math as the CPU kernel (``csrc/mixture_flash.cpp``): for query i, key j and component r the score is
``s_ijr = q_i . k_jr + bias_jr`` (keys already divided by sigma_r^2, ``bias = log pi - |k|^2 / (2 sigma^2)``), and

    out_i = sum_j (sum_r exp(s_ijr - LSE_i)) v_j,     LSE_i = logsumexp_{j,r} s_ijr.

With attention dropout (probability p) the mixed weight is dropped after the sum over components, as in the CPU
kernel: ``out_i = sum_j A_ij Z_ij v_j`` with ``A_ij = sum_r exp(s_ijr - LSE_i)`` (LSE counts kept and dropped
weights alike) and ``Z_ij = keep_ij / (1 - p)``, where ``keep`` is the CPU kernel's own counter-based hash of
(seed, offset, b * H + h, i, j) (:mod:`._triton_dropout`), so backward regenerates the mask without storing it and
for the same (seed, offset) both backends drop the same weights.

Forward: one program per (query block, batch*head) runs an online softmax over key blocks with M score products
and a single value product per block. Backward, without atomics (deterministic): one program per (key block,
batch*head, component) for dK_r and dbias_r, one per (key block, batch*head) for dV (on the summed weights), and one
per (query block, batch*head) for dQ. Causality is bottom-right (key j visible from query i when j <= i + S - L);
key blocks past the diagonal are skipped.

Opt-in with ``MGK_TRITON=1``: these kernels have been checked on CPU through Triton's interpreter
(``TRITON_INTERPRET=1``, see tests/functional/test_mixture_triton.py) but not yet on GPU hardware, so CUDA runs use
the SDPA path unless asked. When enabled they serve CUDA inputs (computed in float32) with equal fixed variances (no
per-row ``|q|^2`` term), attention dropout ``0 <= p < 1`` and at most key padding; everything else takes the SDPA
path.
"""
from __future__ import annotations

import os

import torch
from torch.autograd.function import once_differentiable

try:  # Triton is optional: CPU-only installs do not have it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None

from ._mixture_flash import draw_dropout_seed_tensor
from ._triton_dropout import threshold

if triton is not None:
    from ._triton_dropout import keep_factor


def unavailable(q: torch.Tensor, *, automatic: bool) -> str | None:
    """Why these kernels cannot run on ``q``'s device (None when they can). ``automatic``: for the selector, which
    takes them only on CUDA and only when opted in with ``MGK_TRITON=1``; asked for by name they also run on CPU
    tensors under Triton's interpreter (``TRITON_INTERPRET=1``)."""
    if triton is None:
        return "Triton is not installed"
    if torch.compiler.is_compiling():
        return "the Triton kernels are not traced by torch.compile"
    interpreted = not automatic and os.environ.get("TRITON_INTERPRET", "0") == "1" and q.device.type == "cpu"
    if q.device.type != "cuda" and not interpreted:
        return f"the Triton kernels run on CUDA tensors (or on CPU under TRITON_INTERPRET=1), got {q.device.type}"
    if automatic and os.environ.get("MGK_TRITON", "0") != "1":
        return "not opted in (set MGK_TRITON=1; the kernels are not yet checked on GPU hardware)"
    return None


def available(q: torch.Tensor, dropout_p: float = 0.0) -> bool:
    """True for CUDA tensors (with or without dropout, ``0 <= dropout_p < 1``) when Triton is importable and
    ``MGK_TRITON=1``."""
    return 0.0 <= dropout_p < 1.0 and unavailable(q, automatic=True) is None


if triton is not None:

    @triton.jit
    def _scores(q, k_ptr, bias_ptr, offs_n, offs_d, n_ok, d_ok, stride_kn):
        """(BLOCK_M, BLOCK_N) scores of one component for key rows offs_n."""
        k = tl.load(k_ptr + offs_n[:, None] * stride_kn + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                    other=0.0)
        b = tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0)
        return tl.dot(q, tl.trans(k), input_precision="ieee") + b[None, :], k

    @triton.jit
    def _visible(offs_m, offs_n, L, S, CAUSAL: tl.constexpr):
        ok = (offs_m[:, None] < L) & (offs_n[None, :] < S)
        if CAUSAL:
            ok = ok & (offs_n[None, :] <= offs_m[:, None] + (S - L))
        return ok

    @triton.jit
    def _tile(X, bh, offs, n_rows, offs_w, width):
        """Rows ``offs`` of the (n_rows, width) matrix of slice bh, zero outside (rows, width)."""
        ok = (offs[:, None] < n_rows) & (offs_w[None, :] < width)
        return tl.load(X + (bh * n_rows + offs[:, None]) * width + offs_w[None, :], mask=ok, other=0.0)

    @triton.jit
    def _first_query(pid_n, L, S, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Start of the first query block that sees key block pid_n (0 without causality)."""
        start = 0
        if CAUSAL:
            start = tl.maximum(0, pid_n * BLOCK_N - (S - L)) // BLOCK_M * BLOCK_M
        return start

    @triton.jit
    def _fwd_kernel(Q, K, Bias, V, Out, Lse, Seed, L, S, D, DV, thresh, drop_scale,
                    M: tl.constexpr, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
        pid_m, bh = tl.program_id(0), tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        m_ok, d_ok, dv_ok = offs_m < L, offs_d < D, offs_dv < DV
        q = _tile(Q, bh, offs_m, L, offs_d, D)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
        end = S
        if CAUSAL:
            end = tl.minimum(S, (pid_m + 1) * BLOCK_M + (S - L))
        for n0 in range(0, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < S
            ok = _visible(offs_m, offs_n, L, S, CAUSAL)
            # components one after another, each rescaling the block's summed weights to the running maximum
            m_blk = m_i
            p = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for r in tl.static_range(M):
                s, _ = _scores(q, K + (bh * M + r) * S * D, Bias + (bh * M + r) * S, offs_n, offs_d, n_ok, d_ok, D)
                s = tl.where(ok, s, float("-inf"))
                m_new = tl.maximum(m_blk, tl.max(s, 1))
                shift = tl.where(m_new == float("-inf"), 0.0, m_new)
                scale = tl.where(m_blk == float("-inf"), 0.0, tl.exp(m_blk - shift))
                p = p * scale[:, None] + tl.exp(s - shift[:, None])
                m_blk = m_new
            shift = tl.where(m_blk == float("-inf"), 0.0, m_blk)
            alpha = tl.where(m_i == float("-inf"), 0.0, tl.exp(m_i - shift))
            l_i = l_i * alpha + tl.sum(p, 1)
            if DROPOUT:  # after the normaliser, which counts kept and dropped weights alike
                p = p * keep_factor(Seed, bh, offs_m, offs_n, L, thresh, drop_scale)
            v = _tile(V, bh, offs_n, S, offs_dv, DV)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m_i = m_blk
        has = (l_i > 0) | (l_i != l_i)  # NaN scores give NaN, as in the formula
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        tl.store(Out + bh * L * DV + offs_m[:, None] * DV + offs_dv[None, :], out, mask=m_ok[:, None] & dv_ok[None, :])
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(Lse + bh * L + offs_m, lse, mask=m_ok)

    @triton.jit
    def _probs(q, K, Bias, lse, offs_m, offs_n, offs_d, n_ok, d_ok, L, S, D, CAUSAL: tl.constexpr):
        s, k = _scores(q, K, Bias, offs_n, offs_d, n_ok, d_ok, D)
        ok = _visible(offs_m, offs_n, L, S, CAUSAL) & (lse[:, None] != float("-inf"))
        safe = tl.where(lse == float("-inf"), 0.0, lse)
        return tl.where(ok, tl.exp(s - safe[:, None]), 0.0), k

    @triton.jit
    def _bwd_dk_kernel(Q, K, Bias, V, DO, Lse, Delta, DK, DBias, Seed, L, S, D, DV, thresh, drop_scale,
                       M: tl.constexpr, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
        """dK_r and dbias_r of one key block of one component: dS_r = P_r * (dO V^T Z - delta), Z the keep
        factors (1 without dropout)."""
        pid_n, bh, r = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        n_ok, d_ok = offs_n < S, offs_d < D
        v = _tile(V, bh, offs_n, S, offs_dv, DV)
        dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
        db = tl.zeros((BLOCK_N,), tl.float32)
        for m0 in range(_first_query(pid_n, L, S, CAUSAL, BLOCK_M, BLOCK_N), L, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_ok = offs_m < L
            q = _tile(Q, bh, offs_m, L, offs_d, D)
            do = _tile(DO, bh, offs_m, L, offs_dv, DV)
            lse = tl.load(Lse + bh * L + offs_m, mask=m_ok, other=float("-inf"))
            delta = tl.load(Delta + bh * L + offs_m, mask=m_ok, other=0.0)
            p, _ = _probs(q, K + (bh * M + r) * S * D, Bias + (bh * M + r) * S, lse, offs_m, offs_n, offs_d, n_ok,
                          d_ok, L, S, D, CAUSAL)
            dp = tl.dot(do, tl.trans(v), input_precision="ieee")
            if DROPOUT:
                dp = dp * keep_factor(Seed, bh, offs_m, offs_n, L, thresh, drop_scale)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds), q, input_precision="ieee")
            db += tl.sum(ds, 0)
        tl.store(DK + ((bh * M + r) * S + offs_n[:, None]) * D + offs_d[None, :], dk,
                 mask=n_ok[:, None] & d_ok[None, :])
        tl.store(DBias + (bh * M + r) * S + offs_n, db, mask=n_ok)

    @triton.jit
    def _bwd_dv_kernel(Q, K, Bias, DO, Lse, DVout, Seed, L, S, D, DV, thresh, drop_scale,
                       M: tl.constexpr, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
        """dV of one key block: ((sum_r P_r) * Z)^T dO -- one product for all components."""
        pid_n, bh = tl.program_id(0), tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        n_ok, d_ok, dv_ok = offs_n < S, offs_d < D, offs_dv < DV
        dv = tl.zeros((BLOCK_N, BLOCK_DV), tl.float32)
        for m0 in range(_first_query(pid_n, L, S, CAUSAL, BLOCK_M, BLOCK_N), L, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_ok = offs_m < L
            q = _tile(Q, bh, offs_m, L, offs_d, D)
            do = _tile(DO, bh, offs_m, L, offs_dv, DV)
            lse = tl.load(Lse + bh * L + offs_m, mask=m_ok, other=float("-inf"))
            a = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for r in tl.static_range(M):
                p, _ = _probs(q, K + (bh * M + r) * S * D, Bias + (bh * M + r) * S, lse, offs_m, offs_n, offs_d,
                              n_ok, d_ok, L, S, D, CAUSAL)
                a += p
            if DROPOUT:
                a = a * keep_factor(Seed, bh, offs_m, offs_n, L, thresh, drop_scale)
            dv += tl.dot(tl.trans(a), do, input_precision="ieee")
        tl.store(DVout + bh * S * DV + offs_n[:, None] * DV + offs_dv[None, :], dv,
                 mask=n_ok[:, None] & dv_ok[None, :])

    @triton.jit
    def _bwd_dq_kernel(Q, K, Bias, V, DO, Lse, Delta, DQ, Seed, L, S, D, DV, thresh, drop_scale,
                       M: tl.constexpr, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
        """dQ of one query block: sum_r dS_r K_r."""
        pid_m, bh = tl.program_id(0), tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        m_ok, d_ok = offs_m < L, offs_d < D
        q = _tile(Q, bh, offs_m, L, offs_d, D)
        do = _tile(DO, bh, offs_m, L, offs_dv, DV)
        lse = tl.load(Lse + bh * L + offs_m, mask=m_ok, other=float("-inf"))
        delta = tl.load(Delta + bh * L + offs_m, mask=m_ok, other=0.0)
        dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        end = S
        if CAUSAL:
            end = tl.minimum(S, (pid_m + 1) * BLOCK_M + (S - L))
        for n0 in range(0, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < S
            v = _tile(V, bh, offs_n, S, offs_dv, DV)
            t = tl.dot(do, tl.trans(v), input_precision="ieee")
            if DROPOUT:
                t = t * keep_factor(Seed, bh, offs_m, offs_n, L, thresh, drop_scale)
            t = t - delta[:, None]
            for r in tl.static_range(M):
                p, k = _probs(q, K + (bh * M + r) * S * D, Bias + (bh * M + r) * S, lse, offs_m, offs_n, offs_d,
                              n_ok, d_ok, L, S, D, CAUSAL)
                dq += tl.dot(p * t, k, input_precision="ieee")
        tl.store(DQ + bh * L * D + offs_m[:, None] * D + offs_d[None, :], dq, mask=m_ok[:, None] & d_ok[None, :])


def _blocks(D: int, Dv: int) -> dict:
    pow2 = lambda n: max(16, 1 << (int(n) - 1).bit_length())  # noqa: E731 - tl.dot needs sizes >= 16
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=pow2(D), BLOCK_DV=pow2(Dv))


class MixtureTriton(torch.autograd.Function):
    """q (B, H, L, D), k (B, H, M, S, D) (divided by sigma_r^2), bias (B, H, M, S), v (B, H, S, Dv), is_causal
    (bottom-right), dropout_p in [0, 1), seed (the (2,) int64 (seed, offset) tensor on q's device, or None to draw
    it with :func:`._mixture_flash.draw_dropout_seed_tensor` when ``dropout_p > 0``) -> (B, H, L, Dv) in float32."""

    @staticmethod
    def forward(ctx, q, k, bias, v, is_causal: bool, dropout_p: float = 0.0, seed: torch.Tensor | None = None):
        B, H, L, D = q.shape
        M, S, Dv = k.shape[2], k.shape[3], v.shape[-1]
        qf = q.reshape(B * H, L, D).float().contiguous()
        kf = k.reshape(B * H, M, S, D).float().contiguous()
        bf = bias.expand(B, H, M, S).reshape(B * H, M, S).float().contiguous()
        vf = v.reshape(B * H, S, Dv).float().contiguous()
        out = torch.empty(B * H, L, Dv, device=q.device, dtype=torch.float32)
        lse = torch.empty(B * H, L, device=q.device, dtype=torch.float32)
        ctx.drop = _dropout_args(float(dropout_p), seed, q.device)
        blocks = _blocks(D, Dv)
        grid = (triton.cdiv(L, blocks["BLOCK_M"]), B * H)
        seeds, thresh, scale, on = ctx.drop
        _fwd_kernel[grid](qf, kf, bf, vf, out, lse, seeds, L, S, D, Dv, thresh, scale, M=M, CAUSAL=bool(is_causal),
                          DROPOUT=on, **blocks)
        ctx.save_for_backward(qf, kf, bf, vf, out, lse)
        ctx.is_causal = bool(is_causal)
        ctx.shapes = (B, H, L, S, M, D, Dv)
        return out.view(B, H, L, Dv)

    @staticmethod
    @once_differentiable  # the backward calls kernels autograd cannot differentiate
    def backward(ctx, grad_out):
        """Gradients ``(dq, dk, dbias, dv, None, None, None)`` in float32, shaped like the inputs of forward."""
        qf, kf, bf, vf, out, lse = ctx.saved_tensors
        B, H, L, S, M, D, Dv = ctx.shapes
        do = grad_out.reshape(B * H, L, Dv).float().contiguous()
        # With dropout, out is the dropped output and delta = rowsum(dO * out) = sum_j A_ij dA_ij still holds.
        delta = (do * out).sum(-1).contiguous()
        dq, dk, dbias, dv = torch.empty_like(qf), torch.empty_like(kf), torch.empty_like(bf), torch.empty_like(vf)
        blocks = _blocks(D, Dv)
        seeds, thresh, scale, on = ctx.drop  # the forward's (seed, offset): the same mask, regenerated
        args = dict(M=M, CAUSAL=ctx.is_causal, DROPOUT=on, **blocks)
        tail = (L, S, D, Dv, thresh, scale)
        nk = triton.cdiv(S, blocks["BLOCK_N"])
        _bwd_dk_kernel[(nk, B * H, M)](qf, kf, bf, vf, do, lse, delta, dk, dbias, seeds, *tail, **args)
        _bwd_dv_kernel[(nk, B * H)](qf, kf, bf, do, lse, dv, seeds, *tail, **args)
        _bwd_dq_kernel[(triton.cdiv(L, blocks["BLOCK_M"]), B * H)](qf, kf, bf, vf, do, lse, delta, dq, seeds, *tail,
                                                                    **args)
        return (dq.view(B, H, L, D), dk.view(B, H, M, S, D), dbias.view(B, H, M, S), dv.view(B, H, S, Dv), None,
                None, None)


def _dropout_args(p: float, seed: torch.Tensor | None, device) -> tuple[torch.Tensor, int, float, bool]:
    """(seed tensor, keep threshold, scale 1 / (1 - p), on) for the kernels; raises ValueError unless 0 <= p < 1."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1) for the Triton kernels, got {p}")
    if p == 0.0:
        return torch.zeros(2, dtype=torch.int64, device=device), 0, 1.0, False
    if seed is None:
        seed = draw_dropout_seed_tensor(device)
    elif seed.shape != (2,) or seed.dtype != torch.int64 or seed.device != torch.device(device):
        raise ValueError(f"seed must be a (2,) int64 tensor on {device}, got {tuple(seed.shape)} {seed.dtype} on "
                         f"{seed.device}")
    return seed, threshold(p), 1.0 / (1.0 - p), True
