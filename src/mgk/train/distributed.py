"""torchrun integration: process group set-up and the few collectives the loop needs.

Launch with ``torchrun --nproc_per_node=N -m mgk train ...``: gloo on CPU, NCCL on CUDA. Without torchrun's
environment everything degrades to one process and the collectives are no-ops.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Dist:
    """Rank, world size and device of this process."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """True on rank 0, the process that writes the run directory."""
        return self.rank == 0


def check_device(device: str, name: str = "--device") -> torch.device:
    """``torch.device(device)`` when that device exists here; ValueError naming it otherwise (a bad string, CUDA
    or MPS requested where there is none, a CUDA index beyond the devices present). ``name``: how the caller's user
    gave it, "--device" on the command line (the default) or "device" for a Python argument."""
    cpu = "--device cpu" if name.startswith("--") else f"{name}='cpu'"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{name} {device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name} {device}: CUDA is not available on this machine (torch "
                             f"{torch.__version__}); use {cpu}")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{name} {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        backend = getattr(torch.backends, dev.type, None) or getattr(torch, dev.type, None)
        if backend is None or not getattr(backend, "is_available", lambda: False)():
            raise ValueError(f"{name} {device}: no {dev.type} device on this machine; use {cpu}")
    return dev


def setup(device: str | None = None) -> Dist:
    """Initialise the process group when launched by torchrun (WORLD_SIZE > 1); pick the device. ValueError
    naming ``device`` when it does not exist here (:func:`check_device`)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = check_device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local if dev.index is None or world > 1 else dev.index)
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return Dist(rank, world, dev)


def teardown() -> None:
    """Destroy the process group if this process created one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_sum(values: list[float], device) -> list[float]:
    """Sum a few numbers over ranks (float64, so counts stay exact)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def all_max(value: int, device) -> int:
    """The largest of every rank's ``value`` (``value`` itself in one process)."""
    if dist.is_available() and dist.is_initialized():
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())
    return value


def gather_objects(obj) -> list:
    """Every rank's ``obj`` (a list of one item in a single process)."""
    if dist.is_available() and dist.is_initialized():
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def barrier() -> None:
    """Wait for every rank (no-op in one process)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
