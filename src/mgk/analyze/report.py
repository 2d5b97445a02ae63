"""``analysis.json`` / ``analysis.md`` and the figures, for one run or several side by side (``--compare``)."""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..atomic import write_text_atomic
from . import plots

__all__ = ["write_figures", "write_json", "write_markdown", "CAUSAL_RANK_NOTE", "effective_heads_text"]

CAUSAL_RANK_NOTE = (
    "**Causal layers: rank does not discriminate.** A causal attention map is lower triangular with a positive "
    "diagonal (each query gives its own key a positive weight), so it has full rank by construction, for softmax "
    "and MGK alike; the few missing ranks are diagonal entries below the tolerance. Read the effective heads (as a "
    "fraction of the heads), the JS divergence and the pruning curves (`mgk analyze --prune`) instead.")


def write_json(result, path: Path) -> Path:
    """Atomic JSON write (:mod:`mgk.atomic`)."""
    return write_text_atomic(path, json.dumps(result, indent=1, allow_nan=True) + "\n")


def _mean_std(layers, key, stat) -> tuple[list, list]:
    cells = [layer[key][stat] for layer in layers]
    return [c.get("mean", math.nan) for c in cells], [c.get("std", 0.0) for c in cells]


def write_figures(results: dict, out: Path, maps: dict | None = None) -> dict:
    """Figures of ``results`` (label -> analysis result) in ``out``; ``maps`` (label -> per-layer example maps)
    adds the attention-map grids. Returns {figure name: file name}."""
    out = Path(out)
    mode = next(iter(results.values()))["settings"]["rank_mode"]
    figs = {}
    for label, per_layer in (maps or {}).items():
        for i, m in enumerate(per_layer):
            if m:
                name = f"maps_{_slug(label)}_layer{i}.png" if len(results) > 1 else f"maps_layer{i}.png"
                plots.attention_grid(m, out / name, f"{label}: layer {i}, heads x examples (real tokens)")
                figs[f"maps {label} layer {i}"] = name
    ranks = {lab: [layer["ranks"][mode] for layer in r["layers"]] for lab, r in results.items()}
    figs["rank"] = plots.rank_histograms(ranks, out / "rank.png", f"numerical rank ({mode} tol "
                                         f"{next(iter(results.values()))['settings']['rank_tol']:g})", "rank").name
    rel = {lab: [[k / n for k, n in zip(layer["ranks"][mode], layer["lengths"])] for layer in r["layers"]]
           for lab, r in results.items()}
    figs["rank_over_length"] = plots.rank_histograms(rel, out / "rank_over_length.png",
                                                     "rank / sequence length", "rank / n").name
    for stat, ylabel in (("js", "mean pairwise JS (bits)"), ("l2", "mean pairwise L2"),
                         ("effective_heads", "effective heads")):
        series = {lab: _mean_std(r["layers"], "redundancy", stat) for lab, r in results.items()}
        figs[stat] = plots.per_layer_lines(series, out / f"{stat}.png", ylabel, ylabel).name
    for what, key in (("shares", "shares"), ("pi", "pi")):
        series = {lab: [_mixture_table(layer, key) for layer in r["layers"]] for lab, r in results.items()}
        series = {lab: v for lab, v in series.items() if any(t is not None for t in v)}
        if series:
            title = "component share of attention" if key == "shares" else "mixture weights pi (mean over positions)"
            figs[what] = plots.mixture_bars(series, out / f"mixture_{what}.png", title, what).name
    return figs


def _mixture_table(layer: dict, key: str):
    mix = layer.get("mixture")
    if not mix or mix.get(key) is None:
        return None
    if key == "shares":
        return mix["shares"]
    return [[c["mean"] for c in head] for head in mix["pi"]]


def _slug(label: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in label)


def _fmt(cell: dict, digits: int = 3) -> str:
    if not cell or cell.get("n", 0) == 0:
        return "-"
    return f"{cell['mean']:.{digits}f} ± {cell['std']:.{digits}f}"


def effective_heads_text(cell: dict, num_heads: int, spread: bool = True) -> str:
    """``"3.20 of 8 (0.40)"`` (``"3.20 ± 0.10 of 8 (0.40)"`` with ``spread`` over two or more matrices): the mean
    effective number of heads of a :func:`mgk.analyze.stats.summary` ``cell`` beside the layer's heads and as a
    fraction of them, so that layers of 8 and 4 heads compare; "-" without a value."""
    if not cell or cell.get("n", 0) == 0:
        return "-"
    spread = f" ± {cell['std']:.2f}" if spread and cell["n"] > 1 else ""
    return f"{cell['mean']:.2f}{spread} of {num_heads} ({cell['mean'] / num_heads:.2f})"


def _layer_rows(results: dict) -> list[str]:
    mode = next(iter(results.values()))["settings"]["rank_mode"]
    rows = ["| run | layer | heads | matrices | mean length | rank (" + mode + ") | median rank | rank / length | "
            "JS (bits) | L2 | effective heads |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for lab, r in results.items():
        for layer in r["layers"]:
            rk, red = layer["rank"][mode], layer["redundancy"]
            mean_len = sum(layer["lengths"]) / max(1, len(layer["lengths"]))
            rows.append(f"| {lab} | {layer['layer']} | {layer['num_heads']} | {rk.get('n', 0)} | {mean_len:.1f} | "
                        f"{_fmt(rk, 2)} | {rk.get('median', math.nan):g} | {_fmt(layer['rank_over_length'])} | "
                        f"{_fmt(red['js'])} | {_fmt(red['l2'])} | "
                        f"{effective_heads_text(red['effective_heads'], layer['num_heads'])} |")
    return rows


def _mixture_rows(results: dict) -> list[str]:
    rows = []
    for lab, r in results.items():
        for layer in r["layers"]:
            mix = layer.get("mixture")
            if not mix:
                continue
            if not rows:
                rows = ["| run | layer | head | pi per component (per head, or mean ± std over key positions) "
                        "| share of attention |",
                        "|---|---|---|---|---|"]
            H, G = layer["num_heads"], layer.get("kv_heads", layer["num_heads"])
            for h in range(H):
                head = h if G == H else f"{h} (group {h // (H // G)})"  # a group's pi is its query heads'
                pi = ("unused (Hard-E)" if mix["pi"] is None else
                      ", ".join(f"{c['mean']:.3f}" if c["n"] == 1 else _fmt(c) for c in mix["pi"][h]))
                share = (", ".join(f"{v:.3f}" for v in mix["shares"][h]) if "shares" in mix else
                         mix.get("share_kind", "-"))
                rows.append(f"| {lab} | {layer['layer']} | {head} | {pi} | {share} |")
    return rows


def write_markdown(results: dict, figs: dict, path: Path, title: str, left_out: list[str] = ()) -> Path:
    """The tables (per layer: rank, redundancy; per head: pi and component shares) and the figures linked;
    ``left_out``: one line per run not analysed (failed)."""
    first = next(iter(results.values()))
    s = first["settings"]
    lines = [f"# {title}", "",
             f"Split `{s['split']}`, {first['examples_analysed']} examples drawn with seed {s['seed']}, model in "
             f"{s['dtype']}; rank = singular values > {s['rank_tol']:g}"
             + (" x the largest" if s["rank_mode"] == "relative" else " (absolute)") + ", by SVD in float64.", ""]
    for lab, r in results.items():
        unfinished = "" if r.get("run_status", "finished") == "finished" else \
            "; **unfinished run** (no results.json yet): the model is still in training"
        lines.append(f"- **{lab}**: `{r['run_dir']}` ({r['task']}, checkpoint `{Path(r['checkpoint']).name}` at "
                     f"step {r['step']}" + (f" of {r['steps']}" if r.get("steps") else "") + f"{unfinished})")
    lines += [f"- left out, failed: {line}" for line in left_out]
    lines += ["", "## Rank and head redundancy per layer", "", *_layer_rows(results), "",
              "JS: mean over head pairs and query rows of the Jensen-Shannon divergence (bits, 0..1) between the "
              "heads' attention rows. L2: mean over head pairs of |A_h - A_h'|_F / sqrt(n). Effective heads: "
              "exp(entropy) of the normalised eigenvalues of the heads' cosine-similarity matrix (1 = all heads "
              "alike, H = all distinct).", ""]
    if any(layer.get("causal") for r in results.values() for layer in r["layers"]):
        lines += [CAUSAL_RANK_NOTE, ""]
    mix = _mixture_rows(results)
    if mix:
        lines += ["## Mixture", "", *mix, ""]
    lines += ["## Figures", ""]
    lines += [f"![{name}]({file})" for name, file in figs.items()]
    return write_text_atomic(path, "\n".join(lines) + "\n")
