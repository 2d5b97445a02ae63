"""The one training loop of every task, as a small :class:`Trainer` with named steps: ``setup`` (data, model,
optimiser, checkpoint or seeds, records), ``train_step``, ``validate``, ``save_checkpoint``, ``finish``.

Data order is a pure function of (seed, step) (:class:`mgk.tasks.base.EpochSampler` or the task's own sampler).
Resuming therefore needs only the step; with W processes each rank takes its 1/W slice of the same global batch, so
W processes see what one process sees.
"""
from __future__ import annotations

import contextlib
import math
import os
import shlex
import signal
import sys
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from .. import config as config_mod
from ..attention import soft_e_step
from ..config import RunConfig
from ..seeds import torch_seed
from ..tasks import get_task
from ..tasks.base import EpochSampler, Task
from ..tasks.run_records import run_failure
from . import checkpoint, distributed, records, rundir
from .evaluate import eval_slice, evaluate
from .interrupt import Interrupted, SignalStop, StopSignals, signal_name
from .precision import autocast, grad_scaler
from .schedule import build_scheduler, resume_scheduler
from .state import LoopState

__all__ = ["EpochSampler", "Interrupted", "LoopState", "NonFiniteLoss", "NonFiniteResult", "Trainer", "fit"]


class NonFiniteLoss(RuntimeError):
    """The training loss became NaN or inf; the last good checkpoint is kept."""


class NonFiniteResult(RuntimeError):
    """The final evaluation of a run is not finite (its weights went NaN): results.json records the run as failed
    (``failed``), and tables and reports leave it out."""


def _say(run_dir: Path, message: str) -> None:
    message = rundir.log_text(message)  # one line, whatever the paths in it hold (train.log's own rule)
    tqdm.write(message, file=sys.stderr)
    rundir.append_line(rundir.RunFiles(run_dir).log, message)


# A model with fewer parameters trains on one CPU thread when ``small_model_threads`` (``mgk train`` without
# --threads or $OMP_NUM_THREADS): on the 2-core development machine (2026-12-02, `mgk train` 60 steps, 2 repeats),
# the README's main job (MGK-4 on ListOps, 136k parameters) took 0.048-0.066 s a step on 1 thread and 0.040-0.042 on
# 2 alone, but beside one busy process 0.049-0.051 on 1 thread against 0.126-0.157 on 2, whose threads spin against
# it; a 1.55M-parameter model gained 1.39x from 2 threads alone and lost 1.8x beside a busy process.
SMALL_MODEL_PARAMS = 1_000_000


class Trainer:
    """Trains ``cfg`` into ``run_dir`` (or continues it from checkpoints/last.pt when ``resume``).

    Use: ``t = Trainer(cfg, run_dir); t.setup(); t.train(); results = t.finish()`` (what :func:`fit` does; call
    ``t.close()`` when one of them raises). ``small_model_threads``: set this process's torch threads to 1 when the
    model has fewer than :data:`SMALL_MODEL_PARAMS` parameters (what ``mgk train`` asks for when given neither
    ``--threads`` nor ``$OMP_NUM_THREADS``; a library caller's threads are left alone by default). ``setup`` locks
    the run directory (:mod:`mgk.train.rundir`) and, for a new run, requires it empty unless ``overwrite``;
    ``finish`` or ``close`` releases it. A relative data path of a new run is stored as an absolute path
    (``data.path_as_given`` keeps it as typed). With ``stop`` (:class:`~mgk.train.interrupt.StopSignals`), a
    recorded signal ends ``train`` after the current step with
    last.pt written, raising :class:`~mgk.train.interrupt.Interrupted`. ``initialise(model, task) -> dict`` (new
    runs only; ``mgk train --init-from``, :mod:`mgk.retrofit`): called on the freshly built model once the data is
    read, it sets the weights and returns a record (with a one-line ``"summary"``) written to init.json; the
    initialised weights are then validated and logged at step 0.
    Raises ValueError for a batch size that does not split over ranks and accumulation steps, or a device that does
    not exist here.
    """

    def __init__(self, cfg: RunConfig, run_dir: str | Path, *, resume: bool = False, device: str | None = None,
                 overwrite: bool = False, stop: StopSignals | None = None, small_model_threads: bool = False,
                 initialise=None):
        if not resume and cfg.data.path is not None and cfg.data.path_as_given is None:
            cfg = config_mod.replace(cfg, data=os.path.abspath(os.path.expanduser(cfg.data.path)),
                                     data_as_given=cfg.data.path)
        self.cfg = config_mod.validate(cfg)
        self.dist = distributed.setup(device)
        self.run_dir, self.resume, self.overwrite, self.stop = Path(run_dir), resume, overwrite, stop
        self.small_model_threads = small_model_threads
        self.initialise, self.init_record = None if resume else initialise, None
        self.lock: rundir.RunDirLock | None = None
        self.saved_step: int | None = None
        self.files = rundir.RunFiles(self.run_dir)
        if cfg.optim.batch_size % (self.dist.world_size * cfg.optim.grad_accum):
            raise ValueError(f"batch_size={cfg.optim.batch_size} must be divisible by world_size "
                             f"({self.dist.world_size}) x grad_accum ({cfg.optim.grad_accum})")
        self.local_batch = cfg.optim.batch_size // self.dist.world_size
        self.micro_batch = self.local_batch // cfg.optim.grad_accum
        self.state = LoopState()
        self.train_seconds, self.session_steps = 0.0, 0
        self.step_lr = float("nan")
        self.log = None

    # -- setup -------------------------------------------------------------------------------------------------
    def setup(self) -> None:
        """The run directory's lock, data, model, optimiser, then the checkpoint (resume) or fresh seeds, then the
        run's records. Raises :class:`~mgk.train.rundir.RunDirError` when the directory is in use or not empty."""
        self._claim_run_dir()
        self._setup_data()
        self._setup_model()
        if self.initialise is not None:  # a new run started from another run's weights (mgk train --init-from)
            self.init_record = self.initialise(self.model, self.task)
        self._setup_optimizer()
        if self.resume:
            self._load_checkpoint()
        else:
            torch.manual_seed(torch_seed(self.cfg.seed * 7919 + self.dist.rank))  # each rank its own dropout stream
        self._setup_records()
        self.net = DistributedDataParallel(self.model) if self.dist.world_size > 1 else self.model
        if self.init_record is not None and self.splits["val"] is not None:
            self._validate_start()
        self.sampler = self.task.sampler(len(self.splits["train"]), self.cfg.optim.batch_size, self.cfg.seed)

    def _claim_run_dir(self) -> None:
        """Rank 0 alone takes the lock (the ranks of one run must not block each other); every rank learns whether
        it got it, so that all of them stop together."""
        error = None
        if self.dist.is_main:
            try:
                self.lock = rundir.claim(self.run_dir, resume=self.resume, overwrite=self.overwrite,
                                         data=self.cfg.data.path)
            except rundir.RunDirError as e:
                error = e
        if distributed.all_max(int(error is not None), self.dist.device):
            raise error or rundir.RunDirError(f"rank 0 could not claim {self.run_dir}")

    def _setup_data(self) -> None:
        """Rank 0 finds or generates the files, then every rank builds the task; the model sizes come from it."""
        module = get_task(self.cfg.task)
        if self.dist.is_main:
            data_dir = module.prepare(self.cfg, self.run_dir)
        distributed.barrier()
        if not self.dist.is_main:
            data_dir = module.prepare(self.cfg, self.run_dir)
        self.task: Task = module.build(self.cfg, data_dir)
        self.cfg = config_mod.replace(self.cfg, vocab_size=self.task.vocab_size, num_classes=self.task.num_classes)
        self.splits = {"train": self.task.splits["train"], "val": self.task.splits.get("val"),
                       "test": self.task.splits.get("test")}

    def _setup_model(self) -> None:
        torch.manual_seed(self.cfg.seed)
        self.model = self.task.build_model(self.cfg).to(self.dist.device)
        self.num_params = sum(p.numel() for p in self.model.parameters())
        self.num_attention_params = records.attention_parameters(self.model)
        if self.small_model_threads and self.dist.device.type == "cpu" and self.num_params < SMALL_MODEL_PARAMS:
            torch.set_num_threads(1)  # see SMALL_MODEL_PARAMS

    def _setup_optimizer(self) -> None:
        """AdamW, linear warm-up then the configured decay (Nguyen et al. 2022, Section 4; Loshchilov & Hutter
        2019), and the gradient scaler of fp16."""
        cfg = self.cfg
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.optim.lr, eps=cfg.optim.adam_eps,
                                           weight_decay=cfg.optim.weight_decay)
        self.scheduler = build_scheduler(self.optimizer, schedule=cfg.optim.schedule, lr=cfg.optim.lr,
                                         warmup_steps=cfg.optim.warmup_steps, total_steps=cfg.optim.steps)
        self.scaler = grad_scaler(self.dist.device, cfg.optim.precision)

    def _load_checkpoint(self) -> None:
        """Restore last.pt (0.1.0 checkpoints included); ValueError when it was made with another model."""
        path = self.files.checkpoint("last")
        ckpt = checkpoint.load(path)
        diffs = self.model_differences(ckpt["config"])
        if diffs:
            raise ValueError(f"checkpoint {path} was made with another model config: " + "; ".join(diffs))
        self.model.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(checkpoint.align_optimizer_state(ckpt["optimizer"], ckpt["model"], self.model))
        saved = config_mod.flat(config_mod.from_dict(ckpt["config"]))
        resume_scheduler(self.scheduler, ckpt["scheduler"], saved=saved, now=config_mod.flat(self.cfg))
        self.scaler.load_state_dict(ckpt["scaler"])
        self.state = LoopState.from_checkpoint(ckpt)
        self.saved_step = self.state.step
        rngs = ckpt["rng"]
        if len(rngs) == self.dist.world_size:
            checkpoint.set_rng_state(rngs[self.dist.rank])
        else:  # another world size: fresh per-rank streams, still a function of (seed, step, rank)
            torch.manual_seed(torch_seed(self.cfg.seed * 7919 + self.state.step * 31 + self.dist.rank))

    def model_differences(self, saved_config: dict) -> list[str]:
        """``"key: saved != now"`` for the task, sizes and model-config fields that differ from ``saved_config``."""
        saved = config_mod.from_dict(saved_config)
        was, now = config_mod.flat(saved), config_mod.flat(self.cfg)
        diffs = [f"{k}: {was[k]!r} != {now[k]!r}" for k in ("task", "vocab_size", "num_classes") if was[k] != now[k]]
        if saved.task != self.cfg.task:
            return diffs
        return diffs + config_mod.model_differences(self.task.model_config(saved), self.task.model_config(self.cfg))

    def _setup_records(self) -> None:
        if not self.dist.is_main:
            return
        cfg = self.cfg
        rundir.write_config(self.run_dir, config_mod.to_dict(cfg))
        records.write_env(self.run_dir, seed=cfg.seed, world_size=self.dist.world_size, device=str(self.dist.device))
        if self.task.vocab is not None:  # what loading the run needs without its data
            self.task.vocab.save(self.files.vocab)
        self.log = records.MetricsLog(self.run_dir, resume_step=self.state.step if self.resume else None,
                                      say=lambda line: _say(self.run_dir, line))
        for note in self.task.notes:
            _say(self.run_dir, note)
        if self.init_record is not None:
            rundir.write_json(self.files.init, self.init_record)
            _say(self.run_dir, self.init_record["summary"])
        a = cfg.attention
        _say(self.run_dir, f"model: {a.kind} x {a.num_heads} heads (head_dim {a.head_dim}), "
                           f"{self.num_params:,} parameters in total, {self.num_attention_params:,} in attention; "
                           f"protocol {records.protocol_line(cfg)}; world size {self.dist.world_size}; precision "
                           f"{cfg.optim.precision}" + (f"; resuming at step {self.state.step}" if self.resume else ""))

    # -- training ----------------------------------------------------------------------------------------------
    def train(self) -> None:
        """Optimiser steps until ``cfg.optim.steps``, with logging, validation and checkpoints on their schedules. A
        signal recorded by ``self.stop`` ends it after the whole step (validation and checkpoint included, so that
        resuming is exact), with last.pt written: :class:`~mgk.train.interrupt.Interrupted`."""
        cfg, d = self.cfg, self.dist
        bar = tqdm(total=cfg.optim.steps, initial=self.state.step, disable=not (d.is_main and cfg.progress),
                   unit="step", dynamic_ncols=True)
        self.model.train()
        if self.stop is not None:
            self.stop.graceful = True
        try:
            while self.state.step < cfg.optim.steps:
                t0 = time.perf_counter()
                train = self.train_step()
                self.train_seconds += time.perf_counter() - t0
                self.session_steps += 1
                self._after_step(train, bar)
                bar.update(1)
                signum = distributed.all_max(self.stop.signum, d.device) if self.stop is not None else 0
                if signum:  # every rank sees the same value, so all stop after the same step
                    self._stop_after_step(signum)
        finally:
            if self.stop is not None:
                self.stop.graceful = False
            bar.close()

    def _after_step(self, train: dict, bar) -> None:
        """Logging, validation and checkpoint of the step just done, each on its schedule."""
        cfg, done = self.cfg, self.state.step
        if self.lock is not None and self.lock.previous is not None:  # the new run has started: --overwrite is done
            rundir.discard_previous(self.lock)
        metrics = {}
        if done % cfg.log_every == 0 or done == cfg.optim.steps:
            metrics.update({f"train/{k}": v for k, v in train.items() if k != "count"})
            metrics.update({"train/lr": self.step_lr, "train/skipped": self.state.skipped})
            bar.set_postfix({k: f"{v:.4g}" for k, v in train.items() if k != "count"})
        if self.splits["val"] is not None and (done % cfg.eval.every == 0 or done == cfg.optim.steps):
            metrics.update({f"val/{k}": v for k, v in self.validate().items() if k != "count"})
        if metrics and self.dist.is_main:
            metrics["time/seconds_per_step"] = self.train_seconds / max(1, self.session_steps)
            self.log.log(done, metrics)
        if done % cfg.checkpoint_every == 0 or done == cfg.optim.steps:
            self.save_checkpoint()

    def _stop_after_step(self, signum: int) -> None:
        """Write last.pt at the current step (unless just written), close the records and raise Interrupted."""
        if self.saved_step != self.state.step:
            self.save_checkpoint()
        message = self.stop_message(signum)
        if self.dist.is_main:
            rundir.append_line(self.files.log, message)
        self.close()
        raise Interrupted(message, signum, self.state.step, is_main=self.dist.is_main)

    def stop_message(self, signum: int) -> str:
        """The one line said when a signal stops the run: where it stopped, what last.pt holds, how to go on."""
        where = f"stopped by {signal_name(signum)} at step {self.state.step} of {self.cfg.optim.steps}"
        last = self.files.checkpoint("last")
        if self.saved_step is None and not last.is_file():
            return f"{where}; no checkpoint yet: start again with --overwrite --out {shlex.quote(str(self.run_dir))}"
        held = f"{last} holds step {self.saved_step}" if self.saved_step is not None else f"{last} is kept"
        launcher = "torchrun ... -m mgk train" if self.dist.world_size > 1 else "mgk train"
        return f"{where}; {held}; continue with: {launcher} --resume {shlex.quote(str(self.run_dir))}"

    def train_step(self) -> dict:
        """One optimiser step over the global batch of ``state.step`` (accumulated over ``grad_accum`` micro-batches,
        averaged over ranks); returns the task's training metrics. Raises NonFiniteLoss (nonfinite=stop)."""
        cfg, d = self.cfg, self.dist
        step = self.state.step
        mine = self.sampler.indices(step)[d.rank * self.local_batch:(d.rank + 1) * self.local_batch]
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for a in range(cfg.optim.grad_accum):
            batch = self.task.batch(self.splits["train"], mine[a * self.micro_batch:(a + 1) * self.micro_batch],
                                    d.device)
            last_micro = a == cfg.optim.grad_accum - 1
            sync = contextlib.nullcontext() if (last_micro or d.world_size == 1) else self.net.no_sync()
            with sync:
                with autocast(d.device, cfg.optim.precision):
                    loss_sum, stats = self.task.loss(self.net, batch)
                # local mean over this rank's share; DDP averages over ranks -> mean over the global batch
                self.scaler.scale(loss_sum / self.local_batch).backward()
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + float(value)
        # Soft-E's pi from this step's statistics (committed by the backwards above: all micro-batches, all ranks).
        # Before optimizer.step: both come from the same forward, and every rank reaches this collective whether or
        # not the step below is taken or skipped.
        soft_e_step(self.model)
        keys = sorted(sums)
        train = self.task.summarise(dict(zip(keys, distributed.all_sum([sums[k] for k in keys], d.device))))
        if math.isfinite(train["loss"]):
            if cfg.optim.grad_clip > 0:
                self.scaler.unscale_(self.optimizer)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif cfg.optim.nonfinite == "stop":
            kept = self.files.checkpoint("last")
            raise NonFiniteLoss(f"non-finite training loss ({train['loss']}) at step {step + 1}; the last good "
                                f"checkpoint is {kept if kept.exists() else 'none (no checkpoint yet)'}; "
                                f"lower lr, use --precision 32, or set nonfinite=skip")
        else:
            self.state.skipped += 1
            self.optimizer.zero_grad(set_to_none=True)
        # The lr this step used, logged under its number (after scheduler.step() the scheduler holds the next
        # step's, which past a OneCycle run's last step is an extrapolation below zero).
        self.step_lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        self.state.step = step + 1
        return train

    def evaluate(self, dataset, index=None, desc: str = "eval") -> dict:
        """The task's metrics of the current model on ``dataset`` (or its examples ``index``), every example counted
        once over ranks, with a transient progress bar on rank 0 when ``cfg.progress``."""
        return evaluate(self.task, self.model, dataset, batch_size=self.cfg.eval.batch_size,
                        precision=self.cfg.optim.precision, dist_info=self.dist, index=index,
                        progress=self.cfg.progress, desc=desc)

    def validate(self) -> dict:
        """Validation metrics; a new best (by ``task.best_metric``) is recorded and written to best.pt. A validation
        that is not finite (the weights went NaN) is never a best: NaN compares false with everything, so a NaN best
        would block every later one, and the accuracy of NaN weights (the argmax of NaN logits) can beat a real
        one."""
        ds, cfg = self.splits["val"], self.cfg
        index = None if not cfg.eval.batches else eval_slice(  # the authors' fixed number of dev batches
            len(ds), batches=cfg.eval.batches, batch_size=cfg.eval.batch_size,
            round_index=-(-self.state.step // cfg.eval.every) - 1, seed=cfg.seed)
        val = self.evaluate(ds, index=index, desc="val")
        key, mode = self.task.best_metric
        best = self.state.best
        if run_failure(val) is None and (best is None or (val[key] > best if mode == "max" else val[key] < best)):
            done = self.state.step
            self.state.best, self.state.best_step, self.state.best_val = val[key], done, val
            if self.dist.is_main:
                checkpoint.save({"model": self.model.state_dict(), "step": done,
                                 "config": config_mod.to_dict(self.cfg)}, self.files.checkpoint("best"), kind="best")
        return val

    def _validate_start(self) -> None:
        """Validation of the initialised weights, logged at step 0 (a conversion's starting point; it never becomes
        best.pt, which is chosen among the evaluations of training)."""
        val = self.evaluate(self.splits["val"], desc="val")
        if self.dist.is_main:
            self.log.log(0, {f"val/{k}": v for k, v in val.items() if k != "count"})
            _say(self.run_dir, "validation of the initialised weights (step 0): "
                               + ", ".join(f"{k} {v:.4f}" for k, v in val.items() if k != "count"))

    def save_checkpoint(self) -> None:
        """Write last.pt: model, optimiser, scheduler, scaler, ``loop_state`` (:class:`LoopState` fields), config
        and every rank's RNG state. Every rank must call it (the RNG states are gathered); only rank 0 writes."""
        ckpt = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "loop_state": self.state.to_dict(), "config": config_mod.to_dict(self.cfg),
                "rng": distributed.gather_objects(checkpoint.rng_state()), "step": self.state.step}
        if self.dist.is_main:
            checkpoint.save(ckpt, self.files.checkpoint("last"), kind="last")
        self.saved_step = self.state.step

    # -- end ---------------------------------------------------------------------------------------------------
    def finish(self) -> dict | None:
        """Evaluate the best-validation weights (the last ones without a validation split), write results.json and
        the plots; returns the results on rank 0 (None elsewhere). Raises :class:`NonFiniteResult` on every rank,
        once results.json is written with the run marked ``failed``, when the final evaluation is not finite."""
        best_path = self.files.checkpoint("best")
        distributed.barrier()
        if self.splits["val"] is not None and best_path.exists():
            self.model.load_state_dict(checkpoint.load(best_path, map_location=self.dist.device)["model"])
        results = self.results()
        failure = self._mark_failure(results)
        if self.dist.is_main:
            for name in results.get("missing_splits", []):
                _say(self.run_dir, f"{name} split absent: results.json reports the splits that exist")
            self.log.close()
            self.log = None
            records.plot_learning_curves(self.run_dir)
            rundir.write_json(self.files.results, results)  # last: its presence means the run is finished
            if failure is not None:  # a fixed word first: a line of the log never starts with a path
                rundir.append_line(self.files.log, f"failed: {failure}")
            summary = "; ".join(f"{n}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                     for k, v in results[n].items())
                                for n in ("val", "test") if results[n] is not None)
            if failure is None:
                _say(self.run_dir, f"done: {summary}; {results['seconds_per_step']:.3f} s/step; results in "
                                   f"{self.run_dir}")
        self.close()
        if failure is not None:
            raise NonFiniteResult(failure)
        return results if self.dist.is_main else None

    def _mark_failure(self, results: dict) -> str | None:
        """When the final figures are not finite: set ``results["failed"]`` and return the one-line message."""
        reason = run_failure(results)
        if reason is None:
            return None
        st = self.state
        results["failed"] = (f"{reason} in the final evaluation after {st.step} steps ({st.skipped} skipped for a "
                             "non-finite loss)")
        return (f"{self.run_dir}: {results['failed']}: the weights are not usable; results.json records the run as "
                "failed and tables leave it out (lower lr, use --precision 32, or check adam_eps)")

    def close(self) -> None:
        """Close the records, leave the process group and release the run directory (idempotent). A new run closed
        before its first optimiser step (its setup or first step failed) leaves no run folder behind
        (:func:`~mgk.train.rundir.abandon`)."""
        if self.log is not None:
            self.log.close()
            self.log = None
        distributed.teardown()
        if self.lock is not None:
            if not self.resume and self.state.step == 0:
                rundir.abandon(self.lock)
            else:
                self.lock.release()
            self.lock = None

    def results(self) -> dict:
        """The results.json dict. Attention options the kind does not take are not reported as used (``pi`` is
        None for softmax); ``attention_options`` lists the ones it got."""
        cfg, st = self.cfg, self.state
        a = cfg.attention
        results = {"task": cfg.task, "attention": a.kind, "num_heads": a.num_heads, "head_dim": a.head_dim,
                   "pi": getattr(a.options, "pi", None),
                   "attention_options": self.task.model_config(cfg).attention.options.as_kwargs(),
                   "params": self.num_params, "params_attention": self.num_attention_params,
                   "protocol": records.protocol(cfg), "steps": st.step, "seed": cfg.seed,
                   "world_size": self.dist.world_size,
                   "precision": cfg.optim.precision, "max_len": cfg.data.max_len, "best_step": st.best_step,
                   "skipped_steps": st.skipped, "seconds_per_step": self._seconds_per_step()}
        if self.files.init.is_file():  # started from another run's weights (also after a resume)
            init = rundir.read_json(self.files.init)
            results["init_from"] = {"source": init.get("source"), "step": init.get("step"),
                                    "rules": sorted({layer.get("rule") for layer in init.get("layers", [])})}
        for name, ds in (("val", self.splits["val"]), ("test", self.splits["test"])):
            if ds is None:
                results[name] = None
                results.setdefault("missing_splits", []).append(name)
                continue
            partial = cfg.eval.batches > 0  # validations saw a slice; the reported val figure is the whole split
            reuse = name == "val" and st.best_val is not None and not partial
            m = st.best_val if reuse else self.evaluate(ds, desc=name)
            results[name] = {**m, **self.task.describe(ds)}
        return results

    def _seconds_per_step(self) -> float:
        """Over this session's steps; a session that trained none (resumed after the last step) reports the last
        logged value instead of 0."""
        if self.session_steps:
            return self.train_seconds / self.session_steps
        logged = [r["time/seconds_per_step"] for r in rundir.read_metrics(self.run_dir)
                  if "time/seconds_per_step" in r]
        return logged[-1] if logged else 0.0


def finished_results(run_dir: str | Path, cfg: RunConfig) -> dict | None:
    """results.json of ``run_dir`` when the run is finished for ``cfg``: it reports at least ``cfg.optim.steps``
    steps and ``cfg`` asks for nothing else than config.yaml says (a changed field goes through the resume checks);
    else None."""
    try:
        results = rundir.read_results(run_dir)
        saved = config_mod.flat(rundir.load_config(run_dir))
    except (OSError, ValueError):  # a damaged results.json: the resume evaluates again and rewrites it
        return None
    now = config_mod.flat(cfg)
    same = all(saved.get(k) == v for k, v in now.items() if k not in ("steps", "progress"))
    return results if same and isinstance(results, dict) and results.get("steps", -1) >= cfg.optim.steps else None


def fit(cfg: RunConfig, run_dir: str | Path, *, resume: bool = False, device: str | None = None,
        overwrite: bool = False, small_model_threads: bool = False, initialise=None) -> dict | None:
    """Train ``cfg`` into ``run_dir`` (or continue it from checkpoints/last.pt when ``resume``): :class:`Trainer`'s
    setup, train and finish, with SIGINT and SIGTERM handled (:mod:`mgk.train.interrupt`); ``initialise`` as
    :class:`Trainer`'s. Resuming a finished run
    (results.json reports ``cfg.optim.steps`` steps or more) changes nothing and returns its results.

    Returns the results dict on rank 0 (None elsewhere). Raises NonFiniteLoss when the loss is not finite and
    ``cfg.optim.nonfinite == "stop"``; NonFiniteResult when the final evaluation is not finite (or a resumed run had
    failed so); ValueError when a resumed checkpoint was made with another model config or the device does not
    exist; RunDirError when the directory is in use or (new run) not empty; Interrupted on a signal."""
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if resume and (done := finished_results(run_dir, cfg)) is not None:
        if done.get("failed"):
            raise NonFiniteResult(f"{run_dir} failed ({done['failed']}): there is nothing to continue; start it "
                                  f"again with --overwrite --out {shlex.quote(str(run_dir))}")
        if rank0:
            tqdm.write(f"{run_dir} is finished ({done['steps']} steps, results.json): nothing to do; to train "
                       f"longer: mgk train --resume {shlex.quote(str(run_dir))} --steps N", file=sys.stderr)
        return done if rank0 else None
    trainer = None
    with StopSignals() as stop:
        try:
            trainer = Trainer(cfg, run_dir, resume=resume, device=device, overwrite=overwrite, stop=stop,
                              small_model_threads=small_model_threads, initialise=initialise)
            trainer.setup()
            trainer.train()
            return trainer.finish()
        except (SignalStop, KeyboardInterrupt) as e:
            signum = e.signum if isinstance(e, SignalStop) else signal.SIGINT.value
            if trainer is None:
                raise Interrupted(f"stopped by {signal_name(signum)} before training started", signum, 0,
                                  is_main=rank0) from None
            raise Interrupted(trainer.stop_message(signum), signum, trainer.state.step,
                              is_main=trainer.dist.is_main) from None
        finally:
            if trainer is not None:
                trainer.close()
