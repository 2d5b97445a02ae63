"""A token classifier: the LRA encoder with a linear read-out at every position, causal or not (the model of the
multi-query associative recall tasks, which Zoology, Arora et al. 2023, trains as a causal sequence model scored at
the answer positions only)."""
from __future__ import annotations

from torch import Tensor, nn

from .config import EncoderConfig
from .init import check_init, init_lra_paper_
from .lra import LRAEncoder


class TokenTagger(nn.Module):
    """:class:`~mgk.models.lra.LRAEncoder` (token + learned position embeddings, pre-LN blocks, final LayerNorm) and
    ``Linear(E, num_classes)`` at every position.

    Args:
        vocab_size, num_classes, max_len: embedding sizes and the classes of each position.
        causal: position t attends to positions <= t only (``is_causal=True`` in every block).
        init: "torch" or "paper" (embeddings from N(0, 0.02): :func:`mgk.models.init.init_lra_paper_`).
        encoder_kwargs: of :class:`~mgk.models.lra.LRAEncoder` (d_model, num_layers, attention, num_heads, ...).

    Forward: tokens (B, L) int64, padding_mask bool (B, L) True = padding (or None) -> logits (B, L, num_classes)
    float. ValueError for a longer input than ``max_len`` (from the encoder).
    """

    def __init__(self, vocab_size: int, num_classes: int, max_len: int, *, causal: bool = True, init: str = "torch",
                 **encoder_kwargs):
        super().__init__()
        check_init(init)
        self.causal = bool(causal)
        self.encoder = LRAEncoder(vocab_size, max_len, **encoder_kwargs)
        self.head = nn.Linear(self.encoder.token_embedding.embedding_dim, num_classes)
        if init == "paper":
            init_lra_paper_(self)

    @classmethod
    def from_config(cls, cfg: EncoderConfig, *, causal: bool = True) -> "TokenTagger":
        """The model of ``cfg`` (pooling and the classifier MLP fields of the config do not apply)."""
        a = cfg.attention
        return cls(cfg.vocab_size, cfg.num_classes, cfg.max_len, causal=causal, init=cfg.init, d_model=cfg.d_model,
                   num_layers=cfg.num_layers, ffn_dim=cfg.ffn_dim, attention=a.kind, num_heads=a.num_heads,
                   head_dim=a.head_dim, dropout=cfg.dropout, attn_dropout=a.dropout,
                   attention_options=dict(a.options), attn_bias=a.bias)

    def num_attention_parameters(self) -> int:
        """Parameters of the encoder blocks' attention modules (projections and mixture weights)."""
        return sum(p.numel() for block in self.encoder.blocks for p in block.attn.parameters())

    def forward(self, tokens: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        return self.head(self.encoder(tokens, padding_mask, is_causal=self.causal))
