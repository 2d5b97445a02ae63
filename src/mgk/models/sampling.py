"""The next token from a model's log-probabilities: greedy, temperature, top-k (Fan et al. 2018) and nucleus / top-p
(Holtzman et al. 2020) sampling, as nanoGPT's and Hugging Face's ``generate`` do."""
from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["check_sampling", "next_token"]


def check_sampling(temperature, top_k, top_p, generator) -> None:
    """ValueError naming the first bad argument: temperature a finite float >= 0, top_k None or an int >= 1, top_p
    None or a float in (0, 1], generator None or a torch.Generator."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise ValueError(f"temperature must be a finite float >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or a float in (0, 1], got {top_p!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be None or a torch.Generator, got {type(generator).__name__}")


def _nucleus(logits: Tensor, top_p: float) -> Tensor:
    """``logits`` with -inf outside the smallest set of most likely tokens whose probability reaches ``top_p`` (the
    most likely token is always kept)."""
    ordered, order = logits.sort(dim=-1, descending=True)
    probs = torch.softmax(ordered, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each one
    ordered = ordered.masked_fill(before >= top_p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)


def next_token(log_probs: Tensor, *, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
               generator: torch.Generator | None = None) -> Tensor:
    """(B,) int64 next tokens from ``log_probs`` (B, V) (log-probabilities or logits).

    temperature 0: the argmax (greedy; ties go to the lowest id). Otherwise a draw from ``softmax(log_probs /
    temperature)`` restricted to the ``top_k`` most likely tokens and to the nucleus of mass ``top_p`` (both
    optional), with ``generator`` (its device is used for the draw, so a CPU generator reproduces on any device).
    Raises ValueError as :func:`check_sampling`, and naming ``log_probs`` when a row holds NaN or no finite entry
    (a model whose weights went non-finite: argmax would silently answer token 0, a draw would fail)."""
    check_sampling(temperature, top_k, top_p, generator)
    best = log_probs.amax(dim=-1, keepdim=True)
    if bool(torch.isnan(log_probs).any() | ~torch.isfinite(best).all()):
        raise ValueError("log_probs has NaN or a row without a finite entry: the model's next-token scores are not "
                         "finite (are its weights?)")
    if temperature == 0:
        return log_probs.argmax(dim=-1)
    # Shifted so that the most likely token scores 0 before the division, in float64 (where a temperature of 1e-300
    # is not 0): any temperature > 0, however small, keeps it finite (an unshifted float32 log p / 1e-40 overflows
    # to -inf for every token, and the draw fails).
    logits = (log_probs.double() - best.double()) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        logits = _nucleus(logits, top_p)
    probs = torch.softmax(logits, dim=-1)
    where = probs.device if generator is None else generator.device
    return torch.multinomial(probs.to(where), 1, generator=generator).squeeze(-1).to(log_probs.device)
