"""``mgk bench attention``: time, peak memory, FLOPs and parameters of attention modules at several lengths.

Each (kind, length) is timed in a fresh subprocess under the allocator's defaults, and its peak memory measured in
a second one, so that it is that of one call: on CPU the increase of the process's peak resident set size
(``ru_maxrss``) over the call, with glibc told to serve blocks over 64 KiB from mmap so that freed memory leaves the
resident set (which costs every large allocation page faults: timed that way, one layer call was 17% slower and
MGK-4's ratio to softmax-8 moved from 0.91 to 0.99); on CUDA ``torch.cuda.max_memory_allocated``.
Time is the median over ``repeats`` calls after one warm-up call; with ``--backward`` the module is in training mode
(so Soft-E's E-step is included). With ``--same-process`` the kinds of one length share one subprocess and take
turns, ``repeats`` calls each per round for ``--rounds`` rounds: a row's time is the median of its round medians and
``paired_ratio`` the median over rounds of its time over the first kind's in the same round (a slow moment falls
on both sides of a ratio; calls of a few milliseconds in separate processes moved one kind by up to 40% on the
2-core VM). Peak memory is not measured then (one process holds every kind). The 1-minute load average before
the run is recorded, and a busy machine is warned about, as in ``mgk bench decode``.

Kinds are ``name:heads``. A name is a registered attention kind (:func:`mgk.attention_kinds`), the same
with options ``kind+option=value+...`` (e.g. ``mgk+pi=hard_e``), or a bench variant (:data:`VARIANTS`): ``mgk-hard``
(pi="hard_e"), ``mgk-softe`` (pi="soft_e"), ``mgk-sdpa`` (mgk with ``backend="sdpa"``: the bias folded into an
extra head dimension and SDPA's flash kernel per component) and ``reference``: the formulation of the authors' code,
which builds one N x N squared-distance matrix per component and exponentiates it (kept as the baseline the fast
paths must beat). Labels, FLOP counts and options come from the registry (:mod:`mgk.attention.registry`).
"""
from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from ..attention import MGKAttention, attention_kinds, get_kind
from ..attention.registry import display_label
from ..choices import did_you_mean
from ..functional import select_backend
from .rows import load_record, run_row


class ReferenceMGK(MGKAttention):
    """MGK computed as in the authors' code: per component, |q - k_r|^2 as an explicit (L, S) matrix, then
    ``pi_r * exp(-d / (2 sigma^2))`` summed over r and normalised. Same parameters as MGKAttention; no masks."""

    def _core(self, q, k, v, mask, is_causal, need_weights, query_mask):
        log_pi = self.mixture_log_weights(k.shape[3])
        kernel = 0.0
        for r in range(k.shape[2]):
            kr = k[:, :, r]
            d2 = (q * q).sum(-1, keepdim=True) + (kr * kr).sum(-1).unsqueeze(-2) - 2.0 * q @ kr.transpose(-1, -2)
            kernel = kernel + log_pi[:, :, r].exp().unsqueeze(-2) * torch.exp(-d2 / (2.0 * self.sigma2[r]))
        if is_causal:
            L, S = kernel.shape[-2:]
            kernel = kernel * torch.ones(L, S, dtype=torch.bool, device=q.device).tril(S - L)
        weights = kernel / kernel.sum(-1, keepdim=True)
        return weights @ v, None


@dataclass(frozen=True)
class BenchVariant:
    """A benchmarked module: registered attention ``kind`` with ``options``, and optionally ``backend`` pinned on the
    module (mgk_attention's) or the authors' ``reference`` formulation (:class:`ReferenceMGK`: M distance matrices
    summed before one value product, counted as such)."""

    kind: str
    options: dict = field(default_factory=dict)
    backend: str | None = None
    reference: bool = False

    @property
    def attention_only(self) -> bool:
        """Whether it exists only as a module here (a pinned backend or the reference form), not in a model."""
        return self.backend is not None or self.reference


VARIANTS = {"mgk-hard": BenchVariant("mgk", {"pi": "hard_e"}), "mgk-softe": BenchVariant("mgk", {"pi": "soft_e"}),
            "mgk-sdpa": BenchVariant("mgk", backend="sdpa"), "reference": BenchVariant("mgk", reference=True)}


def variant(name: str) -> BenchVariant:
    """The variant benchmarked as ``name``: a :data:`VARIANTS` name, a registered kind, or ``kind+option=value+...``.
    ValueError naming an unknown kind, an option the kind does not take or given twice, or a bad value."""
    if name in VARIANTS:
        return VARIANTS[name]
    kind, *pairs = name.split("+")
    try:
        spec = get_kind(kind)
    except ValueError:
        close = did_you_mean(kind, [*attention_kinds(), *VARIANTS])
        raise ValueError(f"unknown kind {kind!r}{close}; choose a registered kind ({', '.join(attention_kinds())}), "
                         f"one with options (mgk+pi=hard_e) or a variant ({', '.join(VARIANTS)})") from None
    options = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep:
            raise ValueError(f"{name!r}: expected option=value after '+', got {pair!r}")
        if key in options:
            raise ValueError(f"{name!r}: option {key!r} is given twice; give it once")
        options[key] = spec.parse_option(key, text)
    spec.make_options(**options)
    return BenchVariant(kind, options)


def bench_options(v: BenchVariant, *, max_len: int | None = None, num_keys: int | None = None):
    """The registry options of ``v`` (with ``max_len`` and ``num_keys`` where the kind takes them)."""
    spec = get_kind(v.kind)
    extra = {k: x for k, x in (("max_len", max_len), ("num_keys", num_keys))
             if x is not None and k in spec.options.names()}
    return spec.make_options(**{**extra, **v.options})


def build_kind(kind: str, heads: int, embed_dim: int, head_dim: int, max_len: int) -> nn.Module:
    """The module benchmarked as ``kind`` with ``heads`` heads. Raises ValueError for an unknown kind."""
    v = variant(kind)
    options = bench_options(v, max_len=max_len)
    if v.reference:
        return ReferenceMGK(embed_dim, heads, head_dim=head_dim, batch_first=True, **options.as_kwargs())
    module = get_kind(v.kind).build(embed_dim, heads, options, head_dim=head_dim)
    if v.backend is not None:
        module.backend = v.backend
    return module


def label(kind: str, heads: int) -> str:
    """The row's name in reports: the registry's label of the variant's kind and options, and its pinned backend or
    reference form."""
    v = variant(kind)
    text = display_label(v.kind, heads, bench_options(v))
    return text + (f" [backend {v.backend}]" if v.backend else "") + (" [authors' form]" if v.reference else "")


def analytic_flops(kind: str, heads: int, length: int, batch: int, embed_dim: int, head_dim: int, *,
                   causal: bool, backward: bool, num_keys: int = 2, mixture_kernel: bool = False) -> int:
    """FLOPs of one call of the module benchmarked as ``kind``: the registry's formula of its kind
    (:func:`mgk.attention.registry.total`) with its options. ``mixture_kernel``: the call runs our MGK CPU kernel (the
    reference form always counts as summed before the value product; a pinned SDPA backend never does)."""
    v = variant(kind)
    options = bench_options(v, num_keys=num_keys)
    summed = (mixture_kernel or v.reference) and v.backend != "sdpa"
    return get_kind(v.kind).flops(options, heads=heads, length=length, batch=batch, embed_dim=embed_dim,
                                  head_dim=head_dim, causal=causal, backward=backward, mixture_kernel=summed)


def _counted_flops(module, x, causal, backward) -> int | None:
    """FLOPs that torch's FlopCounterMode sees (it counts matmuls and SDPA kernels it knows; None if it fails)."""
    try:
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            out, _ = module(x, need_weights=False, is_causal=causal)
            if backward:
                out.sum().backward()
        return int(counter.get_total_flops())
    except Exception:  # noqa: BLE001 - a counter failure must not stop the benchmark
        return None


def measure(kind: str, heads: int, length: int, *, batch: int, embed_dim: int, head_dim: int, causal: bool,
            backward: bool, dtype: str, repeats: int, device: str, peak_memory: bool = True) -> dict:
    """One row: time_ms (median), peak_mem_mb (None unless ``peak_memory``), flops (analytic), flops_counted,
    params, mgk_path. Runs in this process. :func:`run` times a row and measures its memory in two processes: on
    CPU the memory needs glibc's mmap threshold lowered, which costs every large allocation page faults and slowed
    one layer call by 17% (MGK-4 more than softmax-8: 0.91x became 0.99x), so time is measured under the
    allocator's defaults, as a user's process runs."""
    return _measure(kind, heads, length, batch=batch, embed_dim=embed_dim, head_dim=head_dim, causal=causal,
                    backward=backward, dtype=dtype, repeats=repeats, device=device, peak_memory=peak_memory)


def measure_peak_memory(kind: str, heads: int, length: int, *, batch: int, embed_dim: int, head_dim: int,
                        causal: bool, backward: bool, dtype: str, device: str, **_unused) -> dict:
    """``{"peak_mem_mb": ...}`` of one call (after a warm-up call at 8 tokens), in this process: on CUDA the growth
    of ``max_memory_allocated``; on CPU the growth of the peak resident set, which follows live memory only when
    glibc serves large blocks from mmap (``MALLOC_MMAP_THRESHOLD_=65536``, as :func:`run` starts it)."""
    return {"peak_mem_mb": _measure(kind, heads, length, batch=batch, embed_dim=embed_dim, head_dim=head_dim,
                                    causal=causal, backward=backward, dtype=dtype, repeats=0, device=device,
                                    peak_memory=True, row=False)}


def mgk_path(module: nn.Module, batch: int, device, dtype) -> str | None:
    """The MGK backend ``module`` runs (None: not an MGK module), from :func:`mgk.functional.select_backend` on
    inputs of its shapes (the choice depends on device, dtype, options and masks, not on the length)."""
    if not isinstance(module, MGKAttention) or isinstance(module, ReferenceMGK):
        return None
    if module.backend is not None:
        return module.backend
    H, D, M = module.num_heads, module.head_dim, module.num_keys
    q = torch.zeros(batch, H, 1, D, device=device, dtype=dtype)
    k = torch.zeros(batch, H, M, 1, D, device=device, dtype=dtype)
    mixture = "max" if module.pi_mode == "hard_e" else "sum"
    return select_backend(q, k, q, mixture=mixture, sigma2=module.sigma2,
                          dropout_p=module.attn_dropout if module.training else 0.0)


def _setup(kind, heads, length, *, batch, embed_dim, head_dim, backward, dtype, device, causal):
    """(module, input, call, backend path) of one row; ``call(inputs)`` runs one timed unit (forward, or forward and
    backward of ``out.sum()``) and waits for CUDA."""
    torch.manual_seed(0)
    dev = torch.device(device)
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    module = build_kind(kind, heads, embed_dim, head_dim, length).to(dev, dt)
    module.train(backward)
    path = mgk_path(module, batch, dev, dt)
    x = torch.randn(batch, length, embed_dim, device=dev, dtype=dt, requires_grad=backward)

    def call(inputs=x):
        """One forward of the module on ``inputs`` (and a backward of ``out.sum()`` when ``backward``); waits for
        CUDA so that timings cover the work."""
        if backward:
            out, _ = module(inputs, need_weights=False, is_causal=causal)
            out.sum().backward()
        else:
            with torch.no_grad():
                module(inputs, need_weights=False, is_causal=causal)
        if dev.type == "cuda":
            torch.cuda.synchronize()

    return module, x, call, path


def _row(kind, heads, length, *, batch, embed_dim, head_dim, causal, backward, dtype, module, x, path,
         time_ms, peak_mem_mb) -> dict:
    """The JSON row of one (kind, length): the measured time and memory with the analytic and counted FLOPs, the
    MGK backend and the parameter count of ``module``."""
    return {"kind": kind, "label": label(kind, heads), "heads": heads, "length": length, "batch": batch,
            "causal": causal, "backward": backward, "dtype": dtype, "time_ms": time_ms, "peak_mem_mb": peak_mem_mb,
            "flops": analytic_flops(kind, heads, length, batch, embed_dim, head_dim, causal=causal,
                                    backward=backward, mixture_kernel=path == "kernel"),
            "mgk_path": path,
            "flops_counted": _counted_flops(module, x, causal, backward) if length <= 1024 else None,
            "params": sum(p.numel() for p in module.parameters())}


def _timed(call, repeats: int) -> list[float]:
    """Milliseconds of each of ``repeats`` calls of ``call``."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1000)
    return times


def _measure(kind, heads, length, *, batch, embed_dim, head_dim, causal, backward, dtype, repeats, device,
             peak_memory, row=True):
    """The row of :func:`measure` (or with ``row=False`` only the peak memory in MB)."""
    import resource

    sizes = dict(batch=batch, embed_dim=embed_dim, head_dim=head_dim, backward=backward, dtype=dtype, causal=causal)
    module, x, call, path = _setup(kind, heads, length, device=device, **sizes)
    dev = x.device
    dt = x.dtype

    # One tiny call first: the first call of a custom op or kernel imports modules and fills caches (tens of MB of
    # resident memory once per process), which is not the call's memory.
    call(torch.randn(batch, 8, embed_dim, device=dev, dtype=dt, requires_grad=backward))
    module.zero_grad(set_to_none=True)
    peak = None
    if not peak_memory:
        call()  # the warm-up the memory call is otherwise
    elif dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        call()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        call()
        peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # KiB -> MiB
    if not row:
        return peak
    time_ms = statistics.median(_timed(call, repeats))
    return _row(kind, heads, length, **sizes, module=module, x=x, path=path, time_ms=time_ms, peak_mem_mb=peak)


def measure_together(kinds: list[tuple[str, int]], length: int, *, batch: int, embed_dim: int, head_dim: int,
                     causal: bool, backward: bool, dtype: str, repeats: int, rounds: int, device: str) -> dict:
    """Every kind at one length in this process (``--same-process``): each built and warmed up (three calls), then
    ``rounds`` rounds in which every kind makes ``repeats`` timed calls in turn. A row's ``time_ms`` is the median of
    its round medians (``round_ms``, with ``time_ms_min`` / ``time_ms_max``) and ``paired_ratio`` the median over
    rounds of its round median over the first kind's; ``peak_mem_mb`` is None (one process holds every kind).
    Returns ``{"rows": [...]}`` in the order of ``kinds``."""
    sizes = dict(batch=batch, embed_dim=embed_dim, head_dim=head_dim, backward=backward, dtype=dtype, causal=causal)
    cells = []
    for kind, heads in kinds:
        module, x, call, path = _setup(kind, heads, length, device=device, **sizes)
        _timed(call, 3)
        cells.append((kind, heads, module, x, call, path, []))
    for _ in range(rounds):
        for *_, call, _path, medians in cells:
            medians.append(statistics.median(_timed(call, repeats)))
    rows = []
    for kind, heads, module, x, _call, path, medians in cells:
        row = _row(kind, heads, length, **sizes, module=module, x=x, path=path, time_ms=statistics.median(medians),
                   peak_mem_mb=None)
        rows.append({**row, "round_ms": medians, "time_ms_min": min(medians), "time_ms_max": max(medians),
                     "rounds": rounds, "same_process": True})
    for row in rows:  # against the first kind round by round
        row["paired_ratio"] = statistics.median(a / b for a, b in zip(row["round_ms"], rows[0]["round_ms"]))
    return {"rows": rows}


def run(kinds: list[tuple[str, int]], lengths: list[int], *, batch: int, embed_dim: int, head_dim: int,
        causal: bool, backward: bool, dtype: str, repeats: int, device: str, timeout: float,
        same_process: bool = False, rounds: int = 1) -> dict:
    """Measure every (kind, length) in its own subprocess, or with ``same_process`` the kinds of each length
    together in one (:func:`measure_together`, ``rounds`` rounds); a failure (e.g. out of memory) becomes a row with
    ``error`` instead of stopping the table. The result records the 1-minute load average before and after and
    whether the machine was busy (:data:`mgk.bench.rows.BUSY_LOAD`)."""
    load_before = os.getloadavg()
    rows = []
    args = dict(batch=batch, embed_dim=embed_dim, head_dim=head_dim, causal=causal, backward=backward,
                dtype=dtype, repeats=repeats, device=device)
    for length in lengths:
        if same_process:
            code = ("import json; from mgk.bench.attention import measure_together; "
                    f"print(json.dumps(measure_together({kinds!r}, {length}, rounds={rounds}, **{args!r})))")
            got = run_row(code, timeout * len(kinds), rss=False)
            rows.extend(got["rows"] if "rows" in got else
                        [{"kind": kind, "heads": heads, "length": length, "error": got["error"]}
                         for kind, heads in kinds])
            continue
        for kind, heads in kinds:
            # time under the allocator's defaults, then the peak memory in a second process that needs mmap'd
            # large blocks (:func:`measure`)
            call = f"{kind!r}, {heads}, {length}, **{args!r}"
            got = run_row(f"import json; from mgk.bench.attention import measure; "
                          f"print(json.dumps(measure({call}, peak_memory=False)))", timeout, rss=False)
            if "error" not in got:
                memory = run_row(f"import json; from mgk.bench.attention import measure_peak_memory; "
                                 f"print(json.dumps(measure_peak_memory({call})))", timeout, rss=True)
                got = {**got, **memory}
            rows.append(got if "error" not in got else {"kind": kind, "heads": heads, "length": length, **got})
    load_after = os.getloadavg()
    return {"rows": rows, "machine": machine(), "torch": torch.__version__,
            "settings": {"batch": batch, "embed_dim": embed_dim, "head_dim": head_dim, "causal": causal,
                         "backward": backward, "dtype": dtype, "repeats": repeats, "device": device,
                         "same_process": same_process, "rounds": rounds if same_process else 1},
            "date": time.strftime("%Y-%m-%d"), **load_record(load_before, load_after)}


def error_cell(message: str) -> str:
    """A row's error as one Markdown table cell, whole (a cut message loses the part that says what to change):
    on one line, its ``|`` escaped."""
    return " ".join(str(message).split()).replace("|", "\\|")


def machine() -> str:
    """A one-line description of the machine (processor, cores, torch threads, GPU if any)."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores, " \
           f"torch threads {torch.get_num_threads()}, {gpu}".replace("  ", " ")


def table(result: dict) -> str:
    """Markdown table of a :func:`run` result, with time and memory relative to the first kind at each length."""
    together = result.get("settings", {}).get("same_process", False)
    lines = ["| kind | heads | length | time ms | x first | peak MB | x first | GFLOPs | params |",
             "|---|---|---|---|---|---|---|---|---|"]
    if together:  # rounds in one process: the spread of the round medians, the paired ratio, no memory
        lines = ["| kind | heads | length | time ms (min-max over rounds) | x first (paired) | GFLOPs | params |",
                 "|---|---|---|---|---|---|---|"]
    first = {}
    for row in result["rows"]:
        if "error" in row:
            lines.append(f"| {row['kind']} | {row['heads']} | {row['length']} | error: {error_cell(row['error'])} "
                         + ("| | | |" if together else "| | | | | |"))
            continue
        base = first.setdefault(row["length"], row)
        if together:
            lines.append(f"| {row['kind']} | {row['heads']} | {row['length']} | {row['time_ms']:.2f} "
                         f"({row['time_ms_min']:.2f}-{row['time_ms_max']:.2f}) | {row['paired_ratio']:.2f} | "
                         f"{row['flops'] / 1e9:.2f} | {row['params']:,} |")
            continue
        rel_t = row["time_ms"] / base["time_ms"]
        # a first row that allocated nothing measurable has no ratio (a dash, not nan)
        rel_m = f"{row['peak_mem_mb'] / base['peak_mem_mb']:.2f}" if base["peak_mem_mb"] > 0 else "—"
        lines.append(f"| {row['kind']} | {row['heads']} | {row['length']} | {row['time_ms']:.1f} | {rel_t:.2f} | "
                     f"{row['peak_mem_mb']:.0f} | {rel_m} | {row['flops'] / 1e9:.2f} | {row['params']:,} |")
    return "\n".join(lines)
