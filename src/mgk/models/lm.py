"""The causal decoder language model of the paper's WikiText-103 experiment (Nguyen et al. 2022, Section 4.2; the
small setting of Schlag et al. 2021): tied adaptive input/softmax, sinusoidal positions, post-LN blocks with a ReLU FFN,
any
attention kind, no memory across segments."""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..attention import build_attention
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

    Args:
        vocab_size: V.
        d_model, num_layers, ffn_dim, dropout: E, depth, FFN width (ReLU), dropout on embeddings, residual
            branches, FFN inner layer and before the softmax.
        attention, num_heads, head_dim, attn_dropout, attention_options: passed to
            :func:`mgk.attention.build_attention` (options: num_keys, pi, pi_shape, sigma2, max_len); every block
            attends causally (``is_causal=True``).
        cutoffs, div_value: of the adaptive softmax (cutoffs >= V are dropped; see :attr:`notes`).
        adaptive_softmax: "torch" (:class:`TiedAdaptiveSoftmax`, ``nn.AdaptiveLogSoftmaxWithLoss`` with tail
            projections, no biases) or "authors" (:class:`~mgk.models.adaptive_authors.AuthorsAdaptiveSoftmax`:
            the tied table with per-word and cluster biases, no projections, of the paper's code).
        attn_bias: whether the attention projections have biases (the authors' LM projections have none,
            ``mem_transformer.py:92-104``).
        init: "torch" (module defaults) or "paper" (N(0, 0.02) weights, N(1, 0.02) LayerNorm weights:
            :func:`mgk.models.init.init_lm_paper_`).

    ``forward(tokens)`` gives the hidden states (B, L, E); ``forward(tokens, targets)`` the per-position negative
    log-likelihood (B, L) float32 with 0 where ``targets == IGNORE_INDEX`` (those positions skip the softmax, so
    scoring a few positions of a long window is cheap). Go through ``forward`` when training under DDP: with
    gradients enabled it adds :meth:`TiedAdaptiveSoftmax.touch` so that clusters absent from a rank's batch still
    take part in the step.
    """

    def __init__(self, vocab_size: int, *, d_model: int = 128, num_layers: int = 16, ffn_dim: int = 2048,
                 attention: str = "softmax", num_heads: int = 8, head_dim: int | None = 16, dropout: float = 0.1,
                 attn_dropout: float = 0.0, attention_options: dict | None = None, cutoffs=None,
                 div_value: float = 1.0, adaptive_softmax: str = "torch", attn_bias: bool = True,
                 init: str = "torch"):
        super().__init__()
        if adaptive_softmax not in ADAPTIVE_SOFTMAX:
            raise ValueError(f"adaptive_softmax must be one of {tuple(ADAPTIVE_SOFTMAX)}, got {adaptive_softmax!r}")
        check_init(init)
        self.d_model = d_model
        self.adaptive = ADAPTIVE_SOFTMAX[adaptive_softmax](vocab_size, d_model, cutoffs, div_value=div_value)
        opts = dict(attention_options or {})
        self.blocks = nn.ModuleList(
            TransformerBlock(d_model, build_attention(attention, d_model, num_heads, head_dim=head_dim,
                                                      dropout=attn_dropout, bias=attn_bias, **opts),
                             ffn_dim, dropout, activation="relu", norm_first=False)
            for _ in range(num_layers))
        self.drop = nn.Dropout(dropout)
        self.out_drop = nn.Dropout(dropout)
        if init == "paper":
            init_lm_paper_(self)

    @classmethod
    def from_config(cls, cfg: LMConfig) -> "TransformerLM":
        """The model of ``cfg`` (:class:`mgk.models.config.LMConfig`)."""
        a = cfg.attention
        return cls(cfg.vocab_size, d_model=cfg.d_model, num_layers=cfg.num_layers, ffn_dim=cfg.ffn_dim,
                   attention=a.kind, num_heads=a.num_heads, head_dim=a.head_dim, dropout=cfg.dropout,
                   attn_dropout=a.dropout, attention_options=dict(a.options),
                   cutoffs=None if cfg.cutoffs is None else list(cfg.cutoffs), div_value=cfg.div_value,
                   adaptive_softmax=cfg.adaptive_softmax, attn_bias=a.bias, init=cfg.init)

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
