"""The Python snippets of README.md and docs/**/*.md, as the tests run them.

Every ```` ```python ```` block is a snippet that must run as written. What the text around a block says about it:

- ``<!-- skip: REASON -->`` on the line before it (blank lines between allowed): not run, reported as skipped with
  REASON (a block that needs data, a trained run, or stands for code the reader supplies);
- ``<!-- slow: REASON -->``: run only with ``pytest -m slow``;
- ``<!-- continues -->``: run after the previous block of the same file, in one namespace (a page that builds a
  model in one block and uses it in the next);
- a comment ``# prints TEXT`` at the end of a line: what that line printed last (``print``'s text without the
  newline) must be TEXT;
- a fenced block with the info string ``output`` right after the snippet: everything the snippet printed must be
  that block's text (trailing spaces and blank lines aside).
"""
from __future__ import annotations

import builtins
import contextlib
import io
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(?P<fence>```|~~~)(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=fence)[ \t]*$", re.S | re.M)
MARKER = re.compile(r"<!--\s*(?P<kind>skip|slow|continues)\s*(?::\s*(?P<reason>.*?))?\s*-->\s*\Z", re.S)
PRINTS = re.compile(r"#\s*prints\s+(?P<text>.*?)\s*$")


@dataclass
class Snippet:
    """One runnable unit: a python block (and the blocks that continue it) of one Markdown file."""

    path: Path
    line: int  # 1-based line of the block's first code line
    code: str
    skip: str | None = None
    slow: str | None = None
    output: str | None = None  # the ```output block after it, if any
    parts: list[tuple[int, str]] = field(default_factory=list)  # (first line, code) of each block, in order

    @property
    def name(self) -> str:
        where = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path.name
        return f"{where}:{self.line}"


def markdown_files(root: Path = ROOT) -> list[Path]:
    """README.md and every Markdown page of docs/, in a fixed order."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def _marker(before: str) -> tuple[str, str] | None:
    """(kind, reason) of an HTML comment that ends the text before a block (blank lines between allowed)."""
    match = MARKER.search(before.rstrip())
    return (match["kind"], (match["reason"] or "").strip()) if match else None


def snippets(path: Path) -> list[Snippet]:
    """The snippets of one Markdown file, continued blocks merged into the one they continue."""
    text = path.read_text()
    found: list[Snippet] = []
    blocks = list(FENCE.finditer(text))
    for i, block in enumerate(blocks):
        if block["info"].strip() != "python":
            continue
        start = blocks[i - 1].end() if i else 0
        marker = _marker(text[start:block.start()])
        line = text.count("\n", 0, block.start("body")) + 1
        output = None
        if i + 1 < len(blocks) and blocks[i + 1]["info"].strip() == "output":
            if not text[block.end():blocks[i + 1].start()].strip():
                output = blocks[i + 1]["body"]
        if marker and marker[0] == "continues" and found:
            previous = found[-1]
            previous.parts.append((line, block["body"]))
            previous.output = output if output is not None else previous.output
            continue
        snippet = Snippet(path, line, block["body"], output=output, parts=[(line, block["body"])])
        if marker and marker[0] == "skip":
            snippet.skip = marker[1] or "marked skip"
        if marker and marker[0] == "slow":
            snippet.slow = marker[1] or "marked slow"
        found.append(snippet)
    return found


def expected_prints(code: str) -> dict[int, str]:
    """{line within the code (1-based): TEXT} of each ``# prints TEXT`` comment."""
    return {n: m["text"] for n, ln in enumerate(code.splitlines(), 1) if (m := PRINTS.search(ln))}


def run(snippet: Snippet) -> tuple[str, dict[tuple[int, int], str]]:
    """Run every part of the snippet in one namespace; return what it printed in all and, per (part, line), the
    text the last print call on that line printed."""
    namespace: dict = {"__name__": "__snippet__"}
    by_line: dict[tuple[int, int], str] = {}
    out = io.StringIO()
    for k, (first, code) in enumerate(snippet.parts):
        filename = f"{snippet.path}:{first}"

        def recording_print(*args, sep=" ", end="\n", file=None, flush=False, _filename=filename, _k=k):
            text = (" " if sep is None else sep).join(map(str, args))
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename != _filename:
                frame = frame.f_back  # a print inside a function the snippet defined is still the snippet's line
            if frame is not None and file in (None, sys.stdout):
                by_line[(_k, frame.f_lineno)] = text
            builtins.print(*args, sep=sep, end=end, file=file, flush=flush)

        namespace["print"] = recording_print
        with contextlib.redirect_stdout(out):
            exec(compile(code, filename, "exec"), namespace)
    return out.getvalue(), by_line


def check(snippet: Snippet) -> None:
    """Run the snippet and compare what it printed with its ``# prints`` comments and its output block."""
    printed, by_line = run(snippet)
    wrong = []
    for k, (first, code) in enumerate(snippet.parts):
        for n, want in expected_prints(code).items():
            got = by_line.get((k, n))
            if got != want:
                wrong.append(f"{snippet.path.name}:{first + n - 1} prints {got!r}, the text says {want!r}")
    if snippet.output is not None:
        def norm(s: str) -> list[str]:
            return [ln.rstrip() for ln in s.strip("\n").splitlines()]
        if norm(printed) != norm(snippet.output):
            wrong.append(f"{snippet.name} printed\n{printed}\nbut its output block says\n{snippet.output}")
    assert not wrong, "\n".join(wrong)
