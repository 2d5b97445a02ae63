"""The adaptive input and softmax of the paper's WikiText-103 code at ``div_val`` 1 (Grave et al. 2017; Baevski &
Auli 2019; the Transformer-XL ``ProjectedAdaptiveLogSoftmax`` that the authors' ``lmtool-fwms`` uses, file
``utils/proj_adaptive_softmax.py``).

Weights (one set, tied between input and output):

- ``weight`` (V, E): the embedding of every word, also its output vector;
- ``bias`` (V,): a per-word output bias;
- ``cluster_weight`` (n_clusters, E), ``cluster_bias`` (n_clusters,): the head's scores of the tail clusters.

There are no projections (at ``div_val`` 1 every cluster has the full width E). The head scores the shortlist words
``0 .. cutoffs[0]-1`` and the clusters; cluster i (1-based) is the head column ``head_size - i``, i.e. the *last*
cluster row belongs to the first tail cluster, as in the authors' code (``proj_adaptive_softmax.py:140-145``), so
their weights load row for row. A word w of cluster i gets
``log p(w) = log p_head(cluster i) + log_softmax(h W[lo:hi]^T + bias[lo:hi])[w - lo]``.

Compared with :class:`mgk.models.adaptive.TiedAdaptiveSoftmax` (``nn.AdaptiveLogSoftmaxWithLoss``, a projection
per tail cluster, no biases) this has V + 2 n_clusters more parameters and no tail projections: 34,538,202
parameters at V = 267,735, E = 128 (the authors' count).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .adaptive import ChunkedNLL

__all__ = ["AuthorsAdaptiveSoftmax"]


class AuthorsAdaptiveSoftmax(ChunkedNLL, nn.Module):
    """Tied adaptive input / adaptive log-softmax with per-word biases and cluster biases (module docstring).

    Args:
        vocab_size: V (word ids 0 .. V-1, most frequent first).
        dim: model width E.
        cutoffs: cluster boundaries (default [20000, 40000, 200000]); those >= V are dropped and noted.
        div_value: must be 1 (the only setting of the authors' runs); ValueError otherwise.
        scale_embedding: multiply input embeddings by sqrt(E).
        chunk: under ``torch.no_grad`` the output layer runs on at most this many positions at a time.

    Same methods as :class:`~mgk.models.adaptive.TiedAdaptiveSoftmax`: :meth:`embed`, :meth:`nll`,
    :meth:`log_prob`, :meth:`touch`.
    """

    def __init__(self, vocab_size: int, dim: int, cutoffs=None, *, div_value: float = 1.0,
                 scale_embedding: bool = True, chunk: int = 8192):
        super().__init__()
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        if float(div_value) != 1.0:
            raise ValueError(f"adaptive_softmax='authors' has full-width clusters only (div_val 1), got "
                             f"div_value={div_value}; use adaptive_softmax='torch' for narrower clusters")
        kept = self._set_sizes(vocab_size, dim, cutoffs, scale_embedding, chunk)
        n = len(kept)
        bound = 1 / math.sqrt(dim)  # as nn.Linear(dim, V); init="paper" re-draws from N(0, 0.02)
        self.weight = nn.Parameter(torch.empty(vocab_size, dim).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.zeros(vocab_size))
        self.cluster_weight = nn.Parameter(torch.empty(n, dim).uniform_(-bound, bound))
        self.cluster_bias = nn.Parameter(torch.zeros(n))

    @property
    def bounds(self) -> list[int]:
        """[0, cutoffs..., V]: cluster c (0 = head shortlist) holds words ``bounds[c] .. bounds[c+1]-1``."""
        return [0, *self.cutoffs, self.vocab_size]

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, dim={self.dim}, cutoffs={self.cutoffs}, scale={self.scale:.4g}"

    def embed(self, tokens: Tensor) -> Tensor:
        """Embeddings of integer ids of any shape -> (*shape, E), the weights' dtype; IndexError out of range."""
        flat = tokens.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.vocab_size):
            raise IndexError(f"token ids must be in [0, {self.vocab_size}), got [{int(flat.min())}, "
                             f"{int(flat.max())}]")
        return F.embedding(tokens, self.weight) * self.scale

    def touch(self) -> Tensor:
        """A zero scalar depending on every weight (see :meth:`TiedAdaptiveSoftmax.touch`: DDP needs every
        parameter in each step, also clusters the batch never used)."""
        return sum(p.reshape(-1)[:1].sum() for p in self.parameters()) * 0.0

    def _head_logprob(self, hidden: Tensor) -> Tensor:
        """(N, shortlist + n_clusters) log-probabilities of the head."""
        short = self.bounds[1]
        weight = torch.cat([self.weight[:short], self.cluster_weight])
        bias = torch.cat([self.bias[:short], self.cluster_bias])
        return F.log_softmax(F.linear(hidden, weight, bias), dim=-1)

    def _cluster_logprob(self, hidden: Tensor, c: int) -> Tensor:
        """(N, size_c) log-probabilities within tail cluster ``c`` (1-based)."""
        lo, hi = self.bounds[c], self.bounds[c + 1]
        return F.log_softmax(F.linear(hidden, self.weight[lo:hi], self.bias[lo:hi]), dim=-1)

    def _nll(self, hidden: Tensor, target: Tensor) -> Tensor:
        head = self._head_logprob(hidden)
        bounds, width = self.bounds, head.shape[1]
        out = torch.zeros(target.shape, dtype=head.dtype, device=head.device)
        for c in range(len(bounds) - 1):
            rows = ((target >= bounds[c]) & (target < bounds[c + 1])).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            local = target.index_select(0, rows) - bounds[c]
            if c == 0:
                logp = head.index_select(0, rows).gather(1, local.unsqueeze(1)).squeeze(1)
            else:
                inner = self._cluster_logprob(hidden.index_select(0, rows), c)
                logp = head[rows, width - c] + inner.gather(1, local.unsqueeze(1)).squeeze(1)
            out = out.index_copy(0, rows, -logp)
        return out

    def log_prob(self, hidden: Tensor) -> Tensor:
        """Log-probabilities of every word, (N, E) -> (N, V) float32 (float64 for float64 weights; sums to 1 over V).
        ValueError for 16-bit weights (:meth:`ChunkedNLL._full_precision`)."""
        with torch.autocast(hidden.device.type, enabled=False):
            hidden = self._full_precision(hidden)
            head = self._head_logprob(hidden)
            bounds, width = self.bounds, head.shape[1]
            parts = [head[:, :bounds[1]]]
            for c in range(1, len(bounds) - 1):
                parts.append(head[:, width - c:width - c + 1] + self._cluster_logprob(hidden, c))
            return torch.cat(parts, dim=1)
