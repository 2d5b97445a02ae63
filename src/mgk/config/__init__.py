"""Run configuration: nested typed dataclasses (:mod:`mgk.config.groups`), presets as instances, ``--set`` overrides
by flat or dotted keys (:mod:`mgk.config.keys`), the one check (:func:`validate`), config.yaml's form
(:mod:`mgk.config.serialize`) and the model configurations derived from it (:mod:`mgk.config.derive`).

Presets live beside their tasks (``mgk.tasks.<task>.PRESETS``); one that reproduces the paper cites its source.
Every field can be set from the command line by its flat name (``--set pi=soft_e``, the keys of 0.1.0 run
directories) or its dotted path (``--set optim.lr=3e-4``); unknown keys and values that do not parse as the field's
type are errors.
"""
from .checks import validate
from .derive import attention_config, encoder_config, lm_config, model_differences
from .groups import GROUPS, PRECISIONS, SCHEDULES, DataConfig, EvalConfig, ModelConfig, OptimConfig, RunConfig
from .keys import (
    RENAMES,
    apply_overrides,
    field_of,
    flat,
    flat_keys,
    flat_name,
    replace,
    run_config,
    with_forms,
)
from .serialize import from_dict, to_dict

__all__ = ["RunConfig", "DataConfig", "ModelConfig", "OptimConfig", "EvalConfig", "GROUPS", "SCHEDULES",
           "PRECISIONS", "RENAMES", "apply_overrides", "replace", "flat", "flat_keys", "flat_name",
           "field_of", "run_config", "with_forms", "validate", "to_dict", "from_dict", "attention_config",
           "encoder_config", "lm_config", "model_differences"]
