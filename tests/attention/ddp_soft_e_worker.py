"""Run by test_soft_e_ddp.py under torchrun (2 gloo processes): Soft-E MGK in DDP, 3 steps of 2 micro-batches
(the first under ``no_sync``), without checkpointing and with ``torch.utils.checkpoint`` (reentrant and not).
Writes the max differences of pi and the gradients against the plain run to ``<out>/rank<r>.json``."""
import json
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import mgk


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


def train(mode):
    torch.manual_seed(0)
    inner = mgk.MGKAttention(16, 2, head_dim=8, keys="shifted", pi="soft_e", max_len=12, batch_first=True).train()
    model = DDP(Checkpointed(inner, mode), static_graph=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    pis, grads = [], []

    def step(x):
        return model(x).square().mean()

    for _ in range(3):
        opt.zero_grad()
        with model.no_sync():
            step(torch.randn(2, 6 + dist.get_rank(), 16, generator=gen).requires_grad_()).backward()
        step(torch.randn(2, 9, 16, generator=gen).requires_grad_()).backward()
        pis.append(inner.pi.clone())
        grads.append([p.grad.clone() for p in inner.parameters()])
        opt.step()
    return pis, grads


def main(out):
    dist.init_process_group("gloo")
    ref_pis, ref_grads = train("plain")
    result = {"pi_changed": bool((ref_pis[-1] - 0.5).abs().max() > 1e-3)}
    for mode in ("non_reentrant", "reentrant"):
        pis, grads = train(mode)
        result[mode] = {
            "pi": max(float((a - b).abs().max()) for a, b in zip(pis, ref_pis)),
            "grad": max(float((a - b).abs().max()) for ga, gb in zip(grads, ref_grads) for a, b in zip(ga, gb)),
        }
    with open(f"{out}/rank{dist.get_rank()}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
