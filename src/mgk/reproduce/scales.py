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

The head-count experiment (``heads``) has task settings of its own, named by the experiment and run as their
``task``: ``dretrieval-d2/-d4/-d8`` (the ``dretrieval-small`` preset at D = 2, 4, 8: T = 16, V = 64, one layer,
d_model 64, head_dim 8, 2000 steps; the sizes were fixed on softmax runs only, results/cpu/heads-exploration.md; a
run takes about 40-60 s on an idle core, 50-130 s on the shared machine) and ``mqar-n8`` (``mqar-small``: n = 8
pairs in L = 64, two causal layers, head_dim 16, 6000 steps, since in 2000 steps linear attention with 4 heads and
with 8 stays on the 1/n plateau alike; 3-4 minutes a run on an idle core, 8-16 on the shared machine). Only the
``cpu`` and ``smoke`` scales define them (there is no paper protocol). A subset in minutes:
``mgk reproduce heads --only task=dretrieval-d8 --only row=softmax-2,softmax-8,mgk-4 --seeds 0``.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TaskSetting", "SCALES", "task_setting"]

SCALES = ("paper", "cpu", "smoke")


@dataclass(frozen=True)
class TaskSetting:
    """How one task runs at one scale. ``data``: path relative to the data root (None = generated);
    ``label``: the task's name in the report; ``eval``: ``(context, stride)`` of ``mgk eval`` for LM runs;
    ``task``: the ``mgk train --task`` when the experiment names the setting otherwise (``dretrieval-d8`` runs task
    ``dretrieval``), else None."""

    preset: str
    data: str | None
    overrides: tuple = ()
    label: str | None = None
    eval: tuple | None = None
    note: str = ""
    task: str | None = None


_DATA = {"listops": "listops", "text": "imdb/aclImdb_train.tar.gz", "retrieval": "aan",
         "image": "cifar10/cifar10_jpeg_train.tar.gz", "pathfinder": "pathfinder32", "lm": "wikitext-103"}

_SMOKE_STEPS = ("steps=6", "warmup_steps=2", "log_every=2", "eval_every=3", "checkpoint_every=3")
_GEN_SHORT = ("gen_train=6000", "gen_val=1000", "gen_test=1000")

_MQAR_LONG = ("steps=6000", "warmup_steps=600", "eval_every=1000", "checkpoint_every=1000", "log_every=200")


def _heads(scale: str) -> dict:
    """The head-count task settings at ``scale`` (cpu or smoke)."""
    smoke = scale == "smoke"
    extra = _SMOKE_STEPS + ("gen_train=200", "gen_val=50", "gen_test=50") if smoke else ()
    out = {f"dretrieval-d{d}": TaskSetting("dretrieval-small", None, (f"gen_features={d}", *extra),
                                           label=f"D-retrieval D={d} (T=16, V=64)", task="dretrieval",
                                           note=f"generated D-retrieval, D = {d} features, T = 16 tokens from V = "
                                                "64 grid points, 20000/2000/2000 sequences (generator seed 0); test "
                                                "NMSE of the best-validation checkpoint, lower is better")
           for d in (2, 4, 8)}
    out["mqar-n8"] = TaskSetting("mqar-small", None, extra or _MQAR_LONG, label="MQAR n=8 (L=64, V=128)",
                                 task="mqar",
                                 note="generated MQAR, 8 key-value pairs in 64 tokens, 20000/1000/1000 sequences "
                                      "(generator seed 0), 6000 steps (600 warm-up); test accuracy over the "
                                      "answers only (1/8 = picking one of the context's values)")
    return out


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
        **_heads("cpu"),
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
        **_heads("smoke"),
    },
}


def task_setting(scale: str, task: str) -> TaskSetting:
    """The setting of ``task`` at ``scale``; ValueError naming a bad scale or task."""
    if scale not in _SETTINGS:
        raise ValueError(f"unknown scale {scale!r}; choose one of {', '.join(SCALES)}")
    if task not in _SETTINGS[scale]:
        raise ValueError(f"no {scale} setting for task {task!r}")
    return _SETTINGS[scale][task]
