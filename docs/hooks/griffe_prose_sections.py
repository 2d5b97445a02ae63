"""griffe extension for the API reference: keep every Args and Raises section's text.

mgk's docstrings often write these sections as prose ("Raises: TypeError when ``batch_first`` is not given;
ValueError naming the argument ...", "Args: as :func:`mgk_attention`; ``query_mask`` bool (B, L) ..."). The
Google-style parser reads them as ``name: description`` items and drops, with a warning, every line that is not
one, so the reference would lose what the docstring says. Such a section is renamed ("Inputs", "Errors raised"),
which the parser renders as a note holding the text as written; well-formed sections keep their tables.
Sphinx roles (":func:`mgk.build_attention`"), which Markdown would show with their role and backticks as text,
become code spans. An item naming several parameters ("kdim, vdim: widths of ...") becomes one item per name with
the same text: the parser takes "kdim, vdim" for one name that the signature lacks, and the reference then showed
"required" as its default where each has one.
"""
from __future__ import annotations

import re

import griffe

HEADER = re.compile(r"^(?P<indent>\s*)(?P<title>Args|Arguments|Parameters|Raises):(?P<inline>.*)$")
RENAMED = {"Args": "Inputs", "Arguments": "Inputs", "Parameters": "Inputs", "Raises": "Errors raised"}
# an item's first line: "name: ...", "a, b: ...", "name (type): ..." or "ValueError: ..."
ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj|py:\w+):`~?([^`]+)`")
ITEM = re.compile(r"^[A-Za-z_*][\w.*]*(,\s*[A-Za-z_*][\w.*]*)*(\s*\([^)]*\))?\s*:(\s|$)")
# an item's first line naming several parameters: "a, b: ..." or "a, b (type): ..."
NAMES = re.compile(r"^(?P<indent>\s*)(?P<names>[A-Za-z_*][\w.*]*(?:,\s*[A-Za-z_*][\w.*]*)+)"
                   r"(?P<rest>(?:\s*\([^)]*\))?\s*:(?:\s.*|$))$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _well_formed(block: list[str]) -> bool:
    """Whether every line at the block's base indent starts a ``name: description`` item."""
    filled = [b for b in block if b.strip()]
    if not filled:
        return True
    base = min(_indent(b) for b in filled)
    return all(ITEM.match(b.strip()) for b in filled if _indent(b) == base)


def keep_prose_sections(text: str) -> str:
    """text with each Args / Raises section that is not a list of items renamed to a note, and roles as code."""
    lines = ROLE.sub(r"`\1`", text).splitlines()
    for i, line in enumerate(lines):
        match = HEADER.match(line)
        if match is None:
            continue
        block = []
        for body in lines[i + 1:]:
            if body.strip() and _indent(body) <= len(match["indent"]):
                break
            block.append(body)
        if match["inline"].strip() or not _well_formed(block):
            lines[i] = f'{match["indent"]}{RENAMED[match["title"]]}:{match["inline"]}'
        elif match["title"] != "Raises":
            lines[i + 1:i + 1 + len(block)] = _one_name_each(block)
    return "\n".join(lines)


def _one_name_each(block: list[str]) -> list[str]:
    """The items of a well-formed Args block, an item naming several parameters ("a, b: ...") repeated for each."""
    filled = [b for b in block if b.strip()]
    if not filled:
        return block
    base = min(_indent(b) for b in filled)
    items: list[list[str]] = []
    for line in block:
        if line.strip() and _indent(line) == base:
            items.append([line])
        elif items:
            items[-1].append(line)
        else:
            items.append([line])
    out = []
    for item in items:
        head = NAMES.match(item[0])
        if head is None:
            out += item
            continue
        for name in head["names"].split(","):
            out += [f'{head["indent"]}{name.strip()}{head["rest"]}', *item[1:]]
    return out


class ProseSections(griffe.Extension):
    """Applies :func:`keep_prose_sections` to every docstring as it is loaded."""

    def on_instance(self, *, node, obj, agent, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = keep_prose_sections(obj.docstring.value)
