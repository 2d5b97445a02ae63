"""``mgk --version`` answers as argparse's standard flag does, without a command."""
from __future__ import annotations

import pytest

import mgk
from mgk.cli import main


def test_version_prints_the_package_version_and_exits_0(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"mgk {mgk.__version__}\n"
