"""Files, tests and comments are named by what they do, never by an issue number: readers of the repository cannot
open our issues (the developers' guide's style rule). A public project's issue given with its address is fine."""
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ISSUE_NUMBER = re.compile(r"issue[ _-]?#?\d+", re.IGNORECASE)
TEXT = {".py", ".md", ".sh", ".toml", ".yml", ".yaml", ".json", ".cpp", ".h", ".txt", ".cfg", ".ini", ""}


def _tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return out.splitlines()


def offenders(paths, read) -> list[str]:
    """'path' for each path naming an issue number, 'path:line' for each text line naming one (unless the line
    gives an address, http...: another project's public issue)."""
    found = [p for p in paths if ISSUE_NUMBER.search(p.replace("/", " "))]
    for p in paths:
        if Path(p).suffix not in TEXT:
            continue
        for i, line in enumerate(read(p).splitlines(), 1):
            if ISSUE_NUMBER.search(line) and "http" not in line:
                found.append(f"{p}:{i}")
    return found


def test_no_tracked_file_or_line_names_an_issue_number():
    def read(p):
        try:
            return (ROOT / p).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError):
            return ""
    assert offenders(_tracked(), read) == []


def test_the_check_sees_a_file_name_and_a_comment_but_not_an_address():
    word = "iss" + "ue"  # spelled in pieces, so that this file's own examples pass the check above
    texts = {f"bench/decode_{word}34_A1.json": "{}", "src/a.py": f"x = 1  # see {word} 12\n",
             "docs/b.md": f"torch's bug (https://github.com/pytorch/pytorch/pull/1234, {word} 1234)\n",
             "src/c.py": "# the issues of padding\n"}
    assert offenders(list(texts), texts.__getitem__) == [f"bench/decode_{word}34_A1.json", "src/a.py:1"]
