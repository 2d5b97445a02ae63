"""The shape of src/mgk, read with ast: imports only go down the layers, and no function is over 80 lines."""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Each top-level part of mgk may import from its own layer and the layers below, never from a layer above.
LAYERS = {
    "atomic": 0, "fields": 0, "functional": 0,  # the attention math, the atomic file writer, declared fields
    "attention": 1,                          # nn.Modules over the functional core
    "models": 2,                             # model families built from attention modules
    "config": 3, "data": 3,                  # the run configuration (built from model configs); datasets, caches
    "tasks": 4,                              # a task = its data, its model and its metric
    "train": 5,                              # the loop, checkpoints, evaluation
    "analyze": 6, "bench": 6, "generate": 6, "reproduce": 6, "cli": 6, "__main__": 6,  # entry points
}
MAX_FUNCTION_LINES = 80


def _modules():
    """(dotted name, path, parsed tree) of every module under src/mgk."""
    for path in sorted((SRC / "mgk").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield name, path, ast.parse(path.read_text(), filename=str(path))


def _imported(name: str, path: Path, tree: ast.AST):
    """(line, dotted module) of every import of an mgk module in ``tree``, relative imports resolved."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from . import x` / `from mgk import x` may name a submodule: count each name as one
            if node.module is None or target == "mgk":
                for alias in node.names:
                    yield node.lineno, f"{target}.{alias.name}"
            else:
                yield node.lineno, target


def _part(dotted: str) -> str | None:
    """The top-level part of mgk a dotted module belongs to (None for the package root itself)."""
    bits = dotted.split(".")
    return bits[1] if len(bits) > 1 and bits[0] == "mgk" else None


def test_every_part_of_mgk_has_a_layer():
    parts = {path.stem if path.is_file() else path.name for path in (SRC / "mgk").iterdir()
             if (path.suffix == ".py" and path.stem != "__init__") or (path / "__init__.py").exists()}
    missing = sorted(parts - set(LAYERS))
    assert not missing, f"add these parts of src/mgk to LAYERS in {Path(__file__).name}: {missing}"


def test_no_module_imports_from_a_higher_layer():
    wrong = []
    for name, path, tree in _modules():
        here = _part(name)
        if here is None:  # mgk/__init__.py re-exports the public API of every layer
            continue
        for line, target in _imported(name, path, tree):
            there = _part(target)
            if there in LAYERS and LAYERS[there] > LAYERS[here]:
                wrong.append(f"{path.relative_to(SRC)}:{line} ({here}, layer {LAYERS[here]}) imports {target} "
                             f"({there}, layer {LAYERS[there]})")
    assert not wrong, "imports from a higher layer:\n" + "\n".join(wrong)


def test_the_layer_check_sees_an_upward_import():
    """The checker itself: a data module importing the trainer is reported (relative and absolute forms)."""
    tree = ast.parse("from ..train import checkpoint\nimport mgk.train.loop\nfrom . import cache\n")
    found = [(line, t) for line, t in _imported("mgk.data.text", SRC / "mgk" / "data" / "text.py", tree)]
    assert found == [(1, "mgk.train"), (2, "mgk.train.loop"), (3, "mgk.data.cache")]
    assert [_part(t) for _, t in found] == ["train", "train", "data"]


def _long_functions(max_lines: int):
    for _, path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > max_lines:
                    yield f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({n} lines)"


def test_no_function_in_src_is_over_80_lines():
    long = list(_long_functions(MAX_FUNCTION_LINES))
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps):\n" + "\n".join(long)


def test_the_length_check_sees_long_functions():
    """The checker itself: at a small limit it does report functions (so the real check can fail)."""
    assert list(_long_functions(10))
