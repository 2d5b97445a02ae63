"""Docs prose never restates a public function's signature otherwise than the function has it, and never shows a call
the function refuses: every inline code span of README.md and docs/*.md that calls an mgk function or method
(``mgk.swap_attention(model, kind, **options)``) must bind to its ``inspect.signature``, and one written as a
parameter list (``f(a, b=None, *, c=0)``) must list its parameters with their kinds and defaults, in order."""
from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[ \t]*$", re.S | re.M)
SPAN = re.compile(r"(?<!`)`([^`]+)`(?!`)")
# where a bare or class-qualified name in the prose is looked up (the public namespaces the docs quote)
NAMESPACES = ("mgk", "mgk.attention", "mgk.functional", "mgk.models", "mgk.train", "mgk.config",
              "mgk.integrations.hf")


def _spans(text: str):
    """(line, code) of every inline code span outside fenced blocks, a span's line breaks read as spaces."""
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for match in SPAN.finditer(prose):
        yield prose.count("\n", 0, match.start()) + 1, " ".join(match[1].split())


def _resolve(dotted: str) -> inspect.Signature | None:
    """The signature of the mgk callable a dotted name in the docs names (``mgk.swap_attention``,
    ``TransformerLM.generate``: without its ``self``), or None when it names none (torch's, a variable, a command)."""
    parts = dotted.split(".")
    starts = [parts] if parts[0] == "mgk" else [[*ns.split("."), *parts] for ns in NAMESPACES]
    for names in starts:
        for cut in range(len(names), 0, -1):
            try:
                obj = importlib.import_module(".".join(names[:cut]))
            except ImportError:
                continue
            owner = None
            for name in names[cut:]:
                owner, obj = obj, getattr(obj, name, None)
            if callable(obj) and getattr(obj, "__module__", "").startswith("mgk"):
                sig = inspect.signature(obj)
                if inspect.isclass(owner) and inspect.isfunction(inspect.getattr_static(owner, names[-1])):
                    sig = sig.replace(parameters=list(sig.parameters.values())[1:])  # a method: its self
                return sig
            break
    return None


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := _name(node.value)) is not None:
        return f"{base}.{node.attr}"
    return None


def _parameter_list(code: str) -> tuple[str, ast.arguments] | None:
    """(name, parameters) when ``code`` reads as a name and a parameter list (``f(a, *, b=None)``)."""
    match = re.fullmatch(r"([\w.]+)\((.*)\)", code)
    if match is None:
        return None
    try:
        return match[1], ast.parse(f"def f({match[2]}): pass").body[0].args
    except SyntaxError:
        return None


def _restates(sig: inspect.Signature, args: ast.arguments) -> bool:
    """Whether a parameter list is the signature restated, not a call that happens to parse as one: it has a bare
    ``*``, or its leading names are the function's own parameter names and it gives defaults or ``**options``
    (``key_padding_mask=...`` shows a value to pass, not a default; ``f(model, **options)`` is a call)."""
    required = [a.arg for a in args.posonlyargs + args.args][:len(args.posonlyargs + args.args) - len(args.defaults)]
    named = bool(required) and required == list(sig.parameters)[:len(required)]
    defaults = [d for d in args.defaults if not (isinstance(d, ast.Constant) and d.value is Ellipsis)]
    return bool(args.kwonlyargs) or (named and bool(defaults or args.kwarg))


def _check_restated(sig: inspect.Signature, args: ast.arguments) -> str | None:
    """What the parameter list ``args`` says otherwise than the signature ``sig``, or None."""
    kinds = inspect.Parameter
    written = [(a.arg, kinds.POSITIONAL_OR_KEYWORD) for a in args.posonlyargs + args.args]
    written += [(a.arg, kinds.KEYWORD_ONLY) for a in args.kwonlyargs]
    defaults = dict(zip([a.arg for a in args.args][len(args.args) - len(args.defaults):], args.defaults))
    defaults.update({a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None})
    real = sig.parameters
    named = [(n, kinds.POSITIONAL_OR_KEYWORD if p.kind == kinds.POSITIONAL_ONLY else p.kind) for n, p in real.items()
             if p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)]
    if written != [w for w in named if w[0] in dict(written)]:
        return f"parameters {_show(written)} where the function has {_show(named)}"
    if args.kwarg is not None and not any(p.kind == kinds.VAR_KEYWORD for p in real.values()):
        return f"**{args.kwarg.arg} where the function takes no other keywords"
    for name, node in defaults.items():
        value = ast.literal_eval(node)
        if real[name].default is kinds.empty or real[name].default != value:
            return f"{name}={value!r} where the function has {real[name]}"
    return None


def _show(params) -> str:
    """``a, b, *, c``: a list of (name, kind) as a signature writes it."""
    out, star = [], False
    for name, kind in params:
        if kind == inspect.Parameter.KEYWORD_ONLY and not star:
            out.append("*")
            star = True
        out.append(name)
    return "(" + ", ".join(out) + ")"


def _check_call(sig: inspect.Signature, call: ast.Call) -> str | None:
    """Why ``call`` does not bind to the signature ``sig`` (too many positional arguments, an unknown keyword, a
    positional one where it is keyword-only), or None. Arguments left out are fine (prose often shows one option:
    ``MGKAttention(keys="shifted")``), and so is ``...`` standing for those before."""
    args = [a for a in call.args if not (isinstance(a, ast.Constant) and a.value is Ellipsis)]
    if any(isinstance(a, ast.Starred) for a in args) or len(args) < len(call.args):
        args = []  # the positional arguments are not all shown
    try:
        sig.bind_partial(*args, **{k.arg: None for k in call.keywords if k.arg is not None})
    except TypeError as e:
        return str(e)
    return None


def _faults(path: Path, root: Path = ROOT) -> list[str]:
    """One line per code span of the page ``path`` that restates a signature otherwise or shows a refused call."""
    faults = []
    for line, code in _spans(path.read_text()):
        where = f"{path.relative_to(root)}:{line}: `{code}`"
        listed = _parameter_list(code)
        if listed is not None and (sig := _resolve(listed[0])) is not None and _restates(sig, listed[1]):
            if (why := _check_restated(sig, listed[1])) is not None:
                faults.append(f"{where}: {why}")
            continue
        try:
            tree = ast.parse(code, mode="eval")
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (name := _name(node.func)) is not None:
                sig = _resolve(name)
                if sig is not None and (why := _check_call(sig, node)) is not None:
                    faults.append(f"{where}: {why}")
    return faults


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_no_code_span_restates_a_signature_or_a_call_the_function_refuses(page):
    faults = _faults(page)
    assert not faults, ("a signature or call in the docs that the function does not have (link to the API "
                        "reference instead of restating it):\n" + "\n".join(faults))


def test_the_check_catches_a_positional_keyword_and_a_restated_signature(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Call `mgk.swap_attention(m, 'mgk', 4)` or read\n`mgk.swap_attention(model, kind, num_heads=None, "
                    "seed=0, **options)`; `mgk.swap_attention(model, 'gqa', num_kv_heads=2)` is right.\n")
    faults = [f.split("`: ", 1)[1] for f in _faults(page, tmp_path)]
    assert len(faults) == 2 and "too many positional arguments" in faults[0] and "num_heads" in faults[1]
