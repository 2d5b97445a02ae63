"""``mgk analyze --prune``: head (and mixture-component) importance, pruning curves, the one-unit ablation table and
a random-order baseline of trained runs (:mod:`mgk.analyze.prune`), written as prune.json, prune.md and figures.

The importance is measured on the validation split and the metric on the test split (validation when the data has
no test split), so the order of pruning is not chosen on the examples it is scored on.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from ..atomic import write_text_atomic
from . import plots, prune
from .report import write_json

__all__ = ["prune_run", "prune_dirs"]

GROUPED_NOTE = ("Grouped mixture keys (gMGK): a component belongs to a key group `g` shared by H / G query heads; "
                "gating it off removes it from every head of the group, so its importance is summed over the "
                "group's heads (the last component of a group takes the summed importance of the group's heads, "
                "since removing it removes the group). Heads are query heads.")


def _splits(run, settings) -> tuple:
    splits = run.task.splits
    if splits.get("val") is None:
        raise ValueError(f"{run.run_dir}: the run's data has no validation split to measure importance on")
    ev_name = "test" if splits.get("test") is not None else "val"
    imp, ev = splits["val"], splits[ev_name]
    n_imp = len(imp) if not settings.importance_examples else min(settings.importance_examples, len(imp))
    n_ev = len(ev) if not settings.eval_examples else min(settings.eval_examples, len(ev))
    return (imp, torch.arange(n_imp), ev, torch.arange(n_ev)), ev_name


def prune_run(run, settings: prune.PruneSettings) -> dict:
    """Pruning analysis of a loaded run (:func:`mgk.analyze.run.load_for_analysis`): for heads, and for mixture
    components where the attention has them, the initial importance per layer (normalised by its L2 norm), the
    pruning curve by importance, ``settings.random_orders`` random-order curves and the one-unit ablation."""
    model, task = run.model, run.task
    layers = prune.attention_layers(model)
    if not layers:
        raise ValueError(f"{run.run_dir}: the model has no attention layer to prune")
    data, ev_name = _splits(run, settings)
    metric, higher = prune.metric_of_task(task)
    out = {"run_dir": str(run.run_dir), "task": task.name, "attention": run.cfg.attention.kind,
           "num_heads": run.cfg.attention.num_heads, "kv_heads": [m.kv_heads for m in layers],  # per layer
           "metric": metric, "higher_is_better": higher,
           "importance_split": "val", "importance_examples": len(data[1]), "eval_split": ev_name,
           "eval_examples": len(data[3]), "checkpoint": str(run.checkpoint), "step": run.step,
           "settings": vars(settings).copy(), "units": {}}
    units = ["head"] + (["component"] if any(prune.has_components(m) for m in layers) else [])
    for unit in units:
        gates = prune.unit_gates(layers, unit)
        find = prune.importance if unit == "head" else prune.component_importance
        scores = find(task, model, layers, data[0], data[1], gates, batch_size=settings.batch_size,
                      **({"unit": unit} if unit == "head" else {}))
        norm = [None if s is None else (s / n if (n := torch.linalg.vector_norm(s)) > 0 else s) for s in scores]
        curve = prune.prune_curve(task, model, layers, data, unit=unit, settings=settings)
        rand = prune.random_curves(task, model, layers, data, unit=unit, settings=settings)
        out["units"][unit] = {"importance": [None if s is None else s.tolist() for s in norm],
                              "importance_raw": [None if s is None else s.tolist() for s in scores],
                              "curve": curve, "random": rand,
                              "ablation": prune.ablation(task, model, layers, data, unit=unit, settings=settings)}
    return out


def _unit_name(unit: str, layer: int, idx: list, grouped: bool = False) -> str:
    """"L0 h1" (a head), "L0 h1 r0" (a head's component), "L0 g1 r0" (a key group's component: gmgk)."""
    if unit != "component":
        return f"L{layer} h{idx[0]}"
    return f"L{layer} {'g' if grouped else 'h'}{idx[0]} r{idx[1]}"


def _ablation_rows(label: str, r: dict, unit: str) -> list[str]:
    u = r["units"][unit]
    imp = u["importance"]
    kv = r.get("kv_heads")  # absent from results written before grouped keys
    rows = []
    for a in u["ablation"]["units"]:
        layer, idx = a["layer"], a["index"]
        grouped = kv is not None and kv[layer] != r["num_heads"]
        score = imp[layer]
        for i in idx:
            score = score[i]
        rows.append(f"| {label} | {_unit_name(unit, layer, idx, grouped)} | {score:.3f} | {a['metric']:.4f} | "
                    f"{a['delta']:+.4f} |")
    return rows


def _curve_line(label: str, r: dict, unit: str) -> str:
    u = r["units"][unit]
    c, rand = u["curve"], u["random"]
    pts = ", ".join(f"{k}: {m:.4f}" + (f" (random {rm:.4f} ± {rs:.4f})" if rand else "")
                    for k, m, rm, rs in zip(c["kept"], c["metric"], rand.get("mean", [math.nan] * len(c["kept"])),
                                            rand.get("std", [math.nan] * len(c["kept"]))))
    return f"- **{label}** ({c['units']} {unit}s): {pts}"


def write_outputs(results: dict, out: Path, left_out=()) -> dict:
    """prune.json, prune.md and the figures ``prune_<unit>.png`` of ``results`` (label -> :func:`prune_run`)."""
    out.mkdir(parents=True, exist_ok=True)
    first = next(iter(results.values()))
    metric = first["metric"] + (" (higher is better)" if first["higher_is_better"] else " (lower is better)")
    figs = {}
    for unit in ("head", "component"):
        series = {lab: {"kept": r["units"][unit]["curve"]["kept"], "importance": r["units"][unit]["curve"]["metric"],
                        "random_mean": r["units"][unit]["random"].get("mean", []),
                        "random_std": r["units"][unit]["random"].get("std", [])}
                  for lab, r in results.items() if unit in r["units"]}
        if series:
            figs[unit] = plots.pruning_curves(series, out / f"prune_{unit}.png", f"pruning {unit}s "
                                              f"({first['eval_split']} split)", metric, f"{unit}s kept").name
    single = len(results) == 1
    write_json({**(first if single else {"runs": results, "left_out": list(left_out)}), "figures": figs},
               out / "prune.json")
    lines = ["# mgk analyze --prune: " + " vs ".join(results), "",
             f"Head importance I_h = E_x |dL(x)/dxi_h| of a gate xi_h on each head's output (Michel, Levy, Neubig "
             f"2019), per example, on the first {first['importance_examples']} examples of the validation split, "
             "normalised per layer by its L2 norm; for mixture keys the same per component (pi_r times its gate, "
             f"renormalised). Pruning: the least important {100 * first['settings']['fraction']:.0f} % of the "
             f"units at a time (at least one), importance recomputed after each step; metric `{first['metric']}` "
             f"on the first {first['eval_examples']} examples of the `{first['eval_split']}` split. Random order: "
             f"{first['settings']['random_orders']} random orders (mean ± sample std).", ""]
    if any(unit == "component" and any(k != r["num_heads"] for k in r.get("kv_heads", ()))
           for r in results.values() for unit in r["units"]):
        lines += [GROUPED_NOTE, ""]
    lines += [f"- left out, failed: {line}" for line in left_out]
    for unit in ("head", "component"):
        have = [(lab, r) for lab, r in results.items() if unit in r["units"]]
        if not have:
            continue
        lines += [f"## Pruning {unit}s", ""] + [_curve_line(lab, r, unit) for lab, r in have] + [""]
        lines += [f"One-{unit} ablation (metric with that {unit} alone removed; full: "
                  + ", ".join(f"{lab} {r['units'][unit]['ablation']['full']:.4f}" for lab, r in have) + ")", "",
                  f"| run | {unit} | importance (normalised) | metric without it | change |", "|---|---|---|---|---|"]
        for lab, r in have:
            lines += _ablation_rows(lab, r, unit)
        lines += [""]
    lines += ["## Figures", ""] + [f"![{name}]({file})" for name, file in figs.items()]
    write_text_atomic(out / "prune.md", "\n".join(lines) + "\n")
    return figs


def prune_dirs(run_dirs, out: Path, settings: prune.PruneSettings, *, data=None, which="best", device="cpu",
               notes: list | None = None) -> dict:
    """:func:`prune_run` of each run of ``run_dirs`` into ``out`` (prune.json, prune.md, figures); labels as
    :func:`mgk.analyze.cli.analyse_dirs`. A failed run is refused alone and left out of a comparison."""
    from .run import FailedRun, loaded_runs

    results, left_out = {}, []
    notes = [] if notes is None else notes
    for label, run in loaded_runs(run_dirs, data=data, which=which, device=device, notes=notes, left_out=left_out):
        results[label] = prune_run(run, settings)
    if not results:
        raise FailedRun("every run failed (final evaluation not finite): " + "; ".join(left_out))
    write_outputs(results, Path(out), left_out)
    return results
