"""Evaluation over a whole split, exact under any world size: rank r takes examples r, r+W, r+2W, ... and the
summed statistics are all-reduced, so every example is counted once (no padding of the last batch)."""
from __future__ import annotations

import sys

import torch
from tqdm import tqdm

from . import distributed
from .precision import autocast


def progress_bar(total: int, *, desc: str, enabled: bool):
    """A transient tqdm bar on stderr (erased when done); shown only when ``enabled`` and stderr is a terminal, so
    logs of batch jobs stay clean."""
    return tqdm(total=total, desc=desc, unit="batch", leave=False, dynamic_ncols=True, file=sys.stderr,
                disable=not enabled or not sys.stderr.isatty())


@torch.no_grad()
def evaluate(task, model, dataset, *, batch_size: int, precision: str, dist_info, progress: bool = False,
             desc: str = "eval") -> dict:
    """Metrics of ``model`` on ``dataset``: ``task.summarise`` of the statistics that ``task.loss`` returns, summed
    over the split and over ranks (e.g. loss, acc, count). ``progress``: a :func:`progress_bar` on rank 0."""
    was_training = model.training
    model.eval()
    index = torch.arange(len(dataset))[dist_info.rank::dist_info.world_size]  # may be empty on some ranks
    # Batches of similar lengths waste less work on padding; the sums do not depend on the order.
    if hasattr(dataset, "lengths"):
        index = index[torch.argsort(dataset.lengths[index], stable=True)]
    totals: dict[str, float] = {}
    starts = range(0, len(index), batch_size)
    bar = progress_bar(len(starts), desc=desc, enabled=progress and dist_info.rank == 0)
    for start in starts:
        batch = task.batch(dataset, index[start:start + batch_size], dist_info.device)
        with autocast(dist_info.device, precision):
            _, sums = task.loss(model, batch)
        for key, value in sums.items():
            totals[key] = totals.get(key, 0.0) + float(value)
        bar.update(1)
    bar.close()
    keys = sorted(totals)
    reduced = distributed.all_sum([totals[k] for k in keys], dist_info.device)
    model.train(was_training)
    return task.summarise(dict(zip(keys, reduced)))
