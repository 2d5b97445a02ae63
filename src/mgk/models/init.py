"""Weight initialisation: ``init="torch"`` keeps PyTorch's module defaults; ``init="paper"`` is the authors'.

The authors' released code (github minhtannguyen/transformer-mgk) initialises

- the WikiText-103 LM (``language-modeling/lmtool-fwms/src/train.py``, ``weights_init`` with the defaults
  ``--init normal --init_std 0.02``): every Linear and Embedding weight from N(0, 0.02), biases 0, LayerNorm
  weights from N(1, 0.02) and biases 0, the adaptive softmax's cluster weights from N(0, 0.02) and its biases 0;
  parameters of other kinds (the mixture weights) keep their own initial values;
- the LRA encoder (``lra/model.py:20-24``): only the word and position embeddings, from N(0, 0.02); every other
  layer keeps PyTorch's default.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["INITS", "PAPER_STD", "init_lm_paper_", "init_lra_paper_", "check_init"]

INITS = ("torch", "paper")
PAPER_STD = 0.02


def check_init(init: str) -> str:
    """``init`` if it is one of :data:`INITS`; ValueError naming the argument otherwise."""
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    return init


@torch.no_grad()
def init_lm_paper_(model: nn.Module) -> nn.Module:
    """The authors' LM initialisation, in place (module docstring). Returns ``model``."""
    from .adaptive_authors import AuthorsAdaptiveSoftmax

    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, PAPER_STD)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            if module.weight is not None:
                nn.init.normal_(module.weight, 1.0, PAPER_STD)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, AuthorsAdaptiveSoftmax):
            nn.init.normal_(module.weight, 0.0, PAPER_STD)
            nn.init.zeros_(module.bias)
            nn.init.normal_(module.cluster_weight, 0.0, PAPER_STD)
            nn.init.zeros_(module.cluster_bias)
    adaptive = getattr(model, "adaptive", None)
    if getattr(adaptive, "softmax", 1) is None and isinstance(getattr(adaptive, "weight", None), nn.Parameter):
        nn.init.normal_(adaptive.weight, 0.0, PAPER_STD)  # the plain tied table (no cutoffs below V)
    return model


@torch.no_grad()
def init_lra_paper_(model: nn.Module) -> nn.Module:
    """The authors' LRA initialisation, in place: every Embedding from N(0, 0.02). Returns ``model``."""
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, PAPER_STD)
    return model
