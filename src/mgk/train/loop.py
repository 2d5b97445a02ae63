"""The one training loop of every task: optimiser, schedule, accumulation, DDP, precision, checkpoints, records.

Data order is a pure function of (seed, step): epoch e is ``randperm(N)`` drawn from a generator seeded with
(seed, e), and step s reads its global batch from that permutation. Resuming therefore needs only the step; with W
processes each rank takes its 1/W slice of the same global batch, so W processes see what one process sees.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from .. import config as config_mod
from ..config import RunConfig
from ..tasks import get_task
from . import checkpoint, distributed, records
from .evaluate import evaluate
from .precision import autocast, grad_scaler
from .schedule import lr_factor


class NonFiniteLoss(RuntimeError):
    """The training loss became NaN or inf; the last good checkpoint is kept."""


class EpochSampler:
    """Global batch indices for step ``s``: slice ``s mod E`` of the permutation of epoch ``s div E``."""

    def __init__(self, num_examples: int, batch_size: int, seed: int):
        if num_examples < batch_size:
            raise ValueError(f"the train split has {num_examples} examples, fewer than batch_size={batch_size}")
        self.n, self.batch_size, self.seed = num_examples, batch_size, seed
        self.per_epoch = num_examples // batch_size  # the incomplete tail batch of an epoch is not used
        self._cache = (None, None)

    def indices(self, step: int) -> torch.Tensor:
        """int64 (batch_size,) example indices of optimiser step ``step``."""
        epoch, pos = divmod(step, self.per_epoch)
        if self._cache[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._cache = (epoch, torch.randperm(self.n, generator=g))
        return self._cache[1][pos * self.batch_size:(pos + 1) * self.batch_size]


def _say(run_dir: Path, message: str) -> None:
    tqdm.write(message, file=sys.stderr)
    with open(run_dir / "train.log", "a") as f:
        f.write(message + "\n")


def fit(cfg: RunConfig, run_dir: str | Path, *, resume: bool = False, device: str | None = None) -> dict | None:
    """Train ``cfg`` into ``run_dir`` (or continue it from checkpoints/last.pt when ``resume``).

    Returns the results dict on rank 0 (None elsewhere). Raises NonFiniteLoss when the loss is not finite and
    ``cfg.nonfinite == "stop"``; ValueError when a resumed checkpoint was made with another model config.
    """
    config_mod.validate(cfg)
    d = distributed.setup(device)
    run_dir = Path(run_dir)
    if cfg.batch_size % (d.world_size * cfg.grad_accum):
        raise ValueError(f"batch_size={cfg.batch_size} must be divisible by world_size ({d.world_size}) "
                         f"x grad_accum ({cfg.grad_accum})")
    local_batch = cfg.batch_size // d.world_size
    micro_batch = local_batch // cfg.grad_accum

    # Data: rank 0 finds or generates the files, then every rank reads them.
    task_mod = get_task(cfg.task)
    if d.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        data_dir = task_mod.prepare(cfg, run_dir)
    distributed.barrier()
    if not d.is_main:
        data_dir = task_mod.prepare(cfg, run_dir)
    task = task_mod.build(cfg, data_dir)
    cfg = dataclasses.replace(cfg, vocab_size=task.vocab_size, num_classes=task.num_classes)
    train_set, val_set, test_set = task.splits["train"], task.splits.get("val"), task.splits.get("test")

    # Model, optimiser, schedule (SPEC section 2: AdamW, warm-up then decay).
    torch.manual_seed(cfg.seed)
    model = task.build_model(cfg).to(d.device)
    num_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(
        s, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps, schedule=cfg.schedule))
    scaler = grad_scaler(d.device, cfg.precision)
    ckpt_dir = run_dir / "checkpoints"
    # The task names the validation metric that selects the best checkpoint, e.g. ("acc", "max") or ("ppl", "min").
    best_key, best_mode = getattr(task, "best_metric", ("acc", "max"))
    state = {"step": 0, "best": None, "best_step": None, "skipped": 0}

    if resume:
        ckpt = checkpoint.load(ckpt_dir / "last.pt")
        diffs = config_mod.model_differences(ckpt["config"], config_mod.to_dict(cfg))
        if diffs:
            raise ValueError(f"checkpoint {ckpt_dir / 'last.pt'} was made with another model config: "
                             + "; ".join(diffs))
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        state.update(ckpt["state"])
        rngs = ckpt["rng"]
        if len(rngs) == d.world_size:
            checkpoint.set_rng_state(rngs[d.rank])
        else:
            torch.manual_seed(cfg.seed * 7919 + state["step"] * 31 + d.rank)
    else:
        torch.manual_seed(cfg.seed * 7919 + d.rank)  # each rank its own dropout stream

    log = None
    if d.is_main:
        records.write_config(run_dir, config_mod.to_dict(cfg))
        records.write_env(run_dir, seed=cfg.seed, world_size=d.world_size, device=str(d.device))
        log = records.MetricsLog(run_dir, resume_step=state["step"] if resume else None)
        for note in task.notes:
            _say(run_dir, note)
        _say(run_dir, f"model: {cfg.attention} x {cfg.num_heads} heads (head_dim {cfg.head_dim}), "
                      f"{num_params:,} parameters; world size {d.world_size}; precision {cfg.precision}"
                      + (f"; resuming at step {state['step']}" if resume else ""))

    net = DistributedDataParallel(model) if d.world_size > 1 else model
    sampler = task.sampler(len(train_set), cfg.batch_size, cfg.seed) if hasattr(task, "sampler") else \
        EpochSampler(len(train_set), cfg.batch_size, cfg.seed)
    bar = tqdm(total=cfg.steps, initial=state["step"], disable=not (d.is_main and cfg.progress), unit="step",
               dynamic_ncols=True)
    train_seconds, session_steps = 0.0, 0

    def save_last() -> None:
        """Write ``last.pt`` (model, optimiser, scheduler, scaler, loop state, config, every rank's RNG state). Every
        rank must call it (the RNG states are gathered); only the main rank writes."""
        ckpt = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "state": dict(state),
                "config": config_mod.to_dict(cfg), "rng": distributed.gather_objects(checkpoint.rng_state())}
        if d.is_main:
            checkpoint.save_atomic(ckpt, ckpt_dir / "last.pt")

    model.train()
    while state["step"] < cfg.steps:
        t0 = time.perf_counter()
        step = state["step"]
        mine = sampler.indices(step)[d.rank * local_batch:(d.rank + 1) * local_batch]
        optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for a in range(cfg.grad_accum):
            batch = task.batch(train_set, mine[a * micro_batch:(a + 1) * micro_batch], d.device)
            last_micro = a == cfg.grad_accum - 1
            sync = contextlib.nullcontext() if (last_micro or d.world_size == 1) else net.no_sync()
            with sync:
                with autocast(d.device, cfg.precision):
                    loss_sum, s = task.loss(net, batch)
                # local mean over this rank's share; DDP averages over ranks -> mean over the global batch
                scaler.scale(loss_sum / local_batch).backward()
            for key, value in s.items():
                sums[key] = sums.get(key, 0.0) + float(value)
        keys = sorted(sums)
        train = task.summarise(dict(zip(keys, distributed.all_sum([sums[k] for k in keys], d.device))))
        train_loss = train["loss"]
        if not math.isfinite(train_loss):
            if cfg.nonfinite == "stop":
                kept = ckpt_dir / "last.pt"
                raise NonFiniteLoss(f"non-finite training loss ({train_loss}) at step {step + 1}; the last good "
                                    f"checkpoint is {kept if kept.exists() else 'none (no checkpoint yet)'}; "
                                    f"lower lr, use --precision 32, or set nonfinite=skip")
            state["skipped"] += 1
            optimizer.zero_grad(set_to_none=True)
        else:
            if cfg.grad_clip > 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            scaler.step(optimizer)
            scaler.update()
        scheduler.step()
        state["step"] = done = step + 1
        train_seconds += time.perf_counter() - t0
        session_steps += 1

        metrics = {}
        if done % cfg.log_every == 0 or done == cfg.steps:
            metrics.update({f"train/{k}": v for k, v in train.items() if k != "count"})
            metrics.update({"train/lr": scheduler.get_last_lr()[0], "train/skipped": state["skipped"]})
            bar.set_postfix({k: f"{v:.4g}" for k, v in train.items() if k != "count"})
        if val_set is not None and (done % cfg.eval_every == 0 or done == cfg.steps):
            val = evaluate(task, model, val_set, batch_size=cfg.eval_batch_size, precision=cfg.precision,
                           dist_info=d)
            metrics.update({f"val/{k}": v for k, v in val.items() if k != "count"})
            better = state["best"] is None or (val[best_key] > state["best"] if best_mode == "max"
                                               else val[best_key] < state["best"])
            if better:
                state["best"], state["best_step"], state["best_val"] = val[best_key], done, val
                if d.is_main:
                    checkpoint.save_atomic({"model": model.state_dict(), "step": done,
                                            "config": config_mod.to_dict(cfg)}, ckpt_dir / "best.pt")
        if metrics and d.is_main:
            metrics["time/seconds_per_step"] = train_seconds / max(1, session_steps)
            log.log(done, metrics)
        if done % cfg.checkpoint_every == 0 or done == cfg.steps:
            save_last()
        bar.update(1)
    bar.close()

    # Final figures: the best-validation weights (the last ones when there is no validation split) on test.
    best_path = ckpt_dir / "best.pt"
    distributed.barrier()
    if val_set is not None and best_path.exists():
        model.load_state_dict(checkpoint.load(best_path, map_location=d.device)["model"])
    results = {"task": cfg.task, "attention": cfg.attention, "num_heads": cfg.num_heads, "head_dim": cfg.head_dim,
               "pi": cfg.pi, "params": num_params, "steps": state["step"], "seed": cfg.seed,
               "world_size": d.world_size, "precision": cfg.precision, "max_len": cfg.max_len,
               "best_step": state["best_step"], "skipped_steps": state["skipped"],
               "seconds_per_step": train_seconds / max(1, session_steps)}
    for name, ds in (("val", val_set), ("test", test_set)):
        if ds is None:
            results[name] = None
            results.setdefault("missing_splits", []).append(name)
            continue
        if name == "val" and "best_val" in state:  # measured when the best checkpoint was written
            m = state["best_val"]
        else:
            m = evaluate(task, model, ds, batch_size=cfg.eval_batch_size, precision=cfg.precision, dist_info=d)
        results[name] = {**m, **task.describe(ds)}
    if d.is_main:
        for name in results.get("missing_splits", []):
            _say(run_dir, f"{name} split absent: results.json reports the splits that exist")
        (run_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        log.close()
        records.plot_learning_curves(run_dir)
        summary = "; ".join(f"{n}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                 for k, v in results[n].items())
                            for n in ("val", "test") if results[n] is not None)
        _say(run_dir, f"done: {summary}; {results['seconds_per_step']:.3f} s/step; results in {run_dir}")
    distributed.teardown()
    return results if d.is_main else None
