"""MGK on CPU through our C++ kernel that sums the component weights before the value product.

The kernel (``csrc/mixture_flash.cpp``) runs one online-softmax pass over key blocks: per block M score GEMMs and
a single value GEMM on ``sum_r exp(s_r - LSE)``, where attention over the M*S concatenated keys (SDPA, or one flash
call per component) needs M value GEMMs, and its head size is D instead of D+1 because the per-key bias is added
inside the kernel instead of riding in an extra column. See the header of the C++ file for the exact math.

It is compiled on first use with ``torch.utils.cpp_extension.load`` (needs a C++ compiler and ninja; about a
minute, cached under ``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``). When compilation fails, or with
``MGK_CPU_KERNEL=0`` in the environment, :func:`available` is False and MGK uses the per-component SDPA flash
path (:mod:`._component_flash`), which gives the same numbers.
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
import warnings
from pathlib import Path

import torch

_SOURCE = Path(__file__).with_name("csrc") / "mixture_flash.cpp"
_module = None
_failed: str | None = None


def _isa_flags() -> list[str]:
    """Compiler flags matching the vector ISA torch itself dispatches to on this CPU (at::vec needs the define)."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap in ("AVX512", "AVX512_BF16", "AVX512_VNNI", "AVX512_FP16", "AMX"):
        return ["-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512", "-mavx512f", "-mavx512dq", "-mavx512vl",
                "-mavx512bw", "-mfma"]
    if cap == "AVX2":
        return ["-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2", "-mavx2", "-mfma"]
    return ["-DCPU_CAPABILITY=DEFAULT"]


def _load():
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    if os.environ.get("MGK_CPU_KERNEL", "1").strip().lower() in ("0", "false", "no", "off"):
        _failed = "disabled by MGK_CPU_KERNEL=" + os.environ["MGK_CPU_KERNEL"]
        return None
    try:
        from torch.utils import cpp_extension

        # The name carries the ISA and a hash of the source, so a changed kernel never reuses a stale build.
        digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:10]
        name = f"mgk_mixture_flash_{torch.backends.cpu.get_cpu_capability().lower()}_{digest}"
        folder = _build_folder(cpp_extension, name)
        if folder is not None:
            _remove_stale_lock(folder)
        if folder is None or not any(folder.glob(f"{name}*.so")):
            print(f"mgk: building the CPU MGK kernel {name} (once, about 30 s; cached in {folder}). If this hangs, "
                  "a killed earlier build left its 'lock' file there: delete it, or set MGK_CPU_KERNEL=0.",
                  file=sys.stderr, flush=True)
        # -fopenmp: at::parallel_for is a header-only OpenMP loop in torch's builds; the module then uses the
        # libgomp that torch has already loaded (same soname).
        _module = cpp_extension.load(name=name, sources=[str(_SOURCE)], extra_cflags=["-O3", "-fopenmp",
                                                                                       *_isa_flags()],
                                     extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the SDPA path
        # The compiler's complaint is at the end of the message, after the command line.
        text = " ".join(str(exc).split())
        _failed = f"{type(exc).__name__}: {'...' if len(text) > 400 else ''}{text[-400:]}"
        warnings.warn(f"mgk: the fused CPU MGK kernel could not be built ({_failed}); using the SDPA path, "
                      "which computes the same result more slowly (set MGK_CPU_KERNEL=0 to skip the build)",
                      RuntimeWarning, stacklevel=3)
    return _module


def _build_folder(cpp_extension, name: str) -> Path | None:
    """Where torch.utils.cpp_extension builds ``name`` (None if its private helper is gone)."""
    try:
        return Path(cpp_extension._get_build_directory(name, verbose=False))
    except Exception:  # noqa: BLE001 - a private helper; without it we announce every load
        return None


_STALE_LOCK_S = 600  # a build takes about 30 s; a lock this old belongs to a build that was killed


def _remove_stale_lock(folder: Path) -> None:
    """torch's build lock waits forever for a lock file left by a killed build; remove one that is clearly stale."""
    lock = folder / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return
    if age > _STALE_LOCK_S:
        warnings.warn(f"mgk: removing the stale build lock {lock} ({age:.0f} s old, left by a killed build)",
                      RuntimeWarning, stacklevel=4)
        lock.unlink(missing_ok=True)


def available(q: torch.Tensor, dropout_p: float) -> bool:
    """True for CPU float32/float64 tensors without dropout, once the kernel has been built (builds it on the
    first call)."""
    if q.device.type != "cpu" or dropout_p != 0.0 or q.dtype not in (torch.float32, torch.float64):
        return False
    if torch.compiler.is_compiling():
        # Building inside a trace is not possible; a kernel loaded by an eager call is used through the custom op.
        return _module is not None
    return _load() is not None


def usable(q: torch.Tensor, v: torch.Tensor, dropout_p: float) -> bool:
    """:func:`available`, and head sizes the kernel takes (BLAS needs q's and v's last dimensions >= 1)."""
    return q.shape[-1] > 0 and v.shape[-1] > 0 and available(q, dropout_p)


def build_error() -> str | None:
    """Why the kernel is unavailable (None when it loaded or was not tried yet)."""
    return _failed


# The kernel as two torch custom ops, so that torch.compile keeps it in its graphs (as an opaque call) instead of
# falling back to the SDPA form; autograd is registered on the forward op.
@torch.library.custom_op("mgk::mixture_flash_forward", mutates_args=(), device_types="cpu")
def _forward_op(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, v: torch.Tensor, rowbias: torch.Tensor,
                causal: bool, hard: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _load().forward(q, k, bias, v, rowbias, causal, hard)
    return out, lse


@_forward_op.register_fake
def _(q, k, bias, v, rowbias, causal, hard):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2])), q.new_empty((q.shape[0], q.shape[1]))


@torch.library.custom_op("mgk::mixture_flash_backward", mutates_args=(), device_types="cpu")
def _backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, v: torch.Tensor,
                 rowbias: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, causal: bool,
                 hard: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dbias, dv, drb = _load().backward(grad_out, q, k, bias, v, rowbias, lse, delta, causal, hard)
    return dq, dk, dbias, dv, drb


@_backward_op.register_fake
def _(grad_out, q, k, bias, v, rowbias, lse, delta, causal, hard):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(bias), torch.empty_like(v),
            torch.empty_like(rowbias))


def _setup_context(ctx, inputs, output):
    q, k, bias, v, rowbias, causal, hard = inputs
    out, lse = output
    ctx.save_for_backward(q, k, bias, v, rowbias, out, lse)
    ctx.flags = (causal, hard)


def _backward(ctx, grad_out, grad_lse):
    # lse is an auxiliary output for the backward pass; nothing differentiates through it (grad_lse is ignored).
    q, k, bias, v, rowbias, out, lse = ctx.saved_tensors
    grad_out = grad_out.contiguous()
    delta = (grad_out * out).sum(-1)
    dq, dk, dbias, dv, drb = _backward_op(grad_out, q, k, bias, v, rowbias, lse, delta, *ctx.flags)
    return dq, dk, dbias, dv, (drb if rowbias.numel() else None), None, None


torch.library.register_autograd("mgk::mixture_flash_forward", _backward, setup_context=_setup_context)


def mixture_flash(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, v: torch.Tensor,
                  rowbias: torch.Tensor | None, is_causal: bool, hard: bool = False) -> torch.Tensor:
    """MGK through the C++ kernel (check :func:`usable` first).

    Args: q (B, H, L, D); k (B, H, M, S, D), already divided by sigma_r^2; bias (B, H, M, S); v (B, H, S, Dv);
        rowbias (B, H, M, L) or None; is_causal (bottom-right); hard (Hard-E). One floating dtype, float32 or
        float64, on CPU.
    Returns:
        (B, H, L, Dv). With ``s_ijr = q_i.k_jr + bias_jr + rowbias_ir``: ``out_i = sum_{j,r} exp(s_ijr - LSE_i) v_j``
        (mixture "sum"), or with ``hard`` ``out_i = sum_j softmax_j(max_r s_ijr) v_j``. Rows that see no key are 0.
        Differentiable once (a second derivative raises).
    """
    B, H, L, D = q.shape
    M, S, Dv = k.shape[2], k.shape[3], v.shape[-1]
    qf = q.reshape(B * H, L, D).contiguous()
    kf = k.reshape(B * H, M, S, D).contiguous()
    bf = bias.expand(B, H, M, S).reshape(B * H, M, S).contiguous()
    vf = v.reshape(B * H, S, Dv).contiguous()
    rf = rowbias.expand(B, H, M, L).reshape(B * H, M, L).contiguous() if rowbias is not None else qf.new_empty(0)
    out, _ = _forward_op(qf, kf, bf, vf, rf, bool(is_causal), bool(hard))
    return out.view(B, H, L, Dv)


def responsibilities(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, rowbias: torch.Tensor | None,
                     query_ok: torch.Tensor | None, key_ok: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
    """Soft-E statistics through the C++ kernel (no gradient; check :func:`usable` first).

    Args: q (B, H, L, D); k (B, H, M, S, D) divided by sigma_r^2; bias (B, H, M, S) finite; rowbias (B, H, M, L) or
        None; query_ok (B, H, L) and key_ok (B, H, S) bool or None; is_causal (bottom-right).
    Returns:
        (B, H, M, S): for each key j and component r, the sum over the queries i that may attend to j of
        ``softmax_r(q_i.k_jr + bias_jr + rowbias_ir)``.
    """
    B, H, L, D = q.shape
    M, S = k.shape[2], k.shape[3]
    flat = lambda t, *shape: t.expand(B, H, *shape).reshape(B * H, *shape).contiguous()  # noqa: E731
    resp = _load().responsibilities(
        flat(q, L, D), flat(k, M, S, D), flat(bias, M, S),
        flat(rowbias, M, L) if rowbias is not None else q.new_empty(0),
        flat(query_ok, L) if query_ok is not None else q.new_empty(0, dtype=torch.bool),
        flat(key_ok, S) if key_ok is not None else q.new_empty(0, dtype=torch.bool), bool(is_causal))
    return resp.view(B, H, M, S)

