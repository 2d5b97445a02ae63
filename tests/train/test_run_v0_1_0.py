"""A run directory of mgk 0.1.0 (flat config.yaml, checkpoints with the string-keyed loop state) still evaluates and
resumes, with the figures 0.1.0 itself gave (tests/fixtures/run_v0_1_0.expected.json)."""
import json

import pytest
import torch

from mgk.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_eval_of_a_0_1_0_run_gives_its_perplexity(run_v0_1_0, tmp_path):
    run_dir, expected = run_v0_1_0
    assert "state" in torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)  # the 0.1.0 layout
    main(["eval", str(run_dir), "--split", "valid", "--json", str(tmp_path / "v.json"), "--no-progress",
          "--device", "cpu"])
    v = json.loads((tmp_path / "v.json").read_text())
    assert v["ppl"] == pytest.approx(expected["eval_valid_best_ppl"], rel=1e-6)
    # float32 rounding: MGK now centres q and k
    assert v["step"] == 4 and v["checkpoint"].endswith("best.pt")


def test_resume_of_a_0_1_0_run_continues_as_0_1_0_did(run_v0_1_0, th):
    run_dir, expected = run_v0_1_0
    main(["train", "--resume", str(run_dir), "--steps", "6", "--device", "cpu"])
    losses = dict(th.series(run_dir, "train/loss"))
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    # As 0.1.0 continued with the resumed schedule's lr from the first resumed step (see
    # resume_steps_6_made_with), to float32 rounding: MGK now centres queries and keys before the scores (translation
    # invariance), which changes the last bits; a wrong optimizer state or schedule would change far more.
    want = expected["resume_steps_6_train_loss"]
    assert {str(k): losses[k] for k in (5, 6)} == {k: pytest.approx(v, rel=1e-6) for k, v in want.items()}
    assert dict(th.series(run_dir, "val/ppl"))[6] == pytest.approx(expected["resume_steps_6_val_ppl"], rel=1e-6)
    ckpt = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert ckpt["loop_state"]["step"] == 6 and ckpt["loop_state"]["best_step"] == 6 and "state" not in ckpt
