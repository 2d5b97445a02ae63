"""Every reader that caches keys its entry by every source file (size and mtime), so a file rewritten in place is
served new: same size, same folder mtime, only the file's own mtime moves (a PNG rewritten in place once served old
pixels, because the key fingerprinted the image folders only)."""
from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import numpy as np
import torch

from mgk.data import image as im
from mgk.data import listops as lo
from mgk.data import pathfinder as pf
from mgk.data import retrieval as rv
from mgk.data import text as tx
from mgk.data import wikitext as wt
from mgk.data.samples import (
    cifar_batch,
    cifar_pickle_files,
    image_folder_files,
    make_aan_dir,
    make_imdb_dir,
    make_pathfinder_tree,
    write_files,
)


def rewrite_in_place(path: Path, data: bytes) -> None:
    """Overwrite ``path`` with ``data`` of the same size; its folder keeps its mtime, the file's mtime moves 1 s
    forward (as a later edit would)."""
    path = Path(path)
    assert len(data) == path.stat().st_size and data != path.read_bytes()
    folder, st = path.parent.stat(), path.stat()
    with open(path, "r+b") as fh:
        fh.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    os.utime(path.parent, ns=(folder.st_atime_ns, folder.st_mtime_ns))
    assert path.parent.stat().st_mtime_ns == folder.st_mtime_ns


def stored_png(arr: np.ndarray) -> bytes:
    """A PNG without compression: its size depends only on the image's shape, so a rewrite can keep the size."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG", compress_level=0)
    return buf.getvalue()


def grey(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(32, 32), dtype=np.uint8)


def test_text_folder(tmp_path):
    root = make_imdb_dir(tmp_path)
    cache = tmp_path / "cache"
    first, status = tx.load_imdb(root, 64, cache_dir=cache)
    assert status.startswith("stored")
    review = root / "aclImdb" / "train" / "pos" / "0_7.txt"
    old = review.read_bytes()
    rewrite_in_place(review, old.replace(b"good", b"fine"))
    again, status = tx.load_imdb(root, 64, cache_dir=cache)
    fresh, _ = tx.load_imdb(root, 64, cache_dir=None)
    assert status.startswith("stored") and torch.equal(again["train"].tokens, fresh["train"].tokens)
    assert not torch.equal(again["train"].tokens, first["train"].tokens)


def test_retrieval_file(tmp_path):
    data = make_aan_dir(tmp_path)
    cache = tmp_path / "cache"
    first, _ = rv.load_aan_split(data, "train", 40, cache_dir=cache)
    path = data / "new_aan_pairs.train.tsv"
    rewrite_in_place(path, path.read_bytes().replace(b"paper", b"PAPER"))
    again, status = rv.load_aan_split(data, "train", 40, cache_dir=cache)
    assert status.startswith("stored") and not torch.equal(again.tokens1, first.tokens1)
    assert torch.equal(again.tokens1, rv.load_aan_split(data, "train", 40, cache_dir=None)[0].tokens1)


def test_image_pickle_batch(tmp_path):
    root = write_files(tmp_path / "cifar", cifar_pickle_files())
    cache = tmp_path / "cache"
    first, _ = im.load_images(root, cache_dir=cache)
    batch = root / "cifar-10-batches-py" / "data_batch_3"
    new = cifar_batch(4, 3)  # the batch as written, then its pixels reversed: same bytes, same pickle size
    new[b"data"] = np.ascontiguousarray(new[b"data"][:, ::-1])
    rewrite_in_place(batch, pickle.dumps(new, protocol=2))
    again, status = im.load_images(root, cache_dir=cache)
    assert status.startswith("stored") and not torch.equal(again["train"].tokens, first["train"].tokens)
    assert torch.equal(again["train"].tokens, im.load_images(root, cache_dir=None)[0]["train"].tokens)


def test_image_folder_png(tmp_path):
    root = write_files(tmp_path / "imgs", image_folder_files(test=False))
    png = root / "train" / "cat" / "0000.png"
    png.write_bytes(stored_png(grey(0)))
    cache = tmp_path / "cache"
    first, _ = im.load_images(root, cache_dir=cache)
    rewrite_in_place(png, stored_png(grey(1)))
    again, status = im.load_images(root, cache_dir=cache)
    assert status.startswith("stored") and not torch.equal(again["train"].tokens, first["train"].tokens)
    assert torch.equal(again["train"].tokens, im.load_images(root, cache_dir=None)[0]["train"].tokens)


def test_pathfinder_png(tmp_path):
    root = make_pathfinder_tree(tmp_path, per_level=4, levels=["curv_baseline"])
    level = root / "pathfinder32" / "curv_baseline"
    png = level / "imgs" / "0" / "sample_2.png"
    png.write_bytes(stored_png(grey(0)))
    cache = tmp_path / "cache"
    first = pf.load_pathfinder(root, "curv_baseline", cache_dir=cache)[0]
    rewrite_in_place(png, stored_png(grey(1)))
    again, _, _, status = pf.load_pathfinder(root, "curv_baseline", cache_dir=cache)
    assert status.startswith("stored"), "a PNG rewritten in place must not be served from the old entry"
    assert torch.equal(again.tokens[2], torch.from_numpy(grey(1).reshape(-1)))
    assert not torch.equal(again.tokens, first.tokens)


def test_listops_file(tmp_path):
    path = lo.write_listops_tsv(tmp_path / "basic_train.tsv", [("( [MAX 2 9 ] )", 9), ("( [MIN 2 9 ] )", 2)])
    cache = tmp_path / "cache"
    first = lo.load_listops_split(tmp_path, "train", 8, cache_dir=cache)
    assert len(list(cache.glob("*.npz"))) == 1
    rewrite_in_place(path, path.read_bytes().replace(b"[MIN 2 9 ] )\t2", b"[MIN 3 9 ] )\t3"))
    again = lo.load_listops_split(tmp_path, "train", 8, cache_dir=cache)
    assert again.labels.tolist() == [9, 3] and first.labels.tolist() == [9, 2]
    assert again.tokens[1, 1] == lo.TOKEN_TO_ID["3"]


def test_wikitext_files(tmp_path):
    train = tmp_path / "wiki.train.tokens"
    train.write_text("a b c\nb c\n")
    valid = tmp_path / "wiki.valid.tokens"
    valid.write_text("a b\n")
    cache = tmp_path / "cache"
    first = wt.load_corpus(tmp_path, cache_dir=cache)
    assert first.vocab.decode(first.tokens["valid"]) == ["a", "b", "<eos>"]
    rewrite_in_place(valid, b"b a\n")
    rewrite_in_place(train, b"a b a\nb c\n")
    again = wt.load_corpus(tmp_path, cache_dir=cache)
    assert again.vocab.decode(again.tokens["valid"]) == ["b", "a", "<eos>"]
    assert again.vocab.counts[again.vocab.index["a"]] == 2

