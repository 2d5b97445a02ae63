"""``mgk eval``: perplexity of a trained language model on a whole split, counted exactly.

Perplexity is ``exp(total NLL / number of predicted tokens)``; every token of the split after its first is
predicted exactly once (the first has nothing before it). Windows of the token stream are scored as follows:

- a window is ``context`` consecutive input tokens ``x[a:b]`` (b - a = context, fewer only at the end of the
  split); the model predicts ``x[a+1:b+1]`` from them, the token ``x[t]`` from ``x[a:t]``;
- the first window starts at token 0 and scores all of its predictions; each next window starts ``stride``
  tokens later and scores only its new predictions, its last ``stride`` (the window that reaches the end of the
  split is cut there, so it scores fewer);
- so a token is predicted from at most ``context`` previous tokens, and from exactly ``context`` once it is far
  enough from the start when ``stride`` is 1. (Counted as a window of W tokens that includes the predicted one, the
  convention of the Hugging Face perplexity recipe, https://huggingface.co/docs/transformers/perplexity,
  W = context + 1.)

``stride == context`` is *segment mode*: non-overlapping segments, the same numbers as the validation during
training (``--context`` defaults to the training ``segment_len``). ``--context 256 --stride 1`` is the paper's
final protocol (lmtool-fwp ``eval_sliding_window.py --tgt_len 256``: every token predicted from the 256 before it,
one model call per token, batched here). Windows are shared out over torchrun ranks and the sums all-reduced, so the
result does not depend on the batch size or the number of processes.
"""
from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from ..data import wikitext as wt
from ..models import IGNORE_INDEX
from ..tasks.run_records import run_failure
from . import distributed, rundir
from .loop import NonFiniteResult

__all__ = ["evaluate_run", "evaluate_tokens", "window_plan"]


def window_plan(num_tokens: int, context: int, stride: int) -> tuple[Tensor, Tensor, Tensor]:
    """(start, length, scored) int64 per window for a stream of ``num_tokens`` tokens: window k reads
    ``tokens[start:start+length]`` (start = k * stride; length = context except where the split ends) and scores
    its last ``scored`` predictions. ``scored`` sums to num_tokens - 1; with stride = context the windows are the
    consecutive segments of the training-time validation.

    Raises ValueError unless 1 <= stride <= context and num_tokens >= 2."""
    if context < 1 or not 1 <= stride <= context:
        raise ValueError(f"need 1 <= stride <= context, got context={context}, stride={stride}")
    n = num_tokens - 1  # predictions: tokens 1 .. num_tokens-1
    if n < 1:
        raise ValueError(f"a stream of {num_tokens} token(s) has nothing to predict (need at least 2)")
    if n <= context:
        one = torch.tensor([0], dtype=torch.int64)
        return one, torch.tensor([n]), torch.tensor([n])
    full_ends = torch.cat([torch.tensor([context]), torch.arange(context + stride, n + stride, stride)])
    ends = full_ends.clamp(max=n)
    scored = torch.diff(ends, prepend=torch.tensor([0]))
    starts = full_ends - context
    return starts, ends - starts, scored


@torch.no_grad()
def evaluate_tokens(model, tokens: Tensor, *, context: int, stride: int, batch_size: int = 16, device=None,
                    dist_info=None, progress: bool = False, desc: str = "eval") -> dict:
    """Sliding-window NLL of ``model`` on the 1-D ``tokens`` (see the module docstring).

    ``model(inputs (b, l), targets (b, l)) -> nll (b, l)`` with 0 at targets equal to IGNORE_INDEX (the interface of
    :class:`mgk.models.TransformerLM`). ``batch_size`` is windows per call. With ``dist_info`` (from
    :func:`mgk.train.distributed.setup`) rank r takes batches r, r+W, ... and the sums are all-reduced.
    Returns ``{"nll_sum", "tokens" (predicted), "nll" (per token), "ppl", "windows"}``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    rank, world = (dist_info.rank, dist_info.world_size) if dist_info is not None else (0, 1)
    device = torch.device(device) if device is not None else (dist_info.device if dist_info is not None else
                                                              next(model.parameters()).device)
    was_training = model.training
    model.eval()
    tokens = tokens.reshape(-1)
    starts, lengths, scored = window_plan(tokens.numel(), context, stride)
    last = tokens.numel() - 1
    num_batches = -(-starts.numel() // batch_size)
    nll_sum, count = 0.0, 0
    mine = range(rank, num_batches, world)
    total = sum(min(batch_size, starts.numel() - b * batch_size) for b in mine)
    bar = tqdm(total=total, disable=not progress or rank != 0, unit="window", desc=desc,
               dynamic_ncols=True, file=sys.stderr)
    for b in mine:
        s, n, k = (t[b * batch_size:(b + 1) * batch_size] for t in (starts, lengths, scored))
        width = int(n.max())
        offs = torch.arange(width, dtype=torch.int64).unsqueeze(0)
        pos = (s.unsqueeze(1) + offs).clamp(max=last)
        pad = offs >= n.unsqueeze(1)  # a shorter last window is padded at its end (causal: inert)
        keep = (offs >= (n - k).unsqueeze(1)) & ~pad  # the last k predictions of each window
        inputs = tokens[pos].long().masked_fill(pad, 0)
        targets = tokens[(pos + 1).clamp(max=last)].long().masked_fill(~keep, IGNORE_INDEX)
        nll = model(inputs.to(device), targets.to(device))
        nll_sum += float(nll.double().sum())
        count += int(keep.sum())
        bar.update(int(s.numel()))
    bar.close()
    if world > 1:
        nll_sum, count = distributed.all_sum([nll_sum, float(count)], device)
        count = round(count)
    model.train(was_training)
    nll = nll_sum / count
    return {"nll_sum": nll_sum, "tokens": count, "nll": nll, "ppl": math.exp(nll) if nll < 700 else float("inf"),
            "windows": int(starts.numel())}


def evaluate_run(run_dir: str | os.PathLike, *, split: str = "valid", data: str | os.PathLike | None = None,
                 context: int | None = None, stride: int | None = None, batch_size: int | None = None,
                 device: str | None = None, which: str = "best", json_path: str | os.PathLike | None = None,
                 progress: bool = True) -> dict:
    """Perplexity of the run in ``run_dir`` (loaded with :func:`mgk.train.load.load_run`: config.yaml, vocab.txt,
    checkpoints/best.pt or last.pt) on ``split``.

    Run directories of 0.1.0 load as they are.

    Args:
        split: "valid" (also "val") or "test": ``wiki.<split>.tokens`` or ``<split>.txt`` of the data folder.
        data: data folder (default: the run's ``data`` setting, or the corpus it generated in ``run_dir/data``).
        context, stride: window and step in tokens (defaults: the run's ``eval_context``/``eval_stride`` when set,
            else ``segment_len`` and stride = context, i.e. segment mode).
        batch_size: windows per model call (default: the run's ``eval_batch_size``).
        which: "best" (falls back to "last" when there is no best.pt) or "last".
        json_path: also write the result there.
    Returns the result dict (on rank 0; None elsewhere) with ppl, nll (per token), nll_sum, tokens (predicted),
    protocol ("segments" or "sliding"), context, stride, windows, split, file, checkpoint, step, ...

    Raises FileNotFoundError naming what is missing (a data folder that moved: pass ``data``); ValueError when the
    vocabulary does not match the checkpoint, a file of the run is damaged or ``device`` does not exist here;
    :class:`~mgk.train.rundir.RunDirError` while a run trains in ``run_dir`` (the evaluation holds the directory's
    lock shared, so evaluations may run side by side); :class:`~mgk.train.loop.NonFiniteResult` when the perplexity
    is not finite (the JSON, when asked for, is written first with ``failed`` set).
    """
    run_dir = Path(run_dir)
    cfg = rundir.load_config(run_dir)
    if cfg.task != "lm":
        raise ValueError(f"{run_dir} is a {cfg.task!r} run; mgk eval measures language-model perplexity")
    if device is not None:
        distributed.check_device(device)
    with rundir.RunDirLock(run_dir, shared=True):
        return _evaluate_locked(run_dir, split=split, data=data, context=context, stride=stride,
                                batch_size=batch_size, device=device, which=which, json_path=json_path,
                                progress=progress)


def _split_tokens(run, split: str, data) -> tuple[Path, Tensor, int]:
    """(file, token ids, words mapped to <unk>) of ``split`` in the run's data folder."""
    from ..tasks.lm import cache_dir

    data_dir = run.data_dir
    if not data_dir.is_dir():
        if data is not None:
            raise FileNotFoundError(f"--data {data}: no such folder")
        raise FileNotFoundError(f"the data folder {data_dir} of run {run.run_dir} does not exist (moved?): pass its "
                                "new place with --data")
    split_file = wt.find_split_file(data_dir, split)
    if split_file is None:
        raise FileNotFoundError(f"no {split} split (wiki.{split}.tokens or {split}.txt) in {data_dir}")
    tokens, mapped = wt.load_split(split_file, run.task.vocab, cache_dir=cache_dir(run.cfg, data_dir))
    return split_file, tokens, mapped


def _evaluate_locked(run_dir: Path, *, split, data, context, stride, batch_size, device, which, json_path,
                     progress) -> dict | None:
    """:func:`evaluate_run` once the run directory is held."""
    from .load import load_run

    t0 = time.perf_counter()
    split = wt.split_name(split)
    d = distributed.setup(device)
    try:
        run = load_run(run_dir, checkpoint=which, device=d.device, data=data)
        if run.failure is not None:
            raise NonFiniteResult(f"{run_dir} failed in training ({run.failure}): its weights are not usable, "
                                  "nothing to evaluate")
        cfg = run.cfg
        split_file, tokens, mapped = _split_tokens(run, split, data)
        context = context or cfg.eval.context or cfg.data.segment_len
        stride = stride or cfg.eval.stride or context
        if stride > context:
            raise ValueError(f"stride ({stride}) must not exceed context ({context})")
        res = evaluate_tokens(run.model, tokens, context=context, stride=stride,
                              batch_size=batch_size or cfg.eval.batch_size, dist_info=d, progress=progress,
                              desc=f"{split} ppl")
    finally:
        distributed.teardown()
    result = {"ppl": res["ppl"], "nll": res["nll"], "nll_sum": res["nll_sum"], "tokens": res["tokens"],
              "protocol": "segments" if stride == context else "sliding", "context": context, "stride": stride,
              "windows": res["windows"], "split": split, "file": str(split_file), "split_tokens": int(tokens.numel()),
              "oov_to_unk": mapped, "vocab_size": len(run.task.vocab), "checkpoint": str(run.checkpoint),
              "step": run.step, "run_dir": str(run_dir), "attention": cfg.attention.kind,
              "num_heads": cfg.attention.num_heads,
              "world_size": d.world_size, "device": str(d.device), "seconds": time.perf_counter() - t0}
    failure = run_failure(result)
    if failure is not None:
        result["failed"] = f"{failure} on {split} with {run.checkpoint.name} (step {run.step})"
    if json_path is not None and d.is_main:
        rundir.write_json(json_path, result)
    if failure is not None:
        raise NonFiniteResult(f"{run_dir}: {result['failed']}: the weights are not usable"
                              + (f"; {json_path} records the evaluation as failed" if json_path else ""))
    return result if d.is_main else None
