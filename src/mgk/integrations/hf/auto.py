"""Config and model classes of swapped Hugging Face models, registered with transformers' Auto classes, so that
``save_pretrained`` / ``from_pretrained`` / ``pipeline`` give the swapped model back without ``trust_remote_code``.

Per supported architecture (``llama``, ``mistral``, ``qwen2``, ``gpt2``, ``bert``) there is a config subclass with
its own ``model_type`` (``"mgk_" + model_type``: ``MGKLlamaConfig``, ...) and, per head the architecture has
(base model, causal LM, masked LM, sequence / token classification, question answering), a model subclass
(``MGKLlamaForCausalLM``, ``MGKGPT2LMHeadModel``, ``MGKBertForMaskedLM``, ...) whose ``__init__`` builds the
base model and swaps its attention as the config's :data:`RECORD` attribute says. :func:`mgk.swap_attention` turns
a model (and its config) into these classes (:func:`adopt`), so ``save_pretrained`` writes the mgk model type; a
folder of that type loads only where this module was imported (``import mgk.integrations.hf``): transformers alone
refuses it with its "does not recognize this architecture" error naming the model type.
"""
from __future__ import annotations

from typing import Callable

import transformers
from transformers import PreTrainedModel

from .maps import listen_for_maps

__all__ = ["MODEL_TYPES", "RECORD", "adopt", "base_model_type", "mgk_class", "record_of", "register"]

RECORD = "mgk_attention"  # the config attribute: {"kind", "num_heads", "head_dim", "seed", "options"}

# model_type -> the prefix of its transformers classes
_PREFIX = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "gpt2": "GPT2", "bert": "Bert"}
# Auto class -> the suffix of an architecture's class for it (GPT-2's causal LM has its own name)
_HEADS = {"AutoModel": "Model", "AutoModelForCausalLM": "ForCausalLM", "AutoModelForMaskedLM": "ForMaskedLM",
          "AutoModelForSequenceClassification": "ForSequenceClassification",
          "AutoModelForTokenClassification": "ForTokenClassification",
          "AutoModelForQuestionAnswering": "ForQuestionAnswering"}
_RENAMED = {"GPT2ForCausalLM": "GPT2LMHeadModel"}

MODEL_TYPES = {t: f"mgk_{t}" for t in _PREFIX}  # base model_type -> the mgk one
_BASE_TYPE = {v: k for k, v in MODEL_TYPES.items()}
_CONFIGS: dict[str, type] = {}  # mgk model_type -> config class
_MODELS: dict[type, type] = {}  # transformers model class -> its mgk subclass
# what swaps a freshly built model as its config records (swap.swap_from_config), handed to register: the swap
# itself adopts models into these classes, so this module takes it as an argument instead of importing it
_BUILD: list[Callable[[PreTrainedModel], None]] = []


def base_model_type(model_type: str | None) -> str | None:
    """The transformers model_type an mgk one (``"mgk_llama"``) was made from; any other is returned as it is."""
    return _BASE_TYPE.get(model_type, model_type)


def mgk_class(cls: type) -> type | None:
    """The mgk subclass of the transformers model class ``cls`` (``cls`` itself when it is one), or None."""
    return cls if cls in _MODELS.values() else _MODELS.get(cls)


def record_of(config) -> dict:
    """The swap recorded in ``config`` (its :data:`RECORD` attribute, written by :func:`mgk.swap_attention`).

    Raises:
        ValueError in one line when it is missing or has no ``kind`` (a config of an mgk model type made by hand
        without it, or a plain model's config).
    """
    record = getattr(config, RECORD, None)
    if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
        raise ValueError(f"{type(config).__name__}.{RECORD} must be a dict naming the attention kind (written by "
                         f"mgk.swap_attention, e.g. {{'kind': 'mgk', 'options': {{'num_keys': 2}}}}), got {record!r}")
    return record


def adopt(model: PreTrainedModel, record: dict) -> None:
    """Make the swapped ``model`` one of this module's classes: its config an mgk config holding ``record`` (so
    ``save_pretrained`` writes the mgk model type and the swap), and every model with a head in it (a causal or
    masked LM, a classifier, ...) the mgk subclass of its class, where there is one. A base model (``LlamaModel``)
    and a class without an mgk subclass keep their class; their saved folder loads through the Auto classes all
    the same (as the mgk class those map the mgk model type to). Its base models then tell its mgk modules when a
    call asks for ``output_attentions`` (:func:`mgk.integrations.hf.maps.listen_for_maps`: GPT-2 does not pass the
    flag on to its attention)."""
    config = model.config
    config.__class__ = _CONFIGS[MODEL_TYPES[base_model_type(config.model_type)]]
    setattr(config, RECORD, record)
    for module in model.modules():
        new = mgk_class(type(module)) if isinstance(module, PreTrainedModel) else None
        # a base model (LlamaModel, ...: its own base_model) keeps its class: transformers 5 finds what its
        # forward records for output_attentions / output_hidden_states by the class it was built as
        if new is not None and type(module) is not new and module.base_model is not module:
            module.__class__ = new
    listen_for_maps(model)


def _config_class(model_type: str, base: type) -> type:
    name = f"MGK{base.__name__}"
    return type(name, (base,), {
        "model_type": MODEL_TYPES[model_type], "__module__": __name__, "__qualname__": name,
        "__doc__": f"{base.__name__} of a model whose attention :func:`mgk.swap_attention` replaced; the swap (kind, "
                   f"num_heads, head_dim, seed, options) is its ``{RECORD}`` attribute (a dict)."})


def _model_class(base: type, config_class: type) -> type:
    name = f"MGK{base.__name__}"

    def __init__(self, config, *args, **kwargs):
        base.__init__(self, config, *args, **kwargs)
        _BUILD[0](self)

    return type(name, (base,), {
        "config_class": config_class, "__init__": __init__, "__module__": __name__, "__qualname__": name,
        "__doc__": f"{base.__name__} with the attention its config's ``{RECORD}`` names, swapped in by "
                   f":func:`mgk.swap_attention` when it is built (``from_pretrained`` then loads the mgk weights)."})


def register(build: Callable[[PreTrainedModel], None]) -> None:
    """Make the config and model classes of every supported architecture (module attributes of this module) and
    register them with transformers' AutoConfig and Auto model classes; called once, by ``mgk.integrations.hf``'s
    import, after its other modules (reading a model class makes transformers re-execute its own ``__init__`` and
    put a new ``transformers`` module in ``sys.modules``, so mgk's modules bind the one imported first).

    ``build(model)`` swaps a model of these classes as its config's :data:`RECORD` says, when it is built
    (:func:`mgk.integrations.hf.swap.swap_from_config`)."""
    if _CONFIGS:
        return
    _BUILD[:] = [build]
    for model_type, prefix in _PREFIX.items():
        base_config = getattr(transformers, f"{prefix}Config")
        config_class = _config_class(model_type, base_config)
        _CONFIGS[config_class.model_type] = config_class
        globals()[config_class.__name__] = config_class
        __all__.append(config_class.__name__)
        transformers.AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        for auto_name, suffix in _HEADS.items():
            class_name = _RENAMED.get(prefix + suffix, prefix + suffix)
            base = getattr(transformers, class_name, None)
            auto = getattr(transformers, auto_name, None)
            if base is None or auto is None:
                continue
            model_class = _model_class(base, config_class)
            _MODELS[base] = model_class
            globals()[model_class.__name__] = model_class
            __all__.append(model_class.__name__)
            auto.register(config_class, model_class, exist_ok=True)

