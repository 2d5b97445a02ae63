"""``mgk bench decode``: cached decoding, per attention kind: time per generated token, prefill time and the bytes the
cache holds, at several context lengths and batch sizes, for one attention layer and for whole LM shapes.

A row prefills ``context`` tokens through the layer's or model's decoding cache (:mod:`mgk.attention.cache`), then
times single-token steps (the median of ``steps`` after :data:`WARMUP_STEPS` untimed ones: the first steps after a
prefill run slower): for a model a step is the new token's next-token log-probabilities (adaptive softmax
included) and its argmax, as one step of greedy generation. The cache's bytes are counted from the tensors it holds
for the tokens seen (``cache_bytes``; ``cache_bytes_allocated`` also counts the slots reserved ahead) and set beside
the registry's formula
(:meth:`mgk.attention.cache_spec.CacheSpec.cache_bytes`, ``cache_bytes_formula``), which they must equal.

Targets: ``layer`` (one attention module of width ``--embed-dim`` with heads of ``--head-dim``, as ``mgk bench
attention``), a preset's LM shape (``lm-small``, ``wt103-paper``: the model ``mgk train`` builds, random weights,
WikiText-103's vocabulary; per-position mixture weights are given ``max_len`` = the longest position a row reaches),
or with ``--run RUN_DIR`` a trained model. Each row runs in a fresh subprocess, as the other benchmarks.
"""
from __future__ import annotations

import statistics
import time

import torch

from ..attention.registry import display_label, get_kind
from .attention import bench_options, build_kind, error_cell, machine, variant
from .model import bench_task, kind_overrides, run_row

DEFAULT_KINDS = "softmax:8,mgk:4,smgk:4,linear:8,mlk:4"
DEFAULT_TARGETS = ("layer", "lm-small", "wt103-paper")
WARMUP_STEPS = 8  # the first steps after a prefill run slower (measured: 3.4 ms settling to 2.2 over about 5)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _layer(kind, heads, *, batch, context, steps, embed_dim, head_dim, device):
    """(step function, prefill function, cache, layer facts) of one attention layer."""
    module = build_kind(kind, heads, embed_dim, head_dim, max_len=context + steps + WARMUP_STEPS).to(device).eval()
    cache = module.new_cache(context + steps + WARMUP_STEPS)
    B = batch
    prompt = torch.randn(B, context, embed_dim, device=device)
    token = torch.randn(B, 1, embed_dim, device=device)

    def prefill():
        module(prompt, past_key_values=cache, is_causal=True, need_weights=False)

    def step():
        module(token, past_key_values=cache, is_causal=True, need_weights=False)

    v = variant(kind)
    facts = {"kind_name": v.kind, "options": bench_options(v, max_len=context + steps + WARMUP_STEPS),
             "heads": module.num_heads, "head_dim": module.head_dim, "layers": 1,
             "params": sum(p.numel() for p in module.parameters())}
    return step, prefill, cache, facts


def _model(model, cfg, *, batch, context, device):
    """(step, prefill, cache, facts) of a TransformerLM ``model`` of run config ``cfg``."""
    model = model.to(device).eval()
    cache = model.new_cache(context + 64)
    prompt = torch.randint(0, model.vocab_size, (batch, context), device=device)
    state = {"token": prompt[:, -1:]}

    def prefill():
        state["token"] = model.next_log_probs(prompt, past_key_values=cache).argmax(-1, keepdim=True)

    def step():
        state["token"] = model.next_log_probs(state["token"], past_key_values=cache).argmax(-1, keepdim=True)

    a = cfg.attention
    facts = {"kind_name": a.kind, "options": a.options, "heads": a.num_heads, "head_dim": model.blocks[0].attn.head_dim,
             "layers": len(model.blocks), "params": sum(p.numel() for p in model.parameters())}
    return step, prefill, cache, facts


def _preset_model(target, kind, heads, overrides, *, context, steps):
    """The model of LM preset ``target`` with bench kind ``kind`` (random weights) and its run config."""
    from ..config import apply_overrides
    from ..tasks import all_presets

    if target not in all_presets():
        raise ValueError(f"unknown target {target!r}: 'layer', a preset (lm-small, wt103-paper) or --run")
    longest = context + steps + WARMUP_STEPS
    cfg = apply_overrides(all_presets()[target], [*kind_overrides(kind, heads), f"max_len={longest}", *overrides])
    if cfg.task != "lm":
        raise ValueError(f"target {target!r} is a {cfg.task!r} preset: decoding needs a language model (lm-*, wt103-*)")
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


@torch.no_grad()
def measure(target: str, kind: str | None, heads: int | None, context: int, *, batch: int, steps: int, device: str,
            embed_dim: int = 256, head_dim: int = 32, overrides: list[str] | None = None,
            run_dir: str | None = None) -> dict:
    """One row, in this process: prefill_ms, step_ms (median), ms_per_token, tokens_per_s and the cache's bytes
    (measured, by the registry's formula, per token and layer, allocated) for ``target`` ("layer", an LM preset, or
    "run" with ``run_dir``) with bench kind ``kind`` (``heads`` heads; None: the preset's or run's own)."""
    torch.manual_seed(0)
    dev = torch.device(device)
    if target == "layer":
        step, prefill, cache, facts = _layer(kind, heads, batch=batch, context=context, steps=steps,
                                             embed_dim=embed_dim, head_dim=head_dim, device=dev)
    else:
        if target == "run":
            from ..train.load import load_run

            run = load_run(run_dir, device=device)
            model, cfg = run.model, run.cfg
        else:
            model, cfg = _preset_model(target, kind, heads, overrides or [], context=context, steps=steps)
        step, prefill, cache, facts = _model(model, cfg, batch=batch, context=context, device=dev)
    prefill_ms = _timed(prefill, dev, 1)[0]
    sizes = _bytes(cache, facts, batch, context)
    _timed(step, dev, WARMUP_STEPS)
    step_ms = statistics.median(_timed(step, dev, steps))
    return {"target": target, "kind": kind or facts["kind_name"],
            "label": display_label(facts["kind_name"], facts["heads"], facts["options"]), "heads": facts["heads"],
            "head_dim": facts["head_dim"], "layers": facts["layers"], "context": context, "batch": batch,
            "prefill_ms": prefill_ms, "step_ms": step_ms, "ms_per_token": step_ms / batch,
            "tokens_per_s": 1000.0 * batch / step_ms, **sizes, "params": facts["params"], "device": device}


def run(targets: list[str], kinds: list[tuple[str, int]], contexts: list[int], batches: list[int], *, steps: int,
        device: str, timeout: float, embed_dim: int = 256, head_dim: int = 32, overrides: list[str] | None = None,
        run_dir: str | None = None) -> dict:
    """:func:`measure` for every (target, kind, batch, context), each in its own subprocess; a failed row holds
    ``error``. Returns ``{"rows", "machine", "torch", "settings", "date"}``."""
    rows = []
    for target in targets:
        for kind, heads in (kinds if target != "run" else [(None, None)]):
            for batch in batches:
                for context in contexts:
                    args = dict(batch=batch, steps=steps, device=device, embed_dim=embed_dim, head_dim=head_dim,
                                overrides=overrides or [], run_dir=run_dir)
                    code = ("import json; from mgk.bench.decode import measure; "
                            f"print(json.dumps(measure({target!r}, {kind!r}, {heads!r}, {context}, **{args!r})))")
                    row = run_row(code, timeout, rss=False)  # times and tensor bytes: no RSS to follow
                    if "error" in row:
                        row = {"target": target, "kind": kind or "run", "heads": heads, "context": context,
                               "batch": batch, **row}
                    rows.append(row)
    return {"rows": rows, "machine": machine(), "torch": torch.__version__,
            "settings": {"targets": targets, "contexts": contexts, "batches": batches, "steps": steps,
                         "device": device, "embed_dim": embed_dim, "head_dim": head_dim,
                         "overrides": overrides or [], "run_dir": run_dir, "dtype": "float32"},
            "date": time.strftime("%Y-%m-%d")}


def table(result: dict) -> str:
    """Markdown table of a :func:`run` result; ``x first`` compares with the first kind of the same target, batch
    and context."""
    lines = ["| target | kind | heads | batch | context | prefill ms | ms/step | x first | cache MB "
             "| bytes/token/layer | x first |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    first = {}
    for row in result["rows"]:
        head = f"| {row['target']} | {row['kind']} | {row.get('heads') or ''} | {row['batch']} | {row['context']} |"
        if "error" in row:
            lines.append(f"{head} error: {error_cell(row['error'])} | | | | | |")
            continue
        base = first.setdefault((row["target"], row["batch"], row["context"]), row)
        lines.append(f"{head} {row['prefill_ms']:.1f} | {row['step_ms']:.2f} | {row['step_ms'] / base['step_ms']:.2f} "
                     f"| {row['cache_bytes'] / 2**20:.2f} | {row['cache_bytes_per_token_layer']:.0f} | "
                     f"{row['cache_bytes'] / base['cache_bytes']:.3f} |")
    return "\n".join(lines)
