"""mgk: Transformer-MGK attention (mixture of Gaussian keys, Nguyen et al., ICML 2022) and its experiment harness.

Public modules (drop-ins for ``torch.nn.MultiheadAttention``): :class:`MultiheadAttention` (softmax baseline),
:class:`MGKAttention` (MGK / sMGK, learned pi, Soft-E, Hard-E), :class:`LinearAttention`, :class:`MLKAttention`,
:class:`GroupedQueryAttention` (GQA / MQA) and :class:`GroupedMGKAttention` (mixture keys shared by groups of query
heads), built by kind name (:func:`build_attention`) or from an :class:`AttentionConfig`, and
:func:`swap_attention`, which puts them into an existing model with its weights; the math is in
:mod:`mgk.functional`.
:func:`soft_e_step` applies the Soft-E update of pi after backward. :func:`load_run` gets a trained run back (its
model, config and tokenizer). Every module decodes with a cache (``forward(x, past_key_values=module.new_cache(),
is_causal=True, need_weights=False)``; :class:`DecodingCache` holds one per layer,
:meth:`mgk.models.TransformerLM.generate` uses it).
"""
from .attention import (
    AttentionConfig,
    DecodingCache,
    GroupedMGKAttention,
    GroupedQueryAttention,
    LinearAttention,
    MGKAttention,
    MLKAttention,
    MultiheadAttention,
    attention_kinds,
    build_attention,
    soft_e_step,
)
from .swap import swap_attention

__version__ = "0.2.0"
__all__ = ["MGKAttention", "MultiheadAttention", "attention_kinds", "build_attention", "__version__"]
__all__ += ["LinearAttention", "MLKAttention", "AttentionConfig", "soft_e_step", "swap_attention", "DecodingCache",
            "LoadedRun", "load_run", "GroupedQueryAttention", "GroupedMGKAttention"]


_LAZY = ("load_run", "LoadedRun")


def __dir__() -> list[str]:
    # PEP 562: without this, dir(mgk) and tab completion miss the lazily imported names
    return sorted({*globals(), *_LAZY})


def __getattr__(name: str):
    # load_run needs the tasks, data readers and training layer: imported on first use, so that `import mgk` for the
    # attention modules stays light.
    if name in _LAZY:
        from .train import load

        return getattr(load, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
