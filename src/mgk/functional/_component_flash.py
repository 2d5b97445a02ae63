"""MGK on CPU with one fused flash-attention call per mixture component.

SDPA's ``is_causal`` cannot be used on the M*S concatenated keys (the causal pattern repeats per component), and an
explicit (L, M*S) mask stops the fused kernel from skipping masked blocks; without causality, one call over the
concatenated keys needs the values repeated M times (a copy, and a sum in backward). Instead each component r runs
the CPU flash kernel (causal or not) on the shared values and returns its output o_r and log-sum-exp lse_r; the
exact result over all components is

    LSE = logsumexp_r lse_r,    out = sum_r exp(lse_r - LSE) o_r.

The public SDPA API returns no log-sum-exp, so this uses ``aten::_scaled_dot_product_flash_attention_for_cpu``. Its
log-sum-exp output has no gradient, so the backward is written out: the flash backward of component r, given the
*merged* output and log-sum-exp, computes exactly the gradient of attention over the concatenated keys restricted
to that component's keys (its probabilities exp(s - LSE) and its row term rowsum(dO * out) are the global ones).
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def available(q: torch.Tensor, dropout_p: float) -> bool:
    """The kernel exists for CPU tensors without dropout (the fused CPU kernels do not implement dropout). Not used
    under ``torch.export``: the aten op is CPU-only, and exported programs keep to device-independent operators."""
    return q.device.type == "cpu" and dropout_p == 0.0 and not torch.compiler.is_exporting()


class ComponentAttention(torch.autograd.Function):
    """qp (B, H, L, P), kp (B, H, M, S, P), vp (B, H, S, P), is_causal (needs L == S) -> (B, H, L, P); scale 1."""

    @staticmethod
    def forward(ctx, qp, kp, vp, is_causal: bool):
        qp, kp, vp = qp.contiguous(), kp.contiguous(), vp.contiguous()
        ctx.is_causal = is_causal
        # Online merge: at most two component outputs are alive at once. The merge weights exp(lse_r - LSE) sum to 1
        # only up to the rounding of the log-sum-exps, which grows with their magnitude (a row whose every visible
        # key is far has |lse| ~ |q - k|^2 / (2 sigma^2)): dividing by their computed sum keeps the output a convex
        # combination of the component outputs (exactly v_0 for a row that sees one key).
        out, lse = _fwd(qp, kp[:, :, 0], vp, 0.0, is_causal, scale=1.0)
        total = None
        for r in range(1, kp.shape[2]):
            o, lse_r = _fwd(qp, kp[:, :, r], vp, 0.0, is_causal, scale=1.0)
            new = torch.logaddexp(lse, lse_r)
            old_w, new_w = torch.exp(lse - new), torch.exp(lse_r - new)
            out.mul_(old_w.unsqueeze(-1)).add_(o.mul_(new_w.unsqueeze(-1)))
            total = new_w.add_(old_w if total is None else old_w.mul_(total))
            lse = new
        if total is not None:  # rows that see no key have NaN weights: their outputs are replaced by the caller
            out.div_(total.unsqueeze(-1))
        ctx.save_for_backward(qp, kp, vp, out, lse)
        return out

    @staticmethod
    @once_differentiable  # the backward calls kernels autograd cannot differentiate
    def backward(ctx, grad_out):
        """Gradients ``(dq, dk, dv, None)`` shaped like qp (B, H, L, P), kp (B, H, M, S, P) and vp (B, H, S, P); none
        for ``is_causal``."""
        qp, kp, vp, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        dk = torch.empty_like(kp)
        dq, dv = None, None
        for r in range(kp.shape[2]):
            gq, gk, gv = _bwd(grad_out, qp, kp[:, :, r], vp, out, lse, 0.0, ctx.is_causal, scale=1.0)
            dq = gq if dq is None else dq.add_(gq)
            dv = gv if dv is None else dv.add_(gv)
            dk[:, :, r] = gk
        return dq, dk, dv, None
