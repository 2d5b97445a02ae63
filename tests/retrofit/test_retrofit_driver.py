"""experiments/retrofit.py's report: the split it names is the one its numbers come from (a WikiText-103 copy
without a test split reports validation perplexity, and must not call it test), and its verdicts are the rule's."""
import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def retrofit(th):
    return th.experiment("retrofit")


def _runs(out: Path, retrofit, split: str, metric: str, values: dict) -> list:
    """Finished continued runs for seeds 0-2: results.json with ``split`` only, metrics.jsonl with a step-0 line."""
    sources = [(seed, out / "src" / f"seed{seed}") for seed in range(3)]
    for target in retrofit.TARGETS:
        for frac in retrofit.FRACTIONS:
            for seed, _ in sources:
                run = out / target / f"f{frac:.2f}" / f"seed{seed}"
                run.mkdir(parents=True)
                v = values[target] * (1 + 0.01 * seed) * (1 - frac)
                (run / "results.json").write_text(json.dumps({"seed": seed, "steps": 10, split: {metric: v}}))
                (run / "metrics.jsonl").write_text(json.dumps({"step": 0, f"val/{metric}": 2 * v}) + "\n")
    return sources


@pytest.mark.parametrize("split,key,name", [("val", "ppl", "validation"), ("test", "nmse", "test")])
def test_the_report_names_the_split_its_numbers_come_from(tmp_path, retrofit, split, key, name):
    values = {"gqa-8-kv2": 400.0, "mgk-4-similar": 300.0, "mgk-4-adjacent": 301.0, "softmax-4": 500.0,
              "gmgk-8-kv2-shifted": 410.0, "gmgk-8-kv1": 450.0}
    sources = _runs(tmp_path, retrofit, split, key, values)
    result = retrofit.collect(tmp_path, sources, retrofit.FRACTIONS, "lm")
    assert result["split"] == name and result["metric"] == key
    path = retrofit.report(result, {}, tmp_path, "lm", 100, "cmd")
    text = path.read_text()
    assert text.splitlines()[4].startswith(f"{name.capitalize()} {key} (mean")
    assert ("Test" in text.splitlines()[4]) == (name == "test")
    verdicts = {(c["row"], c["reference"]): c["verdict"] for c in result["comparisons"]["0.05"]}
    # 300 against 400 with a 1% spread: better; 300 against 301: within one std; 500 against 400: worse
    assert verdicts[("mgk-4-similar", "gqa-8-kv2")] == "better"
    assert verdicts[("mgk-4-similar", "mgk-4-adjacent")] == "within one std"
    assert verdicts[("softmax-4", "gqa-8-kv2")] == "worse"
    assert (tmp_path / "retrofit.png").stat().st_size > 0


def test_the_figure_draws_each_target_in_its_kinds_colour(tmp_path, retrofit):
    """The colours of mgk.figures (as every figure mgk draws): the two MGK targets share MGK's colour and differ in
    style; the from-scratch and source lines take their kind's colour too."""
    from matplotlib.colors import to_hex

    from mgk.figures import kind_colour

    values = {"gqa-8-kv2": 400.0, "mgk-4-similar": 300.0, "mgk-4-adjacent": 301.0, "softmax-4": 500.0,
              "gmgk-8-kv2-shifted": 410.0, "gmgk-8-kv1": 450.0}
    result = retrofit.collect(tmp_path, _runs(tmp_path, retrofit, "val", "ppl", values), retrofit.FRACTIONS, "lm")
    scratch = {row: {"mean": 350.0, "std": 1.0, "n": 3} for row in ("gqa-8-kv2", "mgk-4", "softmax-4", "softmax-8")}
    fig = retrofit.figure(result, scratch, "lm", 100, "validation ppl")
    [ax] = fig.axes
    lines = {c.get_label(): c.lines[0] for c in ax.containers}
    lines.update({ln.get_label(): ln for ln in ax.get_lines() if not ln.get_label().startswith("_")})
    want = {"gqa-8-kv2 (converted)": "gqa", "mgk-4-similar (converted)": "mgk", "mgk-4-adjacent (converted)": "mgk",
            "softmax-4 (converted)": "softmax", "mgk-4 from scratch (100 steps)": "mgk",
            "softmax-8 (source)": "softmax"}
    assert {label: to_hex(lines[label].get_color()) for label in want} == {
        label: to_hex(kind_colour(kind)) for label, kind in want.items()}
    similar, adjacent = lines["mgk-4-similar (converted)"], lines["mgk-4-adjacent (converted)"]
    assert (similar.get_linestyle(), similar.get_marker()) != (adjacent.get_linestyle(), adjacent.get_marker())


def test_targets_restrict_the_runs_and_keep_the_budget_order(tmp_path, retrofit):
    sources = [(0, tmp_path / "s0"), (1, tmp_path / "s1")]
    jobs = retrofit.plan(sources, 200, tmp_path, retrofit._targets("gmgk-8-kv1, gqa-8-kv2"))
    runs = [str(run.relative_to(tmp_path)) for _, run in jobs]
    assert runs[:4] == ["gmgk-8-kv1/f0.05/seed0", "gmgk-8-kv1/f0.05/seed1", "gqa-8-kv2/f0.05/seed0",
                        "gqa-8-kv2/f0.05/seed1"]
    assert len(runs) == 2 * 2 * len(retrofit.FRACTIONS)
    steps = {run.parent.name: cmd[cmd.index("--steps") + 1] for cmd, run in jobs}
    assert steps == {"f0.05": "10", "f0.10": "20", "f0.20": "40"}
    assert len(retrofit.plan(sources, 200, tmp_path, retrofit._targets(",".join(retrofit.TARGETS)))) == \
        2 * len(retrofit.TARGETS) * len(retrofit.FRACTIONS)


@pytest.mark.parametrize("text", ["gqa-8-kv3", "", "gqa-8-kv2,mgk-8"])
def test_an_unknown_target_is_refused_in_one_line_naming_the_option(retrofit, text):
    with pytest.raises(SystemExit) as err:
        retrofit._targets(text)
    message = str(err.value)
    assert message.startswith("retrofit: --targets:") and "\n" not in message and "gqa-8-kv2" in message
