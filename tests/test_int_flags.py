"""Integers the commands pass to torch (issue 30 #9): a seed beyond what torch takes, or any size or count beyond a
64-bit integer, is refused in one line naming the flag or field and its range, never torch's "Overflow when
unpacking long long". A seed anywhere in the range trains (derived seeds are reduced mod 2^64: mgk.seeds)."""
import pytest

from mgk.cli import main
from mgk.seeds import SEED_MAX, torch_seed

BIG = str(2 ** 64)


def _one_line_error(capsys, argv) -> str:
    """The message `mgk ARGV` ends with (argparse's exit on stderr, or the SystemExit text), checked to be one
    line."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    text = e.value.code if isinstance(e.value.code, str) else capsys.readouterr().err
    assert text.strip() and "\n" not in text.strip(), text
    assert "Overflow" not in text
    return text


@pytest.mark.parametrize("value", [BIG, "-1"])
@pytest.mark.parametrize("command", [["generate", "RUN", "--prompt", "a"], ["analyze", "RUN"],
                                     ["train", "--steps", "1"]])
def test_every_seed_flag_names_itself_and_its_range(capsys, command, value):
    text = _one_line_error(capsys, [*command, "--seed", value])
    assert "--seed" in text and f"[0, {SEED_MAX}]" in text, text


@pytest.mark.parametrize("field", ["seed", "split_seed"])
def test_seed_fields_of_the_config_name_themselves_and_their_range(capsys, tmp_path, field):
    text = _one_line_error(capsys, ["train", "--out", str(tmp_path / "r"), "--set", f"{field}={BIG}"])
    assert f"{field} must be in [0, {SEED_MAX}]" in text, text


@pytest.mark.parametrize("field", ["batch_size", "steps", "num_heads", "gen_train", "eval_every"])
def test_any_integer_field_beyond_64_bits_is_one_line(capsys, tmp_path, field):
    text = _one_line_error(capsys, ["train", "--out", str(tmp_path / "r"), "--set", f"{field}={2 ** 63}"])
    assert field in text and "64-bit" in text, text


@pytest.mark.parametrize("argv", [
    ["generate", "RUN", "--prompt", "a", "--max-new-tokens", BIG],
    ["generate", "RUN", "--prompt", "a", "--top-k", BIG],
    ["bench", "attention", "--batch", BIG],
    ["bench", "attention", "--lengths", f"16,{BIG}"],
    ["bench", "attention", "--kinds", f"mgk:{BIG}"],
    ["bench", "decode", "--contexts", BIG],
    ["bench", "decode", "--steps", BIG],
    ["bench", "model", "--steps", BIG],
])
def test_size_and_count_flags_beyond_64_bits_are_one_line(capsys, argv):
    flag = [a for a in argv if a.startswith("--")][-1]
    text = _one_line_error(capsys, argv)
    assert flag in text, text


def test_the_largest_seed_trains(tmp_path, th):
    """seed * 7919 + rank and the data order's seed * 1_000_003 + epoch overflowed torch for large seeds."""
    main(["train", "--attention", "softmax", "--steps", "1", "--out", str(tmp_path / "r"),
          *th.sets(*th.TINY, f"seed={SEED_MAX}")])
    assert (tmp_path / "r" / "results.json").is_file()


def test_torch_seed_keeps_every_seed_that_fits():
    assert [torch_seed(s) for s in (0, 1, 12345, SEED_MAX)] == [0, 1, 12345, SEED_MAX]
    assert torch_seed(SEED_MAX * 7919 + 3) == (SEED_MAX * 7919 + 3) % 2 ** 64
