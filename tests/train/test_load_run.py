"""`mgk.load_run`: the one way to get a trained run back (model in eval mode on the device, its config, tokenizer,
checkpoint and where the run stands), from the run directory alone; `mgk eval` and `mgk analyze` go through it."""
import json
import shutil
import subprocess
import sys

import pytest
import torch

import mgk
from mgk.cli import main
from mgk.data.tokenizers import ByteTokenizer, ListOpsTokenizer, WordTokenizer
from mgk.models import LRAClassifier, TransformerLM
from mgk.train.lm_eval import evaluate_tokens
from mgk.train.rundir import RunFiles

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def listops_run(tmp_path_factory, th):
    out = tmp_path_factory.mktemp("load") / "lo"
    main(["train", "--steps", "4", "--out", str(out), *th.sets(*th.TINY, "eval_every=2", "gen_train=64",
                                                             "gen_val=16", "gen_test=16")])
    return out


def test_a_0_1_0_language_model_comes_back_with_its_vocabulary_and_perplexity(run_v0_1_0):
    run_dir, expected = run_v0_1_0
    run = mgk.load_run(run_dir)
    assert isinstance(run.model, TransformerLM) and not run.model.training
    assert run.cfg.task == "lm" and run.cfg.attention.kind == "mgk" and run.step == 4 and run.steps == 4
    assert run.checkpoint == RunFiles(run_dir).checkpoint("best") and run.finished and run.failure is None
    assert isinstance(run.tokenizer, WordTokenizer) and len(run.tokenizer) == run.cfg.model.vocab_size == 161
    words = [w for w in run.tokenizer.vocab.words[3:8] if w.isalpha()][:2]
    text = " ".join(words) + "\n" + words[0]
    ids = run.tokenizer.encode(text)
    assert ids[len(words)] == run.tokenizer.vocab.eos_id and run.tokenizer.decode(ids) == text
    # the model as `mgk eval` scores it: the perplexity 0.1.0 gave
    valid = (RunFiles(run_dir).data / "wiki.valid.tokens").read_text()
    tokens = torch.tensor(run.tokenizer.encode(valid))
    res = evaluate_tokens(run.model, tokens, context=run.cfg.data.segment_len, stride=run.cfg.data.segment_len)
    assert res["ppl"] == pytest.approx(expected["eval_valid_best_ppl"], rel=1e-6)
    last = mgk.load_run(run_dir, checkpoint="last")
    assert last.checkpoint.name == "last.pt" and last.step == 4


def test_a_classifier_comes_back_with_its_tokenizer_and_splits_on_demand(listops_run):
    run = mgk.load_run(listops_run, device="cpu")
    assert isinstance(run.model, LRAClassifier) and run.task.splits == {}  # no data read
    assert isinstance(run.tokenizer, ListOpsTokenizer)
    ids = torch.tensor([run.tokenizer.encode("[MAX 2 ( [MIN 3 4 ] ) 9 ]")])
    assert run.tokenizer.decode(ids[0]) == "[MAX 2 [MIN 3 4 ] 9 ]"
    logits = run.model(ids, torch.zeros_like(ids, dtype=torch.bool))
    assert logits.shape == (1, 10) and torch.isfinite(logits).all()
    full = run.with_splits()
    assert len(full.task.splits["train"]) == 64 and full.model is run.model
    # the same weights as the checkpoint
    state = torch.load(run.checkpoint, weights_only=True)["model"]
    assert all(torch.equal(v, state[k]) for k, v in run.model.state_dict().items())
    assert run.status() == "finished" and run.step == json.loads(RunFiles(listops_run).results.read_text())[
        "best_step"]


def test_an_unfinished_run_says_where_it_stands(listops_run, tmp_path, capsys):
    """Analysing a run whose best checkpoint is at step 2 of 8 says so, in one line and in analysis.md."""
    run_dir = tmp_path / "unfinished"
    shutil.copytree(listops_run, run_dir)
    RunFiles(run_dir).results.unlink()
    cfg = RunFiles(run_dir).config
    cfg.write_text(cfg.read_text().replace("\n  steps: 4\n", "\n  steps: 8\n"))
    run = mgk.load_run(run_dir)
    assert not run.finished and run.steps == 8
    assert run.status() == f"unfinished: best.pt at step {run.step} of 8"
    out = tmp_path / "analysis"
    main(["analyze", str(run_dir), "--samples", "2", "--no-progress", "--out", str(out)])
    notes = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("mgk analyze: ")]
    assert notes == [f"mgk analyze: {run_dir} is unfinished: best.pt at step {run.step} of 8 (no results.json "
                     "yet): the figures describe a model still in training"]
    md = (out / "analysis.md").read_text()
    assert f"at step {run.step} of 8; **unfinished run** (no results.json yet)" in md


def test_errors_name_what_is_wrong(listops_run, run_v0_1_0, tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a run directory"):
        mgk.load_run(tmp_path / "none")
    with pytest.raises(ValueError, match="checkpoint must be 'best' or 'last'"):
        mgk.load_run(listops_run, checkpoint="final")
    with pytest.raises(ValueError, match="^device 'gpu7' is not a torch device"):  # a Python argument, not a flag
        mgk.load_run(listops_run, device="gpu7")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"^device cuda: CUDA is not available .*; use device='cpu'$"):
            mgk.load_run(listops_run, device="cuda")
    moved = mgk.load_run(listops_run, data=tmp_path / "moved")
    with pytest.raises(FileNotFoundError, match=r"moved\?\): pass its new place with --data"):
        moved.with_splits()
    run_dir, _ = run_v0_1_0
    RunFiles(run_dir).vocab.unlink()  # rebuilt from the data's train split, the same words
    assert len(mgk.load_run(run_dir).tokenizer) == 161
    shutil.rmtree(RunFiles(run_dir).data)
    with pytest.raises(FileNotFoundError, match="vocab.txt is missing .* pass --data"):
        mgk.load_run(run_dir)


def test_byte_tokenizer_round_trips_text():
    tok = ByteTokenizer()
    ids = tok.encode("naïve ok")
    assert min(ids) >= 1 and len(ids) == len("naïve ok".encode()) and tok.decode([*ids, 0, 0]) == "naïve ok"


def test_import_mgk_stays_light_and_load_run_is_exported(th):
    code = "import sys, mgk; assert 'mgk.train.load' not in sys.modules; f = mgk.load_run; " \
           "assert 'mgk.train.load' in sys.modules and f.__module__ == 'mgk.train.load'; print('ok')"
    p = subprocess.run([sys.executable, "-c", code], env=th.env(), capture_output=True, text=True, timeout=300)
    assert p.stdout.strip() == "ok", p.stderr
    assert "load_run" in mgk.__all__ and mgk.LoadedRun.__name__ == "LoadedRun"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        mgk.nope  # noqa: B018


def test_every_exported_name_is_listed_by_dir_without_importing_the_lazy_ones(th):
    """dir(mgk) (and so tab completion) missed load_run and LoadedRun, which come from a module-level __getattr__."""
    code = "import sys, mgk; names = dir(mgk); assert 'mgk.train.load' not in sys.modules; " \
           "missing = set(mgk.__all__) - set(names); assert not missing, missing; print('ok')"
    p = subprocess.run([sys.executable, "-c", code], env=th.env(), capture_output=True, text=True, timeout=300)
    assert p.stdout.strip() == "ok", p.stderr
