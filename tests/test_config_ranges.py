"""Values out of a field's range are refused by the config check, naming the field (its --set name) and the range,
before anything trains."""
import re

import pytest

from mgk import config as config_mod
from mgk.cli import main


@pytest.mark.parametrize("pair, range_text", [
    ("warmup_steps=-5", ">= 0"), ("grad_clip=-1", ">= 0"), ("classifier_dim=0", ">= 1"), ("adam_eps=0", "> 0"),
    ("val_fraction=1.5", "in [0, 1)"), ("segment_len=0", ">= 1")])
def test_out_of_range_values_are_refused_naming_field_and_range(pair, range_text):
    name = pair.split("=")[0]
    with pytest.raises(ValueError, match=re.escape(f"config field {name} must be {range_text}, got")):
        config_mod.validate(config_mod.apply_overrides(config_mod.RunConfig(), [pair]))


def test_mgk_train_answers_an_out_of_range_value_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"mgk train: config field adam_eps must be > 0, got 0.0$"):
        main(["train", "--steps", "1", "--out", str(tmp_path / "r"), "--set", "adam_eps=0"])
    assert not (tmp_path / "r").exists()
