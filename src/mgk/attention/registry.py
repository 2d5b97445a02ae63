"""Attention kinds by name, so that every model and the CLI choose attention the same way.

Each kind declares the options it takes, with their types; an option the chosen kind does not take is an error
naming the option and the kind, never silently dropped (a silently dropped ``pi="soft_e"`` would train softmax
attention while the run's records claimed Soft-E).
"""
from __future__ import annotations

from typing import Callable, Mapping

from torch import nn

from .linear import LinearAttention, MLKAttention
from .mgk import MGKAttention
from .softmax import MultiheadAttention

_MIXTURE = {"num_keys": (int,), "pi": (str,), "pi_shape": (str,), "pi_norm": (str,),
            "sigma2": (type(None), int, float, list, tuple), "max_len": (type(None), int)}
# The form of linear attention (mgk.functional.linear_attention); "attn_eps" is the modules' ``eps`` (a run's
# config also has the optimiser's adam_eps).
_LINEAR = {"normalize": (str,), "feature_map": (str,), "output_scale": (int, float), "attn_eps": (int, float),
           "eps_mode": (str,)}
# MLK takes "pi" so that soft_e / hard_e reach it and are refused with its own message (only "learned" is defined).
_MLK = {**{k: v for k, v in _MIXTURE.items() if k != "sigma2"}, **_LINEAR, "mix": (str,)}

_REGISTRY: dict[str, Callable[..., nn.Module]] = {}
_KIND_OPTIONS: dict[str, dict[str, tuple[type, ...]]] = {}


def register(name: str, factory: Callable[..., nn.Module], options: Mapping[str, tuple[type, ...] | type]) -> None:
    """Add an attention kind:
    ``factory(embed_dim, num_heads, *, head_dim, dropout, bias, batch_first, **options) -> nn.Module``.

    ``options`` maps each option the kind takes to its accepted type(s), e.g. ``{"num_keys": int}``."""
    _REGISTRY[name] = factory
    _KIND_OPTIONS[name] = {k: (t if isinstance(t, tuple) else (t,)) for k, t in options.items()}


def attention_kinds() -> tuple[str, ...]:
    """Names accepted by :func:`build_attention` (and ``mgk train --attention``)."""
    return tuple(_REGISTRY)


def attention_options(kind: str) -> dict[str, tuple[type, ...]]:
    """The options ``kind`` takes, name -> accepted types (empty for "softmax"). ValueError for an unknown kind."""
    _check_kind(kind)
    return dict(_KIND_OPTIONS[kind])


def check_options(kind: str, options: Mapping[str, object]) -> None:
    """ValueError naming the first option that ``kind`` does not take, or whose value has the wrong type."""
    declared = attention_options(kind)
    for name, value in options.items():
        if name not in declared:
            takes = ", ".join(declared) or "no options"
            raise ValueError(f"attention option {name!r} does not apply to attention kind {kind!r} "
                             f"({kind} takes {takes})")
        if not isinstance(value, declared[name]):
            allowed = " or ".join(t.__name__ for t in declared[name])
            raise ValueError(f"attention option {name!r} of kind {kind!r} must be {allowed}, got {value!r}")


def build_attention(kind: str, embed_dim: int, num_heads: int, *, head_dim: int | None = None,
                    dropout: float = 0.0, bias: bool = True, batch_first: bool = True, kdim: int | None = None,
                    vdim: int | None = None, **options) -> nn.Module:
    """Build the attention module ``kind`` ("softmax", "mgk", "smgk", "linear", "mlk", "smlk").

    ``options`` are the kind's own (:func:`attention_options`): num_keys, pi, pi_shape, pi_norm, sigma2, max_len for
    the mixture kinds (Nguyen et al. 2022, Sections 2-3); normalize, feature_map, output_scale, attn_eps, eps_mode
    for linear attention (:func:`mgk.functional.linear_attention`), and those plus mix for MLK (no sigma2); none for
    softmax. ``batch_first`` is the layout (True: (B, T, E), mgk's models; False: (T, B, E), torch's default);
    ``kdim`` / ``vdim`` the widths of key and value inputs (default embed_dim), passed on only when given.
    Raises ValueError for an unknown kind, or an option the kind does not take (naming both).
    """
    check_options(kind, options)
    widths = {k: v for k, v in (("kdim", kdim), ("vdim", vdim)) if v is not None}
    return _REGISTRY[kind](embed_dim, num_heads, head_dim=head_dim, dropout=dropout, bias=bias,
                           batch_first=batch_first, **widths, **options)


def _check_kind(kind: str) -> None:
    if kind not in _REGISTRY:
        raise ValueError(f"unknown attention kind {kind!r}; choose one of {attention_kinds()}")


register("softmax", MultiheadAttention, {})
register("mgk", lambda e, h, **kw: MGKAttention(e, h, keys="separate", **kw), _MIXTURE)
register("smgk", lambda e, h, **kw: MGKAttention(e, h, keys="shifted", **kw), _MIXTURE)

def _eps(kw: dict) -> dict:
    """The registry's ``attn_eps`` as the modules' ``eps``."""
    if "attn_eps" in kw:
        kw["eps"] = kw.pop("attn_eps")
    return kw


register("linear", lambda e, h, **kw: LinearAttention(e, h, **_eps(kw)), _LINEAR)
register("mlk", lambda e, h, **kw: MLKAttention(e, h, keys="separate", **_eps(kw)), _MLK)
register("smlk", lambda e, h, **kw: MLKAttention(e, h, keys="shifted", **_eps(kw)), _MLK)
