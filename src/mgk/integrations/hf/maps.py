"""How ``output_attentions=True`` reaches mgk's attention modules in a transformers model.

transformers 5 reads the flag in each base model's ``forward`` (``LlamaModel``, ``GPT2Model``, ``BertModel``: the
one that collects the maps) and passes it on to the attention modules of some families only: the Llama family and
BERT do, GPT-2 drops it before its layers and records its own attention's maps by class hooks instead. An mgk module
that is not told computes no maps, and the model would return an empty tuple without a word. So every base model of
a swapped model tells its :class:`~mgk.integrations.hf.HFAttention` modules, for the length of its call, whether the
maps were asked for (the keyword, else ``config.output_attentions``, as transformers resolves it), through forward
hooks on the model: public torch hooks, module-level functions (the model still pickles), no transformers code
patched.
"""
from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel

from .attention import HFAttention

__all__ = ["listen_for_maps"]


def _asked(model: nn.Module, kwargs: dict) -> bool:
    """Whether the call of base model ``model`` with keyword arguments ``kwargs`` asks for the attention maps."""
    flag = kwargs.get("output_attentions")
    if flag is None:
        flag = getattr(model.config, "output_attentions", False)
    return bool(flag)


def _tell(model: nn.Module, asked: bool) -> None:
    for module in model.modules():
        if isinstance(module, HFAttention):
            module.maps_asked = asked


def _before(model: nn.Module, args, kwargs) -> None:
    """Forward pre-hook: the model's mgk modules compute their maps for this call when it asks for them."""
    if _asked(model, kwargs):
        _tell(model, True)


def _after(model: nn.Module, args, kwargs, output) -> None:
    """Forward hook (also when the call raised): the call is over, the modules are told nothing any more."""
    if _asked(model, kwargs):
        _tell(model, False)


def listen_for_maps(model: nn.Module) -> None:
    """Put the hooks that tell mgk's modules of ``output_attentions`` on every base model in ``model`` (a
    ``PreTrainedModel`` that is its own ``base_model``) that holds one, once (a model swapped again keeps them)."""
    for module in model.modules():
        if not isinstance(module, PreTrainedModel) or module.base_model is not module:
            continue
        if getattr(module, "_mgk_listens_for_maps", False):
            continue
        if any(isinstance(m, HFAttention) for m in module.modules()):
            module.register_forward_pre_hook(_before, with_kwargs=True)
            module.register_forward_hook(_after, with_kwargs=True, always_call=True)
            module._mgk_listens_for_maps = True
