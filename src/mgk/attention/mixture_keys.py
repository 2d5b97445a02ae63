"""Mixture keys shared by MGK and MLK: M key projections (or one projection and learned shifts) and the log
mixture weights log pi (Nguyen et al., ICML 2022, eq. 9-10 for MGK and eq. 14 for MLK; "shifted" keys are the
paper's sMGK / sMLK variants)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..fields import Label, spec
from ..functional.mgk_cache import shifted_keys
from .base import AttentionBase, factory_kwargs, positive_int
from .registry import Options

KEY_MODES = ("separate", "shifted")
PI_MODES = ("learned", "soft_e", "hard_e")
PI_SHAPES = ("head", "position", "layer")
PI_NORMS = ("softmax", "none")

# The spread of the M separate keys around the one key projection K they are converted from (mgk.swap_attention),
# relative to the standard deviation of K's entries: component r is K + KEY_SPREAD std(K) (N_r - mean_r N_r), N_r
# standard normal. Identical components with uniform pi get identical gradients, and Adam (which divides each step
# by its own size) keeps them identical through any training; a spread that sums to zero over the components costs
# the score only at second order, log sum_r exp(a_r) / M ~ Var_r(a_r) / 2 for the components' score offsets a_r
# (docs/convert.md), so it can be small enough to leave a conversion exact to float32's rounding. Hard-E's max over
# the components costs at first order (max_r a_r), so its spread is smaller: a near-tie sends each score's whole
# gradient to one component, which separates them at once, where an exact tie splits it evenly between them.
KEY_SPREAD = 1e-4
HARD_E_KEY_SPREAD = 1e-6

PI_LABEL = Label({"soft_e": "Soft-E", "hard_e": "Hard-E"}, short="{value}")


@dataclass(frozen=True)
class MixtureOptions(Options):
    """The mixture keys shared by MGK and MLK (Nguyen et al. 2022, eq. 9-10 and 14; :class:`MixtureKeys`): the one
    place their defaults are written."""

    num_keys: int = spec(2, ge=1, doc="M, mixture components per key (the paper uses 2)")
    pi: str = spec("learned", choices=PI_MODES, label=PI_LABEL,
                   doc="mixture weights: 'learned' (softmax of learned logits), 'soft_e' (a buffer set by the E-step, "
                       "paper '+Soft-E') or 'hard_e' (max over components, paper '+Hard-E')")
    pi_shape: str = spec("head", choices=PI_SHAPES, only_if=("pi", "learned"),
                         doc="learned weights per 'head' (H, M), per 'position' (H, M, max_len) or per 'layer' (1, M)")
    pi_norm: str = spec("softmax", choices=PI_NORMS, only_if=("pi", "learned"),
                        doc="'softmax' over the components, or 'none': free log-weights (the authors' LM and LRA code)")
    max_len: int | None = spec(None, ge=1, doc="longest key sequence; needed by pi='soft_e' and pi_shape='position' "
                                               "(a run config fills it in from its max_len)")


# The keyword arguments of AttentionBase: a module's own keywords are everything else.
BASE_ARGUMENTS = ("head_dim", "dropout", "bias", "kdim", "vdim", "batch_first", "device", "dtype")


def split_options(cls: type, kwargs: dict) -> tuple[dict, dict]:
    """(base arguments, option values of the dataclass ``cls``) from a module constructor's keywords; TypeError
    naming a keyword that is neither."""
    base = {k: v for k, v in kwargs.items() if k in BASE_ARGUMENTS}
    values = {k: v for k, v in kwargs.items() if k not in BASE_ARGUMENTS}
    unknown = sorted(set(values) - set(cls.names()))
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r} (options: {', '.join(cls.names())})")
    return base, values

# Checkpoints of mgk 0.1.0 kept these directly on the attention module, before the keys moved into this submodule
# (read when they are upgraded here and by mgk.train.checkpoint.align_optimizer_state).
LEGACY_NAMES = ("k_proj.weight", "k_proj.bias", "key_shift", "pi_logits", "pi")


def _first_positions(table: Tensor, S, start: int = 0) -> Tensor:
    """``table[:, :, start:start + S]`` of per-position weights (H, M, max_len). A symbolic S (torch.export,
    torch.compile with dynamic shapes) takes them by index: the slice would make the trace guard on S != max_len
    (whether the slice is the whole table), so a length range reaching max_len would not export."""
    if isinstance(S, torch.SymInt) or isinstance(start, torch.SymInt):
        return table[:, :, start + torch.arange(S, device=table.device)]
    return table[:, :, start:start + S]


class MixtureKeys(nn.Module):
    """Keys (B, H, M, S, D) of M mixture components per key position, and their log weights.

    Args:
        kdim: width of the key input; num_heads: H; head_dim: D.
        options: :class:`MixtureOptions` (num_keys M, pi, pi_shape, pi_norm, max_len), whose fields are:
        keys: "separate" (M projections ``k_r = x W_r``) or "shifted" (one projection and learned offsets
            ``k_r = x W_k - mu_r`` with ``mu_1 = 0``, the others initialised from N(0, 0.5^2)).
        pi: "learned" (log-softmax of learned logits ``pi_logits``, never clamped, so weights at the boundary keep a
            gradient), "soft_e" (a buffer ``pi`` of shape (H, M, max_len), initialised to 1/M and written in place
            by :func:`mgk.soft_e_step`; see :class:`mgk.MGKAttention`), or "hard_e" (no weights: the max over
            components).
        pi_shape: for pi="learned", "head" (logits (H, M)), "position" (logits (H, M, max_len)) or "layer" (logits
            (1, M), one set shared by every head and position, as the authors' LRA code, ``lra/attention.py:139``).
        pi_norm: for pi="learned", "softmax" (pi = softmax of the logits over the M components, the default) or
            "none" (``pi_logits`` are free log-weights, pi = exp(pi_logits) > 0, not normalised over the components:
            with pi_shape="position" also a learned prior over key positions, the authors' LM form,
            ``language-modeling/lmtool-fwms/src/mem_transformer.py:119-120, 198``). Under "none" they start at
            log(1/M), so pi starts at 1/M (the authors' 0.5 for M = 2) and the first forward equals the softmax
            form's; unlike the authors' clamp to [0, 1], exp keeps a gradient everywhere (pi may exceed 1).
        max_len: longest key sequence; required by pi="soft_e" and pi_shape="position".
        bias: whether the key projections have biases.
        device, dtype: where and in which floating dtype the parameters and the ``pi`` buffer are created (torch's
            factory keywords; default torch's).

    Raises:
        ValueError naming the option for bad values.
    """

    # Multiplies the mixture weights pi_{h,r} (renormalised over r): (H, M) for every example or (B, H, M) per
    # example, H being this mixture's own heads (the key groups G of gmgk), None = no gate; the component form of
    # Michel et al.'s head gate (2019, eq. 2). Set by mgk.analyze.prune; 0 switches a component off exactly.
    component_gate: Tensor | None = None

    def __init__(self, kdim: int, num_heads: int, head_dim: int, options: MixtureOptions, *,
                 keys: str = "separate", bias: bool = True, device=None, dtype=None):
        super().__init__()
        factory = factory_kwargs(device, dtype)
        num_keys, pi, pi_shape = options.num_keys, options.pi, options.pi_shape
        pi_norm, max_len = options.pi_norm, options.max_len
        M = self.num_keys = positive_int(num_keys, "num_keys")
        if keys not in KEY_MODES:
            raise ValueError(f"keys must be one of {KEY_MODES}, got {keys!r}")
        if pi not in PI_MODES:
            raise ValueError(f"pi must be one of {PI_MODES}, got {pi!r}")
        if pi_shape not in PI_SHAPES:
            raise ValueError(f"pi_shape must be one of {PI_SHAPES}, got {pi_shape!r}")
        if pi_norm not in PI_NORMS:
            raise ValueError(f"pi_norm must be one of {PI_NORMS}, got {pi_norm!r}")
        if pi_norm != "softmax" and pi != "learned":
            raise ValueError(f"pi_norm={pi_norm!r} applies to learned weights only (pi='learned'), got pi={pi!r}")
        self.keys, self.pi_mode, self.pi_shape, self.pi_norm = keys, pi, pi_shape, pi_norm
        self.max_len = None if max_len is None else positive_int(max_len, "max_len")
        needs_len = pi == "soft_e" or (pi == "learned" and pi_shape == "position")
        if needs_len and self.max_len is None:
            raise ValueError(f"pi={pi!r} with per-position weights (pi_shape={pi_shape!r}) needs max_len "
                             "(the longest key sequence)")
        self.num_heads, self.head_dim = num_heads, head_dim
        H, D = num_heads, head_dim
        if keys == "separate":
            self.k_proj = nn.Linear(kdim, M * H * D, bias=bias, **factory)
        else:
            self.k_proj = nn.Linear(kdim, H * D, bias=bias, **factory)
            self.key_shift = nn.Parameter(torch.randn(M - 1, H, D, **factory) * 0.5)
        if pi == "learned":
            shape = {"head": (H, M), "layer": (1, M)}.get(pi_shape) or (H, M, self.max_len)
            start = 0.0 if pi_norm == "softmax" else -math.log(M)  # pi = 1/M either way
            self.pi_logits = nn.Parameter(torch.full(shape, start, **factory))
        elif pi == "soft_e":
            self.register_buffer("pi", torch.full((H, M, self.max_len), 1.0 / M, **factory))

    def forward(self, key: Tensor) -> Tensor:
        """Project key inputs (B, S, kdim) to mixture keys (B, H, M, S, D)."""
        k = self.project(key)
        return k if self.keys == "separate" else self.shift(k)

    def project(self, key: Tensor) -> Tensor:
        """The key projection of inputs (B, S, kdim): the M components (B, H, M, S, D) for separate keys; for
        shifted keys the one unshifted key (B, H, S, D), whose components are :meth:`shift` of it."""
        B, S, _ = key.shape
        H, D, M = self.num_heads, self.head_dim, self.num_keys
        if self.keys == "separate":
            return self.k_proj(key).view(B, S, M, H, D).permute(0, 3, 2, 1, 4)
        return self.k_proj(key).view(B, S, H, D).transpose(1, 2)

    def shifts(self, scale: float = 1.0) -> Tensor:
        """(M, H, D): the offsets mu_r of shifted keys (``k_r = k - mu_r``), mu_1 = 0, times ``scale`` (the
        attention's key_scale c, for keys already multiplied by c: the shifts live in the unscaled key space, so a
        step on them moves the scores as a step on the key projection does)."""
        H, D = self.num_heads, self.head_dim
        mu = torch.cat([self.key_shift.new_zeros(1, H, D), self.key_shift], dim=0)
        return mu if scale == 1.0 else mu * scale

    def shift(self, k: Tensor, scale: float = 1.0) -> Tensor:
        """The M components (B, H, M, S, D) of an unshifted key (B, H, S, D) (already multiplied by ``scale``, as
        :meth:`shifts`)."""
        return shifted_keys(k, self.shifts(scale))

    def position_limit(self) -> tuple[str, int] | None:
        """(option, max_len) when the weights are per key position (pi_shape="position" or pi="soft_e"), which
        then cover positions 0 .. max_len - 1 only; None otherwise."""
        if self.pi_mode == "soft_e":
            return "pi='soft_e'", self.max_len
        if self.pi_mode == "learned" and self.pi_shape == "position":
            return "pi_shape='position'", self.max_len
        return None

    def check_length(self, S: int, owner: str) -> None:
        """Raise ValueError naming S and max_len when per-position weights do not cover S keys."""
        if self.position_limit() is not None and S > self.max_len:
            raise ValueError(f"key sequence length {S} exceeds max_len={self.max_len} of this {owner} "
                             f"(per-position mixture weights exist for {self.max_len} positions)")

    def check_position(self, last: int, owner: str) -> None:
        """Raise ValueError naming the option and its limit when position ``last`` (counted from a row's first real
        token) has no per-position weight."""
        limit = self.position_limit()
        if limit is not None and last >= limit[1]:
            raise ValueError(f"{owner}: {limit[0]} has mixture weights for max_len={limit[1]} key positions (its "
                             f"trained length); position {last} is past them")

    def log_weights(self, S: int, start: int = 0) -> Tensor | None:
        """log pi broadcastable to (B, H, M, S) of key positions ``start .. start + S - 1`` (per-position weights;
        decoding a cache without padding reads its new tokens' positions this way, every row at the same ones);
        None for Hard-E. With a :attr:`component_gate` the weights are multiplied by it (and renormalised unless
        pi_norm="none")."""
        if self.pi_mode == "hard_e":
            if self.component_gate is not None:
                raise ValueError("component_gate needs mixture weights; pi='hard_e' has none")
            return None
        if self.pi_mode == "soft_e":
            pi = _first_positions(self.pi, S, start)
            log_pi = pi.clamp_min(torch.finfo(pi.dtype).tiny).log().unsqueeze(0)
        else:
            logits = (_first_positions(self.pi_logits, S, start) if self.pi_shape == "position"
                      else self.pi_logits.unsqueeze(-1))
            log_pi = (torch.log_softmax(logits, dim=1) if self.pi_norm == "softmax" else logits).unsqueeze(0)
        return log_pi if self.component_gate is None else self._gated(log_pi)

    def _gated(self, log_pi: Tensor) -> Tensor:
        """log(xi pi / sum_r xi_r pi_r) for the gate xi of :attr:`component_gate` (no renormalisation for
        pi_norm="none"). A gate of 0 is log 0 = -inf, which the functional core reads as the component switched off
        exactly; a head with every component off has every key masked, so a zero output."""
        gate, (H, M) = self.component_gate, (self.num_heads, self.num_keys)
        if gate.shape[-2:] != (H, M) or gate.dim() not in (2, 3):
            raise ValueError(f"component_gate must have shape (num_heads, num_keys) = ({H}, {M}) or (B, {H}, {M}), "
                             f"got {tuple(gate.shape)}")
        on = gate > 0
        log_gate = torch.where(on, torch.where(on, gate, 1.0).log(), float("-inf"))
        lp = log_pi + log_gate.reshape(-1, H, M, 1).to(log_pi.dtype)
        if self.pi_norm == "none" and self.pi_mode == "learned":
            return lp
        off = ~on.reshape(-1, H, M, 1).any(dim=2, keepdim=True)  # a head with no component left: keep -inf
        norm = torch.logsumexp(torch.where(off, 0.0, lp), dim=2, keepdim=True)
        return lp - torch.where(off, 0.0, norm)

    def log_weights_at(self, positions: Tensor) -> Tensor | None:
        """log pi at the key positions ``positions`` (B, S) int64 (of each row: decoding counts them from a row's
        first real token), broadcastable to (B, H, M, S); None for Hard-E. Positions must be < max_len for
        per-position weights (:meth:`check_position`)."""
        if self.position_limit() is None:
            return self.log_weights(1)
        if self.pi_mode == "soft_e":
            pi = self.pi[:, :, positions].permute(2, 0, 1, 3)  # (H, M, B, S) -> (B, H, M, S)
            log_pi = pi.clamp_min(torch.finfo(pi.dtype).tiny).log()
        else:
            logits = self.pi_logits[:, :, positions].permute(2, 0, 1, 3)
            log_pi = torch.log_softmax(logits, dim=2) if self.pi_norm == "softmax" else logits
        return log_pi if self.component_gate is None else self._gated(log_pi)  # decoding gated as the forward


def upgrade_state_dict(state_dict: dict, prefix: str, name: str = "mixture") -> None:
    """Move the mixture keys of an older checkpoint (``k_proj.*``, ``key_shift``, ``pi_logits``, ``pi`` directly
    on the attention module) under the submodule ``name``, in place, so that old checkpoints still load."""
    for old in LEGACY_NAMES:
        if prefix + old in state_dict and prefix + name + "." + old not in state_dict:
            state_dict[prefix + name + "." + old] = state_dict.pop(prefix + old)


class MixtureKeysMixin:
    """Old attribute names (``k_proj``, ``key_shift``, ``pi_logits``, ``pi``, ``keys``, ``num_keys``, ...) on a
    module that holds its :class:`MixtureKeys` as ``self.mixture``, and loading of older checkpoints."""

    mixture: MixtureKeys

    # H below is the mixture's heads: the query heads, or the G key groups of gmgk
    k_proj = property(lambda self: self.mixture.k_proj, doc="The key projection, nn.Linear from kdim to M * H * D "
                      "(separate keys) or H * D (shifted keys).")
    key_shift = property(lambda self: self.mixture.key_shift, doc="The learned key offsets (M - 1, H, D) of shifted "
                         "keys; AttributeError for separate keys.")
    pi_logits = property(lambda self: self.mixture.pi_logits, doc="The learned mixture logits: (H, M), (H, M, "
                         "max_len) or (1, M) by pi_shape; AttributeError unless pi=\"learned\".")
    pi = property(lambda self: self.mixture.pi, doc="The Soft-E mixture weights, a buffer (H, M, max_len) written by "
                  ":func:`mgk.soft_e_step`; AttributeError unless pi=\"soft_e\".")
    keys = property(lambda self: self.mixture.keys, doc='"separate" or "shifted" keys.')
    num_keys = property(lambda self: self.mixture.num_keys, doc="M, mixture components per key.")
    pi_mode = property(lambda self: self.mixture.pi_mode, doc='The option pi: "learned", "soft_e" or "hard_e".')
    pi_shape = property(lambda self: self.mixture.pi_shape, doc='"head", "position" or "layer" (learned weights).')
    pi_norm = property(lambda self: self.mixture.pi_norm, doc='"softmax" or "none" (learned weights).')
    max_len = property(lambda self: self.mixture.max_len, doc="The longest key sequence per-position weights cover, "
                       "int or None.")

    @property
    def _position_weighted(self) -> bool:
        """Whether the weights are per key position (AttentionBase then passes each row's key positions)."""
        return self.mixture.position_limit() is not None

    def _log_weights_of(self, S: int, key_positions: Tensor | None) -> Tensor | None:
        """log pi of S keys broadcastable to (B, H, M, S): at ``key_positions`` (B, S) int64 (each row's own,
        counted from its first real key) when given, else at positions 0 .. S - 1; None for Hard-E. ValueError
        naming S and max_len when per-position weights do not cover S keys."""
        self.mixture.check_length(S, type(self).__name__)
        if key_positions is None:
            return self.mixture.log_weights(S)
        return self.mixture.log_weights_at(key_positions)

    def _keys(self, key: Tensor) -> Tensor:
        return self.mixture(key)

    def _key_projection(self) -> dict[str, Tensor]:
        """The one key projection of the mixture's heads (the key groups of gmgk) that a conversion into a kind with
        one key per head reads: the mean of the M separate projections, the first-order summary of the mixture
        (``log mean_r exp(q . k_r) = q . mean_r k_r + O(spread^2)``), which a conversion's components spread around;
        shifted keys' one projection (mu_1 = 0)."""
        mixture = self.mixture
        width = mixture.num_heads * self.head_dim
        if mixture.keys != "separate":
            return dict(mixture.k_proj.named_parameters())
        return {n: t.view(mixture.num_keys, width, *t.shape[1:]).mean(dim=0)
                for n, t in mixture.k_proj.named_parameters()}

    def load_projections(self, weights: dict[str, Tensor]) -> dict[str, Tensor]:
        """The conversion rule of mixture keys from a layer with one key projection K (:func:`mgk.swap_attention`):
        queries, values and output copied; separate keys (MGK, MLK) take K plus a spread that sums to zero over the
        components, ``KEY_SPREAD * std(K)`` (``HARD_E_KEY_SPREAD`` for Hard-E) times centred Gaussian noise (biases
        copied: see :data:`KEY_SPREAD`);
        shifted keys (sMGK, sMLK) take K itself with every shift 0, so every component is K. Mixture weights stay as
        initialised (uniform). With the key-norm term removed (MGK's ``key_scale``) the layer is the source's.

        A key projection with M times the layer's width holds the M components themselves, component-major
        (:func:`mgk.convert.regroup.merge_heads`): separate keys take them as they are; shifted keys have one key
        projection and refuse them (ValueError)."""
        out = AttentionBase.load_projections(self, {k: v for k, v in weights.items() if not k.startswith("k_proj.")})
        key_w, key_b = weights["k_proj.weight"], weights.get("k_proj.bias")
        M, width = self.num_keys, self.num_heads * self.head_dim
        if M > 1 and key_w.shape[0] == M * width:
            if self.keys != "separate":
                raise ValueError(f"{type(self).__name__} has one key projection and shifts: it cannot take {M} key "
                                 "components (merging heads into components needs separate keys: mgk or mlk)")
        elif self.keys == "separate":
            noise = torch.randn(M, *key_w.shape, dtype=key_w.dtype) if M > 1 else key_w.new_zeros(1, *key_w.shape)
            spread = HARD_E_KEY_SPREAD if self.pi_mode == "hard_e" else KEY_SPREAD
            noise = (noise - noise.mean(dim=0)) * (spread * key_w.float().std().item())
            key_w = (key_w + noise).flatten(0, 1)
            key_b = None if key_b is None else key_b.repeat(M)
        out["mixture.k_proj.weight"] = key_w
        if key_b is not None and self.mixture.k_proj.bias is not None:
            out["mixture.k_proj.bias"] = key_b
        if self.keys == "shifted":
            out["mixture.key_shift"] = torch.zeros_like(self.mixture.key_shift)
        return out

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        upgrade_state_dict(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
