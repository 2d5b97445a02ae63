"""What every results table reads from a run's record (results.json, eval.json): whether it failed, its metric on
the test split (else validation), and the row it belongs to (attention setting, heads). Shared by the LRA, LM and
synthetic tables and by ``mgk reproduce``."""
from __future__ import annotations

import math
from pathlib import PurePath

from ..attention import attention_kinds, get_kind
from ..attention.registry import run_label

__all__ = ["DASH", "VARIANT_NOTE", "RUN_DIR", "RUN_CONFIG", "run_failure", "left_out_if_failed", "run_metric",
           "run_accuracy", "setting", "base_kind", "row_order", "run_identity", "cells_by_config"]

DASH = "—"
# Keys ``mgk table`` adds to a results.json dict: the run directory it was read from, and the flat resolved config
# of its config.yaml (:func:`mgk.config.flat`). Runs without them are told apart by results.json alone.
RUN_DIR, RUN_CONFIG = "run_dir", "run_config"
VARIANT_NOTE = ("Attention `kind (field=value, ...)`: runs of one cell whose configs differ in more than the seed, a "
                "row per config, named by the fields that differ (mgk table's warnings name them).")
# Config fields that change how a run reports or where it caches, not what it computes; the seed is what a cell's
# runs may differ in.
_NOT_THE_RUN = frozenset({"seed", "log_every", "checkpoint_every", "progress", "data_as_given", "cache_dir",
                          "eval_batch_size"})
# What results.json says of a run's config, under the config's flat names: all a run without config.yaml shows.
_RESULTS_FACTS = ("steps", "max_len", "precision")


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


def base_kind(label: str) -> str:
    """The registered kind of a row's setting label: ``"mgk+hard_e (steps=30)"`` (a variant's options, then the
    config fields :func:`cells_by_config` names) is ``"mgk"``."""
    return label.split(" (")[0].split("+")[0]


def row_order(key):
    """Sort key of a row ``(setting, heads)``: the registry's order of kinds, then the variant, more heads first."""
    kind, heads = key
    base = base_kind(kind)
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


def run_identity(res: dict) -> dict:
    """What the run of record ``res`` computed, bar its seed: its :data:`RUN_CONFIG` (flat name -> value) without
    the fields that do not change a result and ``data`` by its folder's name (seeds run from two machines' scratch
    folders share a cell), else the config facts results.json holds (steps, max_len, precision);
    and ``init_from`` (``"<source> step <n>"``, or None for a run trained from scratch)."""
    config = res.get(RUN_CONFIG)
    if isinstance(config, dict):
        ident = {k: v for k, v in config.items() if k not in _NOT_THE_RUN}
        if isinstance(ident.get("data"), str):  # one dataset under two machines' folders is one dataset
            ident["data"] = PurePath(ident["data"]).name or ident["data"]
    else:
        ident = {k: res[k] for k in _RESULTS_FACTS if res.get(k) is not None}
    init = res.get("init_from")
    ident["init_from"] = f"{init.get('source')} step {init.get('step')}" if isinstance(init, dict) else None
    return ident


def _configs(runs: list[dict]) -> tuple[list[dict], list[tuple], list[str]]:
    """Each run's :func:`run_identity`, the same as a hashable key over the fields every run of ``runs`` has (a run
    without config.yaml is compared by what its results.json says), and the names of those fields whose values
    differ."""
    idents = [run_identity(r) for r in runs]
    common = [k for k in idents[0] if all(k in i for i in idents[1:])]  # in the config's order: reads as --set
    differ = [k for k in common if len({repr(i[k]) for i in idents}) > 1]
    return idents, [tuple(repr(i[k]) for k in common) for i in idents], differ


def _named(res: dict) -> str:
    return str(res.get(RUN_DIR) or f"a run of seed {res.get('seed')}")


def cells_by_config(entries) -> tuple[dict[tuple, dict[str, list]], list[str]]:
    """The cells of a results table, runs sharing one only when their configs differ in the seed alone.

    Args:
        entries: ``(row key, column, results.json dict, payload)`` of each run; the row key's first item is the
            attention setting (:func:`setting`), the payload what the cell keeps of the run (its figure).

    Returns:
        ``({row key: {column: [payload, ...]}}, warnings)``. The runs of one (row, column) whose configs
        (:func:`run_identity`) differ in more than the seed go to rows of their own, the setting followed by what
        differs (``mgk (steps=30, init_from=none)``), with a warning; a second run of one config and seed is a
        duplicate, left out with a warning naming both run directories.
    """
    groups: dict[tuple, list] = {}
    for row, col, res, payload in entries:
        groups.setdefault((row, col), []).append((res, payload))
    cells: dict[tuple, dict[str, list]] = {}
    warnings = []
    for (row, col), runs in groups.items():
        idents, keys, differ = _configs([res for res, _ in runs])
        if differ:
            warnings.append(f"runs of {col} {row[0]} x {row[1]} differ in more than the seed ({', '.join(differ)}): "
                            "each config gets a row of its own")
        first: dict[tuple, dict] = {}
        for ident, key, (res, payload) in zip(idents, keys, runs):
            seed = res.get("seed")
            if seed is not None and (key, seed) in first:
                warnings.append(f"{_named(res)} duplicates {_named(first[key, seed])} ({col} {row[0]} x {row[1]}, "
                                f"seed {seed}, one config): left out, the cell counts seeds once")
                continue
            first.setdefault((key, seed), res)
            label = ", ".join(f"{k}={'none' if ident[k] is None else ident[k]}" for k in differ)
            cells.setdefault((f"{row[0]} ({label})" if label else row[0], *row[1:]), {}).setdefault(col, []).append(
                payload)
    return cells, warnings
