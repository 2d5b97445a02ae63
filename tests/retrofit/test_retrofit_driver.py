"""experiments/retrofit.py's report: the split it names is the one its numbers come from (a WikiText-103 copy
without a test split reports validation perplexity, and must not call it test), and its verdicts are the rule's."""
import importlib.util
import json
from pathlib import Path

import pytest

DRIVER = Path(__file__).resolve().parents[2] / "experiments" / "retrofit.py"


@pytest.fixture(scope="module")
def retrofit():
    spec = importlib.util.spec_from_file_location("retrofit_driver", DRIVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    values = {"gqa-8-kv2": 400.0, "mgk-4-similar": 300.0, "mgk-4-adjacent": 301.0, "softmax-4": 500.0}
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
