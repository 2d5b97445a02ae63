"""The paper's experiments as data: one :class:`Experiment` per table, one :class:`Row` per model setting.

Paper numbers are those of T. Nguyen et al., "Improving Transformers with Probabilistic Attention Keys" (ICML 2022):
Table 1 (softmax / MGK family on LRA), Table 2 (linear / MLK family), Table 4 (mixture-weight ablation, 1 head) and
Table 3 (WikiText-103 perplexity). LRA numbers are test accuracy in % (mean of 5 seeds); WikiText-103 numbers are
perplexities on valid and test. ``None`` marks a setting whose number we do not carry (the report prints "—").

``heads`` is not a table of the paper: the synthetic tasks where the number of heads decides the result
(D-retrieval, Yu et al. ICLR 2026; MQAR, Arora et al. 2023), to test the paper's claim that M keys per head let k
heads do the work of M k (:data:`HEADS_COMPARISONS`; the decision rule is pre-registered in results/cpu/heads.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..attention import get_kind
from ..attention.registry import display_label

__all__ = ["Row", "Experiment", "EXPERIMENTS", "get_experiment", "TASK_LABELS", "HEADS_COMPARISONS"]

TASK_LABELS = {"listops": "ListOps", "text": "Text", "retrieval": "Retrieval", "image": "Image",
               "pathfinder": "Pathfinder", "lm": "WikiText-103"}


@dataclass(frozen=True)
class Row:
    """One model setting of a table.

    ``key`` names it on the command line (``--only row=mgk-4``); ``paper`` maps a task (or, for language modelling,
    a split: ``valid`` / ``test``) to the paper's number; ``overrides`` are extra ``--set key=value`` pairs;
    ``tasks``: the experiment's tasks this row runs on (empty: all of them).
    """

    key: str
    attention: str
    heads: int
    pi: str = "learned"
    paper: dict = field(default_factory=dict)
    overrides: tuple = ()
    tasks: tuple = ()

    def runs_on(self, task: str) -> bool:
        """Whether the row has runs on the experiment's task ``task``."""
        return not self.tasks or task in self.tasks

    @property
    def keys_per_head(self) -> int:
        """M, the keys of each head: ``num_keys`` of the kinds that take it, else 1."""
        return int(getattr(self.options, "num_keys", 1))

    @property
    def options(self):
        """The attention options of the row's runs: ``pi`` (where the kind takes it) and ``overrides``, as ``mgk
        train`` reads them (:func:`mgk.config.apply_overrides`)."""
        from ..config import RunConfig, apply_overrides

        pi = {"pi": self.pi} if "pi" in get_kind(self.attention).options.names() else {}
        return apply_overrides(RunConfig(), self.overrides, attention=self.attention, **pi).attention.options

    @property
    def label(self) -> str:
        """Human name from the registry, e.g. ``sMGK x 4 (Soft-E)``; ``M = 4`` added where the keys per head are not
        the kind's default (``MGK x 1, M = 4``)."""
        label = display_label(self.attention, self.heads, self.options)
        default = getattr(get_kind(self.attention).options(), "num_keys", 1)
        return label if self.keys_per_head == default else f"{label}, M = {self.keys_per_head}"


@dataclass(frozen=True)
class Experiment:
    """A table: rows x tasks. ``metric`` is ``ppl`` (perplexity from ``mgk eval``, lower is better) or ``acc``:
    the metric of each task's results.json (accuracy, or for the synthetic tasks the one
    :func:`mgk.tasks.synthetic_table.metric_of` names, e.g. NMSE, lower is better). ``comparisons``: pairs
    ``(row, reference row)`` the report sets side by side on every task where both ran (the difference of the means
    against the seeds' standard deviations)."""

    name: str
    title: str
    tasks: tuple
    optional_tasks: tuple
    rows: tuple
    metric: str = "acc"
    comparisons: tuple = ()


def _lra(listops, text, retrieval) -> dict:
    return {"listops": listops, "text": text, "retrieval": retrieval}


_NONE = _lra(None, None, None)

_SOFTMAX_FAMILY = (
    Row("softmax-8", "softmax", 8, paper=_lra(37.03, 65.71, 81.74)),
    Row("softmax-4", "softmax", 4, paper=_lra(36.89, 65.26, 81.54)),
    Row("softmax-2", "softmax", 2, paper=_NONE),
    Row("softmax-1", "softmax", 1, paper=_lra(36.81, 64.48, 77.9)),
    Row("mgk-4", "mgk", 4, paper=_lra(36.98, 65.69, 82.23)),
    Row("mgk-2", "mgk", 2, paper=_NONE),
    Row("mgk-1", "mgk", 1, paper=_lra(37.13, 65.40, 80.63)),
    Row("smgk-4", "smgk", 4, paper=_lra(37.25, 65.51, 82.79)),
    Row("smgk-2", "smgk", 2, paper=_NONE),
    Row("smgk-1", "smgk", 1, paper=_NONE),
)

_LINEAR_FAMILY = (
    Row("linear-8", "linear", 8, paper=_lra(19.17, 65.85, 81.18)),
    Row("linear-4", "linear", 4, paper=_NONE),
    Row("linear-2", "linear", 2, paper=_NONE),
    Row("linear-1", "linear", 1, paper=_NONE),
    Row("mlk-4", "mlk", 4, paper=_lra(20.06, 65.7, 81.34)),
    Row("mlk-2", "mlk", 2, paper=_NONE),
    Row("mlk-1", "mlk", 1, paper=_NONE),
    Row("smlk-4", "smlk", 4, paper=_NONE),
    Row("smlk-2", "smlk", 2, paper=_NONE),
    Row("smlk-1", "smlk", 1, paper=_NONE),
)

_PI_ABLATION = (
    Row("mgk-1-learned", "mgk", 1, "learned", paper=_lra(37.13, 65.40, 80.63)),
    Row("mgk-1-soft_e", "mgk", 1, "soft_e", paper=_lra(33.85, 65.25, 80.73)),
    Row("mgk-1-hard_e", "mgk", 1, "hard_e", paper=_NONE),
    Row("smgk-1-learned", "smgk", 1, "learned", paper=_NONE),
    Row("smgk-1-soft_e", "smgk", 1, "soft_e", paper=_lra(37.05, 64.68, 81.44)),
    Row("smgk-1-hard_e", "smgk", 1, "hard_e", paper=_lra(37.25, 64.7, 81.29)),
)


def _ppl(valid, test) -> dict:
    return {"valid": valid, "test": test}


_WT103 = (
    Row("softmax-8", "softmax", 8, paper=_ppl(33.15, 34.29)),
    Row("mgk-4", "mgk", 4, paper=_ppl(33.28, 34.21)),
    Row("smgk-8", "smgk", 8, paper=_ppl(32.92, 33.99)),
    Row("mgk-8", "mgk", 8, paper=_ppl(32.74, 33.93)),
    Row("linear-8", "linear", 8, paper=_ppl(38.07, 39.08)),
    Row("mlk-4", "mlk", 4, paper=_ppl(38.49, 39.46)),
    Row("mlk-8", "mlk", 8, paper=_ppl(37.78, 38.99)),
)

_D_TASKS = ("dretrieval-d8", "dretrieval-d4", "dretrieval-d2")
_MQAR_TASKS = ("mqar-n8",)


def _gqa_rows(tasks: tuple = ()) -> list:
    """GQA with 8 query heads and 4 or 2 key/value heads, and MQA (one): the baselines users pick today for a smaller
    cache (Ainslie et al. 2023; Shazeer 2019); GQA-8 (kv 2) has MGK-4's attention parameters and a third of its
    cache (results/cpu/kv-budget.md)."""
    return [Row(f"gqa-8-kv{g}", "gqa", 8, overrides=(f"num_kv_heads={g}",), tasks=tasks) for g in (4, 2, 1)]


def _gmgk_rows(tasks: tuple = ()) -> list:
    """Grouped mixture keys at GQA's cache (results/cpu/mixture-keys-at-gqa-cache.md, pre-registered): 8 query heads
    sharing 2 key groups of shifted keys (GQA-8 (kv 2)'s cache plus M scalars per key) and sharing 1 group of M = 2
    separate keys (less cache than GQA-8 (kv 2))."""
    return [Row("gmgk-8-kv2-shifted", "gmgk", 8, overrides=("num_kv_heads=2", "keys=shifted"), tasks=tasks),
            Row("gmgk-8-kv1", "gmgk", 8, overrides=("num_kv_heads=1",), tasks=tasks)]


def _heads_rows() -> tuple:
    """Softmax h in {1, 2, 4, 8}, MGK and sMGK h in {1, 2, 4} with M = 2, MGK M = 4 at h = 1, GQA-8 with 4, 2
    and 1 key/value heads on D-retrieval; linear
    h in {1, 2, 4, 8} and MLK h in {1, 2, 4} (M = 2) on MQAR. head_dim is fixed by the presets."""
    rows = [Row(f"softmax-{h}", "softmax", h, tasks=_D_TASKS) for h in (8, 4, 2, 1)]
    rows += [Row(f"{kind}-{h}", kind, h, tasks=_D_TASKS) for kind in ("mgk", "smgk") for h in (4, 2, 1)]
    rows.append(Row("mgk-1-m4", "mgk", 1, overrides=("num_keys=4",), tasks=_D_TASKS))
    rows += _gqa_rows(_D_TASKS)
    rows += _gmgk_rows(_D_TASKS)
    rows += [Row(f"linear-{h}", "linear", h, tasks=_MQAR_TASKS) for h in (8, 4, 2, 1)]
    rows += [Row(f"mlk-{h}", "mlk", h, tasks=_MQAR_TASKS) for h in (4, 2, 1)]
    return tuple(rows)


# results/cpu/kv-budget.md, pre-registered: MGK-4 against GQA-8 (kv 2), the same attention parameters and a third of
# the cache; sMGK-4 against what has its cache; then the reference pairs.
_KV_BUDGET_COMPARISONS = (
    ("mgk-4", "gqa-8-kv2"), ("smgk-4", "softmax-4"), ("smgk-4", "gqa-8-kv4"),
    ("gqa-8-kv2", "softmax-8"), ("gqa-8-kv1", "gqa-8-kv2"), ("gqa-8-kv4", "softmax-4"),
)

# results/cpu/mixture-keys-at-gqa-cache.md, pre-registered: grouped mixture keys against GQA-8 (kv 2) at its cache
# (shifted, two groups) and below it (separate, one group); then the reference pairs.
_GMGK_COMPARISONS = (
    ("gmgk-8-kv2-shifted", "gqa-8-kv2"), ("gmgk-8-kv1", "gqa-8-kv2"),
    ("gmgk-8-kv1", "gqa-8-kv1"), ("gmgk-8-kv2-shifted", "mgk-4"),
)

# (row, reference): M keys per head against M times the heads (equal h * M), the preconditions (does the task
# separate k heads from 2k?) and, on MQAR, equal state size (MLK-k against linear-k).
HEADS_COMPARISONS = (
    ("softmax-8", "softmax-2"), ("softmax-8", "softmax-4"),
    ("mgk-4", "softmax-8"), ("mgk-2", "softmax-4"), ("mgk-1", "softmax-2"), ("mgk-1-m4", "softmax-4"),
    ("smgk-4", "softmax-8"), ("smgk-2", "softmax-4"), ("smgk-1", "softmax-2"),
    ("mgk-4", "softmax-4"), ("mgk-2", "softmax-2"), ("mgk-1", "softmax-1"),
    ("linear-8", "linear-4"),
    ("mlk-4", "linear-4"), ("mlk-4", "linear-8"), ("mlk-2", "linear-4"), ("mlk-1", "linear-2"),
    ("mlk-2", "linear-2"), ("mlk-1", "linear-1"),
    *_KV_BUDGET_COMPARISONS, *_GMGK_COMPARISONS,
)

# The kv-budget experiment on WikiText-103 (results/cpu/kv-budget.md): quality against attention parameters and
# cache bytes, softmax and GQA against MGK-4 and sMGK-4.
_KV_BUDGET = (
    Row("softmax-8", "softmax", 8), Row("softmax-4", "softmax", 4), *_gqa_rows(),
    Row("mgk-4", "mgk", 4), Row("smgk-4", "smgk", 4), *_gmgk_rows(),
)

_LRA_TASKS = ("listops", "text", "retrieval")
_LRA_OPTIONAL = ("image", "pathfinder")

EXPERIMENTS = {e.name: e for e in (
    Experiment("lra-softmax-family", "LRA, softmax and MGK families (paper Table 1)", _LRA_TASKS, _LRA_OPTIONAL,
               _SOFTMAX_FAMILY),
    Experiment("lra-linear-family", "LRA, linear and MLK families (paper Table 2)", _LRA_TASKS, _LRA_OPTIONAL,
               _LINEAR_FAMILY),
    Experiment("lra-pi-ablation", "LRA, mixture weights of 1-head MGK / sMGK: learned, Soft-E, Hard-E "
               "(paper Table 4)", _LRA_TASKS, _LRA_OPTIONAL, _PI_ABLATION),
    Experiment("wt103", "WikiText-103 perplexity, sliding-window evaluation (paper Table 3)", ("lm",), (), _WT103,
               metric="ppl"),
    Experiment("heads", "Heads that matter: D-retrieval and MQAR against the number of heads and keys per head",
               (*_D_TASKS, *_MQAR_TASKS), (), _heads_rows(), comparisons=HEADS_COMPARISONS),
    Experiment("kv-budget", "WikiText-103 perplexity of MGK against GQA / MQA at equal parameters and cache",
               ("lm",), (), _KV_BUDGET, metric="ppl",
               comparisons=(*_KV_BUDGET_COMPARISONS, ("mgk-4", "softmax-8"), ("softmax-8", "softmax-4"),
                            *_GMGK_COMPARISONS)),
)}


def get_experiment(name: str) -> Experiment:
    """The experiment called ``name``; ValueError listing the known names otherwise."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; choose one of {', '.join(EXPERIMENTS)}")
    return EXPERIMENTS[name]
