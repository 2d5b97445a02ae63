"""Tied adaptive input (Baevski & Auli 2019) and adaptive softmax (Grave et al. 2017) over one set of weights.

The output side is :class:`torch.nn.AdaptiveLogSoftmaxWithLoss` itself. Its weights are

- ``head.weight`` (shortlist + n_clusters, E): rows ``0 .. cutoffs[0]-1`` are the output embeddings of the frequent
  words, the last ``n_clusters`` rows score the tail clusters (they have no input counterpart);
- ``tail[i][0].weight`` (h_i, E): the projection of cluster i (``h_i = E // div_value**(i+1)``);
- ``tail[i][1].weight`` (size_i, h_i): the output embeddings of cluster i's words.

The input side reads exactly those tensors (no copies, no extra parameters), the tying of fairseq's
``--tie-adaptive-weights --tie-adaptive-proj`` (the projection used transposed):

- a frequent word w embeds as ``head.weight[w]``;
- a word w of cluster i embeds as ``tail[i][1].weight[w - cutoffs[i]] @ tail[i][0].weight`` (h_i -> E);

then everything is multiplied by ``sqrt(E)`` (Transformer-XL and fairseq scale embeddings the same way). Gradients
from both sides therefore reach the same parameters, and ``state_dict`` holds each weight once.

``div_value`` 1 gives every cluster the full width E (the setting of the Transformer-XL / lmtool-fwp code behind the
paper's WikiText-103 small model, ``--div_val 1``); 4 is fairseq's adaptive-input factor. Cutoffs at or above the
vocabulary size are dropped (the caller logs :attr:`TiedAdaptiveSoftmax.notes`); when none is left, the same module
is a plain tied softmax over one (V, E) matrix.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["DEFAULT_CUTOFFS", "TiedAdaptiveSoftmax", "resolve_cutoffs"]

DEFAULT_CUTOFFS = (20000, 40000, 200000)  # WikiText-103 small setting (Schlag et al. 2021; Baevski & Auli 2019)


def resolve_cutoffs(cutoffs, vocab_size: int) -> tuple[list[int], list[int]]:
    """(kept, dropped): cutoffs >= ``vocab_size`` are dropped; the kept ones must be increasing integers >= 1."""
    cutoffs = [int(c) for c in (DEFAULT_CUTOFFS if cutoffs is None else cutoffs)]
    if cutoffs != sorted(set(cutoffs)) or any(c < 1 for c in cutoffs):
        raise ValueError(f"adaptive cutoffs must be strictly increasing positive integers, got {cutoffs}")
    kept = [c for c in cutoffs if c < vocab_size]
    return kept, [c for c in cutoffs if c >= vocab_size]


class ChunkedNLL:
    """What the adaptive softmaxes share: their sizes (``_set_sizes``) and ``nll``: checks, float32 with autocast
    off (a log-softmax over 20k+ words in bf16 is too coarse), and query chunks of ``self.chunk`` rows without
    gradient. The class provides ``_nll(hidden (N, E) float32, target (N,)) -> (N,)``."""

    vocab_size: int
    chunk: int

    def _full_precision(self, hidden: Tensor) -> Tensor:
        """``hidden`` in the weights' dtype when that is float32 or float64 (a ``model.double()`` scores in
        float64). ValueError for 16-bit weights: the log-softmax runs in at least float32, so a bf16 / fp16 model
        keeps float32 weights and runs its blocks under ``torch.autocast``."""
        dtype = next(self.parameters()).dtype
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"the adaptive softmax's weights are {dtype}: it computes in float32 or float64, so "
                             "keep the model in float32 and use torch.autocast(..., dtype=torch.bfloat16) instead "
                             "of model.to(torch.bfloat16)")
        return hidden.to(dtype)

    def _set_sizes(self, vocab_size: int, dim: int, cutoffs, scale_embedding: bool, chunk: int) -> list[int]:
        """Sizes shared by the adaptive softmaxes: the cutoffs below ``vocab_size`` (returned; the others are
        dropped with a note in ``self.notes``), the embedding scale sqrt(dim) (or 1) and the nll chunk."""
        kept, dropped = resolve_cutoffs(cutoffs, vocab_size)
        self.vocab_size, self.dim, self.chunk = vocab_size, dim, chunk
        self.cutoffs = kept
        self.scale = math.sqrt(dim) if scale_embedding else 1.0
        self.notes = []
        if dropped:
            self.notes.append(f"model: adaptive cutoffs {dropped} >= vocabulary size {vocab_size} dropped; "
                              f"using {kept if kept else 'none (plain tied softmax)'}")
        return kept

    def nll(self, hidden: Tensor, target: Tensor) -> Tensor:
        """Negative log-likelihood of ``target`` (N,) int ids under ``hidden`` (N, E), float32 (N,).

        Runs in float32 with autocast off (a log-softmax over 20k+ words in bf16 is too coarse)."""
        if hidden.shape[0] != target.shape[0]:
            raise ValueError(f"hidden has {hidden.shape[0]} rows but target has {target.shape[0]}")
        if target.numel() and (int(target.min()) < 0 or int(target.max()) >= self.vocab_size):
            raise ValueError(f"target ids must be in [0, {self.vocab_size}), got [{int(target.min())}, "
                             f"{int(target.max())}]")
        with torch.autocast(hidden.device.type, enabled=False):
            hidden = self._full_precision(hidden)
            if torch.is_grad_enabled() or hidden.shape[0] <= self.chunk:
                return self._nll(hidden, target)
            return torch.cat([self._nll(hidden[i:i + self.chunk], target[i:i + self.chunk])
                              for i in range(0, hidden.shape[0], self.chunk)])


class TiedAdaptiveSoftmax(ChunkedNLL, nn.Module):
    """Adaptive input embedding and adaptive log-softmax sharing their weights (see the module docstring).

    Args:
        vocab_size: V (word ids 0 .. V-1, most frequent first).
        dim: model width E.
        cutoffs: cluster boundaries (default [20000, 40000, 200000]); those >= V are dropped and noted.
        div_value: width divisor of successive clusters (1 = full width everywhere).
        scale_embedding: multiply input embeddings by sqrt(E).
        chunk: under ``torch.no_grad`` the output layer runs on at most this many positions at a time.

    Methods: :meth:`embed` (ids -> vectors), :meth:`nll` (per-position negative log-likelihood, float32),
    :meth:`log_prob` (the full (N, V) log-distribution).
    """

    def __init__(self, vocab_size: int, dim: int, cutoffs=None, *, div_value: float = 1.0,
                 scale_embedding: bool = True, chunk: int = 8192):
        super().__init__()
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        kept = self._set_sizes(vocab_size, dim, cutoffs, scale_embedding, chunk)
        if kept:
            self.softmax = nn.AdaptiveLogSoftmaxWithLoss(dim, vocab_size, kept, div_value=div_value)
            self.weight = None
        else:
            self.softmax = None
            self.weight = nn.Parameter(torch.empty(vocab_size, dim))
            nn.init.uniform_(self.weight, -1 / math.sqrt(dim), 1 / math.sqrt(dim))  # as nn.Linear(dim, V)

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, dim={self.dim}, cutoffs={self.cutoffs}, scale={self.scale:.4g}"

    # -- input ---------------------------------------------------------------------------------------------------
    def embed(self, tokens: Tensor) -> Tensor:
        """Embeddings of integer ids of any shape -> (*shape, E), float32 (the weights' dtype)."""
        if self.softmax is None:
            return F.embedding(tokens, self.weight) * self.scale
        sm = self.softmax
        flat = tokens.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.vocab_size):
            raise IndexError(f"token ids must be in [0, {self.vocab_size}), got [{int(flat.min())}, "
                             f"{int(flat.max())}]")
        head_w = sm.head.weight
        bounds = [0] + self.cutoffs + [self.vocab_size]
        out = torch.zeros(flat.numel(), self.dim, dtype=head_w.dtype, device=head_w.device)
        for i in range(len(bounds) - 1):
            lo, hi = bounds[i], bounds[i + 1]
            rows = ((flat >= lo) & (flat < hi)).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            ids = flat.index_select(0, rows) - lo
            if i == 0:
                vec = F.embedding(ids, head_w[:hi])  # the shortlist rows of the head
            else:
                proj, words = sm.tail[i - 1][0].weight, sm.tail[i - 1][1].weight  # (h, E), (size, h)
                vec = F.embedding(ids, words) @ proj
            out = out.index_copy(0, rows, vec.to(out.dtype))
        return out.view(*tokens.shape, self.dim) * self.scale

    def touch(self) -> Tensor:
        """A zero scalar that depends on every weight of this module. Added to a training loss it gives each weight
        a gradient (zero for clusters the batch never used) instead of none: DistributedDataParallel requires every
        parameter to take part in each step (the training loop builds it without ``find_unused_parameters``), and
        one process and W processes then treat rare clusters alike."""
        return sum(p.reshape(-1)[:1].sum() for p in self.parameters()) * 0.0

    # -- output --------------------------------------------------------------------------------------------------
    def _nll(self, hidden: Tensor, target: Tensor) -> Tensor:
        if self.softmax is None:
            logp = F.log_softmax(F.linear(hidden, self.weight), dim=-1)
            return -logp.gather(1, target.unsqueeze(1)).squeeze(1)
        return -self.softmax(hidden, target).output

    def log_prob(self, hidden: Tensor) -> Tensor:
        """Log-probabilities of every word, (N, E) -> (N, V) float32 (float64 for float64 weights; sums to 1 over V).
        ValueError for 16-bit weights (:meth:`ChunkedNLL._full_precision`)."""
        with torch.autocast(hidden.device.type, enabled=False):
            hidden = self._full_precision(hidden)
            if self.softmax is None:
                return F.log_softmax(F.linear(hidden, self.weight), dim=-1)
            return self.softmax.log_prob(hidden)
