"""Run by test_soft_e_ddp.py under torchrun (2 gloo processes): Soft-E MGK in DDP, 3 steps of 2 micro-batches
(the first under ``no_sync``, of a length that differs between ranks), each step ending in ``mgk.soft_e_step``.

Writes to ``<out>/rank<r>.json``: pi after each step of the plain DDP run (``broadcast_buffers`` True and False),
and the max differences against it of the runs with ``torch.utils.checkpoint`` (reentrant and not), of the run
without ``no_sync`` (every micro-batch's backward synchronised) and of one process that runs every rank's
micro-batches itself (computed before the process group exists, so its
``soft_e_step`` reduces nothing)."""
import contextlib
import json
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import mgk

STEPS = 3


class Checkpointed(torch.nn.Module):
    """The attention with checkpointing inside the module that DDP wraps (as in a checkpointed Transformer)."""

    def __init__(self, inner, mode):
        super().__init__()
        self.inner, self.mode = inner, mode

    def forward(self, x):
        fn = lambda inp: self.inner(inp, is_causal=True, need_weights=False)[0]  # noqa: E731
        if self.mode == "plain":
            return fn(x)
        return checkpoint(fn, x, use_reentrant=(self.mode == "reentrant"))


def data(rank):
    """Each step's two micro-batches of ``rank``: different data per rank, and lengths 6 + rank and 9."""
    gen = torch.Generator().manual_seed(1 + rank)
    return [[torch.randn(2, 6 + rank, 16, generator=gen), torch.randn(2, 9, 16, generator=gen)] for _ in range(STEPS)]


def loss(model, x):
    return model(x.requires_grad_()).square().mean()


def train(mode, broadcast_buffers=True, no_sync=True):
    torch.manual_seed(0)
    inner = mgk.MGKAttention(16, 2, head_dim=8, keys="shifted", pi="soft_e", max_len=12, batch_first=True).train()
    model = DDP(Checkpointed(inner, mode), broadcast_buffers=broadcast_buffers)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    pis, grads = [], []
    for first, second in data(dist.get_rank()):
        opt.zero_grad()
        with model.no_sync() if no_sync else contextlib.nullcontext():
            loss(model, first).backward()
        loss(model, second).backward()
        assert mgk.soft_e_step(model) == 1
        pis.append(inner.pi.clone())
        grads.append([p.grad.clone() for p in inner.parameters()])
        opt.step()
    return pis, grads


def one_process(world):
    """The same steps in one process over every rank's micro-batches (gradients averaged over ranks, as DDP)."""
    torch.manual_seed(0)
    inner = mgk.MGKAttention(16, 2, head_dim=8, keys="shifted", pi="soft_e", max_len=12, batch_first=True).train()
    model = Checkpointed(inner, "plain")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    shares = [data(rank) for rank in range(world)]
    pis, grads = [], []
    for step in range(STEPS):
        opt.zero_grad()
        for share in shares:
            for x in share[step]:
                (loss(model, x) / world).backward()
        assert mgk.soft_e_step(inner) == 1
        pis.append(inner.pi.clone())
        grads.append([p.grad.clone() for p in inner.parameters()])
        opt.step()
    return pis, grads


def difference(run, ref):
    (pis, grads), (ref_pis, ref_grads) = run, ref
    return {"pi": max(float((a - b).abs().max()) for a, b in zip(pis, ref_pis)),
            "grad": max(float((a - b).abs().max()) for ga, gb in zip(grads, ref_grads) for a, b in zip(ga, gb))}


def main(out):
    single = one_process(2)  # before init_process_group: soft_e_step reduces nothing here
    dist.init_process_group("gloo")
    plain = train("plain")
    result = {"pi": [p.tolist() for p in plain[0]],
              "pi_no_broadcast": [p.tolist() for p in train("plain", broadcast_buffers=False)[0]],
              "one_process": difference(single, plain),
              # DDP broadcasts its buffers from rank 0 at a forward after a synchronised backward: statistics kept
              # in a buffer would be overwritten between these micro-batches
              "every_micro_batch_synced": difference(train("plain", no_sync=False), plain)}
    for mode in ("non_reentrant", "reentrant"):
        result[mode] = difference(train(mode), plain)
    with open(f"{out}/rank{dist.get_rank()}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
