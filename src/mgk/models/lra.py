"""The LRA encoder classifier of the paper (Nguyen et al. 2022, Section 4.1: the model setting of Nystromformer,
Xiong et al. 2021)."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..attention import build_attention
from ..attention.registry import attention_options
from .blocks import TransformerBlock
from .config import EncoderConfig
from .init import check_init, init_lra_paper_

CLASSIFIER_ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU}


def masked_mean(x: Tensor, padding_mask: Tensor | None) -> Tensor:
    """Mean over real positions: x (B, L, E), padding_mask bool (B, L) True = padding -> (B, E).

    Uses ``where`` so that padded content (even NaN) cannot reach the result; a row with no real token gives 0."""
    if padding_mask is None:
        return x.mean(dim=1)
    real = ~padding_mask
    total = torch.where(real.unsqueeze(-1), x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(dim=1)
    return total / real.sum(dim=1, keepdim=True).clamp_min(1).to(x.dtype)


class LRAEncoder(nn.Module):
    """Token + learned position embeddings, pre-LN blocks, final LayerNorm: tokens (B, L) -> (B, L, E).

    Args:
        vocab_size, max_len: embedding sizes; a longer input raises ValueError naming both lengths.
        attention: attention kind for :func:`mgk.attention.build_attention` ("softmax", "mgk", "smgk", ...).
        num_heads, head_dim: H and D (attention width H * D, independent of d_model).
        attention_options: passed to the attention kind (num_keys, pi, pi_shape, sigma2, max_len).
        attn_bias: whether the attention projections have biases (they do in the authors' LRA code,
            ``lra/attention.py:256-258``).
    """

    def __init__(self, vocab_size: int, max_len: int, *, d_model: int = 64, num_layers: int = 2, ffn_dim: int = 128,
                 attention: str = "softmax", num_heads: int = 2, head_dim: int = 32, dropout: float = 0.1,
                 attn_dropout: float = 0.1, attention_options: dict | None = None, attn_bias: bool = True):
        super().__init__()
        self.max_len = max_len
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(max_len, d_model)
        opts = dict(attention_options or {})
        if "max_len" in _options_of(attention):  # per-position mixture weights cover the input length
            opts.setdefault("max_len", max_len)
        self.blocks = nn.ModuleList(
            TransformerBlock(d_model, build_attention(attention, d_model, num_heads, head_dim=head_dim,
                                                      dropout=attn_dropout, bias=attn_bias, **opts),
                             ffn_dim, dropout)
            for _ in range(num_layers))
        self.drop = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, tokens: Tensor, padding_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        """tokens (B, L) int64/int32, padding_mask bool (B, L) True = padding -> (B, L, E); ``is_causal``: position
        t attends to positions <= t only (every block)."""
        if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"tokens must be an integer tensor of shape (B, L), got {tokens.dtype} "
                             f"{tuple(tokens.shape)}")
        L = tokens.shape[1]
        if L > self.max_len:
            raise ValueError(f"input length {L} exceeds the model's max_len={self.max_len}")
        pos = torch.arange(L, device=tokens.device)
        x = self.drop(self.token_embedding(tokens) + self.position_embedding(pos))
        for block in self.blocks:
            x = block(x, key_padding_mask=padding_mask, is_causal=is_causal)
        return self.norm(x)


def _options_of(kind: str) -> dict:
    return attention_options(kind)


class PooledEncoder(nn.Module):
    """:class:`LRAEncoder` plus pooling that ignores padding, and an MLP head ``head_inputs * E -> classifier_dim ->
    num_classes``; subclasses decide what the head sees. pooling "mean" (over real tokens) or "cls" (first position).
    ``classifier_activation`` "gelu" or "relu" (the authors' LRA head, ``lra/model_wrapper.py:35-39``); ``init``
    "torch" (module defaults) or "paper" (embeddings from N(0, 0.02): :func:`mgk.models.init.init_lra_paper_`).
    """

    head_inputs = 1

    def __init__(self, vocab_size: int, num_classes: int, max_len: int, *, pooling: str = "mean",
                 classifier_dim: int = 128, classifier_activation: str = "gelu", init: str = "torch",
                 **encoder_kwargs):
        super().__init__()
        if pooling not in ("mean", "cls"):
            raise ValueError(f"pooling must be 'mean' or 'cls', got {pooling!r}")
        if classifier_activation not in CLASSIFIER_ACTIVATIONS:
            raise ValueError(f"classifier_activation must be one of {tuple(CLASSIFIER_ACTIVATIONS)}, got "
                             f"{classifier_activation!r}")
        check_init(init)
        self.pooling = pooling
        self.encoder = LRAEncoder(vocab_size, max_len, **encoder_kwargs)
        d_model = self.encoder.token_embedding.embedding_dim
        self.head = nn.Sequential(nn.Linear(self.head_inputs * d_model, classifier_dim),
                                  CLASSIFIER_ACTIVATIONS[classifier_activation](),
                                  nn.Linear(classifier_dim, num_classes))
        if init == "paper":
            init_lra_paper_(self)

    @classmethod
    def from_config(cls, cfg: EncoderConfig) -> "PooledEncoder":
        """The model of ``cfg`` (:class:`mgk.models.config.EncoderConfig`)."""
        a = cfg.attention
        return cls(cfg.vocab_size, cfg.num_classes, cfg.max_len, pooling=cfg.pooling, classifier_dim=cfg.classifier_dim,
                   d_model=cfg.d_model, num_layers=cfg.num_layers, ffn_dim=cfg.ffn_dim, attention=a.kind,
                   num_heads=a.num_heads, head_dim=a.head_dim, dropout=cfg.dropout, attn_dropout=a.dropout,
                   attention_options=dict(a.options), attn_bias=a.bias,
                   classifier_activation=cfg.classifier_activation, init=cfg.init)

    def num_attention_parameters(self) -> int:
        """Parameters of the encoder blocks' attention modules (projections and mixture weights)."""
        return sum(p.numel() for block in self.encoder.blocks for p in block.attn.parameters())

    def encode(self, tokens: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        """Pooled vectors (B, E) of tokens (B, L) with padding_mask bool (B, L) True = padding."""
        h = self.encoder(tokens, padding_mask)
        return h[:, 0] if self.pooling == "cls" else masked_mean(h, padding_mask)


class LRAClassifier(PooledEncoder):
    """Encoder, pooling that ignores padding, and the MLP head ``E -> classifier_dim -> num_classes``.

    Forward: tokens (B, L) int64, padding_mask bool (B, L) True = padding (taken from the data's lengths, never from
    a token value) -> logits (B, num_classes) float.
    """

    def forward(self, tokens: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        return self.head(self.encode(tokens, padding_mask))
