"""mgk.atomic: the one atomic-write helper (write to a temporary file, fsync, rename) and its users."""
from __future__ import annotations

import os
import stat

import numpy as np
import pytest
import torch

from mgk.atomic import atomic_write, write_bytes_atomic, write_text_atomic
from mgk.data import cache as c
from mgk.train import checkpoint


def test_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    p = tmp_path / "sub" / "out.txt"
    write_text_atomic(p, "one\n")
    write_text_atomic(p, "two\r\n")  # written as given, no newline translation
    assert p.read_bytes() == b"two\r\n"
    write_bytes_atomic(p, b"\x00\x01")
    assert p.read_bytes() == b"\x00\x01"
    assert sorted(x.name for x in p.parent.iterdir()) == ["out.txt"]


def test_a_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    p = tmp_path / "out.bin"
    p.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_write(p) as fh:
            fh.write(b"half of the new content")
            raise RuntimeError("boom")
    assert p.read_bytes() == b"old"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["out.bin"]
    with pytest.raises(ValueError, match="mode"):
        with atomic_write(p, "ab"):
            pass


@pytest.mark.parametrize("writer", ["checkpoint", "cache"])
def test_writers_use_the_helper(tmp_path, monkeypatch, writer):
    """A crash in the middle of torch.save / np.savez leaves the previous checkpoint or cache entry intact."""
    p = tmp_path / ("last.pt" if writer == "checkpoint" else "entry.npz")
    if writer == "checkpoint":
        checkpoint.save({"step": 1, "model": {}}, p, kind="last")
        monkeypatch.setattr(torch, "save", lambda obj, f: (f.write(b"partial"), 1 / 0))
        with pytest.raises(ZeroDivisionError):
            checkpoint.save({"step": 2, "model": {}}, p, kind="last")
        assert checkpoint.load(p)["step"] == 1
    else:
        c.save_arrays(p, "k1", {"a": np.arange(3)})
        monkeypatch.setattr(np, "savez", lambda f, **kw: (f.write(b"partial"), 1 / 0))
        with pytest.raises(ZeroDivisionError):
            c.save_arrays(p, "k2", {"a": np.arange(4)})
        assert c.load_arrays(p, "k1")["a"].tolist() == [0, 1, 2]
    assert sorted(x.name for x in tmp_path.iterdir()) == [p.name]


def test_a_figure_is_written_whole_or_not_at_all_and_closed(tmp_path):
    """save_figure_atomic (the plots of mgk reproduce and mgk analyze): a PNG in a new folder; a savefig that fails
    part-way leaves the previous file as it was; the figure is closed either way."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mgk.atomic import save_figure_atomic

    path = tmp_path / "new" / "fig.png"
    fig = plt.figure()
    assert save_figure_atomic(fig, path, dpi=40) == path
    assert path.read_bytes().startswith(b"\x89PNG") and not plt.fignum_exists(fig.number)
    before = path.read_bytes()
    broken = plt.figure()

    def fail(fh, **kw):
        fh.write(b"half an image")
        raise RuntimeError("disk full")

    broken.savefig = fail
    with pytest.raises(RuntimeError, match="disk full"):
        save_figure_atomic(broken, path, dpi=40)
    assert path.read_bytes() == before and not plt.fignum_exists(broken.number)


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_a_written_file_has_the_mode_open_gives_under_the_umask(tmp_path, umask):
    """Results and checkpoints written atomically are readable by whoever a plain open() lets read them (mkstemp
    alone makes them 0600); a file they replace keeps its own mode, as open() keeps it (0600 set on purpose)."""
    old = os.umask(umask)
    try:
        fresh, replaced = tmp_path / "new.json", tmp_path / "old.pt"
        replaced.write_bytes(b"old")
        replaced.chmod(0o600)
        write_text_atomic(fresh, "{}")
        write_bytes_atomic(replaced, b"new")
        with open(tmp_path / "plain.txt", "w"):
            pass
    finally:
        os.umask(old)
    want = 0o666 & ~umask
    assert stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode) == want
    assert [stat.S_IMODE(p.stat().st_mode) for p in (fresh, replaced)] == [want, 0o600]
    assert replaced.read_bytes() == b"new"
