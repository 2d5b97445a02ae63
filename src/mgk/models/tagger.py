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
        cfg: the encoder's :class:`~mgk.models.config.EncoderConfig` (``vocab_size``, ``max_len``, ``d_model``,
            ``num_layers``, ``ffn_dim``, ``dropout``, ``attention``; ``num_classes`` classes at each position;
            ``init`` "torch" or "paper", embeddings from N(0, 0.02): :func:`mgk.models.init.init_lra_paper_`). Its
            pooling and classifier-MLP fields do not apply.
        causal: position t attends to positions <= t only (``is_causal=True`` in every block).

    Forward: tokens (B, L) int64, padding_mask bool (B, L) True = padding (or None) -> logits (B, L, num_classes)
    float. ValueError for a longer input than ``max_len`` (from the encoder).
    """

    def __init__(self, cfg: EncoderConfig, *, causal: bool = True):
        super().__init__()
        check_init(cfg.init)
        self.config = cfg
        self.causal = bool(causal)
        self.encoder = LRAEncoder(cfg)
        self.head = nn.Linear(cfg.d_model, cfg.num_classes)
        if cfg.init == "paper":
            init_lra_paper_(self)

    def num_attention_parameters(self) -> int:
        """Parameters of the encoder blocks' attention modules (projections and mixture weights)."""
        return sum(p.numel() for block in self.encoder.blocks for p in block.attn.parameters())

    def forward(self, tokens: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        """Logits (B, L, num_classes) of ``tokens`` (B, L) int64 with ``padding_mask`` bool (B, L), True = padding
        (or None); causal when the tagger is. ValueError for a longer input than ``max_len``."""
        return self.head(self.encoder(tokens, padding_mask, is_causal=self.causal))
