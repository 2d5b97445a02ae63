"""Perplexity of a causal language model on token windows: exp(total NLL / predicted tokens), each window of W tokens
predicting its last W - 1 from the ones before (non-overlapping windows, no context carried between them)."""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

__all__ = ["perplexity"]


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, *, batch_size: int = 4, progress: bool = False) -> dict:
    """Score ``model`` (a Hugging Face causal LM, called uncached) on ``windows`` (N, W) int64.

    Returns:
        ``{"perplexity", "nll" (total, nats), "predicted" (N (W - 1)), "windows", "window", "seconds"}``.
    Raises:
        ValueError when the loss is not finite (naming the window).
    """
    from tqdm import tqdm

    model.eval()
    total, count, start = 0.0, 0, time.perf_counter()
    batches = range(0, windows.shape[0], batch_size)
    for i in tqdm(batches, desc="perplexity", unit="batch", disable=not progress, leave=False):
        ids = windows[i:i + batch_size]
        logits = model(input_ids=ids, use_cache=False).logits
        nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum").item()
        if not math.isfinite(nll):
            raise ValueError(f"the loss of windows {i}..{i + ids.shape[0] - 1} is not finite ({nll})")
        total += nll
        count += ids[:, 1:].numel()
    return {"perplexity": math.exp(total / count), "nll": total, "predicted": count, "windows": windows.shape[0],
            "window": windows.shape[1], "seconds": time.perf_counter() - start}
