"""How alike the heads of each attention layer attend: the mean Jensen-Shannon divergence between every pair of
heads' attention rows over examples of a split (:func:`mgk.convert.head_measures.js_matrix`), the measure ``mgk train
--init-from`` pairs heads by before merging them into mixture components (results/cpu/kv-budget.md); the grouping
itself is :func:`mgk.convert.head_measures.greedy_groups`, which swap_attention shares."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..convert.head_measures import greedy_groups, js_matrix
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
                    m = js_matrix(call.weights[b, :, :n, :n])
                    sums[call.layer] = m if sums[call.layer] is None else sums[call.layer] + m
                    counts[call.layer] += 1
            recorder.clear()
    if any(c == 0 for c in counts):
        raise ValueError("head_divergence: a layer saw no sequence (no examples given?)")
    return [s / c for s, c in zip(sums, counts)]
