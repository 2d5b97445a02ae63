"""Tasks selectable by ``mgk train --task``.

A task module has ``PRESETS`` (name -> RunConfig), ``prepare(cfg, run_dir) -> data_dir`` (rank 0 only: find or generate the files) and
``build(cfg, data_dir) -> task`` (every rank). The task object the training loop uses provides:

- ``splits``: {"train", "val", "test"} -> dataset or None; ``len(dataset)`` examples;
- ``vocab_size``, ``num_classes`` (0 where meaningless) and ``notes`` (log lines);
- ``build_model(cfg) -> nn.Module``;
- ``batch(dataset, index LongTensor, device) -> dict`` of tensors;
- ``loss(model, batch) -> (loss_sum, sums)``: the summed loss to back-propagate (the loop divides by the local
  batch size) and a dict of additive statistics (``loss``, ``count``, ...) that is summed over batches and ranks;
- ``summarise(sums) -> metrics`` (must contain ``loss``), ``describe(dataset) -> dict`` for results.json;
- ``best_metric``: (validation metric, "max" or "min") that selects the best checkpoint;
- optionally ``sampler(num_examples, global_batch, seed)`` with ``indices(step)``, a pure function of the step
  (default: :class:`mgk.train.loop.EpochSampler`).
"""
from __future__ import annotations

from . import image, listops, lm, pathfinder, retrieval, text

TASKS = {"listops": listops, "lm": lm, "text": text, "retrieval": retrieval, "image": image,
         "pathfinder": pathfinder}


def all_presets() -> dict:
    """Every task's presets by name (``mgk train --preset NAME``)."""
    return {name: cfg for module in TASKS.values() for name, cfg in getattr(module, "PRESETS", {}).items()}


def get_task(name: str):
    """The task module named ``name``; ValueError for an unknown name."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {tuple(TASKS)}")
    return TASKS[name]
