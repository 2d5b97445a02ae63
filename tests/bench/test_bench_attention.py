"""`mgk bench attention`: the FLOP model, one measured row per kind, the JSON schema and argument errors.
(No timing is asserted: speed claims live in BENCHMARKS.md.)"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from mgk.bench.attention import analytic_flops, measure, table
from mgk.bench.cli import _kinds
from mgk.functional import _mixture_flash

SMALL = dict(batch=1, embed_dim=32, head_dim=8, causal=False, backward=True, dtype="float32", repeats=1,
             device="cpu")


def core(kind, heads, N=4096, **kw):
    """Attention-core FLOPs: the count minus its projections (embed_dim 0 removes them)."""
    return analytic_flops(kind, heads, N, 1, 0, 32, causal=False, backward=False, **kw)


def test_mixture_kernel_does_three_quarters_of_softmax8_in_the_core():
    """MGK-4 with 2 keys: 4 heads x (2 score + 1 value products) against 8 heads x 2 products (0.75)."""
    assert core("mgk", 4, mixture_kernel=True) / core("softmax", 8) == pytest.approx(0.75)
    # the SDPA form pays M value products and one extra column per score
    assert core("mgk-sdpa", 4) / core("softmax", 8) == pytest.approx((2 * 2 * 33 + 2 * 2 * 32) * 4 / (4 * 32 * 8))
    assert core("mgk", 4, mixture_kernel=False) == core("mgk-sdpa", 4)


def test_projection_flops_of_mgk4_are_five_eighths_of_softmax8():
    """q, v, out and two key projections for 4 heads against q, k, v, out for 8 heads: 5 * 4 / (4 * 8)."""
    def proj(kind, heads):
        return analytic_flops(kind, heads, 4096, 1, 256, 32, causal=False, backward=False) - \
            core(kind, heads, mixture_kernel=False)
    assert proj("mgk", 4) / proj("softmax", 8) == pytest.approx(5 * 4 / (4 * 8))


def test_analytic_count_matches_torch_flop_counter_for_softmax():
    """FlopCounterMode counts matmuls and SDPA; our formula for softmax must agree with it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from mgk.bench.attention import build_kind

    module = build_kind("softmax", 4, 64, 16, 128)
    x = torch.randn(2, 128, 64)
    # the math backend is plain matmuls, which the counter sees (it has no formula for the CPU flash kernel)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        module(x, need_weights=False)
    assert counter.get_total_flops() == analytic_flops("softmax", 4, 128, 2, 64, 16, causal=False, backward=False)


@pytest.mark.parametrize("kind", ["softmax", "mgk", "mgk-sdpa", "mgk-hard", "mgk-softe", "mlk", "reference"])
def test_measure_returns_a_complete_row(kind, one_thread):
    row = measure(kind, 2, 64, **SMALL)
    assert {"kind", "length", "time_ms", "peak_mem_mb", "flops", "params"} <= set(row)
    assert row["time_ms"] > 0 and row["flops"] > 0 and row["params"] > 0
    kernel = _mixture_flash.available(torch.zeros(1), 0.0)
    expected = {"mgk": "kernel" if kernel else "sdpa", "mgk-softe": "kernel" if kernel else "sdpa",
                "mgk-sdpa": "sdpa", "mgk-hard": "kernel" if kernel else "explicit"}.get(kind)
    assert row["mgk_path"] == expected


def test_mgk_sdpa_kind_pins_the_backend_on_the_module_only():
    """mgk-sdpa maps onto backend="sdpa" of its own module; nothing process-wide changes."""
    from mgk.bench.attention import build_kind

    assert build_kind("mgk-sdpa", 2, 16, 4, 8).backend == "sdpa"
    assert build_kind("mgk", 2, 16, 4, 8).backend is None


def test_cli_writes_json_rows_and_a_table(tmp_path):
    out = tmp_path / "bench.json"
    p = subprocess.run([sys.executable, "-m", "mgk", "bench", "attention", "--lengths", "32,48", "--kinds",
                        "softmax:2,mgk:1,linear:2", "--embed-dim", "16", "--head-dim", "4", "--repeats", "1",
                        "--backward", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    result = json.loads(out.read_text())
    assert {"rows", "machine", "torch"} <= set(result)
    assert [(r["kind"], r["length"]) for r in result["rows"]] == [(k, n) for n in (32, 48)
                                                                  for k in ("softmax", "mgk", "linear")]
    assert "| mgk | 1 | 32 |" in p.stdout
    assert table(result).count("\n") == 1 + len(result["rows"])


@pytest.mark.parametrize("text,message", [("mgk", "NAME:HEADS"), ("mgk:0", ">= 1"), ("flash:4", "unknown kind"),
                                          ("gqa+num_kv_heads=2+num_kv_heads=4:8", "given twice"),
                                          ("gqa+num_kv_heads=3:8", "num_kv_heads=3 must divide num_heads=8"),
                                          ("softmax:8,gqa+num_kv_heads=16:8", "num_kv_heads=16 must divide")])
def test_bad_kinds_are_refused_by_name(text, message):
    """Every kind a bench takes is built once at head size 1 while --kinds is parsed, so a kind that cannot have
    the heads asked for is one line before any row runs (it was an error row per cell after a full run)."""
    with pytest.raises(SystemExit, match=message):
        _kinds(text)


@pytest.mark.parametrize("text", ["softmax:8,gqa+num_kv_heads=2:8,gqa+num_kv_heads=8:8,mgk:4,smgk:4,linear:8,mlk:4",
                                  "mgk-hard:4,mgk-softe:4,mgk-sdpa:4,reference:4,mgk:1,gqa+num_kv_heads=1:3"])
def test_good_kinds_pass_the_build_check(text):
    assert [h for _, h in _kinds(text)] == [int(item.split(":")[1]) for item in text.split(",")]


def test_table_has_no_nan_when_the_first_row_allocated_nothing():
    rows = [{"kind": k, "heads": 4, "length": 16, "time_ms": t, "peak_mem_mb": m, "flops": 1e7, "params": 10}
            for k, t, m in (("gqa", 2.0, 0.0), ("mgk", 4.0, 3.0))]
    text = table({"rows": rows})
    assert "nan" not in text and "| mgk | 4 | 16 | 4.0 | 2.00 | 3 | — |" in text
    rows[0]["peak_mem_mb"] = 1.5
    assert "| mgk | 4 | 16 | 4.0 | 2.00 | 3 | 2.00 |" in table({"rows": rows})


@pytest.mark.parametrize("args,message", [
    (["--repeats", "0"], "--repeats: must be > 0"), (["--batch", "-3"], "--batch: must be > 0"),
    (["--head-dim", "0"], "--head-dim: must be > 0"), (["--timeout", "-1"], "--timeout: must be in (0,"),
    (["--device", "bogus"], "is not a torch device"), (["--json", "/proc/nope/r.json"], "cannot write"),
    (["--json", "/tmp"], "is a directory")])
def test_bad_arguments_give_one_line_before_running(args, message):
    p = subprocess.run([sys.executable, "-m", "mgk", "bench", "attention", "--lengths", "16", "--kinds", "softmax:1",
                        *args], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    assert message in p.stderr and "Traceback" not in p.stderr
    assert p.stdout == ""  # refused before any measurement


def test_failed_rows_make_a_nonzero_exit(tmp_path):
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, "-m", "mgk", "bench", "attention", "--lengths", "16", "--kinds", "softmax:1",
                        "--timeout", "0.001", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "1 of 1 rows failed" in p.stdout
    assert "timeout" in json.loads(out.read_text())["rows"][0]["error"]


def test_peak_memory_is_not_inflated_by_first_call_imports(one_thread):
    """The first call of the kernel's custom op imports modules (tens of MB); measure() warms up first."""
    small = dict(SMALL, embed_dim=16, head_dim=4, backward=False)
    kernel = measure("mgk", 1, 16, **small)["peak_mem_mb"]
    sdpa = measure("mgk-sdpa", 1, 16, **small)["peak_mem_mb"]
    assert kernel < 5 and sdpa < 5, (kernel, sdpa)


def test_same_process_takes_turns_and_reports_rounds_and_paired_ratios(one_thread):
    """--same-process: the kinds of a length built in one process, then round after round each makes its calls in
    turn; a row's time is the median of its round medians, its ratio the median of per-round ratios to the first
    kind, and no peak memory is claimed (one process holds every kind)."""
    from mgk.bench.attention import measure_together

    got = measure_together([("softmax", 2), ("mgk", 1)], 32, rounds=3, **{**SMALL, "repeats": 2})
    rows = got["rows"]
    assert [r["kind"] for r in rows] == ["softmax", "mgk"]
    for r in rows:
        assert r["rounds"] == 3 and len(r["round_ms"]) == 3 and r["same_process"] and r["peak_mem_mb"] is None
        assert r["time_ms_min"] <= r["time_ms"] <= r["time_ms_max"]
        assert sorted(r["round_ms"])[1] == pytest.approx(r["time_ms"])
        paired = sorted(a / b for a, b in zip(r["round_ms"], rows[0]["round_ms"]))[1]
        assert r["paired_ratio"] == pytest.approx(paired) and r["flops"] > 0 and r["params"] > 0
    assert rows[0]["paired_ratio"] == 1.0
    text = table({"rows": rows, "settings": {"same_process": True}})
    assert "x first (paired)" in text and "peak MB" not in text and text.count("\n") == 1 + len(rows)


def test_cli_same_process_records_the_load_and_refuses_rounds_alone(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "mgk", "bench", "attention", "--lengths", "16", "--kinds", "softmax:2,mgk:1",
           "--embed-dim", "16", "--head-dim", "4", "--repeats", "1", "--json", str(out)]
    p = subprocess.run([*cmd, "--same-process", "--rounds", "2"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    result = json.loads(out.read_text())
    assert result["settings"]["same_process"] is True and result["settings"]["rounds"] == 2
    assert all(r["rounds"] == 2 for r in result["rows"]) and "load average" in p.stdout
    assert set(result["load_average"]) == {"before", "after"} and isinstance(result["busy"], bool)
    p = subprocess.run([*cmd, "--rounds", "2"], capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "--rounds counts the rounds of --same-process" in p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""


@pytest.mark.parametrize("bench", ["attention", "model"])
def test_rows_are_timed_under_the_allocators_defaults_and_memory_measured_apart(bench, monkeypatch):
    """Measuring the resident set needs glibc's mmap threshold lowered, which costs every large allocation page
    faults (a layer call 17% slower, MGK-4's ratio to softmax-8 moved from 0.91 to 0.99): every timed row must run
    without it and the peak memory come from a second process that has it."""
    from mgk.bench import attention as bench_attention
    from mgk.bench import model as bench_model

    calls = []

    def fake_run_row(code, timeout, *, rss=True):
        calls.append((code, rss))
        if "measure_peak_memory" in code:
            return {"peak_mem_mb": 1.0, "train_peak_mem_mb": 1.0}
        return {"kind": "x", "time_ms": 1.0, "peak_mem_mb": None, "train_tokens_per_s": 1.0}

    monkeypatch.setattr(bench_attention if bench == "attention" else bench_model, "run_row", fake_run_row)
    if bench == "attention":
        bench_attention.run([("softmax", 2), ("mgk", 1)], [16], timeout=60, **{**SMALL, "causal": True})
    else:
        bench_model.run("listops-small", [], kinds=[("softmax", 2), ("mgk", 1)], steps=1, device="cpu", timeout=60)
    timed = [rss for code, rss in calls if "peak_memory=False" in code]
    memory = [rss for code, rss in calls if "measure_peak_memory" in code]
    assert timed == [False, False] and memory == [True, True] and len(calls) == 4
