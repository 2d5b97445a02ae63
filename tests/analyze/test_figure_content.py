"""What the figures and summaries of `mgk analyze` show, read from the matplotlib objects (not pixels): the attention
grid has a colour bar per example with that example's scale, and the effective number of heads is given beside the
heads and as a fraction of them."""
from __future__ import annotations

import re

import torch

from mgk.analyze import plots
from mgk.analyze.report import effective_heads_text
from mgk.cli import main


def test_attention_grid_has_a_colour_bar_per_example_with_its_scale(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path)
    g = torch.Generator().manual_seed(0)
    maps = [torch.softmax(torch.randn(3, n, n, generator=g) * s, dim=-1) for n, s in ((5, 1.0), (7, 4.0))]
    plots.attention_grid(maps, tmp_path / "grid.png", "maps")
    [fig] = figures
    images = [im for ax in fig.axes for im in ax.get_images()]
    assert len(images) == 6
    for r, m in enumerate(maps):
        row = images[3 * r: 3 * r + 3]
        [bar] = [im.colorbar for im in row if im.colorbar is not None]  # one colour bar per example (row)
        assert bar.norm.vmin == 0.0 and abs(bar.norm.vmax - float(m.max())) < 1e-6
        assert bar.ax.get_ylabel() == "attention weight"
        assert all(im.norm.vmin == 0.0 and im.norm.vmax == bar.norm.vmax for im in row)  # one scale per example
    assert len(fig.axes) == 6 + 2  # the panels and the two colour bars


def test_effective_heads_are_given_as_a_fraction_of_the_heads():
    assert effective_heads_text({"n": 4, "mean": 3.2, "std": 0.1}, 8) == "3.20 ± 0.10 of 8 (0.40)"
    assert effective_heads_text({"n": 4, "mean": 3.2, "std": 0.1}, 8, spread=False) == "3.20 of 8 (0.40)"
    assert effective_heads_text({"n": 1, "mean": 2.0, "std": 0.0}, 4) == "2.00 of 4 (0.50)"
    assert effective_heads_text({"n": 0}, 4) == "-"


def test_analyze_prints_and_writes_effective_heads_with_their_fraction(th, tmp_path, capsys):
    run = tmp_path / "run"
    torch.set_num_threads(1)
    main(["train", "--attention", "softmax", "--heads", "4", "--steps", "2", "--out", str(run),
          *th.sets(*th.TINY, "eval_every=2")])
    capsys.readouterr()
    main(["analyze", str(run), "--samples", "4", "--examples", "0", "--out", str(tmp_path / "a"), "--no-progress"])
    out = capsys.readouterr().out
    found = re.findall(r"effective heads (\d+\.\d\d) of 4 \((\d\.\d\d)\)", out)
    assert len(found) == 2, out  # one per layer
    assert all(abs(float(n) / 4 - float(f)) < 0.006 for n, f in found)
    md = (tmp_path / "a" / "analysis.md").read_text()
    assert len(re.findall(r"\| \d+\.\d\d ± \d+\.\d\d of 4 \(\d\.\d\d\) \|", md)) == 2
