"""What a run records, beyond its checkpoints: the training-protocol fields, the environment, the metrics log
(JSON lines and TensorBoard), the learning-curve plot and a one-line status of an unfinished run. Where each file
lives and how it is written and read is :mod:`mgk.train.rundir`'s.

results.json carries ``protocol`` (:func:`protocol`), so that a table can say which protocol each number came from.
"""
from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import torch

from .. import __version__
from .. import config as config_mod
from ..atomic import save_figure_atomic
from ..figures import kind_colour, thin_tick_labels
from . import rundir


def _git(args: list[str], where: Path | None) -> str | None:
    """The output of ``git ARGS`` run in ``where`` (default: this package's folder), or None when git is missing,
    fails or hangs: what a run records about its checkout must never stop the run."""
    here = where if where is not None else Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def git_commit(where: Path | None = None) -> str | None:
    """The commit of the checkout this package runs from (or of ``where``), or None when it is not a git
    checkout."""
    out = _git(["rev-parse", "HEAD"], where)
    return (out or "").strip() or None


def git_dirty(where: Path | None = None) -> bool | None:
    """Whether the checkout of :func:`git_commit` has uncommitted changes to tracked files (True, False), or None
    when it is not a git checkout or git cannot say. Untracked files are not counted: a run directory or a data
    folder inside the checkout would mark every run dirty, and listing them can take long."""
    # --no-optional-locks: the status refresh would take index.lock and fail the user's own git command meanwhile
    out = _git(["--no-optional-locks", "status", "--porcelain", "--untracked-files=no"], where)
    return None if out is None else bool(out.strip())


# The run-config fields (by --set name) that make a training protocol (the authors' values or ours; see
# docs/paper-protocol.md). The attention-form fields are recorded where the run's kind takes them.
PROTOCOL_FIELDS = ("init", "schedule", "lr", "warmup_steps", "steps", "batch_size", "precision", "grad_clip",
                   "eval_every", "eval_batches", "eval_batch_size", "attn_bias")
LRA_PROTOCOL_FIELDS = ("classifier_activation", "pooling")
LM_PROTOCOL_FIELDS = ("adaptive_softmax", "adaptive_cutoffs", "segment_len")
FORM_FIELDS = ("normalize", "feature_map", "output_scale", "mix", "pi_norm", "pi_shape", "sigma2")


def protocol(cfg) -> dict:
    """The protocol fields of a RunConfig ``cfg`` (name -> value; LM or LRA fields by ``cfg.task``)."""
    values = config_mod.flat(cfg)
    names = PROTOCOL_FIELDS + (LM_PROTOCOL_FIELDS if cfg.task == "lm" else LRA_PROTOCOL_FIELDS)
    names += tuple(n for n in FORM_FIELDS if n in values)
    return {n: list(values[n]) if isinstance(values[n], tuple) else values[n] for n in names}


def protocol_line(cfg) -> str:
    """``"init paper, schedule onecycle, ..."``: the protocol fields that most often differ, for the log."""
    keys = ("init", "schedule", "attn_bias") + (
        ("adaptive_softmax",) if cfg.task == "lm" else ("classifier_activation",))
    values = config_mod.flat(cfg)
    return ", ".join(f"{k} {values[k]}" for k in keys)


def attention_parameters(model: torch.nn.Module) -> int:
    """Parameters held by the model's attention modules (:class:`mgk.attention.base.AttentionBase`)."""
    from ..attention.base import AttentionBase

    return sum(p.numel() for m in model.modules() if isinstance(m, AttentionBase) for p in m.parameters())


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The processor's name ("AMD EPYC", "Intel(R) Xeon(R) ..."): the first ``model name`` of ``cpuinfo`` on Linux,
    else :func:`platform.processor`, else None. Recorded because the same seed, code and torch give other floating-
    point sums on another CPU family (torch picks its vectorised kernels by the CPU), so a run that does not
    reproduce bitwise can be traced to the machine."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or None


def write_env(run_dir: Path, *, seed: int, world_size: int, device: str) -> None:
    """Write env.json with versions, the git commit and ``git_dirty`` (:func:`git_dirty`: whether that commit is
    all of the code that ran; None outside a git checkout), the CPU (:func:`cpu_model`) and the vector instruction
    set torch's CPU kernels use (``cpu_capability``, e.g. "AVX512")."""
    env = {"seed": seed, "world_size": world_size, "device": device, "mgk": __version__, "torch": torch.__version__,
           "python": sys.version.split()[0], "platform": platform.platform(), "git_commit": git_commit(),
           "git_dirty": git_dirty(), "threads": torch.get_num_threads(), "cpu": cpu_model(),
           "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    rundir.write_json(rundir.RunFiles(run_dir).env, env)


class MetricsLog:
    """Appends metrics to metrics.jsonl and TensorBoard. On resume, lines after the checkpoint's step are dropped
    so that the file reads as one uninterrupted run, and so is a last line that a crash cut short (``say`` is
    told, in one line). A new run starts a new file."""

    def __init__(self, run_dir: Path, resume_step: int | None = None, say=None):
        self.path = rundir.RunFiles(run_dir).metrics
        if resume_step is not None and self.path.exists():
            torn: list[str] = []
            kept = [r for r in rundir.read_metrics(run_dir, torn=torn) if r["step"] <= resume_step]
            if torn and say is not None:
                say(f"warning: {self.path}: dropped its last line, cut short by the crash that stopped the run "
                    f"({torn[0][:40]!r})")
            rundir.rewrite_metrics(run_dir, kept)
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        from torch.utils.tensorboard import SummaryWriter  # imported late: tensorboard is slow to import

        self.tb = SummaryWriter(str(rundir.RunFiles(run_dir).tb),
                                purge_step=resume_step + 1 if resume_step is not None else None)

    def log(self, step: int, values: dict) -> None:
        """Record ``values`` (name -> float) at ``step``."""
        rundir.append_line(self.path, json.dumps({"step": step, **values}))
        for name, value in values.items():
            if isinstance(value, (int, float)):
                self.tb.add_scalar(name, value, step)

    def close(self) -> None:
        """Flush and close TensorBoard's writer (each metrics line is flushed when written)."""
        self.tb.close()


def run_status(run_dir: Path) -> str:
    """One line on a run directory without results.json: its task and model (from config.yaml), the last logged
    step, and whether a live process still trains it (its lock, :mod:`mgk.train.rundir`) or it failed or was
    stopped."""
    run_dir = Path(run_dir)
    try:
        cfg = rundir.load_config(run_dir)
        what = f"{cfg.task} {cfg.attention.kind} x {cfg.attention.num_heads}"
        total = cfg.optim.steps
    except (OSError, ValueError):
        what, total = "unreadable config.yaml", None
    try:
        step = rundir.read_metrics(run_dir)[-1]["step"]
    except (OSError, ValueError, IndexError, KeyError):
        step = 0
    pid = rundir.holder_pid(run_dir)
    state = f"running (pid {pid})" if pid is not None else "failed or stopped (resume it with --resume)"
    return f"{run_dir}: {what}, step {step} of {total}, {state}"


def plot_learning_curves(run_dir: Path) -> Path | None:
    """Plot every logged train/ and val/ series against step into plots/learning_curves.png, in the colour of the
    run's attention kind (:mod:`mgk.figures`, as in every figure mgk draws; black when config.yaml is unreadable)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = rundir.read_metrics(run_dir)
    names = sorted({k for r in records for k in r if k.startswith(("train/", "val/")) and k != "train/lr"})
    if not names:
        return None
    try:
        colour = kind_colour(rundir.load_config(run_dir).attention.kind)
    except (OSError, ValueError):
        colour = kind_colour(None)
    fig, axes = plt.subplots(len(names), 1, figsize=(7, 2.4 * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        pts = [(r["step"], r[name]) for r in records if name in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 50 else None, color=colour)
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("optimiser step")
    fig.tight_layout()
    thin_tick_labels(fig)
    # atomically: a reader never sees half an image, and a link in its place is replaced, never written through
    return save_figure_atomic(fig, rundir.RunFiles(run_dir).plots / "learning_curves.png", dpi=100)
