"""MGK on CPU through our C++ kernel that sums the component weights before the value product.

The kernel (``csrc/mixture_flash.cpp``) runs one online-softmax pass over key blocks: per block M score GEMMs and
a single value GEMM on ``sum_r exp(s_r - LSE)``, where attention over the M*S concatenated keys (SDPA, or one flash
call per component) needs M value GEMMs, and its head size is D instead of D+1 because the per-key bias is added
inside the kernel instead of riding in an extra column. See the header of the C++ file for the exact math. With one
component and no bias it is plain softmax attention (:func:`softmax_flash`), and both take attention dropout from a
counter-based random stream, so that training with dropout keeps O(L + S) memory per head. The same extension
holds MGK's decoding step over a cache (``csrc/mixture_decode.cpp``, :mod:`._mixture_decode`).

It is compiled on first use with ``torch.utils.cpp_extension.load`` (needs a C++ compiler and ninja; about 30 s,
cached under ``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``), one build per (kernel sources and their
path, torch version and install, Python, compiler, ninja and flags: :func:`_build_name`), kept side by side. Every
build that actually runs is announced by one line on stderr. Concurrent builds wait on an OS file lock that dies with
its process; a wait behind a build (or a holder slower than a moment) is announced and gives up after
``MGK_KERNEL_BUILD_TIMEOUT`` seconds (default 600). When compilation fails, or with ``MGK_CPU_KERNEL=0`` in the
environment (warned once), :func:`available` is False and MGK uses the per-component SDPA flash path
(:mod:`._component_flash`), which gives the same numbers.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
import warnings
from pathlib import Path

import torch
from torch.autograd import forward_ad as _forward_ad

try:
    import fcntl
except ImportError:  # not POSIX: builds are not serialised by us (torch's own lock file still applies)
    fcntl = None

# mixture_flash.cpp holds the module definition; mixture_decode.cpp the decoding step (one extension, one build)
_SOURCES = tuple(Path(__file__).with_name("csrc") / name for name in ("mixture_flash.cpp", "mixture_decode.cpp"))
_module = None
_failed: str | None = None
_LOCK_FILE = "mgk-build.flock"
_DEFAULT_TIMEOUT_S = 600.0
# A holder that only loads the built library (every rank but one under torchrun) keeps the lock well under this
_QUIET_WAIT_S = 5.0
_BUILDING = "building the kernel"  # what a holder that compiles writes into the lock file, for the waiters' message


def _isa_flags() -> list[str]:
    """Compiler flags matching the vector ISA torch itself dispatches to on this CPU (at::vec needs the define)."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap in ("AVX512", "AVX512_BF16", "AVX512_VNNI", "AVX512_FP16", "AMX"):
        return ["-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512", "-mavx512f", "-mavx512dq", "-mavx512vl",
                "-mavx512bw", "-mfma"]
    if cap == "AVX2":
        return ["-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2", "-mavx2", "-mfma"]
    return ["-DCPU_CAPABILITY=DEFAULT"]


def _flags() -> tuple[list[str], list[str]]:
    """(cflags, ldflags). -fopenmp: at::parallel_for is a header-only OpenMP loop in torch's builds; the module then
    uses the libgomp that torch has already loaded (same soname)."""
    return ["-O3", "-fopenmp", *_isa_flags()], ["-fopenmp"]


def _build_name(source: bytes, torch_version: str, python: str, compiler: str, cflags: list[str],
                ldflags: list[str], source_path: str = "", ninja: str = "", torch_path: str = "") -> str:
    """Extension name: one per (kernel source and its path, torch version and install path, Python, compiler,
    ninja, flags), so environments and checkouts used in turn keep their builds side by side instead of rebuilding
    one shared folder. Each part is something ninja would rebuild for: the source's path, torch's and Python's
    include paths and the compiler are in the commands it records, and ninja versions hash those commands (and
    write their log) differently, so a folder built by one ninja is rebuilt in full by another. ``compiler`` and
    ``ninja`` are what :func:`_tool` reports (the program found on PATH and its version)."""
    h = hashlib.sha256(source)
    for part in (torch_version, python, compiler, " ".join(cflags), " ".join(ldflags), source_path, ninja,
                 torch_path):
        h.update(b"\0" + part.encode())
    return f"mgk_mixture_flash_{torch.backends.cpu.get_cpu_capability().lower()}_{h.hexdigest()[:12]}"


def _disabled_by_env() -> str | None:
    value = os.environ.get("MGK_CPU_KERNEL", "1")
    return value if value.strip().lower() in ("0", "false", "no", "off") else None


def _load():
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    value = _disabled_by_env()
    if value is not None:
        _failed = f"disabled by MGK_CPU_KERNEL={value}"
        warnings.warn(f"mgk: MGK_CPU_KERNEL={value}: the fused CPU MGK kernel is off; MGK uses the SDPA path, "
                      "which computes the same result more slowly", RuntimeWarning, stacklevel=3)
        return None
    try:
        _module = _build_and_load()
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the SDPA path
        # The compiler's complaint is at the end of the message, after the command line.
        text = " ".join(str(exc).split())
        _failed = f"{type(exc).__name__}: {'...' if len(text) > 400 else ''}{text[-400:]}"
        warnings.warn(f"mgk: the fused CPU MGK kernel could not be built ({_failed}); using the SDPA path, "
                      "which computes the same result more slowly (set MGK_CPU_KERNEL=0 to skip the build)",
                      RuntimeWarning, stacklevel=3)
    return _module


def _tool(command: str) -> str:
    """``command`` with the program it runs and that program's version: the first word looked up on PATH, as
    ``cpp_extension`` (ninja) and ninja's shell (the compiler) look it up, so a PATH that puts another ninja or
    compiler first names another build. A program not found is named by ``command`` alone (the build then fails
    with torch's own message)."""
    words = shlex.split(command) or [command]
    found = shutil.which(words[0])
    if found is None:
        return command
    try:
        done = subprocess.run([found, *words[1:], "--version"], capture_output=True, text=True, timeout=60)
        version = (done.stdout.strip() or done.stderr.strip()).partition("\n")[0]
    except (OSError, subprocess.SubprocessError) as exc:
        version = f"no version ({type(exc).__name__})"
    return f"{command} = {os.path.realpath(found)} {version}"


def build_folder() -> tuple[str, Path]:
    """(extension name, build folder) of the kernel for this environment (the folder is created). Runs the
    compiler and ninja found on PATH once each with ``--version`` (a few ms)."""
    from torch.utils import cpp_extension

    cflags, ldflags = _flags()
    include = sysconfig.get_path("include", scheme="nt" if os.name == "nt" else "posix_prefix")
    python = f"{sys.implementation.name} {sys.version} {getattr(sys, 'abiflags', '')} {include}"
    name = _build_name(b"\0".join(src.read_bytes() for src in _SOURCES), torch.__version__, python,
                       _tool(cpp_extension.get_cxx_compiler()), cflags, ldflags,
                       " ".join(str(src.resolve()) for src in _SOURCES), _tool("ninja"),
                       str(Path(torch.__file__).resolve().parent))
    return name, Path(cpp_extension._get_build_directory(name, verbose=False))


def _build_reason(folder: Path, name: str) -> str | None:
    """Why ``cpp_extension.load`` will compile in ``folder`` (None: it is up to date and only loads the library).

    Asks ninja's dry run (``ninja -n``, which writes nothing), run as load runs it: the ninja on PATH, on the
    build.ninja load rewrites unchanged (all it holds is in the build name)."""
    if not any(folder.glob(f"{name}*.so")):
        return "no library built yet"
    ninja = shutil.which("ninja")
    if ninja is None:
        return None  # load fails at once, with torch's message naming ninja
    try:
        done = subprocess.run([ninja, "-n", "-C", str(folder)], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"ninja's up-to-date check failed: {type(exc).__name__}"
    if done.returncode != 0:
        return f"ninja's up-to-date check failed: {' '.join((done.stderr or done.stdout).split())[:200]}"
    if "ninja: no work to do" in done.stdout:
        return None
    # every other line is a step it would run (their "[1/3]" prefix is NINJA_STATUS, which may be changed)
    steps = sum(not line.startswith("ninja: ") for line in done.stdout.splitlines())
    return f"{steps} build steps out of date for {ninja}"


def _build_and_load():
    from torch.utils import cpp_extension

    cflags, ldflags = _flags()
    name, folder = build_folder()
    with _build_lock(folder, build_timeout()) as note_holder_state:
        _remove_orphaned_lock(folder)
        reason = _build_reason(folder, name)
        if reason is not None:
            note_holder_state(_BUILDING)
            print(f"mgk: building the MGK CPU kernel, about 30 s ({reason}; in {folder})", file=sys.stderr,
                  flush=True)
        return cpp_extension.load(name=name, sources=[str(src) for src in _SOURCES], extra_cflags=cflags,
                                  extra_ldflags=ldflags, build_directory=str(folder), verbose=False)


def build_timeout() -> float:
    """Seconds to wait for another process's build: ``MGK_KERNEL_BUILD_TIMEOUT`` (default 600).

    Raises ValueError naming the variable when it is not a non-negative number."""
    raw = os.environ.get("MGK_KERNEL_BUILD_TIMEOUT", str(_DEFAULT_TIMEOUT_S))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0.0:  # also rejects NaN
        raise ValueError(f"MGK_KERNEL_BUILD_TIMEOUT must be a number of seconds >= 0, got {raw!r}")
    return value


@contextlib.contextmanager
def _build_lock(folder: Path, timeout: float, poll_s: float = 0.2, quiet_s: float = _QUIET_WAIT_S):
    """Hold an exclusive ``fcntl.flock`` on ``folder/mgk-build.flock`` while building and loading.

    The OS releases the lock when its holder exits, however it dies, so a lock is never left behind (unlike a lock
    file, whose creator may be killed). The holder's pid is written into the file; the context yields a function
    ``note(state: str)`` that adds what the holder is doing. A wait is announced by one line naming the lock and the
    holder once the holder notes it is building, or has held the lock ``quiet_s`` seconds: a holder that only loads
    the built library (other ranks of one torchrun) is waited for silently. Gives up after ``timeout`` seconds with
    TimeoutError naming the lock."""
    if fcntl is None:
        yield lambda state: None
        return
    path = folder / _LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        _wait_for_lock(fd, path, timeout, poll_s, quiet_s)
        mine = f"pid {os.getpid()}"

        def note(state: str) -> None:
            """Write ``pid N, state`` (``pid N`` for an empty ``state``) into the lock file, what waiters print."""
            # written before the truncation, so a waiter reading meanwhile never sees an empty file
            text = f"{mine}, {state}\n".encode() if state else f"{mine}\n".encode()
            os.pwrite(fd, text, 0)
            os.ftruncate(fd, len(text))

        note("")
        yield note
    finally:
        os.close(fd)  # releases the lock


def _wait_for_lock(fd: int, path: Path, timeout: float, poll_s: float, quiet_s: float) -> None:
    """Poll ``flock`` on ``fd`` until taken (see :func:`_build_lock`); the quiet time restarts with each new holder,
    so a queue of ranks that each only load is never announced."""
    start = since = time.monotonic()
    announced = False
    last_pid = None
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            holder = _lock_holder(path)
            now = time.monotonic()
            pid = holder.partition(",")[0]
            if pid != last_pid:
                since, last_pid = now, pid
            if now - start >= timeout:
                raise TimeoutError(f"gave up after {timeout:g} s waiting for the MGK kernel build lock {path} "
                                   f"(held by {holder}); raise MGK_KERNEL_BUILD_TIMEOUT or set "
                                   "MGK_CPU_KERNEL=0") from None
            if not announced and (_BUILDING in holder or now - since >= quiet_s):
                print(f"mgk: waiting for the MGK kernel build lock {path} (held by {holder}; giving up after "
                      f"{timeout:g} s, MGK_KERNEL_BUILD_TIMEOUT)", file=sys.stderr, flush=True)
                announced = True
            time.sleep(poll_s)


def _lock_holder(path: Path) -> str:
    try:
        text = path.read_text().strip()
    except OSError:
        text = ""
    return text or "another process"


def _remove_orphaned_lock(folder: Path) -> None:
    """torch's ``cpp_extension.load`` waits without end while its ``lock`` file exists. Every build of ours creates
    it only while holding :func:`_build_lock`, so once we hold that lock any ``lock`` file was left by a build
    that died (whatever its age) and is removed."""
    lock = folder / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return
    warnings.warn(f"mgk: removing the stale build lock {lock} ({age:.0f} s old; the build that left it is gone)",
                  RuntimeWarning, stacklevel=4)
    lock.unlink(missing_ok=True)


def available(q: torch.Tensor, dropout_p: float = 0.0) -> bool:
    """True for CPU float32/float64 tensors (with or without dropout, ``0 <= dropout_p < 1``), once the kernel has
    been built (builds it on the first call). False under ``torch.export``: an exported program then holds
    PyTorch operators only, so it loads without mgk, runs on any device and can go on to ONNX."""
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.float64) or torch.compiler.is_exporting():
        return False
    if not 0.0 <= dropout_p < 1.0:  # p = 1 (and invalid values) take the reference path, which handles them
        return False
    if torch.compiler.is_compiling():
        # Building inside a trace is not possible; a kernel loaded by an eager call is used through the custom op.
        return _module is not None
    return _load() is not None


def usable(q: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> bool:
    """:func:`available`, and head sizes the kernel takes (BLAS needs q's and v's last dimensions >= 1)."""
    return q.shape[-1] > 0 and v.shape[-1] > 0 and available(q, dropout_p)


def build_error() -> str | None:
    """Why the kernel is unavailable (None when it loaded or was not tried yet)."""
    return _failed


def draw_dropout_seed() -> tuple[int, int]:
    """(seed, offset) for one call's dropout, drawn from torch's default CPU generator (as flash-attention draws its
    Philox seed and offset), so ``torch.manual_seed`` controls the mask, each call advances the generator, and
    saving/restoring the generator state (resume, activation checkpointing) reproduces it."""
    seed, offset = draw_dropout_seed_tensor("cpu").tolist()
    return seed, offset


def draw_dropout_seed_tensor(device: torch.device | str) -> torch.Tensor:
    """(seed, offset) as a (2,) int64 tensor on ``device``, from torch's generator of that device (the Triton
    kernels read it there, without a host synchronisation); on CPU the very draw of :func:`draw_dropout_seed`."""
    return torch.randint(-2 ** 63, 2 ** 63 - 1, (2,), dtype=torch.int64, device=device)


def dropout_mask(seed: int, offset: int, B: int, H: int, L: int, S: int, p: float) -> torch.Tensor:
    """The keep mask (B, H, L, S) bool that the kernel applies for ``(seed, offset)`` and drop probability ``p``:
    the same for every thread count and blocking (a hash of (seed, offset, b * H + h, i, j)). For tests."""
    return _load().dropout_mask(B * H, L, S, float(p), int(seed), int(offset)).view(B, H, L, S)


# The kernel as two torch custom ops, so that torch.compile keeps it in its graphs (as an opaque call) instead of
# falling back to the SDPA form; autograd is registered on the forward op.
# The forward's third output is the Soft-E statistics (empty unless ``stats``); it has no gradient.
@torch.library.custom_op("mgk::mixture_flash_forward", mutates_args=(), device_types="cpu")
def _forward_op(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, v: torch.Tensor, rowbias: torch.Tensor,
                scale: torch.Tensor, query_ok: torch.Tensor, causal: bool, hard: bool, dropout_p: float, seed: int,
                offset: int, stats: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out, lse, resp = _load().forward(q, k, bias, v, rowbias, scale, query_ok, causal, hard, dropout_p, seed, offset,
                                     stats)
    return out, lse, resp


@_forward_op.register_fake
def _(q, k, bias, v, rowbias, scale, query_ok, causal, hard, dropout_p, seed, offset, stats):
    BH = q.shape[0] * q.shape[1] if q.dim() == 4 else q.shape[0]
    resp = q.new_empty((BH, bias.shape[1], bias.shape[2]) if stats else (0,))
    return _rows_like(q, v.shape[-1]), q.new_empty((BH, q.shape[-2])), resp


def _rows_like(q: torch.Tensor, cols: int) -> torch.Tensor:
    """An empty output shaped like q's rows with ``cols`` columns, laid out as the C++ ``rows_like`` lays it: for
    (B, H, L, D) queries in (B, L, H, D) order, so that merging the heads afterwards is a view."""
    if q.dim() == 4:
        return q.new_empty((q.shape[0], q.shape[2], q.shape[1], cols)).permute(0, 2, 1, 3)
    return q.new_empty((*q.shape[:-1], cols))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the kernel reads it by rows: itself when its columns are adjacent and its row stride is at least the
    row length (any other strides are read in place: the projections' (B, L, H, D) layout), else a contiguous copy
    (e.g. the all-zero-stride gradient of ``out.sum()``). An empty tensor is read as it is (it has no rows)."""
    rows_ok = t.shape[-2] <= 1 or t.stride(-2) >= t.shape[-1]
    return t if t.numel() == 0 or ((t.stride(-1) == 1 or t.shape[-1] <= 1) and rows_ok) else t.contiguous()


@torch.library.custom_op("mgk::mixture_flash_backward", mutates_args=(), device_types="cpu")
def _backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, v: torch.Tensor,
                 rowbias: torch.Tensor, scale: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, causal: bool,
                 hard: bool, dropout_p: float, seed: int, offset: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                torch.Tensor, torch.Tensor,
                                                                                torch.Tensor, torch.Tensor]:
    dq, dk, dbias, dv, drb, dscale = _load().backward(grad_out, q, k, bias, v, rowbias, scale, lse, delta, causal,
                                                      hard, dropout_p, seed, offset)
    return dq, dk, dbias, dv, drb, dscale


@_backward_op.register_fake
def _(grad_out, q, k, bias, v, rowbias, scale, lse, delta, causal, hard, dropout_p, seed, offset):
    return (_grad_like(q), _grad_like(k), torch.empty_like(bias), _grad_like(v), torch.empty_like(rowbias),
            torch.empty_like(scale))


def _grad_like(t: torch.Tensor) -> torch.Tensor:
    """An empty gradient laid out as the C++ ``grad_like`` lays it: as ``t`` when ``t``'s layout is a permutation of
    a contiguous one with adjacent columns, else contiguous."""
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    dense = t.permute(order).is_contiguous()
    return torch.empty_like(t) if dense and (t.shape[-1] <= 1 or t.stride(-1) == 1) else t.new_empty(t.shape)


def _setup_context(ctx, inputs, output):
    q, k, bias, v, rowbias, scale, _query_ok, *flags = inputs
    out, lse, resp = output
    ctx.save_for_backward(q, k, bias, v, rowbias, scale, out, lse)
    ctx.mark_non_differentiable(lse, resp)
    ctx.flags = tuple(flags[:5])  # causal, hard, dropout_p, seed, offset: backward regenerates the same mask


def _gradients(ctx, grad_out, kernel_backward):
    """The forward's input gradients from ``kernel_backward`` (the custom backward op, or the bare C++ function in
    eager mode). lse is an auxiliary output for the backward pass and resp a statistic: nothing differentiates
    through them. With dropout, out is the dropped output and delta = rowsum(dO * out) = sum_j A_ij dA_ij holds."""
    q, k, bias, v, rowbias, scale, out, lse = ctx.saved_tensors
    grad_out = _rows(grad_out)
    delta = (grad_out * out).sum(-1).reshape(lse.shape).contiguous()
    dq, dk, dbias, dv, drb, dscale = kernel_backward(grad_out, q, k, bias, v, rowbias, scale, lse, delta, *ctx.flags)
    return (dq, dk, dbias, dv, (drb if rowbias.numel() else None), (dscale if scale.numel() else None), None, None,
            None, None, None, None, None)


def _backward(ctx, grad_out, grad_lse, grad_resp):
    return _gradients(ctx, grad_out, _backward_op)


torch.library.register_autograd("mgk::mixture_flash_forward", _backward, setup_context=_setup_context)


class _Eager(torch.autograd.Function):
    """The custom op's autograd (same saved tensors, same backward) around the bare C++ functions, for eager calls:
    the custom op's dispatch through torch.library costs tens of microseconds per call, which at a few hundred
    tokens is a visible share of the attention."""

    @staticmethod
    def forward(q, k, bias, v, rowbias, scale, query_ok, causal, hard, dropout_p, seed, offset, stats):
        return tuple(_module.forward(q, k, bias, v, rowbias, scale, query_ok, causal, hard, dropout_p, seed, offset,
                                     stats))

    @staticmethod
    def setup_context(ctx, inputs, output):
        """Save what backward needs, as the custom op's autograd does (:func:`_setup_context`)."""
        _setup_context(ctx, inputs, output)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_lse, grad_resp):
        """Gradients of (q, k, bias, v, rowbias, scale), shaped like them; None for the flags. Once differentiable."""
        return _gradients(ctx, grad_out, _module.backward)


def _eager_ok() -> bool:
    """Whether the bare C++ functions may stand in for the custom op: not while torch.compile traces, under a
    torch.func transform, forward-mode AD or a dispatch mode (FlopCounterMode, FakeTensorMode), all of which must
    see the op itself."""
    return _module is not None and plain_eager()


def plain_eager() -> bool:
    """Whether plain eager PyTorch runs: not while torch.compile traces, nor under a torch.func transform,
    forward-mode AD or a dispatch mode (FlopCounterMode, FakeTensorMode), whose tensors are not the ones they wrap."""
    if torch.compiler.is_compiling():
        return False
    try:  # torch internals: a torch without them answers False (the callers then take their general path)
        return (_forward_ad._current_level < 0 and not torch._C._are_functorch_transforms_active()
                and torch._C._len_torch_dispatch_stack() == 0)
    except AttributeError:
        return False


def _run_forward(*args):
    """(out, lse, resp) of the kernel's forward, with autograd, through :class:`_Eager` or the custom op."""
    if not _eager_ok():
        return _forward_op(*args)
    if torch.is_grad_enabled() and any(t.requires_grad for t in args[:6]):
        return _Eager.apply(*args)
    return tuple(_module.forward(*args))


def mixture_flash(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, v: torch.Tensor,
                  rowbias: torch.Tensor | None, is_causal: bool, hard: bool = False, dropout_p: float = 0.0,
                  seed: tuple[int, int] | None = None, scale: torch.Tensor | None = None):
    """MGK through the C++ kernel (check :func:`usable` first).

    Args: q (B, H, L, D); k (B, G, M, S, D), already divided by sigma_r^2, G = H or G key groups dividing H (query
        head h reads group h // (H / G), in place); or with ``scale``, shifted keys' one unscaled key per position,
        (B, G, 1, S, D); bias (B, G, M, S); v (B, G, S, Dv); rowbias (B, H, M, L) or None; is_causal
        (bottom-right); hard (Hard-E); dropout_p in [0, 1): attention dropout on the mixed weights; seed: (seed,
        offset) of the dropout stream, default drawn by :func:`draw_dropout_seed` when ``dropout_p > 0``; scale:
        broadcastable to (B, G, M), the components' 1 / sigma_r^2 of one-component keys, or None. One floating
        dtype, float32 or float64, on CPU.
    Returns:
        (B, H, L, Dv). With ``s_ijr = q_i.k_jr + bias_jr + rowbias_ir`` (with ``scale``: ``scale_r q_i.k_j + ...``):
        ``out_i = sum_j A_ij Z_ij v_j`` where ``A_ij = sum_r exp(s_ijr - LSE_i)`` (mixture "sum"; paper eq. 9), or
        with ``hard`` ``A_ij = softmax_j(max_r s_ijr)``, and ``Z_ij = keep_ij / (1 - dropout_p)`` with ``keep`` =
        :func:`dropout_mask` (Z = 1 without dropout). Rows that see no key are 0. Differentiable once (a second
        derivative raises).
    """
    return _call(q, k, bias, v, rowbias, None, is_causal, hard, dropout_p, seed, stats=False, scale=scale)[0]


def mixture_flash_with_responsibilities(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, v: torch.Tensor,
                                        rowbias: torch.Tensor | None, query_ok: torch.Tensor | None,
                                        is_causal: bool, dropout_p: float = 0.0,
                                        seed: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`mixture_flash` (mixture "sum") that also returns the Soft-E statistics from the same score GEMMs.

    Args: as :func:`mixture_flash`, plus query_ok (B, H, L) bool or None: True = a real query (the others add no
        responsibility). Masked keys must carry a -inf bias in every component.
    Returns:
        ``(out, resp)``: out as :func:`mixture_flash`; resp (B, H, M, S) without gradient: for each key j and
        component r the sum over the real queries i that see j of ``softmax_r(s_ijr)`` (as :func:`responsibilities`;
        the E-step of the paper's "+Soft-E" ablation).
    """
    return _call(q, k, bias, v, rowbias, query_ok, is_causal, False, dropout_p, seed, stats=True)


def _call(q, k, bias, v, rowbias, query_ok, is_causal, hard, dropout_p, seed, stats, scale=None):
    B, H, L, D = q.shape
    G, M, S = k.shape[1], bias.shape[2], k.shape[3]
    dropout_p = float(dropout_p)
    if dropout_p > 0.0 and seed is None:
        seed = draw_dropout_seed()
    seed, offset = seed if dropout_p > 0.0 else (0, 0)
    # q, k and v are read in place (the projections' layout); the small per-key and per-row terms are flattened.
    qf, kf, vf = _rows(q), _rows(k), _rows(v)
    bf = bias.expand(B, G, M, S).reshape(B * G, M, S).contiguous()
    rf = rowbias.expand(B, H, M, L).reshape(B * H, M, L).contiguous() if rowbias is not None else q.new_empty(0)
    sf = scale.expand(B, G, M).reshape(B * G, M).contiguous() if scale is not None else q.new_empty(0)
    okf = (query_ok.expand(B, H, L).reshape(B * H, L).contiguous() if query_ok is not None
           else q.new_empty(0, dtype=torch.bool))
    out, _, resp = _run_forward(qf, kf, bf, vf, rf, sf, okf, bool(is_causal), bool(hard), dropout_p, int(seed),
                                int(offset), bool(stats))
    return out, (resp.view(B, H, M, S) if stats else None)


def softmax_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, key_padding: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None, is_causal: bool = False, dropout_p: float = 0.0,
                  scale: float | None = None, seed: tuple[int, int] | None = None) -> torch.Tensor:
    """Softmax attention ``softmax(scale * q k^T + bias) v`` (Vaswani et al. 2017) through the kernel with one
    component, O(L + S) memory per head also with dropout (check :func:`usable` first).

    Args: q (B, H, L, D); k (B, H, S, D); v (B, H, S, Dv), one dtype, float32 or float64, on CPU; key_padding bool
        broadcastable to (B, H, 1, S), True = may attend (keys and values there must be finite: zero them first);
        bias a finite per-key bias broadcastable to (B, H, 1, S), or None; is_causal bottom-right; dropout_p in
        [0, 1); scale default 1 / sqrt(D); seed as :func:`mixture_flash`.
    Returns:
        (B, H, L, Dv); rows that see no key are 0.
    """
    B, H, L, D = q.shape
    S = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    key_bias = q.new_zeros(1, 1, 1, S) if bias is None else bias.to(q.dtype).expand(*bias.shape[:-1], S)
    if key_padding is not None:
        key_bias = torch.where(key_padding, key_bias, torch.full((), float("-inf"), dtype=q.dtype))
    key_bias = key_bias.reshape(*key_bias.shape[:-2], 1, S)  # (B?, H?, 1, S): the kernel's one component
    return mixture_flash(q, (k * scale).unsqueeze(2), key_bias.expand(B, H, 1, S), v, None, is_causal,
                         dropout_p=dropout_p, seed=seed)


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

