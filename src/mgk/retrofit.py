"""Starting a run from another run's trained weights, its attention converted to another kind or number of heads:
``mgk train --init-from RUN_DIR --attention KIND --heads H`` (results/cpu/kv-budget.md, "Retro-fitting").

Everything but the attention layers (embeddings, feed-forward layers, norms, the task's head) is copied as it is;
the two models must have the same shapes there (a run of the same task and sizes). Each attention layer of the
source is read as a multi-head layer (:meth:`mgk.attention.AttentionBase.per_head_projections`) and converted by
the rules :func:`mgk.swap_attention` applies (one code path: :mod:`mgk.convert.regroup` names the rule and
chooses the heads, :func:`mgk.convert.layers.load_conversion` loads them), with each kind's default rule:

* **same** heads and head_dim: the new kind's own conversion rule (``load_projections``): softmax -> GQA
  mean-pools each group's key/value heads (Ainslie et al. 2023; exact for G = H), softmax -> MGK with the same heads
  takes the key for every component plus a spread summing to zero (the run config's key_scale: 1 unless set).
* **merge** (mgk / mlk target with ``H_source / num_keys`` heads of the source's head_dim): groups of ``num_keys``
  source heads become the key components of one head (:func:`mgk.convert.regroup.merge_heads`). Groups by
  ``pairs="similar"``: greedy matching on the mean Jensen-Shannon divergence of the heads' attention maps over
  validation examples (:mod:`mgk.analyze.similarity`), or ``"adjacent"``: heads (0, 1), (2, 3), ... (the control).
* **pool** (gqa with fewer query heads of the source's head_dim, dividing its heads): groups of source heads, chosen
  as for merging, mean-pooled (:func:`mgk.convert.regroup.pool_heads`), then GQA's own rule.
* **prune** (any other target with fewer heads of the source's head_dim): the heads of largest importance
  ``E_x |dL/dxi_h|`` on validation examples (Michel et al., NeurIPS 2019; :func:`mgk.analyze.prune.importance`) are
  kept, in their order, then the new kind's rule applies.

Other shapes (more heads, another head_dim, mgk / mlk heads that are not source heads / num_keys) are refused in
one line. The choices made (groups, kept heads, importances) are written to the new run's ``init.json``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .analyze import prune
from .analyze.similarity import head_divergence
from .attention import AttentionBase
from .convert.layers import load_conversion
from .convert.regroup import PAIRINGS, choose_rule, plan_heads
from .train import rundir
from .train.load import load_run

__all__ = ["PAIRINGS", "InitFrom", "describe", "initialise"]

# Validation examples the pairing (JS divergence) and the importance are measured on: the first ones of the split,
# so the choice is a function of the source run and the data alone.
MEASURE_EXAMPLES = 256


@dataclass(frozen=True)
class InitFrom:
    """Where a new run's weights come from: ``run_dir`` (a run of ``mgk train``), its ``checkpoint`` ("best", which
    is last.pt for a run without best.pt, or "last"), and how heads are grouped when they are merged into mixture
    components (``pairs``: "similar", the default, or "adjacent"; given for a conversion that merges nothing, it is
    an error rather than silently unused)."""

    run_dir: Path
    checkpoint: str = "best"
    pairs: str | None = None  # None: "similar" where heads are merged; given, it must be used by a merge

    def __post_init__(self):
        object.__setattr__(self, "run_dir", Path(self.run_dir))
        if self.pairs is not None and self.pairs not in PAIRINGS:
            raise ValueError(f"pairs must be one of {', '.join(PAIRINGS)}, got {self.pairs!r}")
        if self.checkpoint not in ("best", "last"):
            raise ValueError(f"checkpoint must be 'best' or 'last', got {self.checkpoint!r}")

    def check(self, task: str, out: Path | None = None, steps: int | None = None,
              warmup_steps: int | None = None) -> None:
        """ValueError in one line, before anything is written: ``run_dir`` is not a run, or a run of another task
        than ``task``; the new run's ``out`` is the source or holds it (``--overwrite`` would delete it); the
        source's ``warmup_steps`` (kept unless changed) exceed the new run's ``steps``."""
        try:
            src = rundir.load_config(self.run_dir)
        except FileNotFoundError:
            raise ValueError(f"--init-from {self.run_dir}: not a run directory (no config.yaml)") from None
        if src.task != task:
            raise ValueError(f"--init-from {self.run_dir}: a {src.task} run; this run trains {task}")
        if out is not None:
            source, new = self.run_dir.resolve(), Path(out).resolve()
            if new == source or new in source.parents:
                raise ValueError(f"--out {out} is the --init-from run {self.run_dir} or holds it: the new run "
                                 "needs its own folder (--overwrite would delete the source)")
        if steps is not None and warmup_steps is not None and warmup_steps > steps:
            raise ValueError(f"--init-from keeps the source's warmup_steps={warmup_steps}, more than --steps "
                             f"{steps}: give --set warmup_steps=N (for example {max(1, steps // 10)})")


def _attention(model: nn.Module) -> dict[str, AttentionBase]:
    return {n: m for n, m in model.named_modules() if isinstance(m, AttentionBase)}


def _copy_rest(source: nn.Module, model: nn.Module, skip: list[str], run_dir: Path) -> int:
    """Copy every state entry outside the attention layers ``skip``; ValueError naming the first that differs."""
    def outside(name: str) -> bool:
        """Whether state entry ``name`` lies outside every attention layer in ``skip``."""
        return not any(name.startswith(f"{p}.") for p in skip)

    src = {k: v for k, v in source.state_dict().items() if outside(k)}
    dst = {k: v for k, v in model.state_dict().items() if outside(k)}
    if set(src) != set(dst):
        name = sorted(set(src) ^ set(dst))[0]
        raise ValueError(f"--init-from {run_dir}: the models differ outside attention ({name} is in only one of them)")
    for name, t in dst.items():
        if src[name].shape != t.shape:
            raise ValueError(f"--init-from {run_dir}: {name} is {tuple(src[name].shape)} in the source run and "
                             f"{tuple(t.shape)} here (another vocabulary or size)")
    model.load_state_dict({**model.state_dict(), **src})
    return len(src)


def _rule(old: AttentionBase, new: AttentionBase) -> str:
    """The rule converting ``old`` into ``new`` (:func:`mgk.convert.regroup.choose_rule`, each kind's default;
    re-cutting the width into heads of another size is not one of --init-from's); ValueError in one line for other
    shapes."""
    try:
        rule = choose_rule(old.num_heads, old.head_dim, new)
        if rule == "slice":
            raise ValueError("--init-from keeps the head size")
    except ValueError as e:
        raise ValueError(f"no conversion from {type(old).__name__} x {old.num_heads} (head_dim {old.head_dim}) to "
                         f"{type(new).__name__} x {new.num_heads} (head_dim {new.head_dim}): {e}") from None
    return rule


def _measure(source, task, layers: list[str], rules: list[str], new: list[AttentionBase], pairs: str) -> list:
    """Per layer: the groups to merge or pool or the heads to keep ({} for "same"), with what they were chosen by,
    measured on the first validation examples."""
    val = task.splits.get("val")
    index = None if val is None else torch.arange(min(MEASURE_EXAMPLES, len(val)))
    pairs = pairs or "similar"
    need_js = any(r in ("merge", "pool") for r in rules) and pairs == "similar"
    need_imp = any(r == "prune" for r in rules)
    if (need_js or need_imp) and val is None:
        raise ValueError("--init-from: choosing heads needs the run's validation split, and its data has none")
    old = [_attention(source)[p] for p in layers]
    js = head_divergence(task, source, val, index) if need_js else [None] * len(old)
    imp = prune.importance(task, source, old, val, index, prune.unit_gates(old, "head"), unit="head",
                           batch_size=32) if need_imp else [None] * len(old)
    return [plan_heads(rule, o.per_head_projections(), n.num_heads, o.head_dim, divergence=d, importance=i,
                       pairs=pairs) for rule, o, n, d, i in zip(rules, old, new, js, imp)]


def _load_source(init: InitFrom, device):
    try:
        return load_run(init.run_dir, checkpoint=init.checkpoint, device=device)
    except FileNotFoundError as e:
        raise ValueError(f"--init-from {init.run_dir}: {e}") from None


def _check_vocabulary(source, task, run_dir: Path) -> None:
    """ValueError when a language model's words are not the source's, word for word: its embeddings (and tied
    output weights) are rows by word id, so another order would give every word another word's vector."""
    old, new = getattr(source.task, "vocab", None), getattr(task, "vocab", None)
    if old is None or new is None or old.words == new.words:
        return
    at = next((i for i, (a, b) in enumerate(zip(old.words, new.words)) if a != b), min(len(old), len(new)))
    there = old.words[at] if at < len(old) else None
    here = new.words[at] if at < len(new) else None
    raise ValueError(f"--init-from {run_dir}: this data's vocabulary is not the source run's (word {at}: {there!r} "
                     f"there, {here!r} here), so its embeddings would belong to other words; train on the source's "
                     "data")


def initialise(init: InitFrom, model: nn.Module, task, seed: int) -> dict:
    """Load ``init``'s run into ``model`` (a fresh model of the new run, on its device) with its attention converted
    (module docstring); ``task`` is the new run's task with its splits (validation examples choose heads); ``seed``
    seeds the conversion's random draws (the global RNG is left as it was). Returns the record written to init.json.
    Raises ValueError in one line (naming ``--init-from``) for a missing run or checkpoint, another task, another
    vocabulary, sizes that differ outside attention, attention shapes that have no conversion, or ``init.pairs``
    given where nothing is merged."""
    source = _load_source(init, next(model.parameters()).device)
    if source.cfg.task != task.name:
        raise ValueError(f"--init-from {init.run_dir}: its checkpoint is a {source.cfg.task} model; this run trains "
                         f"{task.name}")
    _check_vocabulary(source, task, init.run_dir)
    old, new = _attention(source.model), _attention(model)
    if list(old) != list(new):
        raise ValueError(f"--init-from {init.run_dir}: its attention layers ({len(old)}) are not this model's "
                         f"({len(new)}): another number of layers")
    layers = list(new)
    copied = _copy_rest(source.model, model, layers, init.run_dir)
    rules = [_rule(old[p], new[p]) for p in layers]
    if init.pairs is not None and not {"merge", "pool"} & set(rules):
        raise ValueError(f"--init-pairs {init.pairs}: this conversion merges no heads (it is by "
                         f"{', '.join(sorted(set(rules)))}); pairs apply to mgk / mlk with source heads / num_keys "
                         "heads and to gqa with fewer heads")
    plans = _measure(source.model, task, layers, rules, [new[p] for p in layers], init.pairs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for path, rule, plan in zip(layers, rules, plans):
            _convert(old[path], new[path], rule, plan, path)
    record = {"source": str(init.run_dir), "checkpoint": str(source.checkpoint), "step": source.step,
              "source_status": source.status(),
              "source_attention": f"{source.cfg.attention.kind} x {source.cfg.attention.num_heads}",
              "copied_entries": copied,
              "layers": [{"path": p, "rule": r, **plan} for p, r, plan in zip(layers, rules, plans)]}
    return {"summary": describe(record), **record}


def _convert(old: AttentionBase, new: AttentionBase, rule: str, plan: dict, path: str) -> None:
    """Set ``new``'s projections from ``old``'s by ``rule`` and ``plan`` (swap_attention's
    :func:`mgk.convert.layers.load_conversion`); ValueError naming ``path`` when one does not fit."""
    try:
        weights = {k: v.to(new.q_proj.weight.dtype) for k, v in old.per_head_projections().items()}
    except ValueError as e:
        raise ValueError(f"--init-from: {path}: {e}") from None
    # as swap_attention: with the same heads, the source's own parameters of the same name and shape (mgk -> mgk
    # keeps every key component and the learned weights, so the conversion is exact)
    own = {n: t.detach() for n, t in old.named_parameters()} if rule == "same" else None
    done = load_conversion(new, weights, rule, plan, old.head_dim, own)
    unset = [n for n in ("q_proj.weight", "v_proj.weight", "out_proj.weight") if n not in done]
    if unset:
        raise ValueError(f"--init-from: {path}: {unset[0]} of the source does not fit {type(new).__name__} "
                         f"{tuple(dict(new.named_parameters())[unset[0]].shape)}")


def describe(record: dict) -> str:
    """One line for train.log: the source and the rules applied."""
    rules = sorted({layer["rule"] for layer in record["layers"]})
    status = "" if record["source_status"] == "finished" else f", source {record['source_status']}"
    return (f"initialised from {record['source']} ({Path(record['checkpoint']).name}, step {record['step']}, "
            f"{record['source_attention']}{status}): {record['copied_entries']} entries outside attention copied; "
            f"attention by {', '.join(rules)} (init.json)")

