"""What every results table reads from a run's record (results.json, eval.json): whether it failed, its metric on
the test split (else validation), and the row it belongs to (attention setting, heads). Shared by the LRA, LM and
synthetic tables and by ``mgk reproduce``."""
from __future__ import annotations

import math

from ..attention import attention_kinds, get_kind
from ..attention.registry import run_label

__all__ = ["DASH", "run_failure", "left_out_if_failed", "run_metric", "run_accuracy", "setting", "row_order"]

DASH = "—"


def run_failure(record: dict) -> str | None:
    """Why a run's record (a results.json, or an eval.json of ``mgk eval``) must not count as a result: the
    ``failed`` reason that ``mgk train`` / ``mgk eval`` write when the final evaluation is not finite, or, for
    records without that field (older versions), a non-finite loss, nll, ppl or accuracy at its top level or in
    its val / test split. None for a record that counts. A NaN-weight classifier still reports an accuracy (the
    argmax of NaN logits is a fixed class), so a finite accuracy alone proves nothing."""
    if record.get("failed"):
        return str(record["failed"])
    for where, figures in (("", record), ("val ", record.get("val")), ("test ", record.get("test"))):
        if not isinstance(figures, dict):
            continue
        for key in ("loss", "nll", "ppl", "acc"):
            value = figures.get(key)
            if isinstance(value, float) and not math.isfinite(value):
                return f"non-finite {where}{key} ({value})"
    return None


def left_out_if_failed(res: dict, warnings: list[str], failed: list[str] | None = None,
                       task: str | None = None) -> bool:
    """Whether a table must leave the run of record ``res`` out (:func:`run_failure`); if so the run, named by task
    (``task``, default the record's), kind, heads and seed, is added to ``warnings`` and, with its reason, to
    ``failed``."""
    if (reason := run_failure(res)) is None:
        return False
    what = f"{task or res.get('task')} {res.get('attention')} x {res.get('num_heads')} seed {res.get('seed')}"
    if failed is not None:
        failed.append(f"{what}: {reason}")
    warnings.append(f"run of {what} left out: failed ({reason})")
    return True


def run_metric(res: dict, name: str = "acc") -> tuple[float | None, str | None]:
    """``(metric name of the run, "test" or "val")``: test when the run has it, else validation; (None, None) when
    neither has it."""
    for split in ("test", "val"):
        m = res.get(split)
        if isinstance(m, dict) and isinstance(m.get(name), (int, float)):
            return float(m[name]), split
    return None, None


def run_accuracy(res: dict) -> tuple[float | None, str | None]:
    """``(accuracy in [0, 1], "test" or "val")``: :func:`run_metric` of ``acc``."""
    return run_metric(res, "acc")


def setting(res: dict) -> tuple[str, int]:
    """Row key ``(attention setting, num_heads)``: the kind with the options that name a variant, from the run's
    ``attention_options`` (``pi`` alone in runs that predate them), e.g. ``smgk+hard_e``."""
    kind = str(res["attention"])
    given = res.get("attention_options")
    given = {"pi": res["pi"]} if given is None and res.get("pi") is not None else (given or {})
    try:
        spec = get_kind(kind)
        options = spec.make_options(**{k: v for k, v in given.items() if k in spec.options.names()})
    except ValueError:  # a kind this version does not register, or options it no longer reads
        return kind, int(res["num_heads"])
    return run_label(kind, None, options, sep="+"), int(res["num_heads"])


def row_order(key):
    """Sort key of a row ``(setting, heads)``: the registry's order of kinds, then the variant, more heads first."""
    kind, heads = key
    base = kind.split("+")[0]
    order = attention_kinds()
    rank = order.index(base) if base in order else len(order)
    return rank, base, kind, -heads


def left_out_notes(failed: list[str], unfinished: list[str] = ()) -> list[str]:
    """The footnotes of a results table that name the runs it leaves out: failed ones (final evaluation not finite,
    :func:`left_out_if_failed`) and unfinished ones (no results.json), one line each under a count."""
    notes = []
    for runs, why in ((failed, "failed (final evaluation not finite)"), (unfinished, "unfinished (no results.json)")):
        if runs:
            notes.append(f"Not in the table, {why}: {len(runs)} run(s)")
            notes.extend(f"- {line}" for line in runs)
    return notes


def empty_row(columns: int) -> str:
    """A markdown table row of ``columns`` cells without a figure ({DASH})."""
    return "| " + " | ".join([DASH] * columns) + " |"
