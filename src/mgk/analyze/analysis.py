"""The analysis of one run: attention maps, rank, head redundancy and mixture statistics, per layer.

Sampling: ``samples`` examples are drawn without replacement from the split with a ``torch.Generator`` seeded by
``seed``; every head of every layer is measured on each, so a layer's rank distribution holds ``samples x H``
attention matrices (a retrieval example holds two documents, each its own matrix). Each matrix is the sequence's
real tokens only (padding cut away). The model runs in ``dtype`` (float64 by default, so that rounding stays many
orders of magnitude below the rank threshold; on a 1000 x 1000 map of rank about 90, float32 gives the same rank).
Examples go through the model ``batch_size`` at a time and are reduced to statistics at once, so memory stays
bounded by one batch's weights.

Every statistic is per query head: a layer whose keys have fewer heads (GQA's G key/value heads, gmgk's G groups of
mixture keys; ``kv_heads`` in analysis.json) has H maps, and its mixture weights and shares are read per query head
from the keys of its group (:func:`mgk.analyze.mixture.per_query_head`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from ..attention import MGKAttention
from ..models import IGNORE_INDEX
from . import stats
from .mixture import component_sums, has_mixture, mixture_weights
from .run import LoadedRun
from .weights import StopForward, WeightRecorder

__all__ = ["Settings", "analyse"]


@dataclass
class Settings:
    """What to measure. ``rank_mode`` "absolute" (drop singular values <= ``rank_tol``) or "relative" (<= rank_tol x
    the largest); both are always recorded, ``rank_mode`` picks the one in tables and figures. ``examples``: sequences
    drawn as attention-map grids."""

    split: str = "val"
    samples: int = 100
    seed: int = 0
    batch_size: int = 8
    rank_tol: float = 1e-6
    rank_mode: str = "absolute"
    examples: int = 3
    dtype: str = "float64"

    def check(self) -> "Settings":
        """Raise ValueError naming a bad field."""
        for name in ("samples", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.examples < 0:
            raise ValueError(f"examples must be >= 0, got {self.examples}")
        if self.rank_mode not in stats.RANK_MODES:
            raise ValueError(f"rank mode must be one of {stats.RANK_MODES}, got {self.rank_mode!r}")
        if not 0 <= self.rank_tol < float("inf"):
            raise ValueError(f"rank tolerance must be finite and >= 0, got {self.rank_tol}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be float32 or float64, got {self.dtype!r}")
        return self


class _Layer:
    """Running per-layer accumulators."""

    def __init__(self, name: str, module):
        self.name, self.module = name, module
        self.ranks = {m: [] for m in stats.RANK_MODES}
        self.lengths, self.js, self.l2, self.eff = [], [], [], []
        self.maps: list = []
        self.sums = self.pairs = None
        self.longest = 0
        self.causal = False

    def add(self, maps, x, is_causal: bool, settings: Settings) -> None:
        """Accumulate the statistics of one sequence's (H, n, n) float64 attention maps and its layer input x."""
        n = maps.shape[-1]
        self.longest = max(self.longest, n)
        self.causal |= bool(is_causal)
        for mode, ranks in stats.numerical_ranks(maps, settings.rank_tol).items():  # one SVD for both rules
            self.ranks[mode] += ranks.tolist()
        self.lengths += [n] * maps.shape[0]
        self.js.append(stats.pairwise_js(maps))
        self.l2.append(stats.pairwise_l2(maps))
        self.eff.append(stats.effective_heads(maps))
        if len(self.maps) < settings.examples:
            self.maps.append(maps.float().cpu())
        if has_mixture(self.module):
            found = component_sums(self.module, x, is_causal)
            if found is not None:
                s, p = found
                self.sums = s if self.sums is None else self.sums + s
                self.pairs = p if self.pairs is None else self.pairs + p

    def result(self, index: int, settings: Settings) -> dict:
        """This layer's entry of analysis.json: rank, redundancy and mixture summaries over what was added."""
        rel_rank = [r / n for r, n in zip(self.ranks[settings.rank_mode], self.lengths)]
        out = {"layer": index, "module": self.name, "kind": type(self.module).__name__,
               "num_heads": self.module.num_heads, "kv_heads": _kv_heads(self.module), "causal": self.causal,
               "rank": {m: stats.summary(self.ranks[m]) for m in stats.RANK_MODES},
               "rank_over_length": stats.summary(rel_rank),
               "ranks": {m: self.ranks[m] for m in stats.RANK_MODES}, "lengths": self.lengths,
               "redundancy": {"js": stats.summary(self.js), "l2": stats.summary(self.l2),
                              "effective_heads": stats.summary(self.eff)}}
        if has_mixture(self.module):
            out["mixture"] = _mixture_result(self.module, self.sums, self.pairs, self.longest)
        return out


def _kv_heads(module) -> int:
    """The heads of the layer's keys: H, or G for kinds whose G key heads (groups) serve H / G query heads each."""
    return getattr(module, "kv_heads", module.num_heads)


def _mixture_result(module, sums, pairs, longest: int) -> dict:
    pi = mixture_weights(module, max(1, longest))
    res = {"pi_mode": module.pi_mode, "pi_shape": getattr(module, "pi_shape", "head"),
           "pi_norm": getattr(module, "pi_norm", "softmax"),
           "num_keys": module.num_keys, "positions": int(pi.shape[-1]) if pi is not None else 0,
           "pi": None if pi is None else [[stats.summary(pi[h, r].tolist()) for r in range(pi.shape[1])]
                                         for h in range(pi.shape[0])],
           "pi_values": None if pi is None else pi.tolist()}
    if sums is not None:
        share = sums / pairs.clamp_min(1.0).unsqueeze(1)
        res["shares"] = share.tolist()  # (H, M)
        res["shares_mean"] = (sums.sum(0) / pairs.sum().clamp_min(1.0)).tolist()
        res["share_kind"] = ("nearest component (Hard-E)" if module.pi_mode == "hard_e" else
                             "responsibility" if isinstance(module, MGKAttention) else
                             "share of the linear kernel")
    elif getattr(module, "mix", None) == "keys":
        res["share_kind"] = "none: mix='keys' mixes the keys before the feature map, so no component has a share"
    return res


def _sequences(call, batch):
    """(b, n) of every sequence of a recorded call: n real tokens from the key-padding mask, or for a language-model
    batch (no mask; padding only at the end of the last segment) from the targets that are scored. A target per
    sequence (a class, a regression value: D-retrieval) says nothing about the length."""
    lengths = call.real_lengths()
    per_token = isinstance(batch, dict) and isinstance(batch.get("target"), torch.Tensor) and batch["target"].dim() == 2
    if call.key_padding_mask is None and per_token:
        lengths = (batch["target"] != IGNORE_INDEX).sum(dim=1).cpu()
    return [(b, int(n)) for b, n in enumerate(lengths.tolist()) if n > 0]


@torch.no_grad()
def analyse(run: LoadedRun, settings: Settings, *, progress: bool = True) -> dict:
    """Measure ``run`` (see the module docstring). Returns the JSON-ready result; ``result["layers"][i]["maps"]`` is
    removed into ``result["_maps"]`` (tensors for the figures). Raises ValueError for an absent split."""
    settings.check()
    dataset = run.task.splits.get(settings.split)
    if dataset is None:
        have = sorted(k for k, v in run.task.splits.items() if v is not None)
        raise ValueError(f"run {run.run_dir} has no {settings.split!r} split in {run.data_dir} (has: {have})")
    gen = torch.Generator().manual_seed(settings.seed)
    index = torch.randperm(len(dataset), generator=gen)[:settings.samples]
    model = run.model.to(getattr(torch, settings.dtype)).eval()
    device = next(model.parameters()).device
    recorder = WeightRecorder(model, stop_after_last=True)
    layers = [_Layer(name, module) for name, module in recorder.layers]
    with recorder, tqdm(total=len(index), desc=f"analyse {run.run_dir.name}", unit="example",
                        disable=not progress) as bar:
        for start in range(0, len(index), settings.batch_size):
            idx = index[start:start + settings.batch_size]
            batch = run.task.batch(dataset, idx, device)
            try:
                run.task.loss(model, batch)  # the task's own forward, cut short after the last attention layer
            except StopForward:
                pass
            for call in recorder.calls:
                for b, n in _sequences(call, batch):
                    layers[call.layer].add(call.weights[b, :, :n, :n], call.query[b:b + 1, :n], call.is_causal,
                                           settings)
            recorder.clear()
            bar.update(len(idx))
    return {"run_dir": str(run.run_dir), "checkpoint": str(run.checkpoint), "step": run.step,
            "task": run.cfg.task, "attention": run.cfg.attention.kind, "num_heads": run.cfg.attention.num_heads,
            "head_dim": run.cfg.attention.head_dim, "num_layers": len(layers),
            "pi": getattr(run.cfg.attention.options, "pi", None),
            "num_keys": getattr(run.cfg.attention.options, "num_keys", None),
            "examples_analysed": int(len(index)), "settings": asdict(settings),
            "layers": [layer.result(i, settings) for i, layer in enumerate(layers)],
            "_maps": [layer.maps for layer in layers]}
