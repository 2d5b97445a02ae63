"""The style every figure of mgk shares: one colour per attention kind, the same in every figure, and axes whose
tick labels never overlap.

Colours come from the registry (:func:`mgk.attention.attention_kinds`, in registration order, the order of
:mod:`mgk.attention`, the index of the kinds), so a kind added there gets its own colour everywhere without a second
list; within one figure, several series of one kind (MGK with M = 2 and M = 4, softmax-8 and softmax-4) share its
colour and differ by line style and marker (:func:`series_styles`). Series of no registered kind (a reference line)
are black.

Axes: :func:`log2_axis` for counts that double (heads, keys, context, cache bytes): ticks at powers of two labelled
as plain numbers; :func:`log10_axis` for sizes over decades (parameters, FLOPs): ticks at 1, 2, 5 times a power of
ten labelled "2k", "1.5M"; :func:`thin_tick_labels`, called after the layout, drops any tick label that would still
overlap its neighbour at the figure's size. Matplotlib is imported only by the functions that draw.
"""
from __future__ import annotations

import math

from .attention.registry import attention_kinds, display_label, get_kind, kind_variants

__all__ = ["KIND_PALETTE", "OTHER_COLOUR", "LINESTYLES", "MARKERS", "kind_colour", "kind_colours", "kind_of",
           "series_styles", "log2_axis", "log10_axis", "short_number", "thin_tick_labels"]

# One colour per registered kind, in registration order: softmax, mgk, smgk, linear, mlk, smlk, gqa, gmgk, then kinds
# registered later (the palette's tail, then matplotlib's cycle).
KIND_PALETTE = ("tab:blue", "tab:red", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:green",
                "tab:olive", "tab:cyan")
OTHER_COLOUR = "black"
LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P")


def kind_colour(kind: str | None) -> str:
    """The colour of attention kind ``kind`` (a registered name, "mgk") in every figure; :data:`OTHER_COLOUR` for
    None or a name that is not registered."""
    kinds = attention_kinds()
    if kind not in kinds:
        return OTHER_COLOUR
    i = kinds.index(kind)
    return KIND_PALETTE[i] if i < len(KIND_PALETTE) else f"C{i % 10}"


def kind_colours() -> dict[str, str]:
    """``{kind: colour}`` of every registered kind."""
    return {kind: kind_colour(kind) for kind in attention_kinds()}


def _names() -> dict[str, str]:
    """Lower-cased names a label may start with -> kind: each kind's name and the first word of its display labels
    over its variants ("MGK", "sMGK", "GQA", "MQA" for GQA with one key/value head)."""
    names = {kind: kind for kind in attention_kinds()}
    for kind, values in kind_variants():
        shown = display_label(kind, 8, get_kind(kind).make_options(**values))
        names.setdefault(shown.split(" x ")[0].split(" ")[0].lower(), kind)
    return names


def kind_of(label: str) -> str | None:
    """The registered kind a series label names, or None: "mgk-4", "sMGK x 4 (Soft-E)", "gqa-8-kv2", "MQA-8 (kv 1)",
    "softmax-8 (source)", "smgk M=2", "gqa+num_kv_heads=2" (the longest name the label starts with, followed by no
    letter or digit)."""
    text = str(label).lower()
    for name, kind in sorted(_names().items(), key=lambda item: -len(item[0])):
        if text.startswith(name) and not text[len(name):len(name) + 1].isalnum():
            return kind
    return None


def series_styles(kinds: dict) -> dict:
    """``{series: {"color", "linestyle", "marker"}}`` for ``kinds`` (series label -> kind name, or None to read
    it from the label with :func:`kind_of`), in the dict's order: each series has its kind's colour; the n-th series
    of a kind in this figure has the n-th line style and marker (the first: solid, circles)."""
    seen: dict = {}
    out = {}
    for series, kind in kinds.items():
        kind = kind if kind is not None else kind_of(series)
        n = seen[kind] = seen.get(kind, -1) + 1
        out[series] = {"color": kind_colour(kind), "linestyle": LINESTYLES[n % len(LINESTYLES)],
                       "marker": MARKERS[n % len(MARKERS)]}
    return out


def short_number(x: float) -> str:
    """A tick label: 512, 2k, 16.6k, 1.5M, 2G (three significant digits at most)."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:.3g}"


def _axis(ax, axis: str):
    if axis not in ("x", "y"):
        raise ValueError(f"axis must be 'x' or 'y', got {axis!r}")
    return ax.xaxis if axis == "x" else ax.yaxis


def log2_axis(ax, values, axis: str = "x") -> None:
    """A log-2 ``axis`` of ``ax`` over the positive ``values`` plotted on it, with ticks at the powers of two that
    span them, labelled as plain numbers (1, 2, 4, 8; 64, 128, ...); no minor ticks. ValueError for a bad axis or
    no positive value."""
    from matplotlib import ticker

    side = _axis(ax, axis)
    values = [float(v) for v in values if v is not None and v > 0]
    if not values:
        raise ValueError("values must hold a positive number to place a log-2 axis")
    (ax.set_xscale if axis == "x" else ax.set_yscale)("log", base=2)
    lo, hi = math.floor(math.log2(min(values))), math.ceil(math.log2(max(values)))
    ticks = [2.0 ** e for e in range(lo, hi + 1)]
    side.set_major_locator(ticker.FixedLocator(ticks))
    side.set_major_formatter(ticker.FuncFormatter(lambda x, _: f"{x:.0f}" if 1 <= x < 1e6 else short_number(x)))
    side.set_minor_locator(ticker.NullLocator())


def log10_axis(ax, axis: str = "x") -> None:
    """A log-10 ``axis`` of ``ax`` with major ticks at 1, 2 and 5 times powers of ten, labelled by
    :func:`short_number`, and unlabelled minor ticks. Call it after plotting: a view narrower than a decade (8 to
    14 ms) gets about five evenly spaced round ticks instead (8, 10, 12, 14), where 1-2-5 would give one label."""
    from matplotlib import ticker

    side = _axis(ax, axis)
    (ax.set_xscale if axis == "x" else ax.set_yscale)("log", base=10)
    lo, hi = sorted(ax.get_xlim() if axis == "x" else ax.get_ylim())
    if lo > 0 and hi / lo < 10:
        side.set_major_locator(ticker.FixedLocator(ticker.MaxNLocator(nbins=5, steps=[1, 2, 2.5, 5, 10])
                                                   .tick_values(lo, hi)))
    else:
        side.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    side.set_major_formatter(ticker.FuncFormatter(lambda x, _: short_number(x)))
    side.set_minor_formatter(ticker.NullFormatter())


def _overlap(a, b, pad: float) -> bool:
    return a.x0 < b.x1 + pad and b.x0 < a.x1 + pad and a.y0 < b.y1 + pad and b.y0 < a.y1 + pad


def thin_tick_labels(fig, pad: float = 2.0) -> None:
    """Fix each axis' major ticks to those whose labels do not overlap (``pad`` display pixels apart), keeping the
    first and every next label clear of the last kept, in every axes of ``fig``. Call after ``tight_layout`` (the
    layout sets the axes' widths); the kept ticks stay at savefig (labels and axes scale together with the dpi)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        for side, setter, index in ((ax.xaxis, ax.set_xticks, 0), (ax.yaxis, ax.set_yticks, 1)):
            lo, hi = sorted(ax.get_xlim() if index == 0 else ax.get_ylim())
            ticks = [t for t in side.get_major_ticks() if t.label1.get_visible() and t.label1.get_text()
                     and lo <= t.get_loc() <= hi]
            kept = []
            for t in sorted(ticks, key=lambda t: t.get_loc()):
                box = t.label1.get_window_extent(renderer)
                if not kept or not _overlap(kept[-1][1], box, pad):
                    kept.append((t, box))
            if len(kept) < len(ticks):
                setter([t.get_loc() for t, _ in kept], [t.label1.get_text() for t, _ in kept])
