"""The shape of src/mgk, read with ast: imports only go down the layers, and no function is over 80 lines."""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Each top-level part of mgk may import from its own layer and the layers below, never from a layer above.
LAYERS = {
    "argtypes": 0, "atomic": 0, "choices": 0, "fields": 0, "functional": 0, "seeds": 0,  # the attention math,
    # file writer, fields, names and numbers of the command line, the range of seeds torch takes
    "attention": 1,                          # nn.Modules over the functional core
    "figures": 1,                            # the style of every figure: a colour per kind from attention's registry
    "convert": 2,                            # converting trained layers into other kinds: rules and head measures
    "models": 2,                             # model families built from attention modules
    "integrations": 3,                       # attention modules inside other libraries' models, converted by convert
    "swap": 4,                               # swap_attention: torch models here, Hugging Face ones to integrations
    "config": 4, "data": 4,                  # the run configuration (built from model configs); datasets, caches
    "tasks": 5,                              # a task = its data, its model and its metric
    "train": 6,                              # the loop, checkpoints, evaluation
    "analyze": 7, "bench": 7, "generate": 7, "reproduce": 7, "retrofit": 7, "recovery": 7, "cli": 7,
    "__main__": 7,                           # entry points (retrofit: --init-from; recovery: mgk convert)
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


# --------------------------------------------------------------------------- other packages' private modules


def _private_imports(tree: ast.AST):
    """(line, import) of every import of another package's private module or name (a dotted part or an imported
    name that starts with one underscore): ``import torch._dynamo``, ``from torch._C import x``,
    ``from torch.nn.functional import _in_projection``. Relative imports are mgk's own."""
    def private(dotted: str) -> bool:
        return any(p.startswith("_") and not p.startswith("__") for p in dotted.split("."))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "mgk" and private(alias.name):
                    yield node.lineno, f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] == "mgk":
                continue
            names = [a.name for a in node.names if private(a.name)]
            if private(node.module) or names:
                yield node.lineno, f"from {node.module} import {', '.join(names or [a.name for a in node.names])}"


def test_no_module_imports_another_packages_private_modules():
    wrong = [f"{path.relative_to(SRC)}:{line} {what}" for _, path, tree in _modules()
             for line, what in _private_imports(tree)]
    assert not wrong, "imports of other packages' private modules (use their public API):\n" + "\n".join(wrong)


def test_the_private_import_check_sees_a_private_import():
    tree = ast.parse("import torch._dynamo\nfrom torch._C import _x\nfrom torch.utils import _pytree\n"
                     "from torch.nn.functional import _in_projection\nimport torch.nn.functional as _F\n"
                     "from __future__ import annotations\nfrom ._masks import prepare\nfrom mgk.data._x import y\n")
    assert [line for line, _ in _private_imports(tree)] == [1, 2, 3, 4]


def _mgk_private_imports(name: str, path: Path, tree: ast.AST):
    """(line, import) of every import, in module ``name``, of a private module or name (one leading underscore) of
    another mgk package (directory): within its own package a module may share helpers, across packages only the
    public API (DESIGN: a functional core with public ops; one owner per concept)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]

    def private(parts) -> bool:
        return any(p.startswith("_") and not p.startswith("__") for p in parts)

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "mgk"):
            if node.level:
                target = package[:len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            else:
                target = node.module.split(".")
            for alias in node.names:
                full = target + [alias.name]
                # the package the imported thing lives in: the directory of the module named by ``target``
                home = target[:-1] if SRC.joinpath(*target).with_suffix(".py").exists() else target
                if private(full[1:]) and home != package:
                    yield node.lineno, f"from {'.'.join(target)} import {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "mgk" and private(parts[1:]) and parts[:-1] != package:
                    yield node.lineno, f"import {alias.name}"


def test_no_module_imports_another_mgk_packages_private_names():
    wrong = [f"{path.relative_to(SRC)}:{line} {what}" for name, path, tree in _modules()
             for line, what in _mgk_private_imports(name, path, tree)]
    assert not wrong, "imports of another mgk package's private names (make them public there):\n" + "\n".join(wrong)


def test_the_mgk_private_import_check_sees_one_across_packages_only():
    tree = ast.parse("from ..functional._mixture_terms import key_bias\nfrom ..functional.mgk import _x\n"
                     "from ..functional import _mixture_flash\nfrom .cache import _y\nfrom . import _z\n"
                     "from ..functional import mgk_attention\nimport mgk.functional._dispatch\n")
    found = [line for line, _ in _mgk_private_imports("mgk.attention.mgk", SRC / "mgk" / "attention" / "mgk.py", tree)]
    assert found == [1, 2, 3, 7]


# --------------------------------------------------------------------------- who writes files, who (de)serialises

# torch.save / torch.load of anything: only the checkpoint owner.
SERIALISATION_OWNER = "mgk/train/checkpoint.py"
# Modules that may open files for writing: the atomic writer, and the owners of checkpoints and run directories
# (which write through it, and own the append-only logs and the run directory's lock file).
WRITE_OWNERS = {"mgk/atomic.py", "mgk/train/checkpoint.py", "mgk/train/rundir.py"}
# Writes elsewhere, each with its reason, as (module, function).
WRITE_EXCEPTIONS = {
    ("mgk/reproduce/executor.py", "_spawn"): "the append-only log of a child process's output: read by people, "
                                             "never by a resume or an evaluation",
    ("mgk/functional/_mixture_flash.py", "_build_lock"): "the flock file of the kernel build: the lock is the open "
                                                        "file, nothing is written into it",
}
_WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC"}


def _write_mode(call: ast.Call) -> bool:
    """An ``open``-like call with a literal mode that writes (w, a, x or +; "w:gz" for tarfile); one given an open
    ``fileobj`` (tarfile, gzip) writes into that file, not into a path of its own."""
    if any(k.arg == "fileobj" for k in call.keywords):
        return False
    modes = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    modes += [k.value.value for k in call.keywords if k.arg == "mode" and isinstance(k.value, ast.Constant)]
    return any(isinstance(m, str) and 0 < len(m) <= 6 and set(m.split(":")[0]) <= set("rwaxbt+")
               and set(m) & set("wax+") for m in modes)


def _writes(tree: ast.AST):
    """(line, enclosing function, what) of every file write or (de)serialisation in ``tree``: ``torch.save`` /
    ``torch.load``, ``open(..., "w"/"a"/"x"/"+")`` and ``X.open`` with such a mode (Path, gzip, tarfile, ...),
    ``os.open`` with write flags, ``Path.write_text`` / ``write_bytes``."""
    found = []

    def visit(node, func):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if isinstance(child, ast.Call):
                f = child.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
                flags = {n.attr for n in ast.walk(child) if isinstance(n, ast.Attribute)}
                if owner == "torch" and name in ("save", "load"):
                    found.append((child.lineno, func, f"torch.{name}"))
                elif name in ("write_text", "write_bytes"):
                    found.append((child.lineno, func, name))
                elif owner == "os" and name == "open" and flags & _WRITE_FLAGS:
                    found.append((child.lineno, func, "os.open for writing"))
                elif name in ("open", "fdopen") and owner != "os" and _write_mode(child):
                    found.append((child.lineno, func, f"{name} for writing"))
            visit(child, inner)

    visit(tree, "<module>")
    return found


def test_only_the_owners_write_files_and_only_the_checkpoint_owner_serialises():
    wrong = []
    for _, path, tree in _modules():
        rel = path.relative_to(SRC).as_posix()
        for line, func, what in _writes(tree):
            if what.startswith("torch."):
                if rel != SERIALISATION_OWNER:
                    wrong.append(f"{rel}:{line} {what} (use mgk.train.checkpoint)")
            elif rel not in WRITE_OWNERS and (rel, func) not in WRITE_EXCEPTIONS:
                wrong.append(f"{rel}:{line} {what} in {func} (write through mgk.atomic or mgk.train.rundir)")
    assert not wrong, "files written or (de)serialised outside their owners:\n" + "\n".join(wrong)


def test_the_write_check_sees_writes_and_loads():
    tree = ast.parse("import torch, os\ndef f(p, q):\n    torch.save({}, p)\n    open(p, 'w')\n"
                     "    p.write_text('x')\n    os.open(p, os.O_RDWR | os.O_CREAT)\n    torch.load(q)\n"
                     "    open(p)\n    open(p, 'rb')\n    q.open(mode='a')\n    tarfile.open(p, 'w:gz')\n"
                     "    os.open(p, os.O_RDONLY)\n    np.load(p)\n    tarfile.open(fileobj=fh, mode='w:gz')\n")
    assert [(line, func) for line, func, _ in _writes(tree)] == [(3, "f"), (4, "f"), (5, "f"), (6, "f"), (7, "f"),
                                                                 (10, "f"), (11, "f")]


# --------------------------------------------------------------------------- the run directory's file names

RUN_FILE_NAMES = {"config.yaml", "env.json", "metrics.jsonl", "train.log", "results.json", "eval.json", "vocab.txt",
                  "last.pt", "best.pt"}
LAYOUT_OWNER = "mgk/train/rundir.py"


def _run_file_names(tree: ast.AST):
    """(line, name) of string literals that are a run directory's file names (docstrings and messages, which hold
    them inside longer text, do not count)."""
    return [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in RUN_FILE_NAMES]


def test_only_the_layout_owner_names_the_run_files():
    wrong = [f"{path.relative_to(SRC)}:{line} {name!r} (use mgk.train.rundir.RunFiles)"
             for _, path, tree in _modules() if path.relative_to(SRC).as_posix() != LAYOUT_OWNER
             for line, name in _run_file_names(tree)]
    assert not wrong, "run-directory paths built outside their owner:\n" + "\n".join(wrong)


def test_the_layout_check_sees_a_file_name():
    tree = ast.parse('"""Writes config.yaml."""\np = run_dir / "results.json"\nmsg = "no config.yaml here"\n')
    assert _run_file_names(tree) == [(2, "results.json")]
