"""mkdocs hook: links from a docs page to files of the repository outside docs/ (README.md, BENCHMARKS.md, results/,
benchmarks/, src/) work on GitHub as they are written; this hook makes them work in the built site too.

Each such link target that exists is added to the site under ``repo/<its path>`` (Markdown files as pages, whose own
links are followed the same way) and the link is rewritten to point there. A target that does not exist is left
alone, so mkdocs reports it and ``mkdocs build --strict`` fails, as for any broken link inside docs/.
"""
from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

PREFIX = "repo/"
# [text](target) and ![alt](target); a target with a scheme (http:, mailto:) or a pure #anchor is never a file
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s#]+)((?:#[^)\s]*)?\))")
# fenced code is never rewritten: the split keeps fences at odd indices
FENCE = re.compile(r"(^[ \t]*(```|~~~).*?^[ \t]*\2[ \t]*$)", re.S | re.M)


def _repo_path(src_uri: str, target: str) -> str | None:
    """The repository path a link of the page at src_uri points to (None for URLs and absolute paths)."""
    if ":" in target or target.startswith("/"):
        return None
    place = src_uri[len(PREFIX):] if src_uri.startswith(PREFIX) else "docs/" + src_uri  # the page in the repository
    return posixpath.normpath(posixpath.join(posixpath.dirname(place), target))


def _site_uri(repo_path: str) -> str:
    return repo_path[len("docs/"):] if repo_path.startswith("docs/") else PREFIX + repo_path


def _prose(text: str) -> str:
    return "".join(p for i, p in enumerate(FENCE.split(text)) if i % 3 == 0)


def on_files(files: Files, config) -> Files:
    """Add every repository file that a page (or an added Markdown file, transitively) links to."""
    root = Path(config["config_file_path"]).parent
    queue = [(f.src_uri, Path(f.abs_src_path).read_text()) for f in files.documentation_pages()]
    added: set[str] = set()
    while queue:
        src_uri, text = queue.pop()
        for match in LINK.finditer(_prose(text)):
            repo_path = _repo_path(src_uri, match.group(2))
            if repo_path is None or repo_path.startswith(("docs/", "..")) or repo_path in added:
                continue
            path = root / repo_path
            if not path.is_file():
                continue  # a missing target stays a broken link for mkdocs to report
            added.add(repo_path)
            files.append(File.generated(config, PREFIX + repo_path, abs_src_path=str(path)))
            if path.suffix == ".md":
                queue.append((PREFIX + repo_path, path.read_text()))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Point every link at the site's copy of its target: docs pages' links that leave docs/, and the links of the
    copied repository pages that lead into docs/."""
    src_uri = page.file.src_uri

    def replace(match: re.Match) -> str:
        repo_path = _repo_path(src_uri, match.group(2))
        if repo_path is None or repo_path.startswith(".."):
            return match.group(0)
        target = files.get_file_from_path(_site_uri(repo_path))
        if target is None:
            return match.group(0)  # left for mkdocs to report
        new = posixpath.relpath(target.src_uri, posixpath.dirname(src_uri) or ".")
        return f"{match.group(1)}{new}{match.group(3)}"

    parts = FENCE.split(markdown)
    return "".join(LINK.sub(replace, p) if i % 3 == 0 else (p if i % 3 == 1 else "") for i, p in enumerate(parts))
