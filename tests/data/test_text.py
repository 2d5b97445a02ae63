"""mgk.data.text: byte-level IMDb reader (folder and .tar.gz), encoding, errors, cache, shared copy."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from mgk.data import text as tx
from mgk.data.cache import TokenDataset
from mgk.data.samples import imdb_files, make_imdb_dir, make_imdb_tar, write_tar
from mgk.tasks.text import LRAClassificationTask

SHARED = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"  # the shared data copy next to the repository


# ----------------------------------------------------------------- encoding and length


def test_long_review_keeps_exactly_the_first_max_len_bytes_in_order():
    review = bytes(np.random.default_rng(0).integers(32, 127, size=5000, dtype=np.uint8))
    tokens, lengths, cut = tx.encode_texts([review], 4000)
    assert tokens.shape == (1, 4000) and lengths.tolist() == [4000] and cut.tolist() == [True]
    assert np.array_equal(tokens[0], np.frombuffer(review[:4000], dtype=np.uint8).astype(np.int16) + 1)


def test_short_review_gives_its_tokens_plus_padding_and_a_mask_of_that_many():
    tokens, lengths, cut = tx.encode_texts(["0123456789", "x" * 30], 64)
    ds = TokenDataset(tokens, np.zeros(2, np.int64), lengths, truncated=cut, class_names=("neg", "pos"))
    assert ds.lengths.tolist() == [10, 30] and ds.num_truncated == 0
    assert ds.tokens[0, :10].tolist() == [b + 1 for b in b"0123456789"]
    assert (ds.tokens[0, 10:] == tx.PAD_ID).all()
    batch = LRAClassificationTask.batch(ds, torch.tensor([0, 1]), "cpu")
    assert batch["tokens"].dtype == torch.int64 and batch["tokens"].shape == (2, 30)
    real = ~batch["padding_mask"]
    assert real[0].sum() == 10 and real[0, :10].all() and real[1].sum() == 30


def test_non_ascii_is_utf8_bytes():
    assert tx.encode_text("é").tolist() == [0xC3 + 1, 0xA9 + 1]
    assert tx.encode_text("aé").shape == (3,)
    assert tx.encode_text(b"\x00\xff").tolist() == [1, 256]  # byte b -> b + 1; 0 stays for padding


def test_changing_max_len_changes_the_shape(tmp_path):
    data = make_imdb_dir(tmp_path)
    a, _ = tx.load_imdb(data, 16)
    b, _ = tx.load_imdb(data, 40)
    assert a["train"].tokens.shape[1] == 16 and b["train"].tokens.shape[1] == 40
    assert a["train"].num_truncated > b["train"].num_truncated >= 0


def test_bad_max_len_is_refused():
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_len"):
            tx.encode_texts(["a"], bad)


# ----------------------------------------------------------------- reading


def test_folder_and_archive_read_the_same_reviews_in_the_same_order(tmp_path):
    folder = tx.read_imdb(make_imdb_dir(tmp_path))
    archive = tx.read_imdb(make_imdb_tar(tmp_path))
    for split in ("train", "test"):
        assert folder[split].texts == archive[split].texts and folder[split].labels == archive[split].labels
    assert folder["train"].labels == [0] * 6 + [1] * 6  # neg then pos, each by name
    assert all(b"good" in t for t, y in zip(folder["train"].texts, folder["train"].labels) if y == 1)


def test_aclimdb_folder_itself_and_archive_without_prefix(tmp_path):
    root = make_imdb_dir(tmp_path) / "aclImdb"
    assert len(tx.read_imdb(root)["train"]) == 12
    bare = write_tar(tmp_path / "bare.tgz", imdb_files(prefix=""))
    assert len(tx.read_imdb(bare)["test"]) == 12


def test_absent_test_split_is_none_and_other_members_are_ignored(tmp_path):
    files = imdb_files(test=False)
    files["aclImdb/train/unsup/0_0.txt"] = b"unlabelled"
    files["aclImdb/imdb.vocab"] = b"the\n"
    raw = tx.read_imdb(write_tar(tmp_path / "t.tar.gz", files))
    assert raw["test"] is None and len(raw["train"]) == 12


def test_missing_class_folder_is_an_error_naming_it(tmp_path):
    data = make_imdb_dir(tmp_path)
    for f in (data / "aclImdb" / "test" / "neg").iterdir():
        f.unlink()
    (data / "aclImdb" / "test" / "neg").rmdir()
    with pytest.raises(tx.TextFormatError, match=r"test/neg: folder missing"):
        tx.read_imdb(data)


def test_missing_class_in_archive_and_no_train(tmp_path):
    files = {k: v for k, v in imdb_files().items() if "/train/neg/" not in k}
    with pytest.raises(tx.TextFormatError, match=r"t.tar.gz: no train/neg"):
        tx.read_imdb(write_tar(tmp_path / "t.tar.gz", files))
    with pytest.raises(tx.TextFormatError, match="no train/pos"):
        tx.read_imdb(write_tar(tmp_path / "u.tar.gz", {"README": b"x"}))
    with pytest.raises(FileNotFoundError, match="no IMDb train folder"):
        tx.read_imdb(tmp_path)


def test_empty_review_names_the_file(tmp_path):
    data = make_imdb_dir(tmp_path)
    bad = data / "aclImdb" / "train" / "pos" / "3_7.txt"
    bad.write_bytes(b"  \n")
    with pytest.raises(tx.TextFormatError, match=r"train/pos/3_7.txt: empty review"):
        tx.read_imdb(data)


def test_truncated_and_garbage_archives_name_the_archive(tmp_path):
    good = make_imdb_tar(tmp_path, n_per_class=40)
    data = good.read_bytes()
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(tx.TextFormatError, match=r"cut.tar.gz: .*(truncated|corrupt)"):
        tx.read_imdb(cut)
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"\x1f\x8b" + b"not really gzip" * 10)
    with pytest.raises(tx.TextFormatError, match="junk.tar.gz"):
        tx.read_imdb(junk)
    with pytest.raises(FileNotFoundError, match="nothing.tar.gz"):
        tx.read_imdb(tmp_path / "nothing.tar.gz")


# ----------------------------------------------------------------- cache


def test_load_goes_through_the_cache_and_a_changed_setting_or_file_misses(tmp_path):
    data = make_imdb_dir(tmp_path)
    cache = tmp_path / "cache"
    a, st1 = tx.load_imdb(data, 32, cache_dir=cache)
    b, st2 = tx.load_imdb(data, 32, cache_dir=cache)
    assert st1.startswith("stored") and st2.startswith("hit")
    assert torch.equal(a["train"].tokens, b["train"].tokens) and torch.equal(a["test"].labels, b["test"].labels)
    assert b["train"].tokens.dtype == torch.int16 and b["train"].class_names == ("neg", "pos")
    _, st3 = tx.load_imdb(data, 33, cache_dir=cache)
    assert st3.startswith("stored")
    f = data / "aclImdb" / "train" / "pos" / "0_7.txt"
    f.write_bytes(b"changed review text")
    os.utime(f, ns=(1, 1))
    c, st4 = tx.load_imdb(data, 32, cache_dir=cache)
    assert st4.startswith("stored") and not torch.equal(c["train"].tokens, a["train"].tokens)


# ----------------------------------------------------------------- the shared copy


@pytest.mark.skipif(not (SHARED / "imdb" / "aclImdb_train.tar.gz").is_file(),
                    reason="shared IMDb copy ../shared/data/imdb/aclImdb_train.tar.gz absent")
def test_shared_imdb_archive_counts():
    raw = tx.read_imdb(SHARED / "imdb" / "aclImdb_train.tar.gz")
    train = raw["train"]
    assert raw["test"] is None and len(train) == 25000
    assert train.labels.count(1) == 12500 and sum(map(len, train.texts)) == 33_132_823
    first = train.names.index(next(n for n in train.names if n.endswith("train/pos/0_9.txt")))
    assert train.texts[first].startswith(b"Bromwell High is a cartoon comedy.")
