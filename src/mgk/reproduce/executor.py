"""Running the grid: state of each run directory, one run as subprocesses, and the local / submitit executors.

A run is *finished* when its ``results.json`` exists (and, for LM, its ``eval.json``) and its record
(``<run_dir>.reproduce.json``) carries the same key (the hash of its resolved config: :mod:`mgk.reproduce.grid`);
finished runs are never run again. Another directory of the same task, row and seed, made with another config
(an edited preset or default, another ``--data``, an older mgk's key), is never counted: :func:`stale_run_dirs`
says so in one line each. A run with ``checkpoints/last.pt`` but no results was
interrupted and continues with ``mgk train --resume``; anything else starts from scratch. Each run's output goes
to ``<run_dir>.reproduce.log`` beside the run directory (which holds only what ``mgk train`` writes, since
``mgk train`` refuses a non-empty new directory); ``<run_dir>.reproduce.json`` records the key, the commands,
exit codes, wall time and the peak resident memory of each process (from ``wait4``), written atomically.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

from .. import config as config_mod
from ..atomic import write_text_atomic
from ..train.rundir import RunFiles, load_config, recover
from .grid import Run
from .stopping import GridStop

__all__ = ["run_state", "stale_run_dirs", "execute_run", "run_local", "run_submitit", "slurm_parameters",
           "sbatch_preview", "read_record", "record_path", "log_path"]


def record_path(run_dir: Path) -> Path:
    """``<run_dir>.reproduce.json``: the harness's record of a run, kept beside its directory."""
    run_dir = Path(run_dir)
    return run_dir.with_name(run_dir.name + ".reproduce.json")


def log_path(run_dir: Path) -> Path:
    """``<run_dir>.reproduce.log``: the output of every command run for it."""
    run_dir = Path(run_dir)
    return run_dir.with_name(run_dir.name + ".reproduce.log")


def read_record(run_dir: Path) -> dict:
    """The record of a run directory ({} when absent or unreadable)."""
    try:
        return json.loads(record_path(run_dir).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _write_record(run_dir: Path, record: dict) -> None:
    write_text_atomic(record_path(run_dir), json.dumps(record, indent=2) + "\n")


def run_state(run: Run) -> str:
    """``finished``, ``evaluate`` (trained, LM evaluation missing), ``resume`` (checkpoint, no results),
    ``new``, or ``conflict`` (results of another config in this directory: left alone)."""
    d, files = run.run_dir, RunFiles(run.run_dir)
    recover(d)  # a run that a killed --overwrite set aside is this directory's run again
    if files.results.is_file():
        if read_record(d).get("key") != run.key:
            return "conflict"
        evaluated = [run.eval_json] * (run.eval_args is not None) + [run.eval_test_json] * run.test_eval
        return "evaluate" if not all(p.is_file() for p in evaluated) else "finished"
    return "resume" if files.checkpoint("last").is_file() else "new"


# What mgk train fills in itself (from the data, or as typed), not what a grid run asks for.
_SET_BY_THE_RUN = ("vocab_size", "num_classes", "data_as_given", "progress")


def stale_run_dirs(run: Run) -> list[str]:
    """One line for each other directory of ``run``'s task, row and seed (``seed<k>-*`` beside ``run.run_dir``)
    that holds results or a checkpoint: it was made with another config than ``run`` resolves to now, so it is not
    counted as finished. The line names the fields that differ (none: the same fields under an older
    mgk's key, or another evaluation)."""
    parent = run.run_dir.parent
    if not parent.is_dir():
        return []
    lines = []
    for d in sorted(parent.glob(f"seed{run.seed}-*")):
        files = RunFiles(d)
        if d == run.run_dir or not d.is_dir() or not (files.results.is_file() or files.checkpoint("last").is_file()):
            continue
        lines.append(f"{d} was made with another config than {run.task} {run.row.key} seed {run.seed} resolves to "
                     f"now ({_differences(d, run)}): it is not counted as finished; this run goes to "
                     f"{run.run_dir.name}")
    return lines


def _differences(run_dir: Path, run: Run) -> str:
    """``"key: was != now"`` for the fields of ``run_dir``'s config.yaml that differ from ``run``'s config."""
    try:
        was = config_mod.flat(load_config(run_dir))
    except (OSError, ValueError) as e:
        return f"its config.yaml cannot be read: {' '.join(str(e).split())}"
    now = config_mod.flat(config_mod.from_dict(run.config))
    diffs = [f"{k}: {was.get(k)!r} != {v!r}" for k, v in now.items() if k not in _SET_BY_THE_RUN and was.get(k) != v]
    if not diffs:
        return "the same fields, under an older mgk's key or with another evaluation"
    return "; ".join(diffs[:4]) + (f"; {len(diffs) - 4} more" if len(diffs) > 4 else "")


def _child_env(threads: int | None) -> dict:
    env = dict(os.environ)
    if threads is not None:  # one thread per run by default: N runs share N cores without oversubscription
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[name] = str(threads)
    return env


def _spawn(cmd: list[str], log: Path, env: dict, stop: GridStop | None = None) -> tuple[int, float, float] | None:
    """Run ``cmd`` appending to ``log``: (exit code, wall seconds, peak RSS in MB of that process); None when
    ``stop`` has stopped the grid (nothing started)."""
    t0 = time.time()
    with open(log, "a") as fh:
        fh.write(f"\n$ {shlex.join(cmd)}\n")
        fh.flush()
        if stop is None:
            p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
            _, status, usage = os.wait4(p.pid, 0)  # wait4: the rusage of this child alone
            rc = os.waitstatus_to_exitcode(status)
        else:
            p = stop.popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
            if p is None:
                return None
            rc, usage = stop.wait(p)
    return rc, time.time() - t0, usage.ru_maxrss / 1024


def execute_run(run: Run, python: str = sys.executable, threads: int | None = 1, stop: GridStop | None = None) -> dict:
    """Bring ``run`` to finished: train (or resume), then evaluate for LM. Returns its record (``status``:
    ``skipped``, ``done``, ``failed`` or, once ``stop`` has caught a signal, ``interrupted``; ``log``; per-command
    exit codes). Never raises for a failed command."""
    state = run_state(run)
    if state in ("finished", "conflict"):
        rec = read_record(run.run_dir)
        status = "skipped" if state == "finished" else "failed"
        return {**rec, "status": status, "state": state, "log": str(log_path(run.run_dir)),
                **({"error": "results.json of another config in this directory (left alone)"}
                   if state == "conflict" else {})}
    run.run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = log_path(run.run_dir)
    rec = read_record(run.run_dir)
    rec.update({"key": run.key, "row": run.row.key, "task": run.task, "seed": run.seed,
                "train_args": list(run.train_args), "eval_args": list(run.eval_args or []), "log": str(log)})
    rec.setdefault("attempts", [])
    env = _child_env(threads)
    commands = []
    if state in ("new", "resume"):
        # A "new" directory that is not empty holds a start that died before its first checkpoint: start over.
        restart = state == "new" and run.run_dir.is_dir() and any(run.run_dir.iterdir())
        commands.append(("train", run.train_command(python, resume=state == "resume", overwrite=restart)))
    for done, cmd in ((run.eval_json, run.eval_command(python)), (run.eval_test_json, run.test_eval_command(python))):
        if cmd is not None and (state != "evaluate" or not done.is_file()):  # a finished evaluation is not redone
            commands.append(("eval", cmd))
    rec["status"] = "done"
    # The key is on disk before any command runs: a harness killed between the run's results.json and the record
    # below must not leave a finished run that the next pass takes for another config's directory.
    _write_record(run.run_dir, {**rec, "status": "running"})
    for name, cmd in commands:
        spawned = _spawn(cmd, log, env, stop)
        if spawned is None or (stop is not None and stop.signum and spawned[0] != 0):
            rec.update(status="interrupted", error=f"stopped by {stop.name}; the next pass resumes it")
            if spawned is None:
                break
        rc, wall, rss = spawned
        rec["attempts"].append({"what": name, "state": state, "command": shlex.join(cmd), "rc": rc,
                                "wall_s": round(wall, 2), "peak_rss_mb": round(rss, 1),
                                "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S")})
        if name == "train" and rc == 0:
            rec["peak_rss_mb"] = round(rss, 1)
        if rc != 0:
            if rec["status"] != "interrupted":
                rec.update(status="failed", error=f"`mgk {name}` exited with {rc}; see {log}")
            break
        if name == "train":  # recorded before the LM evaluation starts, so that a crash there keeps it
            _write_record(run.run_dir, rec)
    rec["state"] = state
    _write_record(run.run_dir, rec)
    return rec


def _say(msg: str) -> None:
    print(msg, flush=True)


def _announce(run: Run, rec: dict, i: int, n: int) -> None:
    what = {"skipped": "finished earlier, skipped", "done": "done", "failed": f"FAILED ({rec.get('error')})",
            "interrupted": "interrupted (the next pass resumes it)"}
    _say(f"[{i}/{n}] {run.task} {run.row.key} seed {run.seed}: {what.get(rec['status'], rec['status'])}")


def run_local(runs: list[Run], jobs: int, threads: int | None = 1, stop: GridStop | None = None) -> list[dict | None]:
    """Run the grid with ``jobs`` processes at once on this machine (plain subprocesses). Each of ``jobs`` workers
    takes the next run only while ``stop`` has caught no signal (nothing is queued ahead, so a stopped grid starts
    nothing more); the records of runs never started are None."""
    stop = stop or GridStop()
    records: list[dict | None] = [None] * len(runs)
    todo, lock, done = list(range(len(runs))), threading.Lock(), [0]

    def worker() -> None:
        """Run queued runs one after another until none is left or ``stop`` caught a signal."""
        while not stop.signum:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            try:
                records[i] = execute_run(runs[i], sys.executable, threads, stop)
            except Exception as exc:  # e.g. an unwritable output folder: this run failed, the others go on
                records[i] = {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                              "log": str(log_path(runs[i].run_dir))}
            with lock:
                done[0] += 1
                _announce(runs[i], records[i], done[0], len(runs))

    workers = [threading.Thread(target=worker, daemon=True) for _ in range(min(max(1, jobs), len(runs)))]
    for w in workers:
        w.start()
    while any(w.is_alive() for w in workers):  # the main thread stays free to run the signal handler
        time.sleep(0.2)
        stop.enforce_grace()
    return records


# --------------------------------------------------------------------------- submitit: local and Slurm

_GENERIC = {"timeout_min": "time", "mem_gb": "mem", "nodes": "nodes", "cpus_per_task": "cpus_per_task",
            "gpus_per_node": "gpus_per_node", "tasks_per_node": "ntasks_per_node", "name": "job_name",
            "stderr_to_stdout": "stderr_to_stdout"}


def _value(text: str):
    try:
        return int(text)
    except ValueError:
        return text


def slurm_parameters(pairs) -> dict:
    """``--slurm KEY=VALUE`` pairs -> submitit AutoExecutor parameters: the generic names (timeout_min, mem_gb,
    nodes, cpus_per_task, gpus_per_node, tasks_per_node, name) as they are, any other sbatch option as
    ``slurm_<key>`` (``partition=gpu`` -> ``slurm_partition``). ValueError naming an option sbatch lacks."""
    import inspect

    from submitit.slurm import slurm

    known = set(inspect.signature(slurm._make_sbatch_string).parameters) - {"command", "folder"}
    params = {"timeout_min": 24 * 60, "nodes": 1, "tasks_per_node": 1, "cpus_per_task": 4, "gpus_per_node": 1}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--slurm expects KEY=VALUE, got {pair!r}")
        k, v = (s.strip() for s in pair.split("=", 1))
        k = k.replace("-", "_")
        if k in _GENERIC:
            params[k] = _value(v)
        else:
            bare = k[len("slurm_"):] if k.startswith("slurm_") else k
            if bare not in known:
                raise ValueError(f"--slurm {pair}: unknown option {bare!r} (generic: {', '.join(_GENERIC)}; "
                                 f"sbatch: {', '.join(sorted(known))})")
            params[f"slurm_{bare}"] = _value(v)
    return params


def sbatch_preview(params: dict, folder: Path, command: str) -> str:
    """The sbatch script submitit would write for ``params`` (no cluster needed)."""
    from submitit.slurm import slurm

    kwargs = {}
    for k, v in params.items():
        if k in _GENERIC:
            kwargs[_GENERIC[k]] = f"{v}GB" if k == "mem_gb" else v
        else:
            kwargs[k[len("slurm_"):]] = v
    return slurm._make_sbatch_string(command=command, folder=str(folder), **kwargs)


def _make_executor(kind: str, folder: Path, params: dict):
    import submitit

    if kind == "slurm":
        ex = submitit.AutoExecutor(folder=str(folder), cluster="slurm")
        ex.update_parameters(**params)
        return ex
    ex = submitit.LocalExecutor(folder=str(folder))
    ex.update_parameters(timeout_min=params.get("timeout_min", 24 * 60))
    return ex


def run_submitit(runs: list[Run], kind: str, folder: Path, *, jobs: int, params: dict | None = None,
                 threads: int | None = 1, stop: GridStop | None = None) -> list[dict | None]:
    """Run each grid entry as a submitit job (``kind``: ``submitit-local`` or ``slurm``), at most ``jobs`` at once,
    and wait for them. A job that dies is a failed run with its submitit log; the others go on. Once ``stop`` has
    caught a signal nothing more is submitted and the active jobs are cancelled (their records are None)."""
    ex = _make_executor(kind, folder, params or {})
    stop = stop or GridStop()
    pending = list(enumerate(runs))
    active: list = []
    records: dict[int, dict] = {}
    done = 0
    while pending or active:
        if stop.signum:
            for _, job in active:
                job.cancel(check=False)
            break
        while pending and len(active) < max(1, jobs):
            i, run = pending.pop(0)
            active.append((i, ex.submit(execute_run, run, sys.executable, threads)))
        time.sleep(0.5)
        for i, job in [a for a in active if a[1].done()]:
            active.remove((i, job))
            try:
                records[i] = job.result()
            except Exception as exc:  # the job itself died (node failure, timeout): report, keep going
                records[i] = {"status": "failed", "error": f"submitit job {job.job_id}: {str(exc)[-300:]}",
                              "log": str(job.paths.stdout)}
            done += 1
            _announce(runs[i], records[i], done, len(runs))
    return [records.get(i) for i in range(len(runs))]
