"""``mgk generate``: on a short lm-small run it prints continuations, reproducible with --seed; greedy output equals
the argmax of the uncached model step by step; words in and out in the run's vocabulary; every mistake one line."""
from __future__ import annotations

import pytest
import torch

from mgk.cli import main
from mgk.config import to_dict
from mgk.data.wikitext import EOS, UNK
from mgk.tasks import all_presets
from mgk.train.load import load_run
from mgk.train.rundir import write_config

SHORT = ["batch_size=4", "segment_len=16", "max_len=16", "d_model=16", "num_layers=2", "ffn_dim=32", "head_dim=8",
         "log_every=1", "eval_every=3", "checkpoint_every=3", "eval_batch_size=8", "warmup_steps=1", "progress=false",
         "gen_train=80", "gen_val=12", "gen_test=12"]


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    """A 3-step lm-small run (MGK, 2 heads) on the generated corpus."""
    out = tmp_path_factory.mktemp("gen") / "run"
    main(["train", "--preset", "lm-small", "--attention", "mgk", "--heads", "2", "--steps", "3", "--out", str(out),
          *(x for kv in SHORT for x in ("--set", kv))])
    return out


def _generate(capsys, *args):
    assert main(["generate", *map(str, args)]) == 0
    return capsys.readouterr()


def test_prints_continuations_reproducible_with_the_seed(lm_run, capsys):
    vocab = load_run(lm_run).tokenizer.vocab
    prompt = " ".join(vocab.words[3:7])
    first = _generate(capsys, lm_run, "--prompt", prompt, "--max-new-tokens", 12, "--seed", 1).out
    again = _generate(capsys, lm_run, "--prompt", prompt, "--max-new-tokens", 12, "--seed", 1).out
    other = _generate(capsys, lm_run, "--prompt", prompt, "--max-new-tokens", 12, "--seed", 2).out
    assert first == again and first != other
    assert first.startswith(prompt) and len(first.split()) > len(prompt.split())
    many = _generate(capsys, lm_run, "--prompt", prompt, "--max-new-tokens", 4, "--num-samples", 3).out
    assert [line for line in many.splitlines() if line.startswith("---")] == [
        f"--- sample {i} of 3 ---" for i in (1, 2, 3)]


def test_greedy_output_is_the_argmax_of_the_uncached_model_step_by_step(lm_run, capsys):
    run = load_run(lm_run, device="cpu")
    model, vocab = run.model, run.tokenizer.vocab
    prompt = " ".join(vocab.words[10:15])
    printed = _generate(capsys, lm_run, "--prompt", prompt, "--max-new-tokens", 15, "--temperature", 0,
                        "--device", "cpu").out
    seq = torch.tensor([run.tokenizer.encode(prompt)])
    with torch.no_grad():
        for _ in range(15):
            seq = torch.cat([seq, model.log_probs(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert printed.rstrip("\n") == run.tokenizer.decode(seq[0].tolist()).rstrip("\n")
    uncached = _generate(capsys, lm_run, "--prompt", prompt, "--max-new-tokens", 15, "--temperature", 0,
                         "--no-cache").out
    assert uncached == printed


def test_compile_prints_the_eager_greedy_text_and_needs_the_cache(lm_run, capsys):
    prompt = " ".join(load_run(lm_run).tokenizer.vocab.words[10:15])
    args = (lm_run, "--prompt", prompt, "--max-new-tokens", 8, "--temperature", 0, "--device", "cpu")
    eager = _generate(capsys, *args).out
    torch._dynamo.reset()
    assert _generate(capsys, *args, "--compile").out == eager
    assert "drop --no-cache" in _one_line_error(*args, "--compile", "--no-cache")


def test_unknown_words_are_read_as_unk_and_reported(run_v0_1_0, capsys):
    run_dir, _ = run_v0_1_0
    res = _generate(capsys, run_dir, "--prompt", "tonto zzqq . yyxx zzqq", "--max-new-tokens", 3)
    assert res.err.strip() == ("mgk generate: 2 prompt word(s) not in the run's vocabulary, read as <unk>: zzqq, "
                               "yyxx")
    assert res.out.startswith(f"tonto {UNK} . {UNK} {UNK} ")


def test_a_prompt_file_ends_its_lines_with_eos(run_v0_1_0, tmp_path, capsys):
    run_dir, _ = run_v0_1_0
    tokenizer = load_run(run_dir).tokenizer
    vocab = tokenizer.vocab
    assert tokenizer.encode("tonto .\nenber\n") == [vocab.id(w) for w in ["tonto", ".", EOS, "enber", EOS]]
    assert tokenizer.encode("") == []
    empty = _generate(capsys, run_dir, "--prompt", "", "--max-new-tokens", 3, "--temperature", 0).out
    # an empty prompt starts at a line boundary: the continuation of a lone <eos>
    start = load_run(run_dir).model.generate(torch.tensor([[vocab.id(EOS)]]), 3, temperature=0)
    assert empty.rstrip("\n") == tokenizer.decode(start[0].tolist()).rstrip("\n")
    (tmp_path / "p.txt").write_text("tonto .\nenber", encoding="utf-8")
    out = _generate(capsys, run_dir, "--prompt-file", tmp_path / "p.txt", "--max-new-tokens", 2).out
    assert out.startswith("tonto .\nenber ")


def _one_line_error(*args) -> str:
    with pytest.raises(SystemExit) as e:
        main(["generate", *map(str, args)])
    text = str(e.value.code)
    assert "\n" not in text and text.startswith("mgk generate: "), text
    return text


def test_a_classification_run_is_refused_in_one_line(tmp_path):
    run_dir = tmp_path / "listops"
    run_dir.mkdir()
    write_config(run_dir, to_dict(all_presets()["listops-small"]))
    assert "'listops' run (a classifier)" in _one_line_error(run_dir, "--prompt", "x")


def test_a_run_that_no_cache_serves_names_the_cli_flag_that_works(tmp_path, capsys):
    """normalize='length' refused the cache with the Python argument (use_cache=False) that the CLI does not take."""
    run_dir = tmp_path / "length"
    main(["train", "--preset", "lm-small", "--attention", "linear", "--heads", "2", "--steps", "1", "--out",
          str(run_dir), *(x for kv in [*SHORT, "normalize=length"] for x in ("--set", kv))])
    capsys.readouterr()
    assert "--no-cache" in _one_line_error(run_dir, "--prompt", "", "--max-new-tokens", 2)
    assert _generate(capsys, run_dir, "--prompt", "", "--max-new-tokens", 2, "--no-cache").out.strip()


def test_user_mistakes_are_one_line(run_v0_1_0, tmp_path, capsys):
    run_dir, _ = run_v0_1_0
    assert "is not a run directory" in _one_line_error(tmp_path / "nowhere", "--prompt", "x")
    assert "is not a file" in _one_line_error(run_dir, "--prompt-file", tmp_path / "missing.txt")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\xfa")
    assert "not UTF-8" in _one_line_error(run_dir, "--prompt-file", tmp_path / "bad.txt")
    assert "max_len" not in _one_line_error(run_dir, "--prompt", "x", "--device", "nosuchdevice")
    for bad in (["--temperature", "-1"], ["--top-p", "0"], ["--max-new-tokens", "0"], ["--prompt-file", "f"]):
        with pytest.raises(SystemExit):
            main(["generate", str(run_dir), "--prompt", "x", *bad])
        err = capsys.readouterr().err
        assert err.startswith("mgk generate: argument ") and err.count("\n") == 1, err


def test_generating_past_the_trained_segment_length_is_announced(lm_run, capsys):
    """The run trained on segments of 16 tokens: reading 19 positions says so on stderr (the output is still
    printed); 15 positions say nothing."""
    vocab = load_run(lm_run).tokenizer.vocab
    past = _generate(capsys, lm_run, "--prompt", " ".join(vocab.words[10:15]), "--max-new-tokens", 15)
    assert past.err.strip() == ("mgk generate: warning: the model will read 19 positions, past the 16 it was trained "
                                "on (segment_len): its predictions there were never trained")
    assert past.out.strip()
    within = _generate(capsys, lm_run, "--prompt", " ".join(vocab.words[3:7]), "--max-new-tokens", 12)
    assert within.err == ""
