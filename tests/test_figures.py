"""Every figure mgk draws gives an attention kind one colour (mgk.figures, from the registry), and no two tick labels
overlap: read from the matplotlib Figure objects that the plot functions save (not pixels)."""
from __future__ import annotations

import itertools

import matplotlib.colors
import matplotlib.figure

import mgk
from mgk.analyze import plots as analyze_plots
from mgk.bench.plots import plot_decode
from mgk.figures import OTHER_COLOUR, kind_colour, kind_of, series_styles
from mgk.reproduce.plots import plot_accuracy_vs_params, plot_metric_vs_heads

# (kind, heads, M, mean, attention params, FLOPs, cache bytes): the shape of results/cpu/kv-budget.md's lm-small rows,
# whose sizes are close enough that default log-10 labels ran into each other
ROWS = [("softmax", 8, 1, 355.9, 264190, 2.0e8, 1024), ("softmax", 4, 1, 362.2, 132350, 1.0e8, 512),
        ("gqa", 8, 1, 357.4, 198140, 1.6e8, 512), ("gqa", 8, 1, 354.6, 165120, 1.45e8, 256),
        ("gqa", 8, 1, 355.6, 148610, 1.4e8, 128), ("mgk", 4, 2, 353.5, 165410, 1.3e8, 800),
        ("smgk", 4, 2, 352.1, 132640, 1.1e8, 544), ("mgk", 2, 4, 356.0, 140000, 1.2e8, 900)]



def _report():
    rows = [{"row": f"{k}-{h}-{i}", "task": "lm", "kind": k, "heads": h, "keys": m, "n": 3, "mean": mean, "std": 2.0,
             "attention_params": p, "flops": f, "cache_bytes": c, "metric_label": "perplexity", "better": "lower"}
            for i, (k, h, m, mean, p, f, c) in enumerate(ROWS)]
    return {"rows": rows, "tasks": [{"task": "lm", "label": "lm-small"}], "metric": "ppl"}


def _decode_result():
    kinds = (("softmax", "softmax-8", 0.4), ("mgk", "mgk-4", 0.5), ("gqa", "gqa-8 kv2", 0.3), ("smgk", "smgk-4", 0.45))
    rows = [{"target": "layer", "batch": 1, "kind": kind, "label": label, "context": ctx,
             "ms_per_token": ms * ctx ** 0.1, "step_ms": ms * ctx ** 0.1}
            for kind, label, ms in kinds for ctx in (256, 512, 1024, 2048, 4096, 8192)]
    return {"rows": rows, "date": "today", "machine": "test"}


def _colours_by_kind(fig) -> dict:
    """{kind: {colour}} of every legend entry of ``fig`` that names a kind (its line or marker colour)."""
    out: dict = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            kind = kind_of(line.get_label()) if not line.get_label().startswith("_") else None
            if kind is not None:
                out.setdefault(kind, set()).add(matplotlib.colors.to_hex(line.get_color()))
        for container in ax.containers:
            kind = kind_of(container.get_label() or "")
            if kind is not None:
                out.setdefault(kind, set()).add(matplotlib.colors.to_hex(container.lines[0].get_color()))
    return out


def test_a_kind_has_the_same_colour_in_every_figure(tmp_path, saved, monkeypatch):
    monkeypatch.setattr(analyze_plots, "_save", lambda fig, path: saved.append(fig) or path)
    plot_metric_vs_heads(tmp_path, _report())
    plot_decode(_decode_result(), tmp_path / "decode.png")
    plot_accuracy_vs_params(tmp_path, _report())
    series = {"softmax-8": {"kept": [8, 4], "importance": [1, 2]},
              "mgk-4 soft_e": {"kept": [4, 2], "importance": [1, 3]},
              "MQA-8 (kv 1)": {"kept": [8, 4], "importance": [2, 3]}}
    analyze_plots.pruning_curves(series, tmp_path / "prune.png", "t", "y", "x")
    heads, decode, params, prune = (_colours_by_kind(f) for f in saved)
    assert set(heads) == {"softmax", "gqa", "mgk", "smgk"} and set(decode) == set(heads) and set(params) == set(heads)
    assert set(prune) == {"softmax", "mgk", "gqa"}
    for kind in heads:
        assert heads[kind] == decode[kind] == params[kind] == {matplotlib.colors.to_hex(kind_colour(kind))}, kind
        assert kind not in prune or prune[kind] == heads[kind], kind
    assert len({c for cs in heads.values() for c in cs}) == len(heads)  # one colour per kind, none shared


def test_two_series_of_one_kind_share_its_colour_and_differ_in_style(tmp_path, saved):
    plot_metric_vs_heads(tmp_path, _report())
    [ax] = saved[0].axes[:1]
    lines = {c.get_label(): c.lines[0] for c in ax.containers}
    m2, m4 = lines["mgk M=2"], lines["mgk M=4"]
    assert m2.get_color() == m4.get_color()
    assert (m2.get_linestyle(), m2.get_marker()) != (m4.get_linestyle(), m4.get_marker())


def _overlaps(fig) -> list:
    """(axes title or x label, text a, text b) of visible tick labels whose boxes overlap, on every axis of ``fig``."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    found = []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            labels = [t for t in axis.get_ticklabels(minor=False) + axis.get_ticklabels(minor=True)
                      if t.get_visible() and t.get_text()]
            boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in labels]
            found += [(ax.get_xlabel(), a, b) for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2)
                      if box_a.overlaps(box_b)]
    return found


def test_no_two_tick_labels_overlap_on_the_heads_figures_and_the_decode_figure(tmp_path, saved):
    plot_metric_vs_heads(tmp_path, _report())
    plot_decode(_decode_result(), tmp_path / "decode.png")
    heads, decode = saved
    assert [ax.get_xlabel() for ax in heads.axes][0] == "heads h"
    assert not _overlaps(heads) and not _overlaps(decode)
    assert [t.get_text() for t in heads.axes[0].get_xticklabels() if t.get_visible()] == ["2", "4", "8"]


def test_colours_come_from_the_registry_and_labels_name_their_kind():
    colours = [kind_colour(k) for k in mgk.attention_kinds()]
    assert len(set(colours)) == len(colours) and OTHER_COLOUR not in colours
    assert kind_colour("no such kind") == kind_colour(None) == OTHER_COLOUR
    names = {"smgk-4": "smgk", "mgk-4-similar": "mgk", "MGK x 4": "mgk", "sMLK x 4": "smlk", "MQA-8 (kv 1)": "gqa",
             "gqa-8-kv2": "gqa", "softmax-8 (source)": "softmax", "smgk M=2": "smgk", "linear-8": "linear",
             "mgkx": None, "retrieval": None}
    assert {label: kind_of(label) for label in names} == names
    styles = series_styles({"a": "mgk", "b": "mgk", "c": None, "softmax-4": None})
    assert styles["a"]["color"] == styles["b"]["color"] == kind_colour("mgk") and styles["a"] != styles["b"]
    assert styles["c"]["color"] == OTHER_COLOUR and styles["softmax-4"]["color"] == kind_colour("softmax")
