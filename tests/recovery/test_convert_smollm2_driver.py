"""experiments/convert_smollm2.py's verdicts are its pre-registered rule (results/cpu/convert-smollm2.md): the
checks, rule 1 by kv-budget.md's compare and rule 2 against the straight line between GQA-1 recovered and the
source at the groups row's cache, with the larger of the two stds as the margin; a rule lacking n = 3 says so."""
import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def driver(th):
    return th.experiment("convert_smollm2")


def _record(folder: Path, cells: dict) -> Path:
    for name, ppl in cells.items():
        (folder / f"{name}.json").write_text(json.dumps({"name": name, "score": {"perplexity": ppl},
                                                         "run": {"seconds": 1.0}}))
    return folder


def _cells(gqa, shifted, groups):
    cells = {"source": 27.0, "gmgk-3-exact-step0": 27.001, "gqa-1-step0": 20000.0}
    for label, values in (("gqa-1", gqa), ("gmgk-1-shifted", shifted), ("gmgk-1-groups", groups)):
        cells.update({f"{label}-s{seed}": v for seed, v in enumerate(values)})
    return cells


# frontier at 259 between gqa-1's mean 360 (cache 128) and the source 27 (384): 360 + 131 / 256 (27 - 360) = 189.60
@pytest.mark.parametrize("groups,verdict", [
    ((150.0, 151.0, 152.0), "mixture keys convert better than GQA"),
    ((189.0, 190.0, 191.0), "on the frontier"),
    ((250.0, 251.0, 252.0), "worse than GQA's frontier"),
])
def test_rule_two_is_the_frontier_with_the_larger_std_as_margin(tmp_path, driver, groups, verdict):
    text = driver.verdicts(_record(tmp_path, _cells((355.0, 360.0, 365.0), (361.0, 359.0, 360.0), groups)))
    assert "p* = 189.60" in text and f"-> {verdict}" in text and "not final" not in text
    assert "check 0a" in text and "holds" in text
    assert "rule 1: gmgk-1-shifted" in text and "within one std" in text


def test_a_rule_short_of_three_seeds_says_it_is_not_final(tmp_path, driver):
    text = driver.verdicts(_record(tmp_path, _cells((355.0, 360.0), (300.0, 301.0, 302.0), (150.0, 151.0))))
    assert "rule 1" in text and "better" in text and "not final" in text
    assert "rule 2" in text and text.count("not final") == 2


def test_a_failed_exactness_check_is_named(tmp_path, driver):
    cells = _cells((355.0, 360.0, 365.0), (), ())
    cells["gmgk-3-exact-step0"] = 27.5
    assert "FAILS" in driver.verdicts(_record(tmp_path, cells))
