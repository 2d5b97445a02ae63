"""Head importance and iterative head pruning (P. Michel, O. Levy, G. Neubig, "Are Sixteen Heads Really Better than
One?", NeurIPS 2019), and the same per mixture component for MGK / MLK.

Each unit (a head, or a component r of head h) has a gate xi, 1 when kept and 0 when pruned: a head's output is
multiplied by it (:attr:`mgk.attention.base.AttentionBase.head_gate`); a component's weight pi_{h,r} is multiplied by
it and renormalised over r (:attr:`mgk.attention.mixture_keys.MixtureKeys.component_gate`), so the gates run through
the modules' own forward, not a copy of the attention.

- Importance (Michel et al., eq. 2): ``I = E_x |dL(x) / dxi|`` at the current gates, over the examples x of the
  importance split. The gates are given one value per example (B, H), so one backward of the summed loss gives every
  example's own derivative: the mean is of per-example absolute values, as the definition says, not the absolute
  value of a batch's gradient. Then normalised per layer by its L2 norm (their Section 4.2, after Molchanov et al.).
- Iterative pruning (their Section 4.2): remove the least important 10 % of the units (at least one; over all
  layers after the per-layer normalisation), recompute the importance, repeat until one unit is left; the metric of
  the evaluation split is recorded after every step. A random-order baseline removes the same numbers at random.
- One-unit ablation: the metric with a single unit removed, for every unit.

A head whose every component is pruned has every key masked, so a zero output: pruning components all the way is
also pruning heads. Softmax and linear attention have heads only.

Keys shared by groups of query heads (gmgk: H query heads, G key groups, each group's mixture keys and pi read by
its H / G query heads): a component is a group's, so the component gates are (G, M), the mixture's own shape, and
gating a component off removes it from the keys of every query head of the group. Its derivative is then the sum
over the group's heads of theirs (chain rule, per example before the absolute value): the importance of a group's
component is summed over the group's heads. The last component of a group removes the whole group when pruned, so
it takes the summed importance of the group's heads. Head gates stay per query head (H,), whatever the keys.

Components of one head: attention normalised over the keys does not change when every pi_{h,r} of a head is scaled
by one factor, so the derivatives of a head's component gates sum to zero; with M = 2 the two are opposite and the
two components have the same importance, exactly. Component importance then ranks heads, and within a head the tie
is broken by the component's index (the sort is stable): a first-order estimate cannot tell which of the two to
keep, and the curve says what removing one costs. The last component left in a head has derivative 0 (its weight is
1 whatever its gate), so it takes the importance of its head (:func:`component_importance`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..attention.base import AttentionBase
from ..convert.head_measures import gate_importance, gated, has_components
from ..seeds import torch_seed
from ..train.distributed import Dist
from ..train.evaluate import evaluate

__all__ = ["PruneSettings", "attention_layers", "has_components", "gated", "unit_gates", "importance",
           "component_importance", "prune_curve", "random_curves", "ablation", "metric_of_task"]


@dataclass(frozen=True)
class PruneSettings:
    """``fraction``: share of the original units removed per step (Michel et al.: 0.1); ``random_orders``: random
    baselines; ``batch_size``: examples per call; ``importance_examples`` / ``eval_examples``: the first N examples
    of the importance and evaluation splits (0 = all); ``seed``: of the random orders."""

    fraction: float = 0.1
    random_orders: int = 5
    batch_size: int = 64
    importance_examples: int = 0
    eval_examples: int = 0
    seed: int = 0

    def check(self) -> "PruneSettings":
        """``self`` when every setting is in range: ``fraction`` in (0, 1), ``random_orders``,
        ``importance_examples`` and ``eval_examples`` >= 0, ``batch_size`` >= 1; ValueError naming the first that
        is not."""
        if not 0.0 < self.fraction < 1.0:
            raise ValueError(f"fraction must be in (0, 1), got {self.fraction}")
        for name in ("random_orders", "importance_examples", "eval_examples"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        return self


def attention_layers(model: nn.Module) -> list[AttentionBase]:
    """The attention modules of ``model`` in the order of ``model.modules()`` (a module shared by two towers once)."""
    return list(dict.fromkeys(m for m in model.modules() if isinstance(m, AttentionBase)))


def metric_of_task(task) -> tuple[str, bool]:
    """(the metric that selects a run's best checkpoint, whether higher is better) of ``task``."""
    name, mode = task.best_metric
    return name, mode == "max"


def unit_gates(layers, unit: str) -> list[Tensor | None]:
    """All-ones gates of ``unit`` per layer: "head" (H,) of the query heads, or "component" (H', M) of the mixture
    keys' heads (H' = H, or G for keys shared by G groups of query heads: gmgk), None for a layer without mixture
    weights. ValueError when no layer has such units."""
    if unit == "head":
        return [torch.ones(m.num_heads) for m in layers]
    if unit != "component":
        raise ValueError(f"unit must be 'head' or 'component', got {unit!r}")
    gates = [torch.ones(m.mixture.num_heads, m.mixture.num_keys) if has_components(m) else None for m in layers]
    if all(g is None for g in gates):
        raise ValueError("the model has no mixture components to prune (softmax and linear attention have heads "
                         "only; Hard-E has no mixture weights)")
    return gates


def _with(layers, gates, unit: str, components=None):
    return gated(layers, gates, components) if unit == "head" else gated(layers, None, gates)


def importance(task, model, layers, dataset, index, gates, *, unit: str, batch_size: int,
               components=None) -> list[Tensor | None]:
    """Per layer, ``E_x |dL(x) / dxi|`` over the examples ``index`` of ``dataset`` for the gates of ``unit``
    ("head": (H,), "component": (H', M) as :func:`unit_gates`; None for a layer without them) at their current
    values ``gates``; not
    normalised. ``components``: component gates held fixed while head gates are differentiated. Model in eval
    mode; the parameters' ``.grad`` are not touched. float64 per layer."""
    model.eval()
    device = next(model.parameters()).device
    totals = [None if g is None else torch.zeros(g.shape, dtype=torch.float64) for g in gates]
    for start in range(0, len(index), batch_size):
        batch = task.batch(dataset, index[start:start + batch_size], device)
        sums, _ = gate_importance(layers, [None if g is None else g.to(device) for g in gates],
                                  lambda b=batch: task.loss(model, b)[0], unit=unit, components=components)
        for t, s in zip(totals, sums):
            if t is not None:
                t += s
    return [None if t is None else t / max(len(index), 1) for t in totals]


def component_importance(task, model, layers, dataset, index, gates, *, batch_size: int) -> list[Tensor | None]:
    """:func:`importance` of the component gates ``gates``, where the last component left in a head takes the
    importance of that head's output gate (at the same component gates); in a key group shared by several query
    heads (gmgk) the summed importance of the group's heads. With the weights renormalised over the components a
    head's only component has pi = 1 whatever its gate, so its derivative is 0, yet removing it removes the head
    (the group's heads): without this, pruning by importance would take a head's last component next, every time."""
    scores = importance(task, model, layers, dataset, index, gates, unit="component", batch_size=batch_size)
    last = [None if g is None else ((g > 0).sum(-1) == 1) for g in gates]
    if not any(m is not None and bool(m.any()) for m in last):
        return scores
    device = next(model.parameters()).device
    heads = importance(task, model, layers, dataset, index, unit_gates(layers, "head"), unit="head",
                       batch_size=batch_size, components=[None if g is None else g.to(device) for g in gates])
    for s, g, m, h in zip(scores, gates, last, heads):
        if m is not None:  # (H,) query heads -> the gates' rows: consecutive H / G heads form a group
            h = h.reshape(g.shape[0], -1).sum(dim=1)
            s[:] = torch.where(m.unsqueeze(-1) & (g > 0), h.unsqueeze(-1), s)
    return scores


def _normalised(scores, gates) -> list[Tensor | None]:
    """Scores of kept units divided by their layer's L2 norm over the kept units (Michel et al., Section 4.2)."""
    out = []
    for s, g in zip(scores, gates):
        if s is None:
            out.append(None)
            continue
        s = torch.where(g > 0, s, 0.0)
        norm = torch.linalg.vector_norm(s)
        out.append(s / norm if norm > 0 else s)
    return out


def _flat(gates) -> list[tuple[int, tuple]]:
    """(layer, index) of every unit, in order."""
    return [(i, tuple(int(x) for x in idx)) for i, g in enumerate(gates) if g is not None
            for idx in torch.nonzero(torch.ones_like(g))]


def _kept(gates) -> int:
    return int(sum(int((g > 0).sum()) for g in gates if g is not None))


def prune_curve(task, model, layers, data, *, unit: str, settings, order: torch.Generator | None = None) -> dict:
    """Iterative pruning of ``unit`` ("head" or "component"): ``data`` = (importance dataset, its index,
    evaluation dataset, its index). By importance (recomputed after every step, normalised per layer) or, with
    ``order`` (a seeded generator), at random. Returns ``{"kept": [...], "metric": [...], "pruned": [[layer,
    index], ...] in pruning order, "units": total}``; the first point is the unpruned model."""
    imp_ds, imp_index, ev_ds, ev_index = data
    gates = unit_gates(layers, unit)
    units = _flat(gates)
    step = max(1, round(settings.fraction * len(units)))
    kept, metric, pruned = [len(units)], [_metric_gated(task, model, layers, ev_ds, ev_index, gates, unit,
                                                        settings.batch_size)], []
    while _kept(gates) > 1:
        alive = [u for u in units if gates[u[0]][u[1]] > 0]
        n = min(step, len(alive) - 1)
        if order is not None:
            chosen = [alive[int(j)] for j in torch.randperm(len(alive), generator=order)[:n]]
        else:
            find = importance if unit == "head" else component_importance
            kw = {"unit": unit} if unit == "head" else {}
            scores = _normalised(find(task, model, layers, imp_ds, imp_index, gates, batch_size=settings.batch_size,
                                      **kw), gates)
            chosen = sorted(alive, key=lambda u: float(scores[u[0]][u[1]]))[:n]
        for layer, idx in chosen:
            gates[layer][idx] = 0.0
            pruned.append([layer, list(idx)])
        kept.append(_kept(gates))
        metric.append(_metric_gated(task, model, layers, ev_ds, ev_index, gates, unit, settings.batch_size))
    return {"unit": unit, "units": len(units), "kept": kept, "metric": metric, "pruned": pruned}


def _metric_gated(task, model, layers, dataset, index, gates, unit, batch_size) -> float:
    device = next(model.parameters()).device
    with _with(layers, [None if g is None else g.to(device) for g in gates], unit):
        out = evaluate(task, model, dataset, batch_size=batch_size, precision="32", dist_info=Dist(0, 1, device),
                       index=index)
    return float(out[metric_of_task(task)[0]])


def random_curves(task, model, layers, data, *, unit: str, settings) -> dict:
    """``settings.random_orders`` random-order pruning curves of ``unit`` (seeds ``settings.seed + j``): ``kept``
    and per step the mean and sample std of the metric over the orders, and every curve."""
    curves = [prune_curve(task, model, layers, data, unit=unit, settings=settings,
                          order=torch.Generator().manual_seed(torch_seed(settings.seed + j)))["metric"]
              for j in range(settings.random_orders)]
    if not curves:
        return {}
    cols = list(zip(*curves))
    std = [(sum((x - sum(c) / len(c)) ** 2 for x in c) / (len(c) - 1)) ** 0.5 if len(c) > 1 else 0.0 for c in cols]
    return {"orders": len(curves), "mean": [sum(c) / len(c) for c in cols], "std": std, "curves": curves}


def ablation(task, model, layers, data, *, unit: str, settings) -> dict:
    """The metric with one unit of ``unit`` removed, for every unit: ``{"full": metric, "units": [{"layer",
    "index", "metric", "delta"}]}`` (delta = metric without the unit - full metric)."""
    _, _, ev_ds, ev_index = data
    gates = unit_gates(layers, unit)
    full = _metric_gated(task, model, layers, ev_ds, ev_index, gates, unit, settings.batch_size)
    rows = []
    for layer, idx in _flat(gates):
        gates[layer][idx] = 0.0
        value = _metric_gated(task, model, layers, ev_ds, ev_index, gates, unit, settings.batch_size)
        gates[layer][idx] = 1.0
        rows.append({"layer": layer, "index": list(idx), "metric": value, "delta": value - full})
    return {"full": full, "units": rows}
