"""The code passes the ruff configuration in pyproject.toml (style is checked in CI with the tests)."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _ruff() -> list[str] | None:
    exe = shutil.which("ruff")
    if exe:
        return [exe]
    try:
        import ruff  # noqa: F401
    except ImportError:
        return None
    return [sys.executable, "-m", "ruff"]


@pytest.mark.skipif(_ruff() is None, reason="ruff is not installed (pip install -e '.[test]' installs it)")
def test_ruff_check_passes():
    p = subprocess.run([*_ruff(), "check", "src", "tests"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
