"""The kinds "mgk" and "smgk": multi-head attention with a mixture of Gaussian keys (Nguyen et al., ICML 2022,
Sections 3-4), the Soft-E step, their options, FLOPs, decoding cache (one call into
:class:`mgk.functional.MGKDecodeState`, which keeps the causal-centre protocol and chooses each cached call's path)
and registration."""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..fields import Label, spec
from ..functional import (
    cpu_kernel_available,
    is_transformed,
    mgk_attention,
    mgk_attention_soft_e,
    mgk_responsibilities,
)
from ..functional.mgk_cache import Memo, to_heads
from ..functional.mgk_state import MGKDecodeState
from .base import AttentionBase, factory_kwargs
from .cache import LayerCache
from .mixture_keys import (
    KEY_MODES,
    PI_MODES,
    PI_NORMS,
    PI_SHAPES,
    MixtureKeys,
    MixtureKeysMixin,
    MixtureOptions,
    split_options,
)
from .registry import AttentionKind, CacheSpec, register, total

__all__ = ["MGKAttention", "MGKOptions", "KEY_MODES", "PI_MODES", "PI_NORMS", "PI_SHAPES", "mixture_flops",
           "soft_e_step"]


@dataclass(frozen=True)
class MGKOptions(MixtureOptions):
    """MGK / sMGK (Nguyen et al. 2022, Sections 2-3): the mixture keys and the Gaussians' variances."""

    # str last: --set text parses as the first alternative that fits, and any text is a str
    sigma2: float | tuple[float, ...] | str | None = spec(
        None, gt=0, choices=("learned",), label=Label({"learned": "learned variances"}),
        doc="per-component variances: None (sqrt(head_dim) each), one float for all, M floats (the authors' LM: "
            "(sqrt(D), sqrt(D) / 3)), or 'learned' (per head and component, trained, positive by construction)")
    key_scale: float = spec(
        1.0, gt=0, doc="c: keys are multiplied and queries divided by c before the Gaussian score, whose dot product "
                       "is then unchanged and whose key-norm term shrinks by c^2; a value other than 1 (what "
                       "swap_attention gives a converted dot-product layer, docs/retrofit.md) centres on 0 and needs "
                       "equal, fixed variances")


class _CommitStatistics(torch.autograd.Function):
    """The identity on an attention output whose backward adds one forward's E-step statistics to an accumulator.

    Committing in backward rather than in forward makes every way of running a forward count it exactly once: a
    plain forward and backward once; reentrant checkpointing runs the first forward under no_grad (no statistics)
    and backpropagates its recomputation once; non-reentrant checkpointing backpropagates the original node once
    (the recomputation only refills saved tensors); gradient accumulation and a module called twice (retrieval's
    two towers) add one share per forward; torch.compile traces the in-place add into its backward graph. The
    accumulator and statistics are held on ``ctx``, not saved tensors: the accumulator changes in place between
    forward and backward (other nodes' commits) and the statistics must be those of the forward that ran.
    """

    @staticmethod
    def forward(out, acc, stats):
        return out.view_as(out)

    @staticmethod
    def setup_context(ctx, inputs, output):
        """Keep the accumulator and the forward's statistics for :meth:`backward`."""
        _, ctx.acc, ctx.stats = inputs

    @staticmethod
    def backward(ctx, grad_out):
        """Commit the statistics into the accumulator (only a backward that runs commits), pass the gradient on."""
        ctx.acc[:, :, :ctx.stats.shape[-1]].add_(ctx.stats)
        return grad_out, None, None


def _key_scale(options: MGKOptions) -> float:
    """``options.key_scale`` as a float; ValueError naming it and ``sigma2`` when c != 1 meets variances that
    differ between components or are learned: the ``|q|^2 / (2 sigma_r^2)`` term of each component then stays in
    the score (:mod:`mgk.functional._mixture_terms`), and with queries 1/c times their size it cancels
    catastrophically."""
    c, s2 = float(options.key_scale), options.sigma2
    unequal = s2 == "learned" or (isinstance(s2, (tuple, list)) and len(set(float(x) for x in s2)) > 1)
    if c != 1.0 and unequal:
        raise ValueError(f"key_scale={c} needs equal, fixed variances (sigma2 None or one float), got "
                         f"sigma2={s2!r}: unequal or learned ones keep the |q|^2 / (2 sigma^2) term, which the "
                         "scaled queries make cancel catastrophically")
    return c


def _rows(t: Tensor | None, row: slice) -> Tensor | None:
    """Rows ``row`` of a tensor of B rows (or broadcast over them: its one row, kept)."""
    return t if t is None or t.shape[0] == 1 else t[row]


class MGKAttention(MixtureKeysMixin, AttentionBase):
    """Transformer-MGK attention: each head's keys are a mixture of M Gaussians (paper eq. 9-10).

    Args:
        embed_dim, num_heads, head_dim, dropout, bias, kdim, vdim, batch_first, device, dtype: as
            :class:`AttentionBase`.
        options: an :class:`MGKOptions` (the keyword options below, with their defaults, are its fields) or None;
            keywords given with it must agree with it, as :meth:`mgk.attention.registry.Options.merged` rules: a
            keyword that differs is a ValueError naming both values, options of another type a TypeError.
        num_keys: M, mixture components per key (the paper uses 2).
        keys: "separate" (MGK: M key projections) or "shifted" (sMGK: one key projection and learned offsets,
            ``k_r = x W_k - mu_r`` with ``mu_1 = 0``, others initialised from N(0, 0.5^2)).
        pi: "learned" (log-softmax of learned logits, never clamped), "soft_e" (a buffer set by the E-step in
            training, paper "+Soft-E"), or "hard_e" (max over components, paper "+Hard-E").
        pi_shape: for pi="learned", "head" (logits (H, M)), "position" (logits (H, M, max_len)) or "layer" (logits
            (1, M) shared by all heads and positions, the authors' LRA form).
        pi_norm: for pi="learned", "softmax" (the default) or "none": free log-weights, pi = exp(pi_logits), not
            normalised over the components (initialised at 1/M); with pi_shape="position" and
            ``sigma2=(sqrt(D), sqrt(D) / 3)`` this is the authors' LM MGK
            (``language-modeling/lmtool-fwms/src/mem_transformer.py:81-231``, update_mode ``rbf2keys``) without
            its clamp's dead gradient and without its ``+1e-6`` in the row normaliser. See
            :class:`mgk.attention.mixture_keys.MixtureKeys`.
        sigma2: per-component variances: None (sqrt(head_dim) for all), a float, a sequence (list or tuple) of
            M floats (the authors' LM code used ``(sqrt(D), sqrt(D) / 3)``, ``mem_transformer.py:150-151``), or
            "learned": one variance per head and component, (H, M), trained with the model (the paper's GMM keys
            have means, variances and mixing weights, Section 3), positive by construction (exp of a parameter),
            starting at sqrt(head_dim). Learned variances keep the per-row ``|q|^2`` term; the Triton kernels
            refuse them (mgk.functional.select_backend picks the C++ kernel, SDPA or the explicit form).
        max_len: longest key sequence; required by pi="soft_e" and pi_shape="position".

    The keys and weights live in the submodule ``mixture`` (:class:`mgk.attention.mixture_keys.MixtureKeys`,
    shared with MLK); ``k_proj``, ``key_shift``, ``pi_logits`` and ``pi`` remain readable here, and state dicts
    saved before that submodule existed still load.

    Soft-E: users who train a Soft-E module themselves call ``mgk.soft_e_step(model)`` after backward (once per
    optimiser step); the Trainer does it. In training mode with gradients enabled each forward computes the
    responsibilities of the components (without gradient; padded queries and masked pairs excluded), and its
    backward adds their sums and counts to an accumulator; :func:`soft_e_step` all-reduces them under DDP and writes
    ``pi[:, :, j]`` in place. Forward reads the ``pi`` buffer, unchanged until that step, so activation checkpointing
    (reentrant or not), ``torch.compile`` and gradient accumulation give the pi and gradients of a plain run, and
    an accumulated step averages over its whole global batch. Eval mode, ``torch.no_grad`` and torch.func transforms
    (vmap, grad, jvp) gather nothing and never change pi. ``pi`` is in the state dict; the accumulator is not (it
    is empty between steps, where checkpoints are written).

    Raises:
        ValueError for bad options or a keyword that differs from ``options``, and in ``forward`` when S
        exceeds ``max_len`` (naming both); TypeError for an unknown keyword or ``options`` of another type.
    """

    backend: str | None = None  # mgk_attention's backend; None lets mgk.functional.select_backend pick

    def __init__(self, embed_dim: int, num_heads: int, *, keys: str = "separate", options: MGKOptions | None = None,
                 **kwargs):
        base, values = split_options(MGKOptions, kwargs)
        options = MGKOptions.merged(options, values)  # the defaults, written once there
        super().__init__(embed_dim, num_heads, **base)
        factory = factory_kwargs(base.get("device"), base.get("dtype"))
        self.mixture = MixtureKeys(self.kdim, self.num_heads, self.head_dim, options, keys=keys,
                                   bias=self.q_proj.bias is not None, **factory)
        self._set_variances(options.sigma2, self.mixture.num_keys, **factory)
        self.key_scale = _key_scale(options)
        if self.key_scale != 1.0:  # one variance (_key_scale checked they are equal and fixed), as a float
            s2 = options.sigma2
            self._one_variance = math.sqrt(self.head_dim) if s2 is None else float(
                s2 if isinstance(s2, (int, float)) else s2[0])
        if not torch.cuda.is_available():
            # Build or load the CPU kernel now, outside any torch.compile trace (a trace cannot build it and would
            # fall back to the SDPA form). Without a compiler this warns once and MGK uses the SDPA form.
            cpu_kernel_available(torch.empty(0), 0.0)

    def _set_variances(self, sigma2, M: int, device=None, dtype=None) -> None:
        """The variances behind :attr:`sigma2`: a (M,) buffer ``sigma2`` of fixed values (float64 unless ``dtype``
        is given), or for ``sigma2="learned"`` an (H, M) parameter ``log_sigma2`` (sigma^2 = exp of it: positive for
        every value the optimiser reaches, with a gradient nowhere cut by a clamp), starting at sqrt(head_dim)."""
        if isinstance(sigma2, str):
            if sigma2 != "learned":
                raise ValueError(f"sigma2 must be None, a positive float, M floats or 'learned', got {sigma2!r}")
            self.log_sigma2 = nn.Parameter(torch.full((self.num_heads, M), 0.5 * math.log(self.head_dim),
                                                      device=device, dtype=dtype))
            return
        if sigma2 is None:
            sigma2 = [math.sqrt(self.head_dim)] * M
        elif isinstance(sigma2, (int, float)):
            sigma2 = [float(sigma2)] * M
        # float64, so that a float64 module is exact (sqrt(D) / 3 is not a float32 number); each call casts the
        # variances to its compute dtype
        sigma2 = torch.as_tensor(sigma2, dtype=torch.float64).reshape(-1)
        if sigma2.numel() != M or not bool(torch.all(sigma2 > 0)):
            raise ValueError(f"sigma2 must be positive with one value per component ({M}), got {sigma2.tolist()}")
        # checked on the CPU above (a meta tensor has no values); an explicit dtype applies as Module.to(dtype) would
        self.register_buffer("sigma2", sigma2.to(device=device, dtype=dtype or torch.float64))

    @property
    def sigma2(self) -> Tensor:
        """The variances every call uses: the fixed (M,) buffer, or ``exp(log_sigma2)`` (H, M) when learned (read
        through the module's own parameter and buffer tables, so torch.func's functional_call sees its tensors)."""
        if "log_sigma2" in self._parameters:
            return self._parameters["log_sigma2"].exp()
        if "sigma2" in self._buffers:
            return self._buffers["sigma2"]
        raise AttributeError("sigma2")  # before __init__ registered it (hasattr must say False then)

    @property
    def learned_variances(self) -> bool:
        """Whether the variances are trained (``sigma2="learned"``)."""
        return "log_sigma2" in self._parameters

    @property
    def _score_variances(self) -> Tensor | float:
        """The variances the score reads: :attr:`sigma2`, or at key_scale c != 1 their one value as a float, equal for
        every component by construction, so that no path keeps the ``|q|^2 / (2 sigma^2)`` row term, which the
        scaled queries (1/c times their size) would make round every score away
        (:func:`mgk.functional._mixture_terms.needs_qnorm`)."""
        return self.sigma2 if self.key_scale == 1.0 else self._one_variance

    @property
    def _group_score_variances(self) -> Tensor | float:
        """:attr:`_score_variances` of the key heads (gMGK's G key groups): :attr:`group_variances`, or at key_scale
        c != 1 their one value as a float."""
        return self.group_variances if self.key_scale == 1.0 else self._one_variance

    def _at_scale(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """(q / c, k c, centre) for :attr:`key_scale` c: the queries (B, H, L, D) and keys (B, G, M, S, D) (or sMGK's
        unshifted (B, G, S, D); G the key heads) the Gaussian score reads, and the centre of every call, None (chosen
        from the queries, :mod:`mgk.functional._centre`) for c = 1, else zeros (B, G, D). At c < 1 the queries are 1/c
        times the keys' size: a centre among them would carry that size into every key and its rounding would grow
        as 1/c, while at 0 the expansion's terms are those of dot-product attention (|q~| |k~| = |q| |k|,
        |k~|^2 = c^2 |k|^2)."""
        c = self.key_scale
        if c == 1.0:
            return q, k, None
        return q / c, k * c, q.new_zeros(q.shape[0], k.shape[1], q.shape[3])

    def mixture_log_weights(self, S: int) -> Tensor | None:
        """log pi broadcastable to (B, H, M, S); None for Hard-E. Raises ValueError when S > max_len."""
        self.mixture.check_length(S, "MGKAttention")
        return self.mixture.log_weights(S)

    @property
    def cache_slots(self) -> dict[str, int]:
        """MGK: the M component keys (B, H, M, T, D); sMGK: the one unshifted key (B, H, T, D); both the M scalars
        per key (B, H, M, T) and the values (B, H, T, Dv) (:func:`mgk.functional.mgk_cache_entries`)."""
        return {"keys": 3 if self.keys == "separate" else 2, "key_bias": 3, "values": 2}

    @property
    def cache_layout(self) -> str:
        """"MGKAttention (separate keys)" or "... (shifted keys)": the two store different keys, so a cache filled by
        one is refused by the other."""
        return f"{type(self).__name__} ({self.keys} keys)"

    def _decoding_state(self, capacity: int | None) -> MGKDecodeState:
        """MGK's decoding state (:class:`mgk.functional.MGKDecodeState`) for the key heads' entries."""
        return MGKDecodeState(self.cache_slots, capacity, groups=self.kv_heads, layout=self.cache_layout)

    @property
    def group_variances(self) -> Tensor:
        """The variances of the key heads (H here; gMGK's G key groups): the fixed (M,) buffer, or
        ``exp(log_sigma2)`` (heads, M) when learned (read from the module's own tables, as :attr:`sigma2`)."""
        learned = self._parameters.get("log_sigma2")
        return self._buffers["sigma2"] if learned is None else learned.exp()

    def _cached_core(self, q, x, v, valid, cache: LayerCache):
        """One call into the cache's :class:`mgk.functional.MGKDecodeState` (the prefill, its centre protocol, the
        fused and the fixed-capacity steps), with the key heads' keys, values, variances, shifts and prior;
        per-position weights are read at each row's positions. No Soft-E statistics."""
        L = x.shape[1]
        by_position = self.mixture.position_limit() is not None
        if by_position and not torch.compiler.is_compiling():  # a traced step reads no host count: checked ahead
            self.mixture.check_position(cache.last_position(valid, L), type(self).__name__)
        # the key heads' keys at key_scale c (the queries at 1 / c), and a converted layer's fixed centre (0)
        q, base, fixed = self._at_scale(q, self.mixture.project(x))
        sigma2, shifts, prior = self._decode_parameters(q, by_position)
        return cache.state.step(q, base, v, valid, sigma2=sigma2, shifts=shifts, prior=prior,
                                log_pi=self._decode_log_pi(cache, valid, L) if by_position else None,
                                mixture="max" if self.pi_mode == "hard_e" else "sum", centre=fixed,
                                dropout_p=self.attn_dropout, backend=self.backend)

    def _decode_log_pi(self, cache: LayerCache, valid, L: int) -> Tensor | None:
        """log pi of this call's L new tokens at each row's positions (per-position weights), broadcastable to
        (B, heads, M, L); None for Hard-E."""
        if valid is None and not cache.padded and not cache.fixed:  # every row has seen cache.length: one slice
            return self.mixture.log_weights(L, start=cache.length)
        return self.mixture.log_weights_at(cache.positions(valid, L))

    def _decode_parameters(self, q: Tensor, by_position: bool) -> tuple:
        """``(sigma2, shifts, prior)`` of a decoding call: the key heads' variances, sMGK's shifts (M, heads, D) and
        the log prior of every token when it does not depend on the position (None for Hard-E and per-position
        weights). The same tensors from call to call while the parameters they come from stay the same (a
        :class:`mgk.functional.mgk_cache.Memo` watching them; the options are the mixture's, fixed when it was
        built), so that the state keeps its step terms and a step makes none."""
        mixture = self.mixture
        held = mixture._parameters
        watch = (q.dtype, q.device, mixture, self._parameters.get("log_sigma2"), self._buffers.get("sigma2"),
                 held.get("key_shift"), held.get("pi_logits"), mixture.component_gate)

        def make():
            """The parameters, made anew (when a watched tensor changed, or at the first call)."""
            fixed = self.pi_mode == "hard_e" or by_position
            return (self._group_score_variances, mixture.shifts(self.key_scale) if self.keys == "shifted" else None,
                    None if fixed else mixture.log_weights(1))

        memo = self.__dict__.get("_decode_memo")
        if memo is None:
            memo = self.__dict__["_decode_memo"] = Memo()
        return memo.get(watch, make)

    def _core_keys(self, key: Tensor) -> Tensor:
        """The key heads' projection as :meth:`_core` takes it: the M components (B, G, M, S, D), or sMGK's one
        unshifted key (B, G, S, D), which :func:`mgk.functional.mgk_attention` reads with the shifts (G = H but
        for gMGK's key groups): nothing repeated for the components or the query heads."""
        return self.mixture.project(key)

    def _core(self, q, k, v, mask, is_causal, need_weights, query_mask, bias=None, key_positions=None):
        G, R, c = self.kv_heads, self.num_heads // self.kv_heads, self.key_scale
        log_pi = MixtureKeysMixin._log_weights_of(self, k.shape[-2], key_positions)  # the key heads'
        q, k, centre = self._at_scale(q, k)
        shifts = self.mixture.shifts(c) if self.keys == "shifted" else None
        sigma2 = self._group_score_variances
        collect = self._collects_statistics(q)
        if self.pi_mode == "soft_e":
            # Each query head's components, whether or not this forward gathers the E-step's statistics (which read
            # them): the output's arithmetic is then the same either way, so a checkpoint's replay is bitwise.
            k = to_heads(k if shifts is None else self.mixture.shift(k, c), G, R)
            v, log_pi, centre = to_heads(v, G, R), to_heads(log_pi, G, R), to_heads(centre, G, R)
            shifts, sigma2 = None, self._score_variances
        if collect and bias is None and not need_weights and key_positions is None:
            # The E-step's statistics from the forward's own score GEMMs (None: the kernel cannot serve the call).
            fused = mgk_attention_soft_e(q, k, v, log_pi=log_pi, sigma2=sigma2, attn_mask=mask, is_causal=is_causal,
                                         dropout_p=self.attn_dropout, query_mask=query_mask, backend=self.backend,
                                         centre=centre)
            if fused is not None:
                return self._commit_on_backward(*fused), None
        mixture = "max" if self.pi_mode == "hard_e" else "sum"
        result = mgk_attention(q, k, v, log_pi=log_pi, sigma2=sigma2, mixture=mixture, attn_mask=mask, bias=bias,
                               is_causal=is_causal, dropout_p=self.attn_dropout, return_weights=need_weights,
                               backend=self.backend, shifts=shifts, centre=centre)
        out, weights = result if need_weights else (result, None)
        if collect:
            out = self._statistics(out, q, k, log_pi, sigma2, centre, mask, is_causal, query_mask, key_positions)
        return out, weights

    def _statistics(self, out, q, k, log_pi, sigma2, centre, mask, is_causal, query_mask, key_positions):
        """``out`` through the commit of this forward's E-step statistics (:func:`mgk.functional.mgk_responsibilities`
        of each query head's components k (B, H, M, S, D), at the forward's variances and centre), each row's at its
        own key positions when given."""
        rows = [slice(None)] if key_positions is None else [slice(b, b + 1) for b in range(q.shape[0])]
        stats = None
        for row in rows:  # rows whose key positions are not their columns: each row's statistics at its own
            resp, count = mgk_responsibilities(q[row], k[row], log_pi=_rows(log_pi, row), sigma2=sigma2,
                                               attn_mask=_rows(mask, row), is_causal=is_causal,
                                               query_mask=_rows(query_mask, row), centre=_rows(centre, row))
            if key_positions is not None:
                at = key_positions[row][0]
                resp, count = resp.new_zeros(resp.shape).index_add_(2, at, resp), \
                    count.new_zeros(count.shape).index_add_(1, at, count)
            stats = (resp, count) if stats is None else (stats[0] + resp, stats[1] + count)
        return out if stats is None else self._commit_on_backward(out, *stats)

    # -- Soft-E: statistics in forward, committed in backward, applied by soft_e_step ---------------------------
    def _collects_statistics(self, q: Tensor) -> bool:
        """Whether this forward gathers E-step statistics: Soft-E in training mode with gradients enabled (a
        backward may follow), outside torch.func transforms (whose functions cannot change module state)."""
        return (self.pi_mode == "soft_e" and self.training and torch.is_grad_enabled()
                and not is_transformed(q))

    def _accumulator(self) -> Tensor:
        """The (H, M + 1, max_len) float64 sums of responsibilities (``[:, :M]``) and counts (``[:, M]``) committed
        since the last :meth:`soft_e_step`, on pi's device. A plain attribute, not a buffer: DDP would broadcast a
        buffer from rank 0 at every forward, and a state dict has nothing to keep between steps."""
        pi = self.mixture.pi
        acc = getattr(self, "_soft_e_sums", None)
        if acc is None or acc.device != pi.device:  # first use, or the module was moved since the last one
            H, M, T = pi.shape
            acc = torch.zeros(H, M + 1, T, dtype=torch.float64, device=pi.device) if acc is None else acc.to(pi.device)
            self._soft_e_sums = acc
        return acc

    def _commit_on_backward(self, out: Tensor, resp: Tensor, count: Tensor) -> Tensor:
        """``out``, through a node whose backward adds this forward's statistics (resp (H, M, S), count (H, S))
        to :meth:`_accumulator`."""
        stats = torch.cat([resp, count.unsqueeze(1)], dim=1).to(torch.float64)
        return _CommitStatistics.apply(out, self._accumulator(), stats)

    def soft_e_step(self) -> int:
        """Apply the E-step statistics committed since the last step to pi: :func:`mgk.soft_e_step` of this
        module. Returns 1 for a Soft-E module, 0 otherwise."""
        return soft_e_step(self)

    @torch.no_grad()
    def _apply_statistics(self, acc: Tensor) -> None:
        """``pi[:, :, j] = resp_sum[:, :, j] / count[:, j]`` in place where count > 0 and the average is finite
        (a non-finite forward leaves pi a distribution; its loss is non-finite too); other positions keep pi."""
        pi = self.mixture.pi
        M = pi.shape[1]
        count = acc[:, M:]
        new = acc[:, :M] / count.clamp_min(1)
        keep = (count > 0) & new.isfinite().all(dim=1, keepdim=True)
        pi.copy_(torch.where(keep, new.to(pi.dtype), pi))

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", num_keys={self.num_keys}, keys={self.keys!r}, pi={self.pi_mode!r}, "
                f"pi_shape={self.pi_shape!r}, pi_norm={self.pi_norm!r}, "
                f"sigma2={'learned' if self.learned_variances else self.sigma2.tolist()}, "
                f"max_len={self.max_len}")


@torch.no_grad()
def soft_e_step(model: nn.Module) -> int:
    """The Soft-E update of every Soft-E :class:`MGKAttention` in ``model`` (the paper's "+Soft-E", Section 3.2: the
    E-step of EM for the key mixture): ``pi[h, r, j] = resp_sum[h, r, j] / count[h, j]`` over every query, batch
    row and forward whose backward ran since the last step, in place on the ``pi`` buffer (same ``data_ptr``).

    Call it once per optimiser step, after the backward of all micro-batches (:class:`mgk.train.Trainer` does). Under
    ``torch.distributed`` (initialised, world size > 1) the sums and counts are all-reduced first, in one fixed-size
    (H, M + 1, max_len) tensor per module so that ranks with different lengths send the same sizes: every rank must
    call it, and then holds the same pi, the E-step over the global batch. Positions no query saw keep their pi. The
    accumulated statistics are reset. ``model`` may be a module, a DDP wrapper or any container of modules.

    Returns the number of Soft-E modules updated. Raises whatever ``torch.distributed.all_reduce`` raises.
    """
    modules = [m for m in model.modules() if isinstance(m, MGKAttention) and m.pi_mode == "soft_e"]
    reduce = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    for module in modules:
        acc = module._accumulator()
        if reduce:
            dist.all_reduce(acc)
        module._apply_statistics(acc)
        acc.zero_()
    return len(modules)


def mixture_flops(options, *, separate: bool, heads: int, length: int, batch: int, embed_dim: int, head_dim: int,
                  causal: bool, backward: bool, mixture_kernel: bool = False) -> int:
    """FLOPs of one MGK (``separate`` keys: M key projections) or sMGK (one) call
    (:func:`mgk.attention.registry.total`). The core per head: summed before the value product (our CPU kernel,
    ``mixture_kernel``, and always Hard-E, whose max over components is taken on M distance matrices)
    ``2 N M S D + 2 N S D``; otherwise SDPA over M * S keys with one column more, ``2 N M S (D + 1) + 2 N M S D``;
    Soft-E in training adds the E-step's distances, ``2 N M S D`` (forward only)."""
    N = S = length
    M, D = options.num_keys, head_dim
    if mixture_kernel or options.pi == "hard_e":
        core = 2 * N * M * S * D + 2 * N * S * D
    else:
        core = 2 * N * M * S * (D + 1) + 2 * N * M * S * D
    if options.pi == "soft_e" and backward:
        core += 2 * N * M * S * D / 3  # the E-step runs in the forward only (x 3 below)
    core *= 0.5 if causal else 1.0
    return total(core, 3 + (M if separate else 1), heads=heads, length=length, batch=batch, embed_dim=embed_dim,
                 head_dim=head_dim, backward=backward)


_PI_VARIANTS = ({}, {"pi": "soft_e"}, {"pi": "hard_e"})  # the paper's Table 4 ablation

# MGK keeps its M keys per token, sMGK the one unshifted key; both one scalar per component (mgk.functional.mgk_cache)
register(AttentionKind("mgk", "mixture", "MGK", MGKOptions, partial(MGKAttention, keys="separate"),
                       partial(mixture_flops, separate=True),
                       CacheSpec(keys_per_token="num_keys", scalars_per_token="num_keys"),
                       # variances trained per head and component; the scale of an exact conversion (swap_attention)
                       _PI_VARIANTS + ({"sigma2": "learned"}, {"key_scale": 2.0 ** -12})))
register(AttentionKind("smgk", "mixture", "sMGK", MGKOptions, partial(MGKAttention, keys="shifted"),
                       partial(mixture_flops, separate=False),
                       CacheSpec(keys_per_token=1, scalars_per_token="num_keys"), _PI_VARIANTS))
