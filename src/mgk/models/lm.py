"""The causal decoder language model of the paper's WikiText-103 experiment (Nguyen et al. 2022, Section 4.2; the
small setting of Schlag et al. 2021): tied adaptive input/softmax, sinusoidal positions, post-LN blocks with a ReLU FFN,
any
attention kind, no memory across segments."""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .adaptive import TiedAdaptiveSoftmax
from .adaptive_authors import AuthorsAdaptiveSoftmax
from .blocks import TransformerBlock
from .config import LMConfig
from .init import check_init, init_lm_paper_

ADAPTIVE_SOFTMAX = {"torch": TiedAdaptiveSoftmax, "authors": AuthorsAdaptiveSoftmax}

__all__ = ["IGNORE_INDEX", "TransformerLM", "sinusoidal_positions"]

IGNORE_INDEX = -100  # a target with this value is not scored


def sinusoidal_positions(length: int, dim: int, *, device=None, dtype=torch.float32) -> Tensor:
    """(length, dim) encodings ``[sin(p w_0), ..., sin(p w_{k-1}), cos(p w_0), ...]`` with
    ``w_i = 10000^(-2i/dim)`` (Vaswani et al. 2017; the sin/cos halves concatenated as in Transformer-XL)."""
    half = (dim + 1) // 2
    inv_freq = torch.exp(torch.arange(half, device=device, dtype=torch.float64) * (-2.0 * math.log(10000.0) / dim))
    angles = torch.arange(length, device=device, dtype=torch.float64).unsqueeze(1) * inv_freq
    return torch.cat([angles.sin(), angles.cos()], dim=1)[:, :dim].to(dtype)


class TransformerLM(nn.Module):
    """Causal decoder LM: ``sqrt(E) * adaptive_input(x) + positions -> dropout -> post-LN blocks -> dropout ->
    adaptive softmax``.

    ``cfg`` (:class:`~mgk.models.config.LMConfig`): ``vocab_size`` V; ``d_model``, ``num_layers``, ``ffn_dim``,
    ``dropout``: E, depth, FFN width (ReLU), dropout on embeddings, residual branches, FFN inner layer and before the
    softmax; ``attention``: every block's (:class:`~mgk.attention.AttentionConfig`), attending causally (the
    authors' LM projections have no biases, ``mem_transformer.py:92-104``); ``cutoffs``, ``div_value``: of the
    adaptive softmax (cutoffs >= V are dropped; see :attr:`notes`); ``adaptive_softmax``: "torch"
    (:class:`TiedAdaptiveSoftmax`, ``nn.AdaptiveLogSoftmaxWithLoss`` with tail projections, no biases) or "authors"
    (:class:`~mgk.models.adaptive_authors.AuthorsAdaptiveSoftmax`: the tied table with per-word and cluster biases,
    no projections, of the paper's code); ``init``: "torch" (module defaults) or "paper" (N(0, 0.02) weights,
    N(1, 0.02) LayerNorm weights: :func:`mgk.models.init.init_lm_paper_`). ValueError naming a bad one.

    ``forward(tokens)`` gives the hidden states (B, L, E); ``forward(tokens, targets)`` the per-position negative
    log-likelihood (B, L) float32 with 0 where ``targets == IGNORE_INDEX`` (those positions skip the softmax, so
    scoring a few positions of a long window is cheap). Go through ``forward`` when training under DDP: with
    gradients enabled it adds :meth:`TiedAdaptiveSoftmax.touch` so that clusters absent from a rank's batch still
    take part in the step.
    """

    def __init__(self, cfg: LMConfig):
        super().__init__()
        if cfg.adaptive_softmax not in ADAPTIVE_SOFTMAX:
            raise ValueError(f"adaptive_softmax must be one of {tuple(ADAPTIVE_SOFTMAX)}, got "
                             f"{cfg.adaptive_softmax!r}")
        check_init(cfg.init)
        self.config = cfg
        self.d_model = cfg.d_model
        cutoffs = None if cfg.cutoffs is None else list(cfg.cutoffs)
        self.adaptive = ADAPTIVE_SOFTMAX[cfg.adaptive_softmax](cfg.vocab_size, cfg.d_model, cutoffs,
                                                               div_value=cfg.div_value)
        self.blocks = nn.ModuleList(
            TransformerBlock(cfg.d_model, cfg.attention, cfg.ffn_dim, cfg.dropout, activation="relu",
                             norm_first=False)
            for _ in range(cfg.num_layers))
        self.drop = nn.Dropout(cfg.dropout)
        self.out_drop = nn.Dropout(cfg.dropout)
        if cfg.init == "paper":
            init_lm_paper_(self)

    @property
    def notes(self) -> list[str]:
        """Log lines about choices made at construction (dropped cutoffs)."""
        return list(self.adaptive.notes)

    @property
    def vocab_size(self) -> int:
        """V, the number of token ids the model embeds and scores."""
        return self.adaptive.vocab_size

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Parameters counted once; ``non_embedding`` leaves out the tied input/output weights."""
        total = sum(p.numel() for p in self.parameters())
        return total - sum(p.numel() for p in self.adaptive.parameters()) if non_embedding else total

    def num_attention_parameters(self) -> int:
        """Parameters of the blocks' attention modules (projections and mixture weights)."""
        return sum(p.numel() for block in self.blocks for p in block.attn.parameters())

    def hidden(self, tokens: Tensor) -> Tensor:
        """Final hidden states (B, L, E) of integer tokens (B, L); position t sees tokens 0..t only."""
        if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"tokens must be an integer tensor of shape (B, L), got {tokens.dtype} "
                             f"{tuple(tokens.shape)}")
        x = self.adaptive.embed(tokens.long())
        x = self.drop(x + sinusoidal_positions(tokens.shape[1], self.d_model, device=x.device, dtype=x.dtype))
        for block in self.blocks:
            x = block(x, is_causal=True)
        return x

    def forward(self, tokens: Tensor, targets: Tensor | None = None) -> Tensor:
        h = self.hidden(tokens)
        if targets is None:
            return h
        if targets.shape != tokens.shape:
            raise ValueError(f"targets {tuple(targets.shape)} must have the shape of tokens {tuple(tokens.shape)}")
        h = self.out_drop(h)
        scored = targets != IGNORE_INDEX
        values = self.adaptive.nll(h[scored], targets[scored].long())
        out = torch.zeros(targets.shape, dtype=values.dtype, device=values.device).masked_scatter(scored, values)
        if torch.is_grad_enabled():  # every tied weight takes part in the step, also rare clusters (DDP)
            out = out + self.adaptive.touch()
        return out

    def log_probs(self, tokens: Tensor) -> Tensor:
        """Log-probabilities of the next token at every position, (B, L, V) float32 (for analysis and tests)."""
        h = self.out_drop(self.hidden(tokens))
        return self.adaptive.log_prob(h.reshape(-1, h.shape[-1])).view(*tokens.shape, -1)
