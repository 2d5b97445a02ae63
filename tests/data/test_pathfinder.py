"""mgk.data.pathfinder: the release layout, metadata format, errors, and our generator."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mgk.data import pathfinder as pf
from mgk.data.cache import seeded_split
from mgk.data.samples import encode_image, make_pathfinder_tree


def _corrupt(level_dir):
    """Make a level unreadable: any read of it would raise."""
    (level_dir / "metadata" / "0.npy").write_text("garbage line\n")
    for png in (level_dir / "imgs").rglob("*.png"):
        png.write_bytes(b"not a png")


def test_reads_only_the_chosen_level_with_pixel_tokens_and_disjoint_splits(tmp_path):
    root = make_pathfinder_tree(tmp_path, per_level=4)
    for other in ("curv_baseline", "curv_contour_length_9"):
        _corrupt(root / "pathfinder32" / other)  # any read of these would fail
    ds, empty, level_dir, _ = pf.load_pathfinder(root)  # default level: hard
    assert level_dir == root / "pathfinder32" / "curv_contour_length_14" and empty == 0
    assert ds.source == str(level_dir) and len(ds) == 4
    assert ds.tokens.shape == (4, 1024) and ds.tokens.dtype == torch.uint8  # 0..255 by construction
    assert int(ds.tokens.max()) <= 255 and int(ds.tokens.min()) >= 0 and int(ds.tokens.max()) == 255
    assert set(ds.labels.tolist()) == {0, 1} and ds.lengths.tolist() == [1024] * 4
    splits = pf.split_pathfinder(ds, val_fraction=0.1, split_seed=0)
    sets = [set(map(tuple, s.tokens.tolist())) for s in splits.values()]
    assert [len(s) for s in splits.values()] == [2, 1, 1]
    assert not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
    with pytest.raises(pf.PathfinderFormatError, match="curv_baseline"):
        pf.load_pathfinder(root, "easy")  # the alias reaches the (corrupted) easy level


def test_level_folder_lookup(tmp_path):
    root = make_pathfinder_tree(tmp_path, per_level=2, levels=["curv_contour_length_9"])
    assert pf.find_level_dir(root / "pathfinder32", "intermediate").name == "curv_contour_length_9"
    assert pf.find_level_dir(root / "pathfinder32" / "curv_contour_length_9", "curv_contour_length_9").is_dir()
    with pytest.raises(FileNotFoundError, match=r"no Pathfinder level 'curv_contour_length_14'.*"
                                                r"present: \['curv_contour_length_9'\]"):
        pf.find_level_dir(root, "hard")


def test_metadata_text_and_npy_forms(tmp_path):
    text = tmp_path / "0.npy"
    text.write_text("imgs/0 sample_0.png 0 1 1.8 0.8\nimgs/0 sample_1.png 1 0 1.8 0.8\n")
    assert pf.read_metadata(text) == [("imgs/0", "sample_0.png", 1, 1), ("imgs/0", "sample_1.png", 2, 0)]
    arr = tmp_path / "1.npy"
    np.save(arr, np.array([["imgs/1", "sample_5.png", "5", "0"], ["imgs/1", "sample_6.png", "6", "1"]]))
    assert [r[3] for r in pf.read_metadata(arr)] == [0, 1]


@pytest.mark.parametrize("line, match", [
    ("imgs/0 sample_0.png 0", "line 2: 3 fields, expected at least 4"),
    ("imgs/0 sample_0.png 0 2", "line 2: label '2' is not 0 or 1"),
    ("../x sample_0.png 0 1", "line 2: image path ../x/sample_0.png leaves the level folder"),
])
def test_bad_metadata_names_file_and_line(tmp_path, line, match):
    m = tmp_path / "3.npy"
    m.write_text("imgs/0 sample_0.png 0 1\n" + line + "\n")
    with pytest.raises(pf.PathfinderFormatError, match="3.npy: " + match):
        pf.read_metadata(m)


def test_missing_bad_and_empty_images(tmp_path):
    root = make_pathfinder_tree(tmp_path, per_level=6, levels=["curv_baseline"])
    level = root / "pathfinder32" / "curv_baseline"
    (level / "imgs" / "0" / "sample_2.png").write_bytes(b"")  # the release has a few empty PNGs: skipped
    grey, labels, empty, names = pf.read_pathfinder_level(level)
    assert empty == 1 and len(labels) == 5 and "imgs/0/sample_2.png" not in names
    (level / "imgs" / "0" / "sample_3.png").write_bytes(encode_image(np.zeros((8, 8), np.uint8), "PNG"))
    with pytest.raises(pf.PathfinderFormatError, match=r"sample_3.png \(listed in .*0.npy: line 4\): image is 8x8"):
        pf.read_pathfinder_level(level)
    (level / "imgs" / "0" / "sample_3.png").unlink()
    with pytest.raises(pf.PathfinderFormatError, match=r"sample_3.png .*line 4\): image file missing"):
        pf.read_pathfinder_level(level)
    for f in (level / "metadata").iterdir():
        f.unlink()
    with pytest.raises(pf.PathfinderFormatError, match="no metadata/\\*.npy files"):
        pf.read_pathfinder_level(level)


# ----------------------------------------------------------------- generator


def test_generator_is_balanced_and_deterministic():
    a, la = pf.generate_pathfinder(20, contour_length=6, seed=3)
    b, lb = pf.generate_pathfinder(20, contour_length=6, seed=3)
    c, _ = pf.generate_pathfinder(20, contour_length=6, seed=4)
    assert np.array_equal(a, b) and np.array_equal(la, lb) and not np.array_equal(a, c)
    assert la.sum() == 10 and a.shape == (20, 32, 32) and a.dtype == np.uint8
    assert pf.generate_pathfinder(7, contour_length=6, seed=0)[1].sum() == 3  # odd: num // 2 positives


def test_generator_difficulty_is_the_contour_length():
    easy, _ = pf.generate_pathfinder(8, contour_length=pf.contour_length_of("curv_baseline"), seed=0)
    hard, _ = pf.generate_pathfinder(8, contour_length=pf.contour_length_of("hard"), seed=0)
    assert pf.contour_length_of("curv_contour_length_9") == 9
    # each image has two bright markers (255) and strokes (< 255); the hard paths cover more pixels
    for imgs in (easy, hard):
        assert all((img == 255).any() for img in imgs)
    assert (hard > 0).mean() > (easy > 0).mean()
    with pytest.raises(ValueError, match="contour length"):
        pf.contour_length_of("curvy")


def test_generated_level_round_trips_through_the_reader(tmp_path):
    images, labels = pf.generate_pathfinder(5, contour_length=6, seed=1)
    level_dir = pf.write_pathfinder_level(tmp_path, "easy", images, labels, per_folder=2)
    assert sorted(p.name for p in (level_dir / "imgs").iterdir()) == ["0", "1", "2"]
    grey, got, empty, _ = pf.read_pathfinder_level(level_dir)
    assert np.array_equal(grey, images) and np.array_equal(got, labels) and empty == 0
    test_idx, val_idx, train_idx = seeded_split(5, [0.1, 0.1], 0)
    assert len(test_idx) == 1 and len(val_idx) == 1 and len(train_idx) == 3
