"""mgk's attention kinds in Hugging Face transformers models: Llama-family (Llama, Mistral, Qwen2), GPT-2 and BERT.

Needs the optional extra ``hf`` (``pip install -e ".[hf]"``, transformers :data:`TRANSFORMERS_RANGE`). Call
:func:`mgk.swap_attention` on a transformers model (it imports this package only then)::

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(...))
    mgk.swap_attention(model, "mgk", num_keys=4)
    model.generate(input_ids, attention_mask=mask, max_new_tokens=20)

Each attention module is replaced by :class:`HFAttention`, which holds the mgk module of the kind (built through
:func:`mgk.build_attention`, weights carried by :func:`mgk.swap_attention`'s rules) and keeps the model's rotary
embeddings, padding mask and causality; during generation each layer's cache is mgk's own
(:class:`MGKCacheLayer`).

Importing this package registers mgk's config and model classes with transformers' Auto classes
(:mod:`mgk.integrations.hf.auto`): a swapped model saved with ``save_pretrained`` loads back with
``transformers.AutoModelForCausalLM.from_pretrained(path)`` (or ``pipeline``) in any process that ran
``import mgk.integrations.hf``. LoRA adapters: :func:`lora_target_modules`, :func:`convert_lora_adapter`.
See docs/hf.md.
"""
from __future__ import annotations

from .versions import REQUIREMENT, TRANSFORMERS_RANGE

try:
    import transformers  # noqa: F401
except ImportError as err:
    raise ImportError(f"mgk.integrations.hf needs Hugging Face transformers: pip install -e '.[hf]' ({REQUIREMENT})"
                      ) from err

from .adapters import convert_lora_adapter, lora_target_modules
from .attention import HFAttention, key_valid
from .auto import MODEL_TYPES, register
from .cache import MGKCacheLayer, mgk_layer
from .swap import SUPPORTED, swap_attention, swap_from_config

register(swap_from_config)  # the Auto classes load the mgk model types from here on (see .auto)

__all__ = ["HFAttention", "MGKCacheLayer", "MODEL_TYPES", "REQUIREMENT", "SUPPORTED", "TRANSFORMERS_RANGE",
           "convert_lora_adapter", "key_valid", "lora_target_modules", "mgk_layer", "swap_attention"]
