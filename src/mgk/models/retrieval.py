"""The two-tower matching model of LRA "Retrieval" (Tay et al. 2021, Section 3; Nguyen et al. 2022, Section 4.1):
one shared encoder, head on
``[x0, x1, x0 * x1, x0 - x1]``."""
from __future__ import annotations

import torch
from torch import Tensor

from .lra import PooledEncoder


class RetrievalModel(PooledEncoder):
    """Encode both documents with the same :class:`~mgk.models.lra.LRAEncoder` (shared weights), pool each over its
    real tokens, and classify ``[x0, x1, x0 * x1, x0 - x1]`` (4E) with the MLP ``4E -> classifier_dim -> C``.

    Forward: ``tokens1`` (B, L1), ``padding_mask1`` bool (B, L1) True = padding, ``tokens2`` (B, L2),
    ``padding_mask2`` (B, L2) -> logits (B, num_classes) float. Both documents go through the encoder in one call
    (the shorter is padded to the longer length and masked), so the encoder runs once per batch; padding never
    changes the result (each pair's logits do not depend on the other pairs of its batch).
    pooling: "mean" (over real tokens) or "cls" (first position).
    """

    head_inputs = 4

    def forward(self, tokens1: Tensor, padding_mask1: Tensor | None, tokens2: Tensor,
                padding_mask2: Tensor | None) -> Tensor:
        """Logits (B, num_classes) of the pairs (``tokens1`` (B, L1), ``tokens2`` (B, L2)), int64, with their bool
        padding masks (True = padding, None = none); ValueError unless both are (B, L) with one B."""
        if tokens1.dim() != 2 or tokens2.dim() != 2 or tokens1.shape[0] != tokens2.shape[0]:
            raise ValueError(f"tokens1 and tokens2 must be (B, L) with one B, got {tuple(tokens1.shape)} and "
                             f"{tuple(tokens2.shape)}")
        B, L = tokens1.shape[0], max(tokens1.shape[1], tokens2.shape[1])

        def pad(tokens, mask):
            """``tokens`` (B, l) and its padding mask (all False when None), right-padded to length L with token 0 and
            mask True."""
            if mask is None:
                mask = torch.zeros(tokens.shape, dtype=torch.bool, device=tokens.device)
            extra = L - tokens.shape[1]
            if extra:
                tokens = torch.cat([tokens, tokens.new_zeros(B, extra)], dim=1)
                mask = torch.cat([mask, mask.new_ones(B, extra)], dim=1)
            return tokens, mask

        t1, m1 = pad(tokens1, padding_mask1)
        t2, m2 = pad(tokens2, padding_mask2)
        pooled = self.encode(torch.cat([t1, t2]), torch.cat([m1, m2]))
        x0, x1 = pooled[:B], pooled[B:]
        return self.head(torch.cat([x0, x1, x0 * x1, x0 - x1], dim=-1))
