"""Reading the finished runs of a grid into one summary (the content of report.json).

Everything comes from the run directories that ``mgk train`` / ``mgk eval`` write: results.json, config.yaml,
env.json, metrics.jsonl, eval.json, the checkpoint (attention parameter count) and <run>.reproduce.json (peak memory,
exit codes). The figure of a run is its task's metric (:func:`mgk.tasks.synthetic_table.metric_of`: accuracy in %,
or NMSE for D-retrieval) by :func:`mgk.tasks.run_records.run_metric` (test, else validation), the same rule as
``mgk table``; its chance level is the majority-class accuracy (%) or the NMSE of the constant prediction. A failed
run (:func:`mgk.tasks.run_records.run_failure`: its final evaluation was not finite), or one
whose results.json / eval.json / config.yaml is damaged, has no value (``failed`` says why) and is not averaged in;
a damaged file the value does not need (env.json, the checkpoint) is named in ``problems``.
"""
from __future__ import annotations

import hashlib
import json
import math
import statistics
from pathlib import Path

from .. import config as config_mod
from ..tasks.run_records import run_failure, run_metric
from ..tasks.synthetic_table import metric_of
from ..train import checkpoint, rundir
from .executor import record_path
from .experiments import Experiment
from .grid import Run

__all__ = ["run_figures", "attention_params", "attention_flops", "attention_cache_bytes", "aggregate", "file_facts",
           "PROTOCOL_FIELDS", "task_metric"]

PROTOCOL_FIELDS = ("max_len", "batch_size", "steps", "lr", "warmup_steps", "schedule", "weight_decay", "adam_eps",
                   "d_model", "num_layers", "ffn_dim", "head_dim", "num_keys", "dropout", "attn_dropout", "pooling",
                   "precision", "grad_clip", "segment_len", "val_fraction", "split_seed", "truncate")


def _json(path: Path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _read(path: Path, problems: list, reader=rundir.read_json):
    """``reader(path)``, or None when the file is absent; a damaged file is named in ``problems``."""
    try:
        return reader(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        problems.append(str(e))
        return None


def attention_params(run_dir: Path) -> int | None:
    """Parameters of the attention modules (state-dict entries under ``.attn.``, less the ``sigma2`` and Soft-E
    ``pi`` buffers) of the run's checkpoint; None without one. ValueError naming a damaged checkpoint."""
    path = rundir.RunFiles(run_dir).existing_checkpoint("best")
    if not path.is_file():
        return None
    state = checkpoint.load(path)["model"]
    return int(sum(v.numel() for k, v in state.items() if ".attn." in k and not k.endswith((".sigma2", ".pi"))))


def task_metric(run: Run, exp_metric: str) -> tuple[str, str, float, str]:
    """``(name in results.json or eval.json, name in reports, factor to the shown unit, "lower" or "higher")`` of
    the runs of ``run``'s task in an experiment whose metric is ``exp_metric``."""
    if exp_metric == "ppl":
        return "ppl", "perplexity", 1.0, "lower"
    return metric_of(run.setting.task or run.task)


def _sequence(cfg) -> tuple[int, bool]:
    """(tokens of one sequence, causal) of the task of ``cfg``: the LM segment; the generated synthetic tasks' own
    length (D-retrieval: T and the class token; MQAR: L, causal), whatever ``max_len`` allows; else ``max_len``."""
    d = cfg.data
    if cfg.task == "lm":
        return d.segment_len, True
    if cfg.task == "dretrieval" and d.path is None:
        return d.gen_seq_len + 1, False
    if cfg.task in ("mqar", "cmqar"):
        return (d.gen_seq_len if d.path is None else d.max_len), True
    return d.max_len, False


def attention_flops(cfg) -> int:
    """Analytic FLOPs of the attention layers in one forward pass of one sequence (``max_len`` tokens; the LM's
    ``segment_len``; a generated synthetic task's own length), all layers, of the RunConfig ``cfg``: the registry's
    formula of its kind and options (:func:`mgk.attention.registry.total`; CPU-kernel form for MGK)."""
    from ..attention import get_kind

    a = cfg.attention
    length, causal = _sequence(cfg)
    per_layer = get_kind(a.kind).flops(a.options, heads=a.num_heads, batch=1, embed_dim=cfg.model.d_model,
                                       length=length, head_dim=a.head_dim, causal=causal, backward=False,
                                       mixture_kernel=True)
    towers = 2 if cfg.task == "retrieval" else 1
    return per_layer * cfg.model.num_layers * towers


def attention_cache_bytes(cfg) -> int:
    """Bytes a decoding cache holds per token and attention layer in float32 for the RunConfig ``cfg``: the
    registry's formula of its kind (:class:`mgk.attention.registry.CacheSpec`; GQA counts its key/value heads
    only), held against the buffers by the tests; for linear attention and MLK, the fixed state of a layer."""
    from ..attention import get_kind

    a = cfg.attention
    return get_kind(a.kind).cache.cache_bytes(a.options, num_heads=a.num_heads, head_dim=a.head_dim, length=1)


def _window(ev: dict) -> str | None:
    """``"context 256, stride 1"``: the evaluation window of an ``mgk eval`` result (None without one)."""
    return f"context {ev['context']}, stride {ev['stride']}" if "context" in ev and "stride" in ev else None


def run_figures(run: Run, metric: str) -> dict:
    """The figures of one run directory (``value`` None when it has none; ``failed``: why it has none although it
    finished; ``problems``: damaged files, named)."""
    d, files, failed, problems = run.run_dir, rundir.RunFiles(run.run_dir), [], []
    res = _read(files.results, failed) or {}
    rec = _json(record_path(d)) or {}
    cfg = _read(d, failed, rundir.load_config)
    out = {"row": run.row.key, "task": run.task, "seed": run.seed, "key": run.key, "run_dir": str(d),
           "value": None, "split": None, "majority_acc": None, "constant": None}
    if res and (reason := run_failure(res)) is not None:
        failed.append(f"{files.results}: {reason}")
    if metric == "ppl":
        ev = _read(run.eval_json, failed) or {}
        out.update(value=ev.get("ppl"), split=ev.get("split"), protocol=ev.get("protocol"), window=_window(ev))
        if ev and (reason := run_failure(ev)) is not None:
            failed.append(f"{run.eval_json}: {reason}")
        test = (_read(run.eval_test_json, failed) or {}) if run.test_eval else {}
        out.update(test_value=test.get("ppl"), test_window=_window(test))
        if test and (reason := run_failure(test)) is not None:
            failed.append(f"{run.eval_test_json}: {reason}")
    elif res:
        name, _, factor, _ = task_metric(run, metric)
        value, split = run_metric(res, name)
        out.update(value=None if value is None else factor * value, split=split)
        if split and name == "acc":
            out["majority_acc"] = 100 * res[split].get("majority_acc", float("nan"))
        elif split:
            out["constant"] = res[split].get("constant_nmse")
    if res:
        out.update(params=res.get("params"), s_per_step=res.get("seconds_per_step"), steps=res.get("steps"),
                   best_step=res.get("best_step"),
                   attention_params=res["params_attention"] if "params_attention" in res
                   else _read(d, problems, attention_params),
                   flops=attention_flops(cfg) if cfg else None,
                   cache_bytes=attention_cache_bytes(cfg) if cfg else None)
    if failed:
        out["value"] = None
    out.update(failed=failed[0] if failed else None, problems=problems, results=res or None)
    out["peak_rss_mb"] = rec.get("peak_rss_mb")
    flat = config_mod.flat(cfg) if cfg else {}
    out["config"] = {k: list(v) if isinstance(v, tuple) else v for k, v in flat.items() if k in PROTOCOL_FIELDS}
    out["env"] = _read(files.env, problems)
    return out


def _mean_std(values):
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) if len(values) > 1 else None)


def aggregate(exp: Experiment, runs: list[Run], figures: list[dict]) -> list[dict]:
    """Per row and task: mean, sample std (n - 1) and n over seeds, the paper's number and the run figures."""
    rows = []
    for row in exp.rows:
        for task in dict.fromkeys(r.task for r in runs):
            figs = [f for r, f in zip(runs, figures) if r.row.key == row.key and r.task == task]
            if not figs:
                continue
            vals = [f["value"] for f in figs if isinstance(f["value"], (int, float)) and math.isfinite(f["value"])]
            split0 = figs[0].get("split")
            paper = row.paper.get(split0 or "valid") if exp.metric == "ppl" else row.paper.get(task)
            cell = {"n": len(vals), "planned": len(figs), "values": vals,
                    "seeds": [f["seed"] for f in figs if f["value"] in vals], "paper": paper,
                    "splits": sorted({f["split"] for f in figs if f["split"]})}
            if vals:
                cell["mean"], cell["std"] = _mean_std(vals)
            if exp.metric == "ppl":  # Table 3's second column: test perplexity, with the window of each column
                tests = [f["test_value"] for f in figs if f["value"] in vals and isinstance(f.get("test_value"), float)
                         and math.isfinite(f["test_value"])]
                cell["test"] = {"n": len(tests), "values": tests, "paper": row.paper.get("test"),
                                **dict(zip(("mean", "std"), _mean_std(tests) if tests else ()))}
                for name in ("window", "test_window"):
                    cell[name] = sorted({f[name] for f in figs if f.get(name)})
            for name in ("params", "attention_params", "flops", "cache_bytes", "s_per_step", "peak_rss_mb",
                         "majority_acc", "constant"):
                xs = [f.get(name) for f in figs if isinstance(f.get(name), (int, float))]
                cell[name] = statistics.fmean(xs) if xs and name in ("s_per_step", "peak_rss_mb", "majority_acc",
                                                                      "constant") else (xs[0] if xs else None)
            first = next(r for r in runs if r.row.key == row.key and r.task == task)
            metric, shown, _, better = task_metric(first, exp.metric)
            rows.append({"row": row.key, "label": row.label, "task": task, "heads": row.heads,
                         "keys": row.keys_per_head, "kind": row.attention, "metric": metric, "metric_label": shown,
                         "better": better, **cell})
    return rows


def file_facts(path: str | Path) -> list[dict]:
    """``{path, bytes, sha256}`` of a data file, or of every file (not hidden) in a data folder, top level and one
    below."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for f in list(p.glob("*")) + list(p.glob("*/*"))
                                           if f.is_file() and not any(s.startswith(".") for s in f.parts[-2:]))
    out = []
    for f in files:
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        out.append({"path": str(f), "bytes": f.stat().st_size, "sha256": h.hexdigest()})
    return out
