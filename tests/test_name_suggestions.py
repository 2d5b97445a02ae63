"""A mistyped task, attention kind, preset, experiment or scale is answered by every command in one line that names
what was mistyped, lists the names that exist and suggests the close ones (``mgk train --task listop`` used to say
``no preset 'listop-small'``, a preset problem, without listing the tasks)."""
from __future__ import annotations

import pytest

from mgk.attention import attention_kinds
from mgk.choices import did_you_mean, require, unknown
from mgk.cli import main
from mgk.reproduce import EXPERIMENTS
from mgk.tasks import TASKS, all_presets


def _line(capsys, argv) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code not in (0, None)
    err = capsys.readouterr().err
    line = e.value.code if isinstance(e.value.code, str) else err.strip().splitlines()[-1]
    assert "\n" not in line and "Traceback" not in err
    return line


def test_a_mistyped_task_names_the_tasks_not_a_preset(capsys):
    line = _line(capsys, ["train", "--task", "listop"])
    assert line.startswith("mgk train: ") and "unknown task 'listop'" in line
    assert "did you mean 'listops'?" in line
    assert all(t in line for t in TASKS) and "preset" not in line


@pytest.mark.parametrize("argv, what, wrong, meant, names", [
    (["train", "--preset", "listops-smal"], "preset", "listops-smal", "listops-small", sorted(all_presets())),
    (["train", "--attention", "mgkk"], "attention kind", "mgkk", "mgk", attention_kinds()),
    (["data", "check", "--task", "listop", "--data", "."], "task", "listop", "listops", TASKS),
    (["data", "check", "--task", "lm", "--preset", "wt103-smal", "--data", "."], "preset", "wt103-smal",
     "wt103-small", sorted(all_presets())),
    (["reproduce", "lra-sofmax-family", "--dry-run"], "experiment", "lra-sofmax-family", "lra-softmax-family",
     EXPERIMENTS),
    (["reproduce", "wt103", "--scale", "papr", "--dry-run"], "scale", "papr", "paper", ("paper", "cpu", "smoke")),
])
def test_every_command_suggests_the_close_name(capsys, argv, what, wrong, meant, names):
    line = _line(capsys, argv)
    assert line.startswith(f"mgk {' '.join(argv[:2]) if argv[0] == 'data' else argv[0]}: "), line
    assert f"unknown {what} {wrong!r}" in line and f"{meant!r}" in line.split("did you mean", 1)[1], line
    assert all(n in line for n in names), line


@pytest.mark.parametrize("argv, fragment", [
    (["train", "--set", "attention=mgkk"], "got 'mgkk' (did you mean 'mgk'"),
    (["train", "--set", "task=listop"], "unknown task 'listop' (did you mean 'listops'?)"),
    (["train", "--set", "pi=soft-e"], "got 'soft-e' (did you mean 'soft_e'?)"),
    (["reproduce", "wt103", "--only", "row=mgk4", "--dry-run"], "--only row=mgk4: not in wt103 (did you mean 'mgk-4'"),
    (["reproduce", "wt103", "--data", "lmm=/x", "--dry-run"], "no task 'lmm' (did you mean 'lm'?)"),
])
def test_names_given_through_set_only_and_data_are_suggested_too(capsys, argv, fragment):
    assert fragment in _line(capsys, argv)


def test_the_suggestion_helper():
    assert did_you_mean("listop", TASKS) == " (did you mean 'listops'?)"
    assert did_you_mean("zzzz", TASKS) == "" and did_you_mean(3, TASKS) == ""
    assert did_you_mean("wt103", ["wt103-paper", "wt103-small", "lm-small"]).count("wt103-") == 2
    assert unknown("task", "x", ["a", "b"]) == "unknown task 'x'; choose from a, b"
    assert require("task", "lm", TASKS) == "lm"
    with pytest.raises(ValueError, match=r"unknown task 'lmm' \(did you mean 'lm'\?\); choose from listops, lm"):
        require("task", "lmm", TASKS)


@pytest.mark.parametrize("argv, prefix, fragment, names", [
    (["bench", "model", "--task", "listop"], "mgk bench model: ", "unknown task 'listop' (did you mean 'listops'?)",
     TASKS),
    (["bench", "model", "--preset", "listops-smal"], "mgk bench model: ",
     "unknown preset 'listops-smal' (did you mean 'listops-small'", sorted(all_presets())),
    (["bench", "attention", "--kinds", "mgkk:4"], "mgk bench attention: ",
     "unknown kind 'mgkk' (did you mean 'mgk'", attention_kinds()),
    (["bench", "model", "--kinds", "softmaxx:8"], "mgk bench model: ", "unknown kind 'softmaxx' (did you mean "
     "'softmax'?)", attention_kinds()),
    (["train", "--pi", "soft-e"], "mgk train: ", "unknown pi mode 'soft-e' (did you mean 'soft_e'?)",
     ("learned", "soft_e", "hard_e")),
])
def test_bench_and_the_pi_flag_suggest_the_close_name_and_list_the_names(capsys, argv, prefix, fragment, names):
    """`mgk bench model --task listop` used to answer with a preset problem (`unknown preset 'listop-small'`)."""
    line = _line(capsys, argv)
    assert line.startswith(prefix) and fragment in line and "preset 'listop-small'" not in line, line
    assert all(n in line for n in names), line


@pytest.mark.parametrize("argv, line", [
    (["train", "--set", "batch_siz=3"], "mgk train: --set batch_siz: unknown config field; did you mean 'batch_size'?"),
    (["train", "--set", "attention.options.sigma=2"], "mgk train: --set attention.options.sigma: unknown config "
     "field; did you mean 'attention.options.sigma2' or 'attention.options.pi'?"),
    (["data", "check", "--task", "listops", "--data", ".", "--set", "lrr=3"],
     "mgk data check: --set lrr: unknown config field; did you mean 'lr'?"),
    (["bench", "model", "--set", "batch_siz=3"],
     "mgk bench model: --set batch_siz: unknown config field; did you mean 'batch_size'?"),
    (["bench", "decode", "--set", "num_keyz=2"],
     "mgk bench decode: --set num_keyz: unknown config field; did you mean 'num_keys'?"),
    (["train", "--attention", "softmax", "--set", "num_keys=2"], "mgk train: --set num_keys: attention option "
     "'num_keys' does not apply to attention kind 'softmax' (softmax takes no options)"),
])
def test_an_unknown_set_field_is_one_line_naming_the_flag_and_the_field(capsys, argv, line):
    """As for --task: the flag and the field, named once (bench used to say `--set: --set batch_siz`), and the close
    names; an option the chosen kind does not take names the --set that gave it."""
    assert _line(capsys, argv) == line
