"""The kind "gqa": grouped-query attention (Ainslie et al., "GQA: Training Generalized Multi-Query Transformer Models
from Multi-Head Checkpoints", EMNLP 2023) and, with one key/value head, multi-query attention (Shazeer, "Fast
Transformer Decoding: One Write-Head is All You Need", 2019): the baselines users pick today for fewer key/value
heads and a smaller decoding cache. Its module, options, FLOPs, cache layout, conversion rule and registration.

H query heads share G key/value heads (G divides H): query head h attends with key/value head h // (H / G);
otherwise it is softmax attention (:func:`mgk.functional.softmax_attention`, which reads the G heads through SDPA's
own grouped path). Per layer, with width d = H * D and no biases: attention parameters ``d D (2 H + 2 G)``; a
decoding cache stores ``2 G D`` numbers per token.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ..fields import Label, spec
from .base import positive_int
from .registry import AttentionKind, CacheSpec, Options, register, total
from .softmax import MultiheadAttention

__all__ = ["GQAOptions", "GroupedQueryAttention", "gqa_flops"]


@dataclass(frozen=True)
class GQAOptions(Options):
    """Grouped-query attention: the number of key/value heads."""

    num_kv_heads: int | None = spec(
        None, ge=1, label=Label(short="kv{value}"),
        doc="G, key/value heads, each shared by H / G query heads (G must divide num_heads; 1 is multi-query "
            "attention); None: G = H, multi-head attention")


class GroupedQueryAttention(MultiheadAttention):
    """Softmax attention whose H query heads share G key/value heads (GQA; MQA for G = 1), a drop-in for
    ``nn.MultiheadAttention`` like :class:`mgk.attention.softmax.MultiheadAttention`.

    Args:
        embed_dim, num_heads, head_dim, dropout, bias, kdim, vdim, batch_first, device, dtype: as
            :class:`mgk.attention.base.AttentionBase`; num_heads is H, the query heads.
        num_kv_heads: G, key and value heads (default None: G = H, which is multi-head softmax attention with the
            same parameter names, so a softmax layer's state dict loads as is). Query head h reads key/value
            head h // (H / G).
        options: a :class:`GQAOptions` (its one field is ``num_kv_heads``) or None; keywords given with it must
            agree with it, as :meth:`mgk.attention.registry.Options.merged` rules: a keyword that differs is a
            ValueError naming both values, options of another type a TypeError. ``num_kv_heads=None``, its
            default, counts as not given.

    ``k_proj`` and ``v_proj`` have width G * D; a decoding cache (:meth:`new_cache`) stores G heads of keys and
    values, never the H expanded ones. :func:`mgk.swap_attention` converts a multi-head layer by mean-pooling the key
    and value projections of each group of H / G heads (Ainslie et al. 2023, Section 2.1), exact for G = H.

    Raises:
        ValueError naming ``num_kv_heads`` when it is not a positive int dividing num_heads, or when it and
        ``options`` are both given and disagree; TypeError for ``options`` of another type.
    """

    def __init__(self, embed_dim: int, num_heads: int, *, num_kv_heads: int | None = None,
                 options: GQAOptions | None = None, **kwargs):
        # None is the keyword's default: only a number given with options can disagree with them
        options = GQAOptions.merged(options, {} if num_kv_heads is None else {"num_kv_heads": num_kv_heads})
        G = options.num_kv_heads
        self._num_kv_heads = None if G is None else positive_int(G, "num_kv_heads")
        if G is not None and isinstance(num_heads, int) and num_heads % G:
            raise ValueError(f"num_kv_heads={G} must divide num_heads={num_heads} (each key/value head serves "
                             "num_heads / num_kv_heads query heads)")
        super().__init__(embed_dim, num_heads, **kwargs)

    @property
    def kv_heads(self) -> int:
        """G, the key/value heads."""
        return self.num_heads if self._num_kv_heads is None else self._num_kv_heads

    @property
    def num_kv_heads(self) -> int:
        """G, the key/value heads (``kv_heads``)."""
        return self.kv_heads

    def _groups(self, t: Tensor) -> Tensor:
        """A projection's weight (G*D, in) or bias (G*D,) as (G, D, ...)."""
        return t.reshape(self.kv_heads, self.head_dim, *t.shape[1:])

    def per_head_projections(self) -> dict[str, Tensor]:
        """The projections as a multi-head layer's: each key/value head repeated for the H / G query heads it
        serves (exactly this layer's function)."""
        out = super().per_head_projections()
        repeat = self.num_heads // self.kv_heads
        for name in [n for n in out if n.startswith(("k_proj.", "v_proj."))]:
            out[name] = self._groups(out[name]).repeat_interleave(repeat, dim=0).flatten(0, 1)
        return out

    def load_projections(self, weights: dict[str, Tensor]) -> dict[str, Tensor]:
        """Ainslie et al.'s conversion of a multi-head layer: query and output projections copied, each group's key
        and value projections the mean of its H / G heads' (G = H: copied exactly)."""
        H, G, D = self.num_heads, self.kv_heads, self.head_dim
        pooled = dict(weights)
        for name in [n for n in weights if n.startswith(("k_proj.", "v_proj."))]:
            t = weights[name]
            pooled[name] = t.reshape(G, H // G, D, *t.shape[1:]).mean(dim=1).flatten(0, 1)
        return super().load_projections(pooled)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", num_kv_heads={self.kv_heads}"


def gqa_flops(options, *, heads: int, length: int, batch: int, embed_dim: int, head_dim: int, causal: bool,
              backward: bool, mixture_kernel: bool = False) -> int:
    """FLOPs of one call (:func:`mgk.attention.registry.total`): the query and output projections of width H * D, the
    key and value projections of width G * D, and softmax's ``4 N S D`` per query head; ``mixture_kernel`` unused."""
    G = options.num_kv_heads or heads
    core = 4 * length * length * head_dim * (0.5 if causal else 1.0)
    return total(core, 2 + 2 * G / heads, heads=heads, length=length, batch=batch, embed_dim=embed_dim,
                 head_dim=head_dim, backward=backward)


def _display(num_heads: int, options: GQAOptions) -> str:
    """"MQA x 8" for one key/value head, "GQA x 8 (kv 2)" for G of them, "GQA x 8" for G = H by default."""
    G = options.num_kv_heads
    if G == 1:
        return f"MQA x {num_heads}"
    return f"GQA x {num_heads}" + ("" if G is None else f" (kv {G})")


register(AttentionKind("gqa", "softmax", "GQA", GQAOptions, GroupedQueryAttention, gqa_flops,
                       CacheSpec(keys_per_token=1, heads="num_kv_heads"), ({}, {"num_kv_heads": 1}),
                       display=_display))
