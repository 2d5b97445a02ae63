"""Evaluation over a whole split (or a given set of its examples), exact under any world size: rank r takes
examples r, r+W, r+2W, ... and the summed statistics are all-reduced, so every example is counted once (no padding
of the last batch).

:func:`eval_slice` gives the examples of one validation with a fixed number of batches (``eval_batches``)."""
from __future__ import annotations

import sys

import torch
from tqdm import tqdm

from ..seeds import torch_seed
from . import distributed
from .precision import autocast


def progress_bar(total: int, *, desc: str, enabled: bool):
    """A transient tqdm bar on stderr (erased when done); shown only when ``enabled`` and stderr is a terminal, so
    logs of batch jobs stay clean."""
    return tqdm(total=total, desc=desc, unit="batch", leave=False, dynamic_ncols=True, file=sys.stderr,
                disable=not enabled or not sys.stderr.isatty())


@torch.no_grad()
def evaluate(task, model, dataset, *, batch_size: int, precision: str, dist_info, index=None, progress: bool = False,
             desc: str = "eval") -> dict:
    """Metrics of ``model`` on ``dataset``: ``task.summarise`` of the statistics that ``task.loss`` returns, summed
    over the split (or over the examples ``index``, int64 (N,)) and over ranks (e.g. loss, acc, count).
    ``progress``: a :func:`progress_bar` on rank 0."""
    was_training = model.training
    model.eval()
    index = torch.arange(len(dataset)) if index is None else torch.as_tensor(index, dtype=torch.int64)
    index = index[dist_info.rank::dist_info.world_size]  # may be empty on some ranks
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


def eval_slice(num_examples: int, *, batches: int, batch_size: int, round_index: int, seed: int) -> torch.Tensor:
    """Examples of validation round ``round_index`` (0-based) when each round reads ``batches`` batches of
    ``batch_size``: the next slice of an endless stream of permutations of the split (permutation e drawn from a
    generator seeded with (seed, e)), so successive rounds see different examples and reshuffle on wrap, as the
    authors' LRA dev iterator does (``lra/run_tasks.py:366-380``, ``lra/dataset.py:40-48``). A pure function of its
    arguments, so a resumed run validates on the same examples. int64 (min(batches * batch_size, ...),)."""
    if num_examples < 1:
        raise ValueError("eval_slice needs a non-empty split")
    want = batches * batch_size
    start = round_index * want
    epoch, offset = divmod(start, num_examples)
    parts, have = [], 0
    while have < want:
        g = torch.Generator().manual_seed(torch_seed(int(seed) * 1_000_003 + 7 * epoch + 1))
        perm = torch.randperm(num_examples, generator=g)[offset:]
        parts.append(perm[:want - have])
        have += parts[-1].numel()
        epoch, offset = epoch + 1, 0
    return torch.cat(parts)
