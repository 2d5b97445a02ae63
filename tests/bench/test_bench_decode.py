"""`mgk bench decode`: the JSON fields, and the cache bytes it measures against the registry's formula (MGK-4 and
sMGK-4 against softmax-8, MLK-4's state constant over the context). No timing is asserted: speed figures live in
BENCHMARKS.md, measured on a quiet machine."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from mgk.bench.decode import measure, table
from mgk.cli import main
from mgk.config import to_dict
from mgk.tasks import all_presets
from mgk.train.rundir import write_config

FIELDS = ("target", "kind", "label", "heads", "head_dim", "layers", "context", "batch", "prefill_ms", "step_ms",
          "ms_per_token", "tokens_per_s", "cache_bytes", "cache_bytes_formula", "cache_bytes_per_token_layer",
          "cache_bytes_allocated", "params", "device")
SMALL_LM = ["vocab_size=64", "num_layers=2"]


@pytest.mark.parametrize("kind,heads", [("softmax", 8), ("mgk", 4), ("smgk", 4), ("linear", 8), ("mlk", 4),
                                        ("mgk+pi=hard_e", 4), ("mgk-softe", 4)])
def test_a_layer_row_is_complete_and_its_bytes_are_the_formula(kind, heads, one_thread):
    row = measure("layer", kind, heads, 24, batch=2, steps=2, device="cpu", embed_dim=64, head_dim=16)
    assert set(FIELDS) <= set(row)
    assert row["cache_bytes"] == row["cache_bytes_formula"] > 0
    assert row["step_ms"] > 0 and row["prefill_ms"] > 0 and row["cache_bytes_allocated"] >= row["cache_bytes"]


def test_bytes_per_token_and_layer_of_mgk4_and_smgk4_against_softmax8_and_a_constant_mlk4_state(one_thread):
    D, M = 16, 2

    def row(kind, heads, context=32):
        return measure("layer", kind, heads, context, batch=2, steps=1, device="cpu", embed_dim=64, head_dim=D)

    softmax = row("softmax", 8)["cache_bytes_per_token_layer"]
    assert row("mgk", 4)["cache_bytes_per_token_layer"] / softmax == 0.75 + M / (4 * D)
    assert row("smgk", 4)["cache_bytes_per_token_layer"] / softmax == 0.5 + M / (4 * D)
    assert row("mlk", 4, 16)["cache_bytes"] == row("mlk", 4, 64)["cache_bytes"] == 2 * 4 * (D * D + D) * 4


@pytest.mark.parametrize("preset,kind", [("lm-small", "mgk"), ("wt103-paper", "mgk"), ("wt103-paper", "mlk")])
def test_a_model_row_counts_every_layer_and_reads_past_the_presets_segment(preset, kind, one_thread):
    """The wt103-paper MGK has per-position weights: the bench gives them the positions it decodes (300 > 256)."""
    row = measure(preset, kind, 4, 300, batch=1, steps=1, device="cpu", overrides=SMALL_LM)
    assert row["layers"] == 2 and row["cache_bytes"] == row["cache_bytes_formula"]


def test_cli_writes_the_grid_as_json_rows_and_a_table(tmp_path):
    out = tmp_path / "decode.json"
    cmd = [sys.executable, "-m", "mgk", "bench", "decode", "--targets", "layer,lm-small", "--kinds",
           "softmax:4,mgk:2", "--contexts", "8,16", "--batches", "1,2", "--steps", "1", "--embed-dim", "32",
           "--head-dim", "8", "--json", str(out), *(x for kv in SMALL_LM for x in ("--set", kv))]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr
    result = json.loads(out.read_text())
    keys = [(r["target"], r["kind"], r["batch"], r["context"]) for r in result["rows"]]
    assert keys == [(t, k, b, c) for t in ("layer", "lm-small") for k in ("softmax", "mgk") for b in (1, 2)
                    for c in (8, 16)]
    for r in result["rows"]:
        assert set(FIELDS) <= set(r) and r["cache_bytes"] == r["cache_bytes_formula"]
    assert {"machine", "torch", "settings", "date"} <= set(result)
    assert "| layer | mgk | 2 | 2 | 16 |" in p.stdout


@pytest.mark.parametrize("args,message", [
    (["--targets", "listops-small"], "unknown target"),
    (["--kinds", "reference:4"], "exists only in `mgk bench attention`"),
    (["--contexts", "0"], "positive"),
    (["--run", "/nonexistent"], "not a run directory"),
])
def test_bad_arguments_give_one_line_before_running(args, message):
    p = subprocess.run([sys.executable, "-m", "mgk", "bench", "decode", *args], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode != 0 and message in p.stderr


def test_a_classification_run_is_refused_in_one_line_before_running(tmp_path):
    """Each row of a classifier run failed inside the model with a cut-off AttributeError in the table."""
    run_dir = tmp_path / "listops"
    run_dir.mkdir()
    write_config(run_dir, to_dict(all_presets()["listops-small"]))
    with pytest.raises(SystemExit) as e:
        main(["bench", "decode", "--run", str(run_dir), "--contexts", "8", "--batches", "1", "--steps", "1"])
    text = str(e.value.code)
    assert "\n" not in text and "'listops' run (a classifier): only language-model runs" in text, text


def test_a_trained_run_is_measured_through_the_loader(run_v0_1_0, one_thread):
    run_dir, _ = run_v0_1_0
    row = measure("run", None, None, 8, batch=2, steps=1, device="cpu", run_dir=str(run_dir))
    assert row["kind"] == "mgk" and row["cache_bytes"] == row["cache_bytes_formula"]


def test_table_shows_failed_rows():
    rows = [{"target": "layer", "kind": "mgk", "heads": 4, "batch": 1, "context": 8, "error": "boom"}]
    assert "error: boom" in table({"rows": rows})


def test_decode_rows_run_under_the_allocators_defaults(monkeypatch):
    """The attention bench forces glibc to serve every block over 64 KiB from mmap (so that the resident set follows
    live memory); that costs page faults on every large allocation, which a decoding step makes each token. Decode
    rows measure only time and tensor bytes, so they must run as a user's process does."""
    import subprocess

    from mgk.bench import decode

    seen = []

    def fake_run(cmd, **kw):
        seen.append(kw.get("env") or {})
        return subprocess.CompletedProcess(cmd, 1, "", "boom")

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    decode.run(["layer"], [("mgk", 4)], [16], [1], steps=1, device="cpu", timeout=5.0)
    assert seen and all("MALLOC_MMAP_THRESHOLD_" not in env for env in seen)


@pytest.fixture
def position_run(tmp_path_factory):
    """A trained 2-step LM run whose MGK has mixture weights per key position, over max_len=16 positions."""
    from mgk.data import wikitext as wt

    root = tmp_path_factory.mktemp("position_run")
    wt.generate_corpus(root / "data", train_lines=60, valid_lines=10, test_lines=10, num_words=80, seed=1)
    sets = ["batch_size=4", "segment_len=8", "max_len=16", "d_model=16", "num_layers=2", "ffn_dim=32", "head_dim=4",
            "eval_every=2", "eval_batch_size=8", "warmup_steps=1", "progress=false", "adaptive_cutoffs=[20,60]",
            "pi_shape=position"]
    main(["train", "--task", "lm", "--data", str(root / "data"), "--attention", "mgk", "--heads", "2", "--steps", "2",
          "--out", str(root / "run"), *(x for kv in sets for x in ("--set", kv))])
    return root / "run"


def test_a_run_too_short_for_the_rows_is_refused_in_one_line_before_running(position_run, monkeypatch, one_thread):
    """Every row failed on its own, with its message cut at 80 characters in the table."""
    from mgk.bench import decode

    monkeypatch.setattr(decode, "run_row", lambda *a, **k: pytest.fail("a row ran"))
    with pytest.raises(SystemExit) as e:
        main(["bench", "decode", "--run", str(position_run), "--contexts", "4,8", "--batches", "1", "--steps", "2"])
    text = str(e.value.code)
    assert "\n" not in text and "max_len=16" in text and "--contexts of at most 6" in text, text
    # what it says to change is right: the longest context it allows decodes, one more does not
    measure("run", None, None, 6, batch=1, steps=2, device="cpu", run_dir=str(position_run))
    with pytest.raises(ValueError, match="max_len=16"):
        measure("run", None, None, 7, batch=1, steps=2, device="cpu", run_dir=str(position_run))


def test_tables_show_a_row_error_whole():
    from mgk.bench.attention import table as attention_table
    from mgk.bench.model import table as model_table

    error = "x" * 150 + " | what to change: use --contexts of at most 6"
    row = {"kind": "mgk", "heads": 4, "num_heads": 4, "target": "layer", "batch": 1, "context": 8, "length": 8,
           "preset": "lm-small", "error": error}
    for shown in (table({"rows": [row]}), attention_table({"rows": [row]}), model_table({"rows": [row]})):
        assert "x" * 150 + " \\| what to change: use --contexts of at most 6" in shown


def _fake_rows(calls):
    """A run_row stand-in: records the code it was given and returns a finished row for it."""
    def fake(code, timeout, rss=True):
        calls.append(code)
        if "read_bandwidth" in code:
            return {"gb_s": 10.0}
        kind = re.search(r"measure\('(\w+)', (None|'[^']*'), (None|\d+), (\d+)", code)
        step = 2.0 + len(calls) % 3
        return {"target": kind.group(1), "kind": (kind.group(2) or "None").strip("'"), "heads": kind.group(3),
                "context": int(kind.group(4)), "batch": 1, "prefill_ms": 5.0, "step_ms": step,
                "ms_per_token": step, "tokens_per_s": 1000 / step, "cache_bytes": 10**6, "cache_bytes_formula": 10**6,
                "cache_bytes_per_token_layer": 100.0, "weight_bytes": 4 * 10**6, "params": 10**6, "label": "x"}
    return fake


def test_rounds_interleave_the_kinds_and_report_median_min_and_max(monkeypatch):
    """Kinds measured in turn, round after round, so that a change of the machine's load falls on every
    kind alike; the row holds the median of the rounds and their spread."""
    from mgk.bench import decode

    calls = []
    monkeypatch.setattr(decode, "run_row", _fake_rows(calls))
    result = decode.run(["layer"], [("softmax", 8), ("mgk", 4)], [16], [1], steps=1, device="cpu", timeout=5.0,
                        rounds=3)
    kinds = [c.split("measure(")[1].split(",")[1].strip() for c in calls if "measure(" in c]
    assert kinds == ["'softmax'", "'mgk'"] * 3
    for row in result["rows"]:
        assert row["rounds"] == 3 and row["step_ms_min"] <= row["step_ms"] <= row["step_ms_max"]
        assert len(row["load_1min"]) == 3
    assert result["settings"]["rounds"] == 3
    spreads = re.findall(r"\| \d+\.\d\d \((\d+\.\d\d)-(\d+\.\d\d)\) \|", decode.table(result))
    assert len(spreads) == 2 and all(float(a) <= float(b) for a, b in spreads)


def test_the_limit_the_load_and_the_bandwidth_are_recorded(monkeypatch):
    """Each row against t_min = (weight + cache bytes) / measured read bandwidth (gpt-fast's bandwidth achieved);
    the load average before and after; a busy machine is named in a warning."""
    from mgk.bench import decode

    monkeypatch.setattr(decode, "run_row", _fake_rows([]))
    monkeypatch.setattr(decode.os, "getloadavg", lambda: (3.5, 2.0, 1.0))
    result = decode.run(["layer"], [("softmax", 8)], [16], [1], steps=1, device="cpu", timeout=5.0)
    row = result["rows"][0]
    assert result["read_bandwidth_gb_s"] == 10.0
    assert row["t_min_ms"] == pytest.approx((4 * 10**6 + 10**6) / 10e9 * 1000)
    assert row["bandwidth_fraction"] == pytest.approx(row["t_min_ms"] / row["step_ms"])
    assert result["load_average"]["before"][0] == 3.5 and result["busy"] is True
    assert "busy (1-minute load average 3.50" in decode.busy_warning(result)
    monkeypatch.setattr(decode.os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    quiet = decode.run(["layer"], [("softmax", 8)], [16], [1], steps=1, device="cpu", timeout=5.0)
    assert quiet["busy"] is False and decode.busy_warning(quiet) is None


def test_read_bandwidth_is_a_positive_rate(one_thread):
    from mgk.bench.decode import read_bandwidth

    assert 0.05 < read_bandwidth("cpu", megabytes=16, repeats=2) < 10_000


def test_a_run_is_measured_beside_softmax8_of_its_sizes(run_v0_1_0, one_thread, monkeypatch):
    """`--run` had no baseline ("x first" was always 1.00); now softmax-8 of the run's sizes (random
    weights) is measured first."""
    from mgk.bench import decode

    run_dir, _ = run_v0_1_0
    base = measure("run", "softmax", 8, 8, batch=1, steps=1, device="cpu", run_dir=str(run_dir))
    own = measure("run", None, None, 8, batch=1, steps=1, device="cpu", run_dir=str(run_dir))
    assert base["kind"] == "softmax" and base["heads"] == 8 and own["kind"] == "mgk"
    assert base["layers"] == own["layers"] and base["head_dim"] == own["head_dim"]
    calls = []
    monkeypatch.setattr(decode, "run_row", _fake_rows(calls))
    decode.run(["run"], [("mgk", 4)], [8], [1], steps=1, device="cpu", timeout=5.0, run_dir=str(run_dir))
    order = [c.split("measure(")[1].split(",")[1].strip() for c in calls if "measure(" in c]
    assert order == ["'softmax'", "None"]


def test_plot_draws_ms_per_token_against_context_per_kind(tmp_path):
    """The figure of ms per token against the context, a line per kind, a panel per (target, batch), with
    the rounds' spread; failed rows are left out, a result with none that succeeded is refused."""
    from PIL import Image

    from mgk.bench.plots import plot_decode

    rows = [{"target": "layer", "kind": kind, "label": f"{kind}-{heads}", "heads": heads, "context": context,
             "batch": batch, "step_ms": step * batch, "ms_per_token": step, "step_ms_min": 0.9 * step * batch,
             "step_ms_max": 1.2 * step * batch, "rounds": 3}
            for kind, heads, step in (("softmax", 8, 1.0), ("mgk", 4, 0.8)) for batch in (1, 8)
            for context in (256, 1024, 4096)]
    rows.append({"target": "layer", "kind": "smgk", "heads": 4, "context": 256, "batch": 1, "error": "failed"})
    path = plot_decode({"rows": rows, "date": "2026-12-02", "machine": "test"}, tmp_path / "decode.png")
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size[0] > 2 * image.size[1]  # two panels side by side
    with pytest.raises(ValueError, match="no row succeeded"):
        plot_decode({"rows": rows[-1:]}, tmp_path / "none.png")


def test_plot_needs_a_png_path_before_running():
    p = subprocess.run([sys.executable, "-m", "mgk", "bench", "decode", "--plot", "figure.pdf"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "ending in .png" in p.stderr and "Traceback" not in p.stderr


def test_same_process_alternates_the_kinds_of_a_cell_in_one_process(one_thread):
    """--same-process: every kind of a cell prefilled in one process, then round after round each takes its steps
    in turn; a row's step is the median of its rounds with their min and max, and its bytes are the formula's."""
    from mgk.bench.decode import measure_cell

    got = measure_cell("layer", [("softmax", 4), ("mgk", 2)], 16, batch=2, steps=2, rounds=3, device="cpu",
                       embed_dim=32, head_dim=8)
    rows = got["rows"]
    assert [r["kind"] for r in rows] == ["softmax", "mgk"]
    for r in rows:
        assert set(FIELDS) <= set(r) and r["cache_bytes"] == r["cache_bytes_formula"]
        assert r["rounds"] == 3 and r["step_ms_min"] <= r["step_ms"] <= r["step_ms_max"] and r["same_process"]
        assert len(r["round_ms"]) == 3 and sorted(r["round_ms"])[1] == pytest.approx(r["step_ms"])
        paired = sorted(a / b for a, b in zip(r["round_ms"], rows[0]["round_ms"]))[1]
        assert r["paired_ratio"] == pytest.approx(paired)
    assert rows[0]["paired_ratio"] == 1.0


def test_cli_same_process_writes_every_row_and_says_so(tmp_path):
    out = tmp_path / "decode.json"
    cmd = [sys.executable, "-m", "mgk", "bench", "decode", "--targets", "layer,lm-small", "--kinds",
           "softmax:4,mgk:2", "--contexts", "8", "--batches", "1", "--steps", "1", "--rounds", "2", "--embed-dim",
           "32", "--head-dim", "8", "--same-process", "--json", str(out),
           *(x for kv in SMALL_LM for x in ("--set", kv))]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr
    result = json.loads(out.read_text())
    assert [(r["target"], r["kind"]) for r in result["rows"]] == [
        ("layer", "softmax"), ("layer", "mgk"), ("lm-small", "softmax"), ("lm-small", "mgk")]
    assert all(r["same_process"] and r["rounds"] == 2 for r in result["rows"])
    assert result["settings"]["same_process"] is True and "alternating in one process" in p.stdout


def test_compiled_rows_stand_beside_eager_ones_with_their_compile_time_apart(tmp_path):
    """--compile: each kind's step also through torch.compile over a cache of fixed capacity (generate's compiled
    step), its first, compiling step reported as compile_ms and kept out of step_ms; the table names the row."""
    out = tmp_path / "decode.json"
    cmd = [sys.executable, "-m", "mgk", "bench", "decode", "--targets", "layer,lm-small", "--kinds", "mgk:2",
           "--contexts", "8", "--batches", "1", "--steps", "2", "--rounds", "2", "--embed-dim", "32", "--head-dim",
           "8", "--same-process", "--compile", "--json", str(out), *(x for kv in SMALL_LM for x in ("--set", kv))]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["target"], r["compiled"]) for r in rows] == [("layer", False), ("layer", True), ("lm-small", False),
                                                          ("lm-small", True)]
    for r in rows:
        assert (r["compile_ms"] is not None) == r["compiled"] and r["cache_bytes"] == r["cache_bytes_formula"]
        if r["compiled"]:  # the compiling step took far longer than any timed one, which it is not among
            assert r["compile_ms"] > r["step_ms_max"] and len(r["round_ms"]) == 2
    assert result["settings"]["compile"] is True
    assert re.search(r"\| lm-small \| mgk, compiled \(\d+\.\d s\) \|", p.stdout)
