"""The kind "gmgk": grouped mixture keys, MGK's Gaussian mixture keys (Nguyen et al., ICML 2022, eq. 9-10) shared by
groups of query heads as grouped-query attention shares its keys (Ainslie et al., EMNLP 2023). Its module, options,
FLOPs, decoding cache, conversion rule and registration.

H query heads, G key groups (G divides H): each group's key is a mixture of M Gaussian components, from M key
projections per group (``keys="separate"``) or from one plus M learned shifts (``keys="shifted"``, mu_1 = 0). The
mixture weights pi (every mode and shape of MGK), the shifts and learned variances belong to the key group. Query
head h reads group g = h // (H / G):

    A_ij = softmax_j( logsumexp_r( log pi_{g,r,j} - |q_i - k_{g,r,j}|^2 / (2 sigma_{g,r}^2) ) )

(max over r for Hard-E): MGK's eq. 9-10 with the key shared by the group. G = H is MGK (sMGK for shifted keys) with
the same parameter names and shapes, so their checkpoints load as they are. M = 1 is GQA's grouping with MGK's
Gaussian score ``softmax((q.k - |k|^2 / 2) / sigma^2)``, which equals GQA only when every key has the same norm.

A decoding cache stores the G groups' entries, never H expanded ones: separate keys the M component keys, shifted
keys the one unshifted key, each with M per-key scalars and the values (:mod:`mgk.functional.mgk_cache`): per token
and layer ``G (M D + D + M)`` or ``G (2 D + M)`` numbers. Its cached call is MGK's, one call into
:class:`mgk.functional.MGKDecodeState` with ``groups=G``: the H / G query heads of a group read its entries once
(folded into its query rows), with one centre per (row, group) among the group's queries (the scores depend on
q - k only, so one centre per group is exact for all its heads).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..fields import Label, spec
from ..functional.mgk_cache import to_heads
from .base import AttentionBase, factory_kwargs, positive_int
from .gqa import GQAOptions, GroupedQueryAttention
from .mgk import MGKAttention, MGKOptions, mixture_flops
from .mixture_keys import KEY_MODES, MixtureKeys, split_options
from .registry import AttentionKind, CacheSpec, option_labels, register, total

__all__ = ["GMGKOptions", "GroupedMGKAttention", "gmgk_flops"]


@dataclass(frozen=True)
class GMGKOptions(MGKOptions, GQAOptions):
    """Grouped mixture keys: MGK's options, GQA's number of key/value groups (``num_kv_heads``, None: G = H, which
    is MGK, or sMGK for shifted keys) and the key parameterisation."""

    keys: str = spec("separate", choices=KEY_MODES, label=Label({"shifted": "shifted"}, short="{value}"),
                     doc="'separate' (M key projections per group, as MGK) or 'shifted' (one key projection per "
                         "group and M learned shifts, as sMGK)")


class GroupedMGKAttention(MGKAttention):
    """MGK attention whose H query heads share G groups of mixture keys and values (module docstring).

    Args:
        embed_dim, num_heads, head_dim, dropout, bias, kdim, vdim, batch_first, device, dtype: as
            :class:`mgk.attention.base.AttentionBase`; num_heads is H, the query heads.
        options: a :class:`GMGKOptions` (the keyword options below, with their defaults, are its fields) or None;
            keywords given with it must agree with it, as :meth:`mgk.attention.registry.Options.merged` rules: a
            keyword that differs is a ValueError naming both values, options of another type a TypeError.
        num_kv_heads: G, the key/value groups (default None: G = H, which is :class:`MGKAttention` itself, the same
            parameters by name and shape).
        keys: "separate" (``k_proj`` of width M * G * D) or "shifted" (``k_proj`` of width G * D and ``key_shift``
            (M - 1, G, D)).
        num_keys, pi, pi_shape, pi_norm, sigma2, max_len: as :class:`MGKAttention`, per key group: ``pi_logits``
            (G, M) or (G, M, max_len) (or (1, M) for pi_shape="layer"), the Soft-E buffer ``pi`` (G, M, max_len),
            learned variances ``log_sigma2`` (G, M). The Soft-E statistics of a group are summed over its heads.

    ``v_proj`` has width G * D. Inputs and outputs are those of :class:`MGKAttention` (query (B, L, E) with
    ``batch_first=True``, output likewise; float dtypes of the parameters). A decoding cache (:meth:`new_cache`)
    stores G groups' entries.

    Raises:
        ValueError naming ``num_kv_heads`` when it is not a positive int dividing num_heads, naming a keyword and
        ``options`` when both are given and disagree, and as :class:`MGKAttention` for the other options;
        TypeError for an unknown keyword or ``options`` of another type.
    """

    def __init__(self, embed_dim: int, num_heads: int, *, options: GMGKOptions | None = None, **kwargs):
        base, values = split_options(GMGKOptions, kwargs)
        options = GMGKOptions.merged(options, values)
        G = options.num_kv_heads
        self._num_kv_heads = None if G is None else positive_int(G, "num_kv_heads")
        if G is not None and isinstance(num_heads, int) and num_heads % G:
            raise ValueError(f"num_kv_heads={G} must divide num_heads={num_heads} (each key group serves "
                             "num_heads / num_kv_heads query heads)")
        # MGKAttention takes exactly MGKOptions: the mixture fields of ours (the groups' keys replace its own below)
        mgk_options = MGKOptions(**{name: getattr(options, name) for name in MGKOptions.names()})
        super().__init__(embed_dim, num_heads, keys=options.keys, options=mgk_options, **base)
        if self.kv_heads != self.num_heads:  # MGKAttention made H heads of keys: the groups' G instead
            self.mixture = MixtureKeys(self.kdim, self.kv_heads, self.head_dim, options, keys=options.keys,
                                       bias=self.q_proj.bias is not None,
                                       **factory_kwargs(base.get("device"), base.get("dtype")))

    # G, the key/value groups: read as GQA reads its key/value heads
    kv_heads = GroupedQueryAttention.kv_heads
    num_kv_heads = GroupedQueryAttention.num_kv_heads

    @property
    def _repeat(self) -> int:
        """H / G, the query heads of each group."""
        return self.num_heads // self.kv_heads

    def _set_variances(self, sigma2, M: int, device=None, dtype=None) -> None:
        """MGK's variances, learned ones per key group (G, M): the group's key distribution has them."""
        super()._set_variances(sigma2, M, device=device, dtype=dtype)
        if self.learned_variances and self.kv_heads != self.num_heads:
            self.log_sigma2 = nn.Parameter(self.log_sigma2.detach()[:self.kv_heads].clone())  # all start equal

    @property
    def sigma2(self) -> Tensor:
        """The variances of each query head's keys: the fixed (M,) buffer, or the learned (G, M) repeated to (H, M)."""
        if "sigma2" not in self._buffers and "log_sigma2" not in self._parameters:
            raise AttributeError("sigma2")  # before __init__ registered it (hasattr must say False then)
        s2 = self.group_variances
        return to_heads(s2, self.kv_heads, self._repeat, dim=0) if s2.dim() == 2 else s2

    def mixture_log_weights(self, S: int) -> Tensor | None:
        """log pi of each query head's keys, broadcastable to (B, H, M, S); None for Hard-E. ValueError when
        S > max_len."""
        return to_heads(super().mixture_log_weights(S), self.kv_heads, self._repeat)

    def _commit_on_backward(self, out: Tensor, resp: Tensor, count: Tensor) -> Tensor:
        """MGK's commit of per-head statistics resp (H, M, S), count (H, S), summed over each group's heads first."""
        G = self.kv_heads
        return super()._commit_on_backward(out, resp.reshape(G, -1, *resp.shape[1:]).sum(dim=1),
                                           count.reshape(G, -1, count.shape[-1]).sum(dim=1))

    # -- conversion (mgk.swap_attention) -------------------------------------------------------------------------
    def per_head_projections(self) -> dict[str, Tensor]:
        """The projections as a multi-head layer's: each group's key (its components' mean) and value projections
        repeated for the H / G query heads it serves."""
        out = AttentionBase.per_head_projections(self)
        for name in [n for n in out if n.startswith(("k_proj.", "v_proj."))]:
            t = out[name]
            out[name] = t.reshape(self.kv_heads, self.head_dim, *t.shape[1:]).repeat_interleave(
                self._repeat, dim=0).flatten(0, 1)
        return out

    def load_projections(self, weights: dict[str, Tensor]) -> dict[str, Tensor]:
        """The conversion of a multi-head layer: each group's key and value projections the mean of its H / G heads'
        (Ainslie et al. 2023; exact for a GQA source, whose heads of a group are copies, and for G = H), then MGK's
        mixture-keys rule with G groups (:meth:`mgk.attention.mixture_keys.MixtureKeysMixin.load_projections`); a
        key projection of M components per head (merged heads) is pooled component by component.

        Groups kept as components: a source that is itself grouped (its heads in runs of identical key and value
        projections: a GQA layer read as multi-head, as Llama's num_key_value_heads; a multi-head layer is a run per
        head) with M G groups, into separate keys, gives each new group the keys of its M source groups as its
        components, unpooled, and their mean value projection: the keys pooling would average away stay in the
        mixture (``sum_r pi_r exp(q . k_r)``), while the cache holds M keys and one value per group."""
        H, G, D = self.num_heads, self.kv_heads, self.head_dim
        if G == H:
            return super().load_projections(weights)
        kept = self._groups_as_components(weights)
        if kept is not None:
            return kept
        pooled = dict(weights)
        for name in [n for n in weights if n.startswith(("k_proj.", "v_proj."))]:
            t = weights[name]
            parts = t.shape[0] // (H * D)  # 1, or M components of every head for merged keys
            pooled[name] = t.reshape(parts, G, H // G, D, *t.shape[1:]).mean(dim=2).flatten(0, 2)
        if pooled["k_proj.weight"].shape[0] == G * D:
            return super().load_projections(pooled)
        if self.keys != "separate":
            raise ValueError(f"{type(self).__name__} has one key projection and shifts: it cannot take "
                             f"{self.num_keys} key components (merging heads into components needs separate keys)")
        out = AttentionBase.load_projections(self, {k: t for k, t in pooled.items() if not k.startswith("k_proj.")})
        out.update({f"mixture.{n}": t for n, t in pooled.items() if n.startswith("k_proj.")})
        return out

    def _groups_as_components(self, weights: dict[str, Tensor]) -> dict[str, Tensor] | None:
        """:meth:`load_projections`' rule for a grouped source of M G groups into separate keys, or None when it does
        not apply."""
        H, G, D, M = self.num_heads, self.kv_heads, self.head_dim, self.num_keys
        runs = _source_groups(weights, H, D)
        if self.keys != "separate" or M < 2 or runs != M * G or weights["k_proj.weight"].shape[0] != H * D:
            return None
        first = torch.arange(runs) * (H // runs) * D  # the first row of each source group's first head
        rows = (first[:, None] + torch.arange(D)).reshape(-1)  # (runs D,): the source groups' projections in order
        out = AttentionBase.load_projections(self, {k: t for k, t in weights.items() if not k.startswith(
            ("k_proj.", "v_proj."))})
        for name in [n for n in weights if n.startswith("v_proj.")]:
            out[name] = weights[name][rows].reshape(G, M, D, *weights[name].shape[1:]).mean(dim=1).flatten(0, 1)
        for name in [n for n in weights if n.startswith("k_proj.")]:
            # component-major rows (component r of group g: source group g M + r)
            t = weights[name][rows].reshape(G, M, D, *weights[name].shape[1:])
            out[f"mixture.{name}"] = t.transpose(0, 1).flatten(0, 2)
        return out

    def extra_repr(self) -> str:
        return super().extra_repr() + f", num_kv_heads={self.kv_heads}"


def _source_groups(weights: dict[str, Tensor], H: int, D: int) -> int | None:
    """How many groups of consecutive heads with identical key and value projections (weights and biases) the
    multi-head projections ``weights`` have, when they all have the same size; None otherwise."""
    parts = [weights[n] for n in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias") if n in weights]
    if any(t.shape[0] != H * D for t in parts):
        return None
    heads = torch.cat([t.reshape(H, -1) for t in parts], dim=1)
    starts = [0] + [h for h in range(1, H) if not torch.equal(heads[h], heads[h - 1])]
    sizes = {b - a for a, b in zip(starts, starts[1:] + [H])}
    return len(starts) if len(sizes) == 1 else None


def gmgk_flops(options, *, heads: int, length: int, batch: int, embed_dim: int, head_dim: int, causal: bool,
               backward: bool, mixture_kernel: bool = False) -> int:
    """FLOPs of one call (:func:`mgk.attention.registry.total`): MGK's (:func:`mgk.attention.mgk.mixture_flops`, the
    core per query head) with the key projections (M, or one for shifted keys) and the value projection of width
    G * D instead of H * D."""
    separate = options.keys == "separate"
    shape = dict(heads=heads, length=length, batch=batch, embed_dim=embed_dim, head_dim=head_dim, backward=backward)
    G = options.num_kv_heads or heads
    narrower = (1 + (options.num_keys if separate else 1)) * (1 - G / heads)  # projections of width H D saved
    return mixture_flops(options, separate=separate, causal=causal, mixture_kernel=mixture_kernel, **shape) - \
        total(0.0, narrower, **shape)


def _keys_per_token(options: GMGKOptions) -> int:
    """Key vectors cached per token and group: the M components of separate keys, the one unshifted shifted key."""
    return options.num_keys if options.keys == "separate" else 1


def _display(num_heads: int, options: GMGKOptions) -> str:
    """"gMGK x 8 (kv 2)", "gMGK x 8 (kv 2, shifted)", "gMGK x 8" for G = H by default; MGK's labels (Soft-E, ...)
    after the groups."""
    G = options.num_kv_heads
    extra = ([] if G is None else [f"kv {G}"]) + [
        long for _, long in option_labels(dataclasses.replace(options, num_kv_heads=None))]
    return f"gMGK x {num_heads}" + (f" ({', '.join(extra)})" if extra else "")


register(AttentionKind("gmgk", "mixture", "gMGK", GMGKOptions, GroupedMGKAttention, gmgk_flops,
                       CacheSpec(keys_per_token=_keys_per_token, scalars_per_token="num_keys", heads="num_kv_heads"),
                       # Soft-E per key group is covered by tests/attention/test_gmgk.py, not the generic sweeps
                       ({}, {"num_kv_heads": 1}, {"num_kv_heads": 1, "keys": "shifted"}),
                       display=_display))
