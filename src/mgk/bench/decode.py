"""``mgk bench decode``: cached decoding, per attention kind: time per generated token, prefill time and the bytes the
cache holds, at several context lengths and batch sizes, for one attention layer and for whole LM shapes.

A row prefills ``context`` tokens through the layer's or model's decoding cache (:mod:`mgk.attention.cache`), then
times single-token steps (the median of ``steps`` after :data:`WARMUP_STEPS` untimed ones: the first steps after a
prefill run slower): for a model a step is the new token's next-token log-probabilities (adaptive softmax
included) and its argmax, as one step of greedy generation. The cache's bytes are counted from the tensors it holds
for the tokens seen (``cache_bytes``; ``cache_bytes_allocated`` also counts the slots reserved ahead) and set beside
the registry's formula
(:meth:`mgk.attention.registry.CacheSpec.cache_bytes`, ``cache_bytes_formula``), which they must equal.

Targets: ``layer`` (one attention module of width ``--embed-dim`` with heads of ``--head-dim``, as ``mgk bench
attention``), a preset's LM shape (``lm-small``, ``wt103-paper``: the model ``mgk train`` builds, random weights,
WikiText-103's vocabulary; per-position mixture weights are given ``max_len`` = the longest position a row reaches),
or with ``--run RUN_DIR`` a trained model, beside softmax-8 of the run's sizes (random weights) as its baseline. Each
row runs in a fresh subprocess, as the other benchmarks.

Against a limit, as gpt-fast's "bandwidth achieved": the bench measures the machine's read bandwidth itself (a
streaming sum over a buffer much larger than the caches, :func:`read_bandwidth`), and each row reports ``t_min_ms``,
the time a step takes at that bandwidth reading the weights and the cache once (``weight_bytes`` + ``cache_bytes``),
and ``bandwidth_fraction`` = t_min / step time. ``rounds`` > 1 repeats every kind of a (target, batch, context) cell
in turn, round after round, and reports the median of the rounds with their min and max. The JSON records the load
average before and after and at each row's start, and the torch threads; a busy machine (1-minute load average
above :data:`BUSY_LOAD` before the first row) is warned about, since other work changes the ratios between kinds
(a busy machine turned a measured 0.71x into 1.03x).
"""
from __future__ import annotations

import os
import statistics
import time

import torch

from ..attention.registry import display_label, get_kind
from .attention import bench_options, build_kind, error_cell, machine, variant
from .model import bench_task, with_kind
from .rows import BUSY_LOAD, busy_warning, load_record, run_row  # noqa: F401 - BUSY_LOAD, busy_warning: its interface

DEFAULT_KINDS = "softmax:8,mgk:4,smgk:4,gqa+num_kv_heads=2:8,linear:8,mlk:4"
DEFAULT_TARGETS = ("layer", "lm-small", "wt103-paper")
WARMUP_STEPS = 8  # the first steps after a prefill run slower (measured: 3.4 ms settling to 2.2 over about 5)
BANDWIDTH_MB = 1024  # the streamed buffer: far above the CPU caches (and the layer caches measured here)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _layer_step(module, token, cache):
    return module(token, past_key_values=cache, is_causal=True, need_weights=False)[0]


def _layer(kind, heads, *, batch, context, steps, embed_dim, head_dim, device, compiled=False):
    """(step function, prefill function, cache, layer facts) of one attention layer; ``compiled``: the step through
    torch.compile over the cache fixed at its capacity (its first call compiles)."""
    capacity = context + steps + WARMUP_STEPS + 1  # the compiled row's first, compiling step included
    module = build_kind(kind, heads, embed_dim, head_dim, max_len=capacity).to(device).eval()
    cache = module.new_cache(capacity)
    B = batch
    prompt = torch.randn(B, context, embed_dim, device=device)
    token = torch.randn(B, 1, embed_dim, device=device)
    state = {"fn": None}

    def prefill():
        """The untimed prompt: ``context`` tokens into the empty cache."""
        module(prompt, past_key_values=cache, is_causal=True, need_weights=False)

    def step():
        """One timed token (compiled: the first call compiles, on a cache of fixed capacity)."""
        if not compiled:
            _layer_step(module, token, cache)
            return
        if state["fn"] is None:
            cache.fix_capacity(capacity)
            state["fn"] = torch.compile(_layer_step, fullgraph=True, dynamic=False)
        state["fn"](module, token, cache)
        cache.advance(1)

    v = variant(kind)
    facts = {"kind_name": v.kind, "options": bench_options(v, max_len=capacity),
             "heads": module.num_heads, "head_dim": module.head_dim, "layers": 1,
             "params": sum(p.numel() for p in module.parameters())}
    return step, prefill, cache, facts


def _model(model, cfg, *, batch, context, steps, device, compiled=False):
    """(step, prefill, cache, facts) of a TransformerLM ``model`` of run config ``cfg``; ``compiled``: the step of
    ``generate(..., compile=True)`` (:class:`mgk.models.compiled_decode.CompiledStep`; its first call compiles)."""
    from ..models.compiled_decode import CompiledStep

    model = model.to(device).eval()
    capacity = context + steps + WARMUP_STEPS + 1
    cache = model.new_cache(capacity)
    prompt = torch.randint(0, model.vocab_size, (batch, context), device=device)
    state = {"token": prompt[:, -1:], "fn": None}

    def prefill():
        """The untimed prompt into the empty cache; its greedy next token is the first step's input."""
        state["token"] = model.next_log_probs(prompt, past_key_values=cache).argmax(-1, keepdim=True)

    def step():
        """One timed greedy token through the model's cache (``generate``'s step, compiled or eager)."""
        if state["fn"] is None:
            state["fn"] = CompiledStep(model, cache, capacity) if compiled else \
                (lambda t: model.next_log_probs(t, past_key_values=cache))
        state["token"] = state["fn"](state["token"]).argmax(-1, keepdim=True)

    a = cfg.attention
    facts = {"kind_name": a.kind, "options": a.options, "heads": a.num_heads, "head_dim": model.blocks[0].attn.head_dim,
             "layers": len(model.blocks), "params": sum(p.numel() for p in model.parameters())}
    return step, prefill, cache, facts


def _preset_model(target, kind, heads, overrides, *, context, steps):
    """The model of LM preset ``target`` with bench kind ``kind`` (random weights) and its run config."""
    from ..tasks import all_presets

    if target not in all_presets():
        raise ValueError(f"unknown target {target!r}: 'layer', a preset (lm-small, wt103-paper) or --run")
    longest = context + steps + WARMUP_STEPS
    cfg = with_kind(all_presets()[target], kind, heads, overrides,
                    fixed=[(f"max_len={longest}", "--contexts and --steps (the longest position decoded)")])
    if cfg.task != "lm":
        raise ValueError(f"target {target!r} is a {cfg.task!r} preset: decoding needs a language model (lm-*, wt103-*)")
    torch.manual_seed(0)
    return bench_task(cfg).build_model(cfg), cfg


def _run_model(run_dir, kind, heads, *, context, steps):
    """The trained model of ``run_dir`` (kind None), or its sizes with bench kind ``kind`` and random weights (the
    baseline of ``--run``), and the run config."""
    from ..train.load import load_run

    if kind is None:
        run = load_run(run_dir, device="cpu")
        return run.model, run.cfg
    from ..train.rundir import load_config

    longest = context + steps + WARMUP_STEPS
    cfg = with_kind(load_config(run_dir), kind, heads, fixed=[(f"max_len={longest}", "--contexts and --steps")])
    torch.manual_seed(0)
    return bench_task(cfg).build_model(cfg), cfg


def check_run_positions(run_dir: str, contexts: list[int], steps: int) -> None:
    """ValueError, one line saying what to change, when the model of ``run_dir`` cannot decode the longest of
    ``contexts`` plus the :data:`WARMUP_STEPS` warm-up and ``steps`` timed steps: per-position mixture weights
    cover ``max_len`` positions only (:meth:`mgk.models.lm.TransformerLM.position_limit`). Checked once, before any
    row runs (each row failed on its own otherwise)."""
    from ..train.load import load_run

    limit = load_run(run_dir, device="cpu").model.position_limit()
    longest = max(contexts)
    need = longest + WARMUP_STEPS + steps  # positions read: the context, then one per warm-up and timed step
    if limit is None or need <= limit[1]:
        return
    option, max_len = limit
    room = max_len - WARMUP_STEPS - steps
    fix = (f"use --contexts of at most {room}" if room >= 1 else
           f"use --steps of at most {max_len - WARMUP_STEPS - 1} with --contexts 1" if max_len > WARMUP_STEPS + 1
           else f"the run's max_len leaves no room for the {WARMUP_STEPS} warm-up steps: measure a preset instead")
    raise ValueError(f"{run_dir} has mixture weights for max_len={max_len} positions ({option}), but --contexts "
                     f"{longest} plus {WARMUP_STEPS} warm-up and --steps {steps} timed steps read {need}: {fix}")


def _timed(fn, device, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1000)
    return times


def _bytes(cache, facts, batch: int, context: int) -> dict:
    spec = get_kind(facts["kind_name"]).cache
    per_layer = spec.cache_bytes(facts["options"], num_heads=facts["heads"], head_dim=facts["head_dim"],
                                 length=context, element_size=4)
    measured = cache.nbytes()
    allocated = sum(layer.allocated_bytes() for layer in cache) if hasattr(cache, "layers") \
        else cache.allocated_bytes()
    return {"cache_bytes": measured, "cache_bytes_formula": per_layer * batch * facts["layers"],
            "cache_bytes_per_token_layer": measured / (batch * context * facts["layers"]),
            "cache_bytes_allocated": allocated}


def _setup(target, kind, heads, context, *, batch, steps, device, embed_dim, head_dim, overrides, run_dir,
           compiled=False):
    """(step, prefill, cache, facts) of one row, room for ``steps`` timed steps (and the compiling one) after the
    warm-up."""
    torch.manual_seed(0)
    if target == "layer":
        return _layer(kind, heads, batch=batch, context=context, steps=steps, embed_dim=embed_dim,
                      head_dim=head_dim, device=device, compiled=compiled)
    if target == "run":
        model, cfg = _run_model(run_dir, kind, heads, context=context, steps=steps + 1)
    else:
        model, cfg = _preset_model(target, kind, heads, overrides or [], context=context, steps=steps + 1)
    return _model(model, cfg, batch=batch, context=context, steps=steps, device=device, compiled=compiled)


def _first_step_ms(step, device, compiled: bool) -> float | None:
    """A compiled row's first step, which compiles (reported as ``compile_ms``, never in a per-token figure)."""
    return _timed(step, device, 1)[0] if compiled else None


def _row(target, kind, facts, context, batch, prefill_ms, step_ms, sizes, device, compile_ms=None) -> dict:
    return {"target": target, "kind": kind or facts["kind_name"], "compiled": compile_ms is not None,
            "compile_ms": compile_ms,
            "label": display_label(facts["kind_name"], facts["heads"], facts["options"]), "heads": facts["heads"],
            "head_dim": facts["head_dim"], "layers": facts["layers"], "context": context, "batch": batch,
            "prefill_ms": prefill_ms, "step_ms": step_ms, "ms_per_token": step_ms / batch,
            "tokens_per_s": 1000.0 * batch / step_ms, **sizes, "params": facts["params"],
            "weight_bytes": facts["params"] * 4, "threads": torch.get_num_threads(), "device": device}


@torch.no_grad()
def measure(target: str, kind: str | None, heads: int | None, context: int, *, batch: int, steps: int, device: str,
            embed_dim: int = 256, head_dim: int = 32, overrides: list[str] | None = None,
            run_dir: str | None = None, compiled: bool = False) -> dict:
    """One row, in this process: prefill_ms, step_ms (median), ms_per_token, tokens_per_s and the cache's bytes
    (measured, by the registry's formula, per token and layer, allocated) for ``target`` ("layer", an LM preset, or
    "run" with ``run_dir``) with bench kind ``kind`` (``heads`` heads; None: the preset's or run's own);
    ``compiled``: the step through torch.compile, its first (compiling) step reported as ``compile_ms``."""
    dev = torch.device(device)
    step, prefill, cache, facts = _setup(target, kind, heads, context, batch=batch, steps=steps, device=dev,
                                         embed_dim=embed_dim, head_dim=head_dim, overrides=overrides,
                                         run_dir=run_dir, compiled=compiled)
    prefill_ms = _timed(prefill, dev, 1)[0]
    sizes = _bytes(cache, facts, batch, context)
    compile_ms = _first_step_ms(step, dev, compiled)
    _timed(step, dev, WARMUP_STEPS)
    step_ms = statistics.median(_timed(step, dev, steps))
    return _row(target, kind, facts, context, batch, prefill_ms, step_ms, sizes, device, compile_ms)


@torch.no_grad()
def measure_cell(target: str, kinds: list, context: int, *, batch: int, steps: int, rounds: int, device: str,
                 embed_dim: int = 256, head_dim: int = 32, overrides: list[str] | None = None,
                 run_dir: str | None = None) -> dict:
    """Every kind of one (target, batch, context) cell in this process (``--same-process``): each prefilled and
    warmed up, then ``rounds`` rounds in which every kind takes ``steps`` steps in turn; a row's step_ms is the median
    of its rounds' medians, with their min and max, and ``paired_ratio`` the median over rounds of its time over
    the first kind's in the same round. Sharing the process, its heap and its moment makes the kinds'
    ratios tighter than rows in separate processes (on a shared 2-core VM the process-to-process spread of one kind
    reached 10-15%). ``kinds``: [(kind, heads), ...], or (kind, heads, compiled) for a row through torch.compile.
    Returns ``{"rows": [...]}`` in the order of ``kinds``."""
    dev = torch.device(device)
    cells = []
    for kind, heads, *mode in kinds:
        compiled = bool(mode and mode[0])
        step, prefill, cache, facts = _setup(target, kind, heads, context, batch=batch, steps=steps * rounds,
                                             device=dev, embed_dim=embed_dim, head_dim=head_dim,
                                             overrides=overrides, run_dir=run_dir, compiled=compiled)
        prefill_ms = _timed(prefill, dev, 1)[0]
        sizes = _bytes(cache, facts, batch, context)
        compile_ms = _first_step_ms(step, dev, compiled)
        _timed(step, dev, WARMUP_STEPS)
        cells.append((kind, step, facts, prefill_ms, sizes, compile_ms, []))
    for _ in range(rounds):
        for cell in cells:
            cell[-1].append(statistics.median(_timed(cell[1], dev, steps)))
    rows = []
    for kind, _, facts, prefill_ms, sizes, compile_ms, medians in cells:
        row = _row(target, kind, facts, context, batch, prefill_ms, statistics.median(medians), sizes, device,
                   compile_ms)
        rows.append({**row, "step_ms_min": min(medians), "step_ms_max": max(medians), "rounds": rounds,
                     "round_ms": medians, "same_process": True})
    for row in rows:  # against the first kind round by round: a slow minute falls on both sides of each ratio
        row["paired_ratio"] = statistics.median(a / b for a, b in zip(row["round_ms"], rows[0]["round_ms"]))
    return {"rows": rows}


@torch.no_grad()
def read_bandwidth(device: str = "cpu", megabytes: int = BANDWIDTH_MB, repeats: int = 5) -> float:
    """The memory system's read bandwidth in GB/s (1e9 bytes) as this process sees it: the fastest of ``repeats``
    sums over a float32 buffer of ``megabytes`` MiB (after one untimed pass), on ``device`` with torch's threads."""
    dev = torch.device(device)
    buf = torch.ones(megabytes * 2**20 // 4, device=dev)
    buf.sum()
    _sync(dev)
    best = min(_timed(buf.sum, dev, repeats))
    return buf.numel() * 4 / (best / 1000) / 1e9


def _row_code(target, kind, heads, context, args) -> str:
    return ("import json; from mgk.bench.decode import measure; "
            f"print(json.dumps(measure({target!r}, {kind!r}, {heads!r}, {context}, **{args!r})))")


def _merge_rounds(rounds: list[dict]) -> dict:
    """One row from the rows of the same cell and kind over rounds: the median step and prefill, their spread."""
    good = [r for r in rounds if "error" not in r]
    if not good:
        return rounds[-1]
    steps = [r["step_ms"] for r in good]
    row = dict(good[0])
    step = statistics.median(steps)
    row.update(step_ms=step, ms_per_token=step / row["batch"], tokens_per_s=1000.0 * row["batch"] / step,
               prefill_ms=statistics.median(r["prefill_ms"] for r in good), step_ms_min=min(steps),
               step_ms_max=max(steps), rounds=len(good), load_1min=[r["load_1min"] for r in good])
    if len(good) < len(rounds):
        row["failed_rounds"] = len(rounds) - len(good)
    return row


def run(targets: list[str], kinds: list[tuple[str, int]], contexts: list[int], batches: list[int], *, steps: int,
        device: str, timeout: float, embed_dim: int = 256, head_dim: int = 32, overrides: list[str] | None = None,
        run_dir: str | None = None, rounds: int = 1, bandwidth: bool = True, same_process: bool = False,
        compile: bool = False) -> dict:
    """:func:`measure` for every (target, kind, batch, context), each in its own subprocess; with ``rounds`` > 1 the
    kinds of each (target, batch, context) run in turn, ``rounds`` times, and a row holds the median with its min
    and max (``step_ms_min``, ``step_ms_max``). A failed row holds ``error``. The target "run" measures ``run_dir``
    beside softmax-8 of its sizes (first, so that ``x first`` in the table is the run against softmax-8). Returns
    ``{"rows", "machine", "torch", "settings", "date", "load_average", "read_bandwidth_gb_s", "busy"}``. With
    ``same_process`` every cell runs in one subprocess (:func:`measure_cell`) and its kinds alternate there. With
    ``compile`` every kind has a second row, its step through torch.compile over a cache of fixed capacity (the
    step of ``generate(..., compile=True)``), with its compiling first step as ``compile_ms``."""
    load_before = os.getloadavg()
    bw = None
    if bandwidth:
        got = run_row(f"import json; from mgk.bench.decode import read_bandwidth; "
                      f"print(json.dumps({{'gb_s': read_bandwidth({device!r})}}))", timeout, rss=False)
        bw = got.get("gb_s")
    rows = {}  # measured cell by cell (kinds in turn), listed kind by kind as before: (target, kind, batch, context)
    for t, target in enumerate(targets):
        cell_kinds = [(kind, heads, compiled) for kind, heads in (kinds if target != "run" else
                                                                  [("softmax", 8), (None, None)])
                      for compiled in ((False, True) if compile else (False,))]
        for b, batch in enumerate(batches):
            for c, context in enumerate(contexts):
                args = dict(batch=batch, steps=steps, device=device, embed_dim=embed_dim, head_dim=head_dim,
                            overrides=overrides or [], run_dir=run_dir)
                if same_process:
                    load = os.getloadavg()[0]
                    code = ("import json; from mgk.bench.decode import measure_cell; "
                            f"print(json.dumps(measure_cell({target!r}, {cell_kinds!r}, {context}, rounds={rounds}, "
                            f"**{args!r})))")
                    got = run_row(code, timeout * len(cell_kinds), rss=False)
                    for i, (kind, heads, compiled) in enumerate(cell_kinds):
                        row = got["rows"][i] if "rows" in got else {
                            "target": target, "kind": kind or "run", "heads": heads, "context": context,
                            "batch": batch, "compiled": compiled, "error": got.get("error", "no rows")}
                        rows[t, i, b, c] = _limit({**row, "load_1min": [load]}, bw)
                    continue
                per_kind = {i: [] for i in range(len(cell_kinds))}
                for _ in range(rounds):
                    for i, (kind, heads, compiled) in enumerate(cell_kinds):
                        load = os.getloadavg()[0]
                        row = run_row(_row_code(target, kind, heads, context, {**args, "compiled": compiled}),
                                      timeout, rss=False)
                        if "error" in row:
                            row = {"target": target, "kind": kind or "run", "heads": heads, "context": context,
                                   "batch": batch, "compiled": compiled, **row}
                        per_kind[i].append({**row, "load_1min": load})
                for i in per_kind:
                    rows[t, i, b, c] = _limit(_merge_rounds(per_kind[i]), bw)
    load_after = os.getloadavg()
    return {"rows": [rows[k] for k in sorted(rows)], "machine": machine(), "torch": torch.__version__,
            "settings": {"targets": targets, "contexts": contexts, "batches": batches, "steps": steps,
                         "device": device, "embed_dim": embed_dim, "head_dim": head_dim, "rounds": rounds,
                         "overrides": overrides or [], "run_dir": run_dir, "dtype": "float32",
                         "same_process": same_process, "compile": compile},
            "date": time.strftime("%Y-%m-%d"), **load_record(load_before, load_after), "read_bandwidth_gb_s": bw}


def _limit(row: dict, bandwidth_gb_s: float | None) -> dict:
    """``t_min_ms`` (weights and cache read once at the measured bandwidth) and ``bandwidth_fraction`` of a row."""
    if "error" in row or not bandwidth_gb_s:
        return row
    t_min = (row["weight_bytes"] + row["cache_bytes"]) / (bandwidth_gb_s * 1e9) * 1000
    return {**row, "t_min_ms": t_min, "bandwidth_fraction": t_min / row["step_ms"]}


def table(result: dict) -> str:
    """Markdown table of a :func:`run` result; ``x first`` compares with the first kind of the same target, batch
    and context (with ``--same-process`` the median of the per-round ratios, ``paired_ratio``); ms/step shows the
    rounds' min-max when there were several; t_min/t is ``bandwidth_fraction``. A compiled row's kind reads
    "KIND, compiled (N s)", N its first step's time, the compilation (not in any per-token figure)."""
    lines = ["| target | kind | heads | batch | context | prefill ms | ms/step | x first | cache MB "
             "| bytes/token/layer | x first | t_min/t |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    first = {}
    for row in result["rows"]:
        kind = row["kind"]
        if row.get("compiled"):
            kind += f", compiled ({row['compile_ms'] / 1000:.1f} s)" if row.get("compile_ms") else ", compiled"
        head = f"| {row['target']} | {kind} | {row.get('heads') or ''} | {row['batch']} | {row['context']} |"
        if "error" in row:
            lines.append(f"{head} error: {error_cell(row['error'])} | | | | | | |")
            continue
        base = first.setdefault((row["target"], row["batch"], row["context"]), row)
        spread = f" ({row['step_ms_min']:.2f}-{row['step_ms_max']:.2f})" if row.get("rounds", 1) > 1 else ""
        frac = f"{row['bandwidth_fraction']:.2f}" if "bandwidth_fraction" in row else ""
        ratio = row.get("paired_ratio", row["step_ms"] / base["step_ms"])
        lines.append(f"{head} {row['prefill_ms']:.1f} | {row['step_ms']:.2f}{spread} | "
                     f"{ratio:.2f} | {row['cache_bytes'] / 2**20:.2f} | "
                     f"{row['cache_bytes_per_token_layer']:.0f} | {row['cache_bytes'] / base['cache_bytes']:.3f} | "
                     f"{frac} |")
    return "\n".join(lines)
