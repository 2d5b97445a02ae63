"""Every ``mgk bench`` command records the load average, prints it above its table and warns about a busy machine
(one code path, mgk.bench.rows, for all of them). The rows are stand-ins: only the reporting is under test."""
from __future__ import annotations

import json

import pytest

from mgk.cli import main

ARGS = {
    "attention": ["--lengths", "16", "--kinds", "softmax:2", "--embed-dim", "8", "--head-dim", "4"],
    "model": ["--preset", "listops-small", "--kinds", "softmax:2"],
    "decode": ["--targets", "layer", "--kinds", "softmax:2", "--contexts", "16", "--batches", "1"],
}


@pytest.mark.parametrize("bench", sorted(ARGS))
@pytest.mark.parametrize("load", [3.5, 0.1])
def test_every_bench_reports_the_load_and_warns_when_busy(bench, load, monkeypatch, capsys, tmp_path):
    import importlib
    import os

    module = importlib.import_module(f"mgk.bench.{bench}")
    monkeypatch.setattr(module, "run_row", lambda code, timeout, rss=True: {"error": "not measured in this test"})
    monkeypatch.setattr(os, "getloadavg", lambda: (load, 1.0, 1.0))
    out = tmp_path / "bench.json"
    assert main(["bench", bench, *ARGS[bench], "--json", str(out)]) == 1  # every row is a stand-in error
    captured = capsys.readouterr()
    assert f"load average {load:.2f} before, {load:.2f} after" in captured.out
    assert ("warning: the machine was busy" in captured.err) == (load > 0.5)
    result = json.loads(out.read_text())
    assert result["load_average"]["before"][0] == load and result["busy"] == (load > 0.5)
    assert result["cores"] == os.cpu_count()
