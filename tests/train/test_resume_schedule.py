"""Resuming with another schedule (more steps, another peak lr or warm-up): the resumed run's schedule sets the lr
from its first resumed step (after a finished linear or cosine decay the first resumed step ran at the
old schedule's lr, 0). OneCycleLR's phases are fixed when it is built, so any change to them is refused in one line.
Resuming with nothing changed stays bitwise exact (tests/train/test_resume_exact.py)."""
import pytest

from mgk.cli import main
from mgk.train.schedule import lr_factor

LR = 2e-3


def _train(th, out, schedule, steps, *extra):
    main(["train", "--attention", "softmax", "--steps", str(steps), "--out", str(out),
          *th.sets(*th.TINY, f"schedule={schedule}", "warmup_steps=1", f"lr={LR}", *extra)])


def _expected(step, *, schedule, steps, lr=LR, warmup=1):
    """The lr that logged step ``step`` (1-based) must have used under the resumed run's schedule."""
    return lr * lr_factor(step - 1, warmup_steps=warmup, total_steps=steps, schedule=schedule)


@pytest.mark.parametrize("schedule", ["linear", "cosine", "cosine_global"])
def test_more_steps_apply_the_new_schedule_from_the_first_resumed_step(tmp_path, th, schedule):
    out = tmp_path / "run"
    _train(th, out, schedule, 4)  # finished: its decay has reached 0 (linear, cosine) at step 4
    main(["train", "--resume", str(out), "--set", "steps=8"])
    lrs = dict(th.series(out, "train/lr"))
    for step in range(1, 5):  # the first session's steps keep the lrs they were trained with
        assert lrs[step] == pytest.approx(_expected(step, schedule=schedule, steps=4), abs=1e-12), step
    for step in range(5, 9):
        assert lrs[step] == pytest.approx(_expected(step, schedule=schedule, steps=8), abs=1e-12), (step, lrs)
    assert lrs[5] > 0


def test_another_peak_lr_and_warmup_apply_from_the_first_resumed_step(tmp_path, th):
    out = tmp_path / "run"
    _train(th, out, "cosine", 3, "checkpoint_every=3")
    main(["train", "--resume", str(out), "--set", "steps=7", "--set", "lr=5e-4", "--set", "warmup_steps=5"])
    lrs = dict(th.series(out, "train/lr"))
    for step in range(4, 8):  # steps 4 and 5 are inside the new warm-up
        assert lrs[step] == pytest.approx(_expected(step, schedule="cosine", steps=7, lr=5e-4, warmup=5),
                                          abs=1e-12), (step, lrs)


@pytest.mark.parametrize("change,match", [
    (["--set", "steps=12"], "steps=12"),
    (["--set", "lr=1e-4"], "lr=0.0001"),
    (["--set", "warmup_steps=3"], "warmup_steps=3"),
    (["--set", "schedule=cosine"], "schedule=cosine"),
])
def test_onecycle_refuses_any_change_of_its_phases_in_one_line(tmp_path, th, change, match):
    out = tmp_path / "run"
    _train(th, out, "onecycle", 4, "warmup_steps=2", "checkpoint_every=2")
    with pytest.raises(SystemExit, match=f"mgk train: .*onecycle.*{match}"):
        main(["train", "--resume", str(out), *change])


def test_switching_to_onecycle_on_resume_is_refused(tmp_path, th):
    out = tmp_path / "run"
    _train(th, out, "linear", 4, "checkpoint_every=2")
    with pytest.raises(SystemExit, match="mgk train: .*schedule=onecycle"):
        main(["train", "--resume", str(out), "--set", "schedule=onecycle", "--set", "warmup_steps=2",
              "--set", "steps=8"])
