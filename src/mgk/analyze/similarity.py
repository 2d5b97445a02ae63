"""How alike the heads of each attention layer attend: the mean Jensen-Shannon divergence between every pair of
heads' attention rows over examples of a split (:func:`mgk.analyze.stats.js_matrix`), the measure ``mgk train
--init-from`` pairs heads by before merging them into mixture components (results/cpu/kv-budget.md)."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from . import stats
from .analysis import _sequences
from .weights import StopForward, WeightRecorder

__all__ = ["head_divergence", "greedy_groups"]


@torch.no_grad()
def head_divergence(task, model: nn.Module, dataset, index: Tensor, *, batch_size: int = 32) -> list[Tensor]:
    """Per attention layer (forward order), the (H, H) float64 matrix of mean JS divergences (bits) between heads,
    averaged over the real tokens' query rows of the examples ``index`` of ``dataset`` (each sequence weighs the
    same). ``model`` runs in eval mode as it is (its dtype and device)."""
    model.eval()
    device = next(model.parameters()).device
    recorder = WeightRecorder(model, stop_after_last=True)
    sums: list[Tensor | None] = [None] * len(recorder.layers)
    counts = [0] * len(recorder.layers)
    with recorder:
        for start in range(0, len(index), batch_size):
            batch = task.batch(dataset, index[start:start + batch_size], device)
            try:
                task.loss(model, batch)
            except StopForward:
                pass
            for call in recorder.calls:
                for b, n in _sequences(call, batch):
                    m = stats.js_matrix(call.weights[b, :, :n, :n])
                    sums[call.layer] = m if sums[call.layer] is None else sums[call.layer] + m
                    counts[call.layer] += 1
            recorder.clear()
    if any(c == 0 for c in counts):
        raise ValueError("head_divergence: a layer saw no sequence (no examples given?)")
    return [s / c for s, c in zip(sums, counts)]


def greedy_groups(divergence: Tensor, size: int) -> list[list[int]]:
    """Split the H heads of one layer into groups of ``size`` by greedy matching on ``divergence`` (H, H): the
    pair of unmatched heads with the smallest divergence starts a group (ties: the lowest indices), then the
    unmatched head with the smallest mean divergence to the group joins it until it has ``size`` heads. Groups are
    returned in the order they were formed, each sorted. ValueError when ``size`` does not divide H."""
    H = divergence.shape[0]
    if size < 1 or H % size:
        raise ValueError(f"greedy_groups: groups of {size} do not split {H} heads")
    if size == 1:
        return [[h] for h in range(H)]
    free, groups = list(range(H)), []
    while free:
        pairs = [(float(divergence[a, b]), a, b) for i, a in enumerate(free) for b in free[i + 1:]]
        _, a, b = min(pairs)
        group = [a, b]
        while len(group) < size:
            rest = [h for h in free if h not in group]
            group.append(min(rest, key=lambda h: (float(divergence[group, h].mean()), h)))
        groups.append(sorted(group))
        free = [h for h in free if h not in group]
    return groups
