"""Every public function, class, method and property of mgk's public modules has a docstring (the API reference is
generated from them and leaves out what has none), read with ast."""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# nn.Module's repr hook: its docstring is torch's, which says what it is; each module's own says nothing more.
INHERITED = {"extra_repr"}


def _public(name: str) -> bool:
    return not name.startswith("_")


def _undocumented_property(node: ast.stmt) -> str | None:
    """The name of ``name = property(getter)`` given without ``doc=`` (a lambda getter has no docstring either)."""
    if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
        return None
    call = node.value
    if not (isinstance(call.func, ast.Name) and call.func.id == "property"):
        return None
    if any(k.arg == "doc" for k in call.keywords) or len(call.args) >= 4:
        return None
    names = [t.id for t in node.targets if isinstance(t, ast.Name) and _public(t.id)]
    return names[0] if names else None


def undocumented(tree: ast.Module, module: str):
    """``module:line name`` of each public def, class, method or property of ``tree`` without a docstring."""
    def visit(body, prefix: str, in_class: bool):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _public(node.name):
                if ast.get_docstring(node) is None and not (in_class and node.name in INHERITED):
                    yield f"{module}:{node.lineno} {prefix}{node.name}"
                if isinstance(node, ast.ClassDef):
                    yield from visit(node.body, f"{prefix}{node.name}.", True)
            elif in_class and (name := _undocumented_property(node)):
                yield f"{module}:{node.lineno} {prefix}{name}"

    yield from visit(tree.body, "", False)


def _public_modules():
    """(path relative to src, parsed tree) of every module under src/mgk that no private part names."""
    for path in sorted((SRC / "mgk").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        if all(_public(p) or p in ("__init__", "__main__") for p in parts):
            yield path.relative_to(SRC), ast.parse(path.read_text(), filename=str(path))


def test_every_public_name_of_mgk_has_a_docstring():
    missing = [line for path, tree in _public_modules() for line in undocumented(tree, str(path))]
    assert not missing, "public names without a docstring (the API reference leaves them out):\n" + "\n".join(missing)


def test_the_docstring_check_sees_undocumented_names():
    """The checker itself: each undocumented form is reported, documented and private ones are not."""
    tree = ast.parse(
        "def f():\n    pass\n"
        "def g():\n    '''Doc.'''\n"
        "def _h():\n    pass\n"
        "class C:\n"
        "    x = property(lambda self: 1)\n"
        "    y = property(lambda self: 1, doc='Doc.')\n"
        "    def forward(self):\n        pass\n"
        "    def extra_repr(self):\n        return ''\n"
        "    class Inner:\n        '''Doc.'''\n        def m(self):\n            pass\n")
    assert list(undocumented(tree, "m.py")) == ["m.py:1 f", "m.py:7 C", "m.py:8 C.x", "m.py:10 C.forward",
                                                "m.py:16 C.Inner.m"]
