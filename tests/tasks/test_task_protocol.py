"""The task interface is declared: every task module provides PRESETS, prepare, build, restore and check, every
built task is a `Task` (the loop calls nothing else), and a task class that lacks a required member cannot be
built."""
import dataclasses

import pytest

from mgk.tasks import TASKS, EpochSampler, Task
from mgk.tasks.classification import ClassificationTask
from mgk.tasks.lm import LMTask, StreamSampler
from mgk.train.loop import EpochSampler as LoopEpochSampler
from mgk.train.state import LoopState


@pytest.mark.parametrize("name", sorted(TASKS))
def test_every_task_module_has_the_members(name):
    module = TASKS[name]
    assert module.PRESETS and all(cfg.task == name for cfg in module.PRESETS.values())
    for member in ("prepare", "build", "restore", "check"):
        assert callable(getattr(module, member)), member


def test_task_classes_implement_the_protocol():
    assert issubclass(ClassificationTask, Task) and issubclass(LMTask, Task)
    task = ClassificationTask("t", {}, 10, 2)
    assert task.best_metric == ("acc", "max") and isinstance(task.sampler(10, 3, 0), EpochSampler)
    assert isinstance(LMTask("lm", {}, vocab=[None] * 3).sampler(8, 4, 0), StreamSampler)
    assert LoopEpochSampler is EpochSampler  # still importable from the loop


def test_a_task_without_loss_cannot_be_built():
    @dataclasses.dataclass
    class Incomplete(Task):
        name: str = "x"

        def model_config(self, cfg): ...
        def build_model(self, cfg): ...
        def batch(self, dataset, index, device): ...
        def summarise(self, sums): ...
        def describe(self, dataset): ...

    with pytest.raises(TypeError, match="loss"):
        Incomplete()


def test_loop_state_reads_both_checkpoint_layouts():
    old = {"state": {"step": 7, "best": 0.5, "best_step": 5, "skipped": 1}}  # 0.1.0: no best_val before a best
    assert LoopState.from_checkpoint(old) == LoopState(step=7, best=0.5, best_step=5, skipped=1)
    new = {"loop_state": LoopState(step=3, best_val={"acc": 1.0}).to_dict()}
    assert LoopState.from_checkpoint(new).best_val == {"acc": 1.0}
    with pytest.raises(ValueError, match="unknown fields"):
        LoopState.from_checkpoint({"loop_state": {"step": 1, "epoch": 2}})
    with pytest.raises(ValueError, match="no loop state"):
        LoopState.from_checkpoint({})
