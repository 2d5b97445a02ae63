"""Every built-in kind's module class is public: importable from ``mgk`` and ``mgk.attention`` and listed in their
``__all__`` (which the API reference pages document), as MGKAttention is."""
import mgk
import mgk.attention
from mgk.attention import attention_kinds, get_kind


def _builtin_module_classes() -> dict[str, type]:
    """name -> class of the module each kind of mgk's own builds (kinds registered by tests live elsewhere)."""
    classes = {}
    for kind in attention_kinds():
        factory = get_kind(kind).factory
        cls = getattr(factory, "func", factory)  # smgk, mlk, smlk: a partial of their class with keys=...
        if cls.__module__.startswith("mgk.attention."):
            classes[cls.__name__] = cls
    return classes


def test_every_kinds_module_class_is_exported_from_mgk_and_mgk_attention():
    classes = _builtin_module_classes()
    assert {"MultiheadAttention", "MGKAttention", "GroupedQueryAttention", "GroupedMGKAttention"} <= set(classes)
    missing = [f"{package.__name__}.{name}" for name, cls in classes.items() for package in (mgk, mgk.attention)
               if name not in package.__all__ or getattr(package, name, None) is not cls]
    assert not missing, f"module classes not exported: {missing}"
