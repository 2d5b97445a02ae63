"""The LRA encoder classifier of the paper (Nguyen et al. 2022, Section 4.1: the model setting of Nystromformer,
Xiong et al. 2021)."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .blocks import TransformerBlock
from .config import EncoderConfig
from .init import check_init, init_lra_paper_

CLASSIFIER_ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU}
POOLINGS = ("mean", "cls")


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

    ``cfg`` (:class:`~mgk.models.config.EncoderConfig`): ``vocab_size`` and ``max_len`` size the embeddings (a longer
    input raises ValueError naming both lengths); ``d_model``, ``num_layers``, ``ffn_dim``, ``dropout`` the blocks,
    each with the attention of ``cfg.attention`` (its width H * D independent of d_model; the authors' LRA
    projections have biases, ``lra/attention.py:256-258``).
    """

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.max_len = cfg.max_len
        self.token_embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.position_embedding = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(TransformerBlock(cfg.d_model, cfg.attention, cfg.ffn_dim, cfg.dropout)
                                    for _ in range(cfg.num_layers))
        self.drop = nn.Dropout(cfg.dropout)
        self.norm = nn.LayerNorm(cfg.d_model)

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


class PooledEncoder(nn.Module):
    """:class:`LRAEncoder` plus pooling that ignores padding, and an MLP head ``head_inputs * E -> classifier_dim ->
    num_classes``; subclasses decide what the head sees. ``cfg.pooling`` "mean" (over real tokens) or "cls" (first
    position); ``cfg.classifier_activation`` "gelu" or "relu" (the authors' LRA head, ``lra/model_wrapper.py:35-39``);
    ``cfg.init`` "torch" (module defaults) or "paper" (embeddings from N(0, 0.02):
    :func:`mgk.models.init.init_lra_paper_`). ValueError naming a bad one.
    """

    head_inputs = 1

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        if cfg.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {cfg.pooling!r}")
        if cfg.classifier_activation not in CLASSIFIER_ACTIVATIONS:
            raise ValueError(f"classifier_activation must be one of {tuple(CLASSIFIER_ACTIVATIONS)}, got "
                             f"{cfg.classifier_activation!r}")
        check_init(cfg.init)
        self.config = cfg
        self.pooling = cfg.pooling
        self.encoder = LRAEncoder(cfg)
        self.head = nn.Sequential(nn.Linear(self.head_inputs * cfg.d_model, cfg.classifier_dim),
                                  CLASSIFIER_ACTIVATIONS[cfg.classifier_activation](),
                                  nn.Linear(cfg.classifier_dim, cfg.num_classes))
        if cfg.init == "paper":
            init_lra_paper_(self)

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
        """Logits (B, num_classes) of ``tokens`` (B, L) int64 with ``padding_mask`` bool (B, L), True = padding."""
        return self.head(self.encode(tokens, padding_mask))
