"""An attention option that the chosen kind does not take is an error naming the option and the kind; defaults of
such options are not passed and not reported as used."""
import json
import subprocess

import pytest

from mgk.attention import build_attention
from mgk.cli import main


def test_cli_refuses_pi_for_softmax_in_one_line(tmp_path, th):
    p = subprocess.run(th.mgk_cmd("train", "--attention", "softmax", "--pi", "soft_e", "--out", str(tmp_path / "r")),
                       env=th.env(), capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "'pi'" in lines[0] and "'softmax'" in lines[0], p.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("kind,args", [
    ("softmax", ["--set", "num_keys=3"]), ("softmax", ["--set", "sigma2=1,2"]), ("linear", ["--pi", "learned"]),
    ("linear", ["--set", "pi_shape=position"]), ("mlk", ["--set", "sigma2=[1.0,2.0]"]),
])
def test_every_option_set_on_purpose_is_checked(tmp_path, kind, args):
    option = args[-1].split("=")[0] if args[0] == "--set" else args[0][2:]
    with pytest.raises(SystemExit, match=f"'{option}'.*'{kind}'"):
        main(["train", "--attention", kind, *args, "--out", str(tmp_path / "r")])


def test_resume_refuses_an_inapplicable_override(tmp_path, th):
    out = tmp_path / "run"
    main(["train", "--attention", "softmax", "--steps", "2", "--out", str(out), *th.sets(*th.TINY)])
    with pytest.raises(SystemExit, match="'pi'.*'softmax'"):
        main(["train", "--resume", str(out), "--set", "pi=hard_e"])


def test_softmax_run_does_not_claim_mixture_options(tmp_path, th):
    out = tmp_path / "run"
    main(["train", "--attention", "softmax", "--steps", "2", "--out", str(out), *th.sets(*th.TINY)])
    res = json.loads((out / "results.json").read_text())
    assert res["pi"] is None and res["attention_options"] == {}
    out = tmp_path / "mgk"
    main(["train", "--attention", "smgk", "--pi", "hard_e", "--steps", "2", "--out", str(out), *th.sets(*th.TINY)])
    res = json.loads((out / "results.json").read_text())
    assert res["pi"] == "hard_e" and res["attention_options"]["pi"] == "hard_e"
    assert res["attention_options"]["num_keys"] == 2 and res["attention_options"]["max_len"] == 64


@pytest.mark.parametrize("kind,option", [("softmax", {"pi": "soft_e"}), ("softmax", {"max_len": 8}),
                                         ("linear", {"num_keys": 2}), ("smlk", {"sigma2": 1.0})])
def test_build_attention_refuses_inapplicable_options(kind, option):
    name = next(iter(option))
    with pytest.raises(ValueError, match=f"'{name}'.*'{kind}'"):
        build_attention(kind, 16, 2, **option)


def test_build_attention_checks_option_types():
    with pytest.raises(ValueError, match="'num_keys'.*int"):
        build_attention("mgk", 16, 2, num_keys="2")
    assert build_attention("mgk", 16, 2, num_keys=3, sigma2=[1.0, 2.0, 3.0]).num_keys == 3
