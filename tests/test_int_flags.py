"""Integers the commands pass to torch: a seed beyond what torch takes, or any size or count beyond a
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


# Every entry point checks its own numbers: `mgk reproduce` used to pass a seed out of range on to the `mgk train`
# command line of each run, which exited with `mgk train`'s usage block about --seed; a bench --timeout beyond what
# a subprocess can wait ran the row, then died in a traceback; swap_attention(seed=2**64) gave torch's "Overflow
# when unpacking long long".
REPRODUCE = ["reproduce", "lra-softmax-family", "--scale", "smoke", "--only", "task=listops", "--only",
             "row=softmax-8", "--dry-run"]


@pytest.mark.parametrize("seeds", [BIG, "-1", f"0,{BIG}"])
def test_reproduce_checks_its_seeds_itself(capsys, tmp_path, seeds):
    text = _one_line_error(capsys, [*REPRODUCE, "--out", str(tmp_path), "--seeds", seeds])
    assert text.startswith("mgk reproduce: argument --seeds") and f"[0, {SEED_MAX}]" in text, text
    assert "mgk train" not in text


@pytest.mark.parametrize("flag, value", [("--jobs", BIG), ("--threads", str(2 ** 31)), ("--threads", "-1"),
                                         ("--analyze", BIG)])
def test_reproduce_numeric_flags_name_themselves(capsys, tmp_path, flag, value):
    text = _one_line_error(capsys, [*REPRODUCE, "--out", str(tmp_path), "--seeds", "0", flag, value])
    assert text.startswith(f"mgk reproduce: argument {flag}: must be"), text


@pytest.mark.parametrize("argv", [
    ["bench", "attention", "--timeout", "1e300", "--lengths", "16", "--kinds", "softmax:1", "--repeats", "1",
     "--embed-dim", "8", "--head-dim", "4"],
    ["bench", "decode", "--timeout", "3e6", "--targets", "layer", "--kinds", "softmax:1", "--contexts", "8",
     "--batches", "1", "--steps", "1", "--embed-dim", "8", "--head-dim", "4"],
    ["train", "--threads", str(2 ** 31), "--steps", "1"],
])
def test_time_and_thread_flags_beyond_what_the_system_takes_are_one_line(capsys, argv):
    flag = next(a for a in argv if a in ("--timeout", "--threads"))
    text = _one_line_error(capsys, argv)
    assert f"argument {flag}: must be in" in text, text


def test_a_bench_row_waits_at_most_what_a_subprocess_can():
    """A cell's timeout times its kinds (--same-process) may pass the limit that --timeout itself keeps."""
    from mgk.bench.rows import run_row

    assert run_row("print('{\"ok\": 1}')", 1e300, rss=False) == {"ok": 1}


@pytest.mark.parametrize("seed", [2 ** 64, -1, True, 1.5])
def test_swap_attention_checks_its_seed(seed):
    import torch

    import mgk

    model = torch.nn.Sequential(torch.nn.MultiheadAttention(8, 2, batch_first=True))
    with pytest.raises(ValueError, match=rf"^swap_attention: seed must be an integer in \[0, {SEED_MAX}\]"):
        mgk.swap_attention(model, "mgk", seed=seed)
    assert isinstance(model[0], torch.nn.MultiheadAttention)  # refused before anything was replaced
    mgk.swap_attention(model, "mgk", seed=SEED_MAX)
