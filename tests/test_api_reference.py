"""The API reference (mkdocstrings, through the griffe extension docs/hooks/griffe_prose_sections.py) lists every
documented parameter under its own name, so that it shows the signature's default: an item naming several
("kdim, vdim: ...", "device, dtype: ...") was read as one parameter the signature lacks and shown as "required"."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

griffe = pytest.importorskip("griffe", reason="the API reference needs the docs extra: pip install -e '.[docs]'")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def package():
    extensions = griffe.load_extensions(str(ROOT / "docs" / "hooks" / "griffe_prose_sections.py"))
    return griffe.load("mgk", search_paths=[str(ROOT / "src")], extensions=extensions, docstring_parser="google")


def _documented(obj, seen=None):
    """(path, [(name, default shown)], {signature parameter: default}) of every function and class under ``obj``
    whose docstring has a parameters section."""
    seen = set() if seen is None else seen
    for member in obj.members.values():
        if member.is_alias or member.path in seen:
            continue
        seen.add(member.path)
        if (member.is_function or member.is_class) and member.docstring is not None:
            sections = member.docstring.parse("google", warnings=False)
            listed = [(p.name, p.default) for s in sections if s.kind.value == "parameters" for p in s.value]
            if listed:
                yield member.path, listed, {p.name: p.default for p in member.parameters}
        if member.is_module or member.is_class:
            yield from _documented(member, seen)


def test_each_documented_parameter_is_its_own_item_with_the_signature_s_default(package):
    faults = []
    for path, listed, signature in _documented(package):
        for name, shown in listed:
            if "," in name:
                faults.append(f"{path}: {name!r} is listed as one parameter")
            elif name in signature and shown != signature[name]:
                faults.append(f"{path}: {name} shows default {shown!r}, the signature has {signature[name]!r}")
    assert not faults, "\n".join(faults)


def test_attention_base_shows_the_defaults_of_the_parameters_documented_together(package):
    listed = next(listed for path, listed, _ in _documented(package) if path == "mgk.attention.base.AttentionBase")
    shown = dict(listed)
    assert all(shown[name] == "None" for name in ("kdim", "vdim", "device", "dtype")), shown


def test_no_docstring_item_is_malformed(package):
    """A section item griffe cannot split into 'name: description' (a list of names wrapped before its colon) is a
    warning that fails ``mkdocs build --strict`` once the page showing it is built; no docstring of mgk has one."""
    faults = []

    class Collect(logging.Handler):
        def emit(self, record):
            if "Failed to get" in record.getMessage():
                faults.append(record.getMessage())

    handler, logger = Collect(), logging.getLogger("griffe")
    logger.addHandler(handler)
    try:
        seen = set()

        def walk(obj):
            for member in obj.members.values():
                if member.is_alias or member.path in seen:
                    continue
                seen.add(member.path)
                if member.docstring is not None:
                    member.docstring.parse("google")
                if member.is_module or member.is_class:
                    walk(member)
        walk(package)
    finally:
        logger.removeHandler(handler)
    assert not faults, "\n".join(faults)
