"""The kinds "linear", "mlk" and "smlk": multi-head linear attention (Katharopoulos et al. 2020) and attention with a
mixture of linear keys (Nguyen et al. 2022, eq. 14), their options, FLOPs, recurrent cache and registration."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn

from ..fields import Label, spec
from ..functional.linear import EPS_MODES, FEATURE_MAPS, MIX, NORMALIZE, linear_attention, linear_form, mlk_attention
from ..functional.linear_cache import LinearCacheState
from . import module_masks
from .base import AttentionBase, factory_kwargs
from .mixture_keys import PI_LABEL, PI_MODES, MixtureKeys, MixtureKeysMixin, MixtureOptions, split_options
from .registry import AttentionKind, CacheSpec, Options, register, total

__all__ = ["LinearAttention", "LinearOptions", "MLKAttention", "MLKMixtureOptions", "MLKOptions", "linear_flops",
           "mlk_flops"]


@dataclass(frozen=True)
class LinearOptions(Options):
    """The form of linear attention (:func:`mgk.functional.linear_attention`; defaults = Katharopoulos et al. 2020,
    eq. 6)."""

    normalize: str = spec("row", choices=NORMALIZE,
                          doc="'row' (eq. 6 denominator), 'length' (the authors' LRA scale by L^(-1/4)) or 'none'")
    feature_map: str = spec("elu", choices=FEATURE_MAPS, label=Label(),
                            doc="'elu' (elu + 1) or 'elu_sum' (elu + 1 divided by its sum, the authors' LM)")
    output_scale: float = spec(1.0, gt=0, doc="factor on the output (the authors' LM: 1 / sqrt(head_dim))")
    eps: float = spec(1e-6, ge=0, doc="the denominator's eps (the authors' LM: 1e-5 with eps_mode 'add')")
    eps_mode: str = spec("guard", choices=EPS_MODES,
                         doc="'guard' (eps replaces a zero denominator) or 'add' (denominator + eps)")


@dataclass(frozen=True)
class MLKMixtureOptions(MixtureOptions):
    """The mixture keys of MLK: learned weights only, and where the mixture is taken."""

    pi: str = spec("learned", choices=("learned",), label=PI_LABEL,
                   why="MLK's weights are learned, pi='learned'; Soft-E and Hard-E are MGK ablations built on the "
                       "Gaussian kernel", doc="mixture weights: 'learned' only")
    mix: str = spec("features", choices=MIX, label=Label(),
                    doc="'features' (eq. 14: sum_r pi_r phi(k_r)) or 'keys' (phi(sum_r pi_r k_r), the authors' LRA)")


@dataclass(frozen=True)
class MLKOptions(LinearOptions, MLKMixtureOptions):
    """MLK / sMLK (Nguyen et al. 2022, eq. 14): the mixture keys (:class:`MLKMixtureOptions`) and the linear form
    (:class:`LinearOptions`)."""


class _KeyMasksOnly:
    """Linear attention sums over keys once for all queries, so masks can remove keys (padding) or apply the
    causal order, nothing that varies per query; float masks only as 0 / -inf (there are no logits to bias)."""

    _takes_bias = False

    def _attn_mask_hook(self, attn_mask, is_causal: bool, L: int, S: int):
        # The causal mask is the only query-dependent mask linear attention can compute (as is_causal): recognised
        # inside a compile trace too, at the cost of a graph break there.
        return module_masks.causal_hint(attn_mask, is_causal, L, S)


class _FormOptions:
    """The form options of linear and MLK attention (:func:`mgk.functional.linear_attention`), checked once."""

    def _set_form(self, options, mix="features") -> None:
        eps, output_scale, feature_map = options.eps, options.output_scale, options.feature_map
        linear_form(eps=eps, feature_map=feature_map, normalize=options.normalize, output_scale=output_scale,
                    eps_mode=options.eps_mode, mix=mix)  # ValueError naming a bad option, at construction
        self.eps, self.output_scale = float(eps), float(output_scale)
        self.normalize, self.feature_map, self.eps_mode = options.normalize, feature_map, options.eps_mode
        self.mix = mix

    def _form_kwargs(self) -> dict:
        return {"eps": self.eps, "normalize": self.normalize, "feature_map": self.feature_map,
                "output_scale": self.output_scale, "eps_mode": self.eps_mode}

    @property
    def feature_map_fn(self):
        """The feature map phi this module applies, a callable (..., D) -> (..., D') resolved from its option: pass
        it as ``feature_map=`` to :mod:`mgk.functional` (or pass :attr:`feature_map` itself)."""
        return linear_form(**self._form_kwargs()).feature_map

    cache_slots: dict[str, int] = {}  # no per-token entries: a recurrent state of fixed size (LinearCacheState)

    def _decoding_state(self, capacity: int | None) -> LinearCacheState:
        """A recurrent state of fixed size (:class:`mgk.functional.LinearCacheState`)."""
        return LinearCacheState(capacity, layout=self.cache_layout)

    def _form_repr(self) -> str:
        fm = self.feature_map
        fm = fm if isinstance(fm, str) else getattr(fm, "__name__", "callable")
        return (f", normalize={self.normalize!r}, feature_map={fm!r}, output_scale={self.output_scale}, "
                f"eps={self.eps}, eps_mode={self.eps_mode!r}")


class LinearAttention(_FormOptions, _KeyMasksOnly, AttentionBase):
    """Linear attention with H heads of size D and the feature map ``elu(x) + 1`` (Katharopoulos et al. 2020).

    Args:
        embed_dim, num_heads, head_dim, bias, kdim, vdim, batch_first, device, dtype: as :class:`AttentionBase`.
        dropout: accepted so that one constructor call builds every attention kind, but unused: linear attention
            never forms attention weights, so there is nothing to drop (the output is deterministic in training).
        options: a :class:`LinearOptions` (the keyword options below, with their defaults, are its fields) or None;
            keywords given with it must agree with it, as :meth:`mgk.attention.registry.Options.merged` rules: a
            keyword that differs is a ValueError naming both values, options of another type a TypeError.
        normalize, feature_map, output_scale, eps, eps_mode: the form, as :func:`mgk.functional.linear_attention`:
            defaults "row", "elu", 1.0, 1e-6, "guard" (eq. 6 with an exact denominator). The authors' LRA form is
            normalize="length" (its scale uses the padded tensor length, so outputs depend on the padding); their
            LM type-34 form is feature_map="elu_sum", output_scale=head_dim**-0.5, eps=1e-5, eps_mode="add".

    ``forward`` is :meth:`AttentionBase.forward`. Only ``key_padding_mask`` and ``is_causal`` can be expressed: an
    ``attn_mask`` equal to the causal mask is taken as ``is_causal=True``, any other raises
    :class:`mgk.functional.MaskError`; float masks may hold only 0 (allowed) and -inf (not allowed).
    ``need_weights=True`` returns the explicit
    (B, H, L, S) weights W with ``output = W @ v`` per head (O(L S) memory).

    Raises:
        ValueError for bad options or a keyword that differs from ``options``; TypeError for an unknown keyword
        or ``options`` of another type.
    """

    def __init__(self, embed_dim: int, num_heads: int, *, options: LinearOptions | None = None, **kwargs):
        base, values = split_options(LinearOptions, kwargs)
        options = LinearOptions.merged(options, values)  # the defaults, written once there
        super().__init__(embed_dim, num_heads, **base)
        self._set_form(options)
        self.k_proj = nn.Linear(self.kdim, self.num_heads * self.head_dim, bias=self.q_proj.bias is not None,
                                **factory_kwargs(base.get("device"), base.get("dtype")))

    def _keys(self, key: Tensor) -> Tensor:
        return self._split(self.k_proj(key))

    def _core(self, q, k, v, mask, is_causal, need_weights, query_mask):
        result = linear_attention(q, k, v, attn_mask=mask, is_causal=is_causal, return_weights=need_weights,
                                  **self._form_kwargs())
        return result if need_weights else (result, None)

    def _cached_core(self, q, x, v, valid, cache):
        return cache.state.step(q, self._keys(x), v, valid, **self._form_kwargs())

    def extra_repr(self) -> str:
        return super().extra_repr() + self._form_repr() + " (dropout unused)"


class MLKAttention(MixtureKeysMixin, _FormOptions, _KeyMasksOnly, AttentionBase):
    """Linear attention with a mixture of M linear keys per position (MLK / sMLK, paper eq. 14).

    The key feature is ``phi~(k_j) = sum_r pi_r phi(k_jr)``; see :func:`mgk.functional.mlk_attention`.

    Args:
        embed_dim, num_heads, head_dim, bias, kdim, vdim, batch_first, device, dtype: as :class:`AttentionBase`.
        dropout: accepted but unused, as in :class:`LinearAttention`.
        options: an :class:`MLKOptions` (the keyword options below, with their defaults, are its fields) or None;
            keywords given with it must agree with it, as :meth:`mgk.attention.registry.Options.merged` rules: a
            keyword that differs is a ValueError naming both values, options of another type a TypeError.
        num_keys: M, mixture components per key (the paper uses 2).
        keys: "separate" (MLK: M key projections) or "shifted" (sMLK: one key projection and learned offsets
            ``k_r = x W_k - mu_r``, ``mu_1 = 0``), exactly as :class:`MGKAttention`: both hold the keys and weights
            in the same submodule ``mixture`` (:class:`mgk.attention.mixture_keys.MixtureKeys`).
        pi: only "learned" (log-softmax of learned logits, never clamped). Soft-E and Hard-E are defined through
            the Gaussian kernel of MGK and are rejected.
        pi_shape: "head" (logits (H, M)), "position" (logits (H, M, max_len), needs ``max_len``) or "layer"
            (logits (1, M) shared by all heads and positions).
        pi_norm: "softmax" (the default) or "none" (free log-weights, pi = exp(pi_logits), initialised at 1/M), as
            :class:`mgk.attention.mixture_keys.MixtureKeys`.
        max_len: longest key sequence, for pi_shape="position".
        mix: "features" (the default, eq. 14: ``sum_r pi_r phi(k_r)``) or "keys" (``phi(sum_r pi_r k_r)``).
        normalize, feature_map, output_scale, eps, eps_mode: as :class:`LinearAttention`.

    The authors' forms: LRA "MLK" is mix="keys", pi_shape="layer", pi_norm="none", normalize="length"
    (``lra/attention_linear.py:20-21, 38-47``); LM type 400 is mix="features", pi_shape="position", pi_norm="none",
    feature_map="elu_sum", output_scale=head_dim**-0.5, eps=1e-5, eps_mode="add"
    (``language-modeling/lmtool-fwms/src/mem_transformer.py:405-542``), with exp of free log-weights in place of
    their weights clamped to [0, 1].

    Masks as :class:`LinearAttention`.

    Raises:
        ValueError for bad options or a keyword that differs from ``options``, and in ``forward`` when S
        exceeds ``max_len`` (naming both); TypeError for an unknown keyword or ``options`` of another type.
    """

    def __init__(self, embed_dim: int, num_heads: int, *, keys: str = "separate", options: MLKOptions | None = None,
                 **kwargs):
        base, values = split_options(MLKOptions, kwargs)
        options = MLKOptions.merged(options, values)  # the defaults, written once there
        super().__init__(embed_dim, num_heads, **base)
        pi = options.pi
        if pi != "learned":
            why = ("Soft-E and Hard-E are MGK ablations built on the Gaussian kernel" if pi in PI_MODES
                   else "unknown mode")
            raise ValueError(f"MLKAttention supports only pi='learned', got pi={pi!r} ({why})")
        self.mixture = MixtureKeys(self.kdim, self.num_heads, self.head_dim, options, keys=keys,
                                   bias=self.q_proj.bias is not None, **factory_kwargs(base.get("device"),
                                                                                       base.get("dtype")))
        self._set_form(options, options.mix)

    def mixture_log_weights(self, S: int) -> Tensor:
        """log pi broadcastable to (B, H, M, S). Raises ValueError when S > max_len for per-position weights."""
        self.mixture.check_length(S, "MLKAttention")
        return self.mixture.log_weights(S)

    def _cached_core(self, q, x, v, valid, cache):
        L = x.shape[1]
        if not torch.compiler.is_compiling():  # a traced step reads no host count: checked ahead
            self.mixture.check_position(cache.last_position(valid, L), type(self).__name__)
        log_pi = self.mixture.log_weights_at(cache.positions(valid, L))
        return cache.state.step(q, self._keys(x), v, valid, log_pi=log_pi, mix=self.mix, **self._form_kwargs())

    def _core(self, q, k, v, mask, is_causal, need_weights, query_mask, key_positions=None):
        log_pi = self._log_weights_of(k.shape[3], key_positions)
        result = mlk_attention(q, k, v, log_pi=log_pi, attn_mask=mask, is_causal=is_causal, mix=self.mix,
                               return_weights=need_weights, **self._form_kwargs())
        return result if need_weights else (result, None)

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", num_keys={self.num_keys}, keys={self.keys!r}, pi={self.pi_mode!r}, "
                f"pi_shape={self.pi_shape!r}, pi_norm={self.pi_norm!r}, max_len={self.max_len}, mix={self.mix!r}"
                + self._form_repr() + " (dropout unused)")


def linear_flops(options, *, heads: int, length: int, batch: int, embed_dim: int, head_dim: int, causal: bool,
                 backward: bool, mixture_kernel: bool = False) -> int:
    """FLOPs of one linear-attention call (:func:`mgk.attention.registry.total`): four projections and
    ``4 S D D + 4 N D D`` per head (key-value sums and their use, with denominators), whatever ``causal``."""
    core = 4 * length * head_dim * head_dim * 2
    return total(core, 4, heads=heads, length=length, batch=batch, embed_dim=embed_dim, head_dim=head_dim,
                 backward=backward)


def mlk_flops(options, *, separate: bool, heads: int, length: int, batch: int, embed_dim: int, head_dim: int,
              causal: bool, backward: bool, mixture_kernel: bool = False) -> int:
    """MLK (``separate`` keys: M key projections) or sMLK (one): linear attention plus the mixture of the M key
    features, ``2 M S D`` per head."""
    M, D = options.num_keys, head_dim
    core = 4 * length * D * D * 2 + 2 * M * length * D
    return total(core, 3 + (M if separate else 1), heads=heads, length=length, batch=batch, embed_dim=embed_dim,
                 head_dim=head_dim, backward=backward)


_RECURRENT = CacheSpec(recurrent=True)

register(AttentionKind("linear", "linear", "linear", LinearOptions, LinearAttention, linear_flops, _RECURRENT))
register(AttentionKind("mlk", "linear", "MLK", MLKOptions, partial(MLKAttention, keys="separate"),
                       partial(mlk_flops, separate=True), _RECURRENT, ({}, {"mix": "keys"})))
register(AttentionKind("smlk", "linear", "sMLK", MLKOptions, partial(MLKAttention, keys="shifted"),
                       partial(mlk_flops, separate=False), _RECURRENT))
