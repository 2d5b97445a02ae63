"""The options of each attention kind as frozen dataclasses: types, defaults, choices, ranges and docs in one place.

Each field is declared with :func:`mgk.fields.spec`; :meth:`Options.check` validates an instance (types, choices,
ranges, and options that apply only under another option's value, such as ``pi_shape`` under ``pi="learned"``).
The choices are the modules' own constants, so a value the module accepts is a value the options accept.
:mod:`mgk.attention.kinds` says which kind takes which dataclass.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .. import fields
from ..fields import Label, spec
from ..functional.linear import EPS_MODES, FEATURE_MAPS, MIX, NORMALIZE
from .mixture_keys import PI_MODES, PI_NORMS, PI_SHAPES

__all__ = ["Options", "SoftmaxOptions", "MixtureOptions", "MGKOptions", "LinearOptions", "MLKMixtureOptions",
           "MLKOptions"]


@dataclass(frozen=True)
class Options:
    """Base of every kind's options (softmax attention takes none). A list given for a tuple option is kept as a
    tuple (options are frozen and hashable)."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if isinstance(getattr(self, f.name), list):
                object.__setattr__(self, f.name, tuple(getattr(self, f.name)))

    def check(self, kind: str) -> "Options":
        """``self`` when every field is valid; ValueError naming the first bad option and ``kind``."""
        fields.check(self, name=lambda n: f"attention option {n!r} of kind {kind!r}")
        return self

    def as_kwargs(self) -> dict:
        """The options as keyword arguments of the kind's module constructor."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The option names, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def reset_inapplicable(self, keep=()) -> "Options":
        """A copy with every option whose ``only_if`` condition fails set back to its default, except those named
        in ``keep`` (a user set them: :meth:`check` then reports them)."""
        resets = {n: type(self).__dataclass_fields__[n].default for n in fields.inapplicable(self) if n not in keep}
        return dataclasses.replace(self, **resets) if resets else self


@dataclass(frozen=True)
class SoftmaxOptions(Options):
    """Softmax attention (Vaswani et al. 2017) has no options."""


_PI_LABEL = Label({"soft_e": "Soft-E", "hard_e": "Hard-E"}, short="{value}")


@dataclass(frozen=True)
class MixtureOptions(Options):
    """The mixture keys shared by MGK and MLK (Nguyen et al. 2022, eq. 9-10 and 14;
    :class:`mgk.attention.mixture_keys.MixtureKeys`)."""

    num_keys: int = spec(2, ge=1, doc="M, mixture components per key (the paper uses 2)")
    pi: str = spec("learned", choices=PI_MODES, label=_PI_LABEL,
                   doc="mixture weights: 'learned' (softmax of learned logits), 'soft_e' (a buffer set by the E-step, "
                       "paper '+Soft-E') or 'hard_e' (max over components, paper '+Hard-E')")
    pi_shape: str = spec("head", choices=PI_SHAPES, only_if=("pi", "learned"),
                         doc="learned weights per 'head' (H, M), per 'position' (H, M, max_len) or per 'layer' (1, M)")
    pi_norm: str = spec("softmax", choices=PI_NORMS, only_if=("pi", "learned"),
                        doc="'softmax' over the components, or 'none': free log-weights (the authors' LM and LRA code)")
    max_len: int | None = spec(None, ge=1, doc="longest key sequence; needed by pi='soft_e' and pi_shape='position' "
                                               "(a run config fills it in from its max_len)")


@dataclass(frozen=True)
class MGKOptions(MixtureOptions):
    """MGK / sMGK (Nguyen et al. 2022, Sections 2-3): the mixture keys and the Gaussians' variances."""

    # str last: --set text parses as the first alternative that fits, and any text is a str
    sigma2: float | tuple[float, ...] | str | None = spec(
        None, gt=0, choices=("learned",), label=Label({"learned": "learned variances"}),
        doc="per-component variances: None (sqrt(head_dim) each), one float for all, M floats (the authors' LM: "
            "(sqrt(D), sqrt(D) / 3)), or 'learned' (per head and component, trained, positive by construction)")


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

    pi: str = spec("learned", choices=("learned",), label=_PI_LABEL,
                   why="MLK's weights are learned, pi='learned'; Soft-E and Hard-E are MGK ablations built on the "
                       "Gaussian kernel", doc="mixture weights: 'learned' only")
    mix: str = spec("features", choices=MIX, label=Label(),
                    doc="'features' (eq. 14: sum_r pi_r phi(k_r)) or 'keys' (phi(sum_r pi_r k_r), the authors' LRA)")


@dataclass(frozen=True)
class MLKOptions(LinearOptions, MLKMixtureOptions):
    """MLK / sMLK (Nguyen et al. 2022, eq. 14): the mixture keys (:class:`MLKMixtureOptions`) and the linear form
    (:class:`LinearOptions`)."""
