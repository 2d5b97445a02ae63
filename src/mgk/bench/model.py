"""``mgk bench model``: training and inference tokens per second and peak memory of a whole preset's model.

Inputs are random tokens at the preset's full length (the slowest case: no padding to trim); a training step is
forward, backward and an AdamW step. Runs in a subprocess so that peak memory (``ru_maxrss`` growth on CPU,
``max_memory_allocated`` on CUDA) belongs to this measurement alone.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import time

import torch


def measure(preset: str, overrides: list[str], *, steps: int, device: str) -> dict:
    """Tokens/s of training and inference, peak memory in MB and parameter count of ``preset`` (+ overrides)."""
    import resource

    from ..config import apply_overrides, encoder_config
    from ..models import LRAClassifier
    from ..tasks import all_presets

    cfg = apply_overrides(all_presets()[preset], overrides)
    cfg = dataclasses.replace(cfg, vocab_size=cfg.vocab_size or 256, num_classes=cfg.num_classes or 10)
    torch.manual_seed(0)
    dev = torch.device(device)
    model = LRAClassifier.from_config(encoder_config(cfg)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    B, L = cfg.batch_size, cfg.max_len
    tokens = torch.randint(0, cfg.vocab_size, (B, L), device=dev)
    labels = torch.randint(0, cfg.num_classes, (B,), device=dev)

    def train_step():
        """One training step on the fixed batch: forward, cross-entropy, backward and an AdamW step."""
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(tokens), labels).backward()
        opt.step()

    def infer():
        """One forward pass on the fixed batch without gradients."""
        with torch.no_grad():
            model(tokens)

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model.train()
    train_step()
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        train_step()
        times.append(time.perf_counter() - t0)
    model.eval()
    infer()
    itimes = []
    for _ in range(steps):
        t0 = time.perf_counter()
        infer()
        itimes.append(time.perf_counter() - t0)
    return {"preset": preset, "overrides": overrides, "attention": cfg.attention, "num_heads": cfg.num_heads,
            "batch": B, "length": L, "params": sum(p.numel() for p in model.parameters()),
            "train_tokens_per_s": B * L / statistics.median(times),
            "infer_tokens_per_s": B * L / statistics.median(itimes), "train_peak_mem_mb": peak}


def run(preset: str, overrides: list[str], *, steps: int, device: str, timeout: float) -> dict:
    """:func:`measure` in a fresh subprocess."""
    code = ("import json; from mgk.bench.model import measure; "
            f"print(json.dumps(measure({preset!r}, {overrides!r}, steps={steps}, device={device!r})))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"mgk bench model {preset} failed: {p.stderr.strip()[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])
