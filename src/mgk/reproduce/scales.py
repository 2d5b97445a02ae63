"""Scales: how each task is trained at ``paper``, ``cpu`` and ``smoke`` size.

A :class:`TaskSetting` names the ``mgk train`` preset, the data (a path under the data root, or None for the
package's generator), the ``--set`` overrides and, for language modelling, the final evaluation window.

- ``paper``: the ``*-paper`` presets (the paper's protocol, for a GPU cluster) on the LRA release files.
- ``cpu``: a reduced setting per task that learns well above the majority class on 2 CPU cores with one thread per
  run (two runs side by side): ListOps 800 steps, 2-5 minutes a run; Text 300 steps of batch 32 at 512 bytes,
  11-20 minutes a run on the shared machine (at 512 bytes, fewer steps stay at 50%). ListOps there is the package's
  *generated, short* ListOps
  (lengths 10-100, depth 3): the LRA release (500-2000 tokens) stays at its majority plateau (~16%) for every model
  in the few hundred steps a CPU affords, so it would compare nothing. Text is IMDb bytes cut to 512.
- ``smoke``: the cpu data at a few steps, seconds a run: checks a grid end to end before launching it.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TaskSetting", "SCALES", "task_setting"]

SCALES = ("paper", "cpu", "smoke")


@dataclass(frozen=True)
class TaskSetting:
    """How one task runs at one scale. ``data``: path relative to the data root (None = generated);
    ``label``: the task's name in the report; ``eval``: ``(context, stride)`` of ``mgk eval`` for LM runs."""

    preset: str
    data: str | None
    overrides: tuple = ()
    label: str | None = None
    eval: tuple | None = None
    note: str = ""


_DATA = {"listops": "listops", "text": "imdb/aclImdb_train.tar.gz", "retrieval": "aan",
         "image": "cifar10/cifar10_jpeg_train.tar.gz", "pathfinder": "pathfinder32", "lm": "wikitext-103"}

_SMOKE_STEPS = ("steps=6", "warmup_steps=2", "log_every=2", "eval_every=3", "checkpoint_every=3")
_GEN_SHORT = ("gen_train=6000", "gen_val=1000", "gen_test=1000")

_SETTINGS = {
    "paper": {t: TaskSetting(f"{t}-paper", _DATA[t]) for t in ("listops", "text", "retrieval", "image",
                                                                "pathfinder")}
    | {"lm": TaskSetting("wt103-paper", _DATA["lm"], eval=(256, 1),
                         note="final perplexity: stride-1 sliding window of 256 tokens")},
    "cpu": {
        "listops": TaskSetting("listops-small", None, ("steps=800", "warmup_steps=80", "eval_every=200",
                                                       "checkpoint_every=200", "log_every=25") + _GEN_SHORT,
                               label="ListOps (generated, short)",
                               note="the package's generator: lengths 10-100 tokens, depth 3, 6000/1000/1000 rows"),
        "text": TaskSetting("text-small", _DATA["text"], ("max_len=512", "steps=300", "warmup_steps=30",
                                                          "attn_dropout=0", "val_fraction=0.04", "eval_every=150",
                                                          "checkpoint_every=150", "log_every=15"),
                            label="Text (IMDb bytes, 512)",
                            note="first 512 bytes of each review; 4% of train (1000 reviews) carved out as validation "
                                 "(the shared "
                                 "copy has no test split); attention dropout 0 keeps SDPA and the MGK kernel fused"),
        "retrieval": TaskSetting("retrieval-small", _DATA["retrieval"]),
        "image": TaskSetting("image-small", _DATA["image"]),
        "pathfinder": TaskSetting("pathfinder-small", None, label="Pathfinder (generated)"),
        "lm": TaskSetting("lm-small", _DATA["lm"], eval=(256, 256),
                          note="final perplexity by non-overlapping 256-token windows (stride 1 is too slow on CPU)"),
    },
    "smoke": {
        "listops": TaskSetting("listops-small", None, _SMOKE_STEPS + ("gen_train=200", "gen_val=50", "gen_test=50"),
                               label="ListOps (generated, short)"),
        "text": TaskSetting("text-small", _DATA["text"], _SMOKE_STEPS + ("max_len=64", "eval_batch_size=256"),
                            label="Text (IMDb bytes, 64)"),
        "retrieval": TaskSetting("retrieval-small", _DATA["retrieval"], _SMOKE_STEPS + ("max_len=64",)),
        "image": TaskSetting("image-small", _DATA["image"], _SMOKE_STEPS),
        "pathfinder": TaskSetting("pathfinder-small", None, _SMOKE_STEPS + ("gen_train=64", "gen_val=16",
                                                                            "gen_test=16"),
                                  label="Pathfinder (generated)"),
        "lm": TaskSetting("lm-small", None, _SMOKE_STEPS + ("gen_train=400", "gen_val=100", "gen_test=100"),
                          eval=(32, 32), label="LM (generated corpus)"),
    },
}


def task_setting(scale: str, task: str) -> TaskSetting:
    """The setting of ``task`` at ``scale``; ValueError naming a bad scale or task."""
    if scale not in _SETTINGS:
        raise ValueError(f"unknown scale {scale!r}; choose one of {', '.join(SCALES)}")
    if task not in _SETTINGS[scale]:
        raise ValueError(f"no {scale} setting for task {task!r}")
    return _SETTINGS[scale][task]
