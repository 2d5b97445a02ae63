"""A refused conversion changes nothing (the strong exception guarantee of :func:`mgk.swap_attention`).

:func:`unchanged_on_error` records what a conversion can change in a model before it starts: the class and the
attributes of every module (the contents of its dicts and lists included: children, parameters, buffers, hooks)
and of every Hugging Face config a module holds (``model.config``, whose class and attributes the swap rewrites).
When the body raises, every recorded object gets its class and attributes back, in place (the same module and dict
objects, so references a caller holds, and hook handles, stay valid), and the exception goes on. Tensors are not
copied: a conversion reads the old weights and never writes them, so the old parameters, put back, are as they were.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

__all__ = ["unchanged_on_error"]


@contextlib.contextmanager
def unchanged_on_error(model: nn.Module) -> Iterator[None]:
    """Run the body; when it raises, put ``model`` back as it was before (module tree, classes, attributes,
    configs), then re-raise. Nothing is restored when the body returns."""
    saved = [_record(obj) for obj in _objects(model)]
    try:
        yield
    except BaseException:
        for obj, cls, attributes in saved:
            _restore(obj, cls, attributes)
        raise


def _objects(model: nn.Module) -> list:
    """Every module of ``model`` and every config object its modules hold, each once."""
    found: dict[int, object] = {}
    for module in model.modules():
        found.setdefault(id(module), module)
        config = module.__dict__.get("config")
        if config is not None and hasattr(config, "__dict__") and not isinstance(config, nn.Module):
            found.setdefault(id(config), config)
    return list(found.values())


def _record(obj) -> tuple[object, type, dict]:
    """(obj, its class, {attribute: (value, a copy of its items when it is a dict or list, else None)})."""
    attributes = {}
    for name, value in vars(obj).items():
        items = list(value.items()) if isinstance(value, dict) else list(value) if isinstance(value, list) else None
        attributes[name] = (value, items)
    return obj, type(obj), attributes


def _restore(obj, cls: type, attributes: dict) -> None:
    """Give ``obj`` back its class and recorded attributes (dicts and lists refilled in place); attributes added
    since are removed."""
    if type(obj) is not cls:
        obj.__class__ = cls
    own = vars(obj)
    for name in [n for n in own if n not in attributes]:
        del own[name]
    for name, (value, items) in attributes.items():
        if isinstance(value, dict):
            value.clear()
            value.update(items)
        elif isinstance(value, list):
            value[:] = items
        own[name] = value
