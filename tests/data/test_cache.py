"""mgk.data.cache: keys, atomic entries, cache folder choice, seeded splits, TokenDataset."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from mgk.data import cache as c


def test_key_changes_with_settings_and_with_the_files(tmp_path):
    f = tmp_path / "src.txt"
    f.write_text("abc")
    k = c.cache_key([f], {"max_len": 10, "reader": 1})
    assert k == c.cache_key([f], {"reader": 1, "max_len": 10})  # order of settings does not matter
    assert k != c.cache_key([f], {"max_len": 11, "reader": 1})
    f.write_text("abcd")
    assert k != c.cache_key([f], {"max_len": 10, "reader": 1})
    k2 = c.cache_key([f], {"max_len": 10, "reader": 1})
    os.utime(f, ns=(5, 5))
    assert k2 != c.cache_key([f], {"max_len": 10, "reader": 1})
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        c.cache_key([tmp_path / "missing.txt"], {})


def test_cached_arrays_hit_miss_and_corrupt_entry(tmp_path):
    f = tmp_path / "src.txt"
    f.write_text("abc")
    calls = []

    def build():
        calls.append(1)
        return {"x": np.arange(6, dtype=np.int16).reshape(2, 3), "name": np.array("train")}

    a, st = c.cached_arrays(tmp_path / "cache", "demo", [f], {"max_len": 3}, build)
    b, st2 = c.cached_arrays(tmp_path / "cache", "demo", [f], {"max_len": 3}, build)
    assert st.startswith("stored") and st2.startswith("hit") and len(calls) == 1
    assert np.array_equal(a["x"], b["x"]) and b["x"].dtype == np.int16 and str(b["name"]) == "train"
    entry = next((tmp_path / "cache").glob("demo-*.npz"))
    assert not list((tmp_path / "cache").glob("*.tmp"))  # atomic: no temporary left behind
    entry.write_bytes(entry.read_bytes()[:40])  # a broken entry is a miss, rebuilt
    _, st3 = c.cached_arrays(tmp_path / "cache", "demo", [f], {"max_len": 3}, build)
    assert st3.startswith("stored") and len(calls) == 2
    _, st4 = c.cached_arrays(None, "demo", [f], {"max_len": 3}, build)
    assert st4 == "off" and len(calls) == 3
    with pytest.raises(ValueError, match="object dtype"):
        c.save_arrays(tmp_path / "x.npz", "k", {"o": np.array([None, 1], dtype=object)})


def test_resolve_cache_dir(tmp_path, monkeypatch):
    assert c.resolve_cache_dir("off", tmp_path) is None and c.resolve_cache_dir("OFF", None) is None
    assert c.resolve_cache_dir(tmp_path / "mine", tmp_path) == tmp_path / "mine"
    assert c.resolve_cache_dir(None, tmp_path) == tmp_path / ".mgk-cache"
    archive = tmp_path / "a.tar.gz"
    archive.write_bytes(b"x")
    assert c.resolve_cache_dir(None, archive) == tmp_path / ".mgk-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "data.tar.gz").write_bytes(b"x")
    shared.chmod(0o555)  # a read-only shared copy: never written into, even by root
    try:
        assert c.resolve_cache_dir(None, shared / "data.tar.gz") == tmp_path / "xdg" / "mgk"
        assert sorted(p.name for p in shared.iterdir()) == ["data.tar.gz"]
    finally:
        shared.chmod(0o755)


def test_seeded_split_is_disjoint_complete_and_deterministic():
    parts = c.seeded_split(100, [0.1, 0.2], seed=3)
    assert [len(p) for p in parts] == [10, 20, 70]
    assert sorted(np.concatenate(parts).tolist()) == list(range(100))
    again = c.seeded_split(100, [0.1, 0.2], seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    assert not np.array_equal(parts[0], c.seeded_split(100, [0.1, 0.2], seed=4)[0])
    tiny = c.seeded_split(4, [0.1, 0.1], seed=0)
    assert [len(p) for p in tiny] == [1, 1, 2]  # at least one each while something is left for the rest
    assert [len(p) for p in c.seeded_split(10, [0.0], seed=0)] == [0, 10]
    with pytest.raises(ValueError):
        c.seeded_split(10, [0.6, 0.5], seed=0)


def test_token_dataset_subset_and_counts():
    ds = c.TokenDataset(np.arange(12, dtype=np.uint8).reshape(4, 3), np.array([0, 1, 1, 1]), np.array([3, 2, 3, 1]),
                        truncated=np.array([True, False, False, True]), class_names=("a", "b"))
    assert ds.majority_acc() == 0.75 and ds.label_counts() == [1, 3] and ds.num_truncated == 2
    sub = ds.subset([3, 0])
    assert sub.labels.tolist() == [1, 0] and sub.num_truncated == 2 and sub.tokens.dtype == torch.uint8
    assert ds[1]["tokens"].dtype == torch.int64
    with pytest.raises(ValueError, match="row counts"):
        c.TokenDataset(np.zeros((2, 3)), np.zeros(3), np.zeros(2))
