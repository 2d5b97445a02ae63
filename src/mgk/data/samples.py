"""Tiny synthetic releases in the official LRA layouts: IMDb (folder or tar), AAN pairs, CIFAR (python pickles and
image folders), Pathfinder. Used by the tests (``from mgk.data import samples``) and handy to try ``mgk data check``
or ``mgk train`` without a download. Image files need Pillow.
"""
from __future__ import annotations

import io
import pickle
import tarfile
from pathlib import Path

import numpy as np

from ..atomic import atomic_write, write_bytes_atomic, write_text_atomic

__all__ = ["write_tar", "write_files", "imdb_files", "make_imdb_dir", "make_imdb_tar", "aan_rows", "make_aan_dir",
           "cifar_batch", "cifar_pickle_files", "make_cifar_pickle_dir", "encode_image", "image_folder_files",
           "make_pathfinder_tree"]


def write_tar(out: Path, files: dict[str, bytes]) -> Path:
    """A .tar.gz holding ``files`` (member name -> bytes), in sorted order."""
    with atomic_write(out) as fh, tarfile.open(fileobj=fh, mode="w:gz") as tar:
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size = len(files[name])
            tar.addfile(info, io.BytesIO(files[name]))
    return out


def imdb_files(n_per_class: int = 6, *, test: bool = True, seed: int = 0, prefix: str = "aclImdb/") -> dict:
    """``{member name: bytes}`` of a small aclImdb tree; positive reviews say "good", negative ones "bad"."""
    rng = np.random.default_rng(seed)
    files = {}
    for split in ("train", "test") if test else ("train",):
        for cls, word in (("pos", "good"), ("neg", "bad")):
            for i in range(n_per_class):
                n = int(rng.integers(3, 30))
                text = " ".join([word] * n) + f" review {i} é"
                files[f"{prefix}{split}/{cls}/{i}_{7 if cls == 'pos' else 2}.txt"] = text.encode("utf-8")
    return files


def write_files(root: Path, files: dict[str, bytes]) -> Path:
    """Write ``files`` (relative name -> bytes) below ``root``; returns ``root``."""
    for name, data in files.items():
        write_bytes_atomic(root / name, data)
    return root


def make_imdb_dir(tmp: Path, **kw) -> Path:
    """``tmp/imdb/aclImdb`` folder; returns the folder holding ``aclImdb``."""
    return write_files(tmp / "imdb", imdb_files(**kw))


def make_imdb_tar(tmp: Path, **kw) -> Path:
    """``tmp/aclImdb.tar.gz`` of :func:`imdb_files`."""
    return write_tar(tmp / "aclImdb.tar.gz", imdb_files(**kw))


def aan_rows(n: int, seed: int = 0) -> list[str]:
    """TSV lines ``label id1 id2 text1 text2``: label 1 when both texts share a topic word."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        label = i % 2
        a = str(rng.choice(["alpha", "beta", "gamma"]))
        b = a if label else {"alpha": "beta", "beta": "gamma", "gamma": "alpha"}[a]
        t1 = " ".join([a] * int(rng.integers(2, 12))) + " paper"
        t2 = " ".join([b] * int(rng.integers(2, 12))) + " paper"
        rows.append(f"{label}\tP{i}a\tP{i}b\t{t1}\t{t2}")
    return rows


def make_aan_dir(tmp: Path, n: int = 24, *, splits=("train", "eval", "test")) -> Path:
    """``tmp/aan/new_aan_pairs.<split>.tsv`` with ``n`` rows of :func:`aan_rows` each; returns ``tmp/aan``."""
    out = tmp / "aan"
    out.mkdir(parents=True, exist_ok=True)
    for k, split in enumerate(splits):
        write_text_atomic(out / f"new_aan_pairs.{split}.tsv", "\n".join(aan_rows(n, seed=k)) + "\n")
    return out


def cifar_batch(n: int, seed: int, *, labels=None) -> dict:
    """A CIFAR-10 python batch dict (bytes keys) of ``n`` random images."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
    labels = list(rng.integers(0, 10, size=n)) if labels is None else labels
    return {b"batch_label": b"fixture", b"labels": [int(x) for x in labels], b"data": data,
            b"filenames": [f"img{i}.png".encode() for i in range(n)]}


def cifar_pickle_files(n: int = 4, *, test: bool = True) -> dict[str, bytes]:
    """``{cifar-10-batches-py/<batch>: pickled bytes}`` for the five train batches (and ``test_batch``)."""
    files = {f"cifar-10-batches-py/data_batch_{i}": pickle.dumps(cifar_batch(n, i), protocol=2) for i in range(1, 6)}
    if test:
        files["cifar-10-batches-py/test_batch"] = pickle.dumps(cifar_batch(n, 99), protocol=2)
    return files


def make_cifar_pickle_dir(tmp: Path, **kw) -> Path:
    """Folder holding ``cifar-10-batches-py``."""
    return write_files(tmp / "cifar", cifar_pickle_files(**kw))


def encode_image(arr: np.ndarray, fmt: str) -> bytes:
    """``arr`` (uint8 image) encoded as ``fmt`` ("PNG", "JPEG") with Pillow."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


def image_folder_files(n_per_class: int = 3, classes=("cat", "dog", "airplane"), *, test: bool = True,
                       fmt: str = "PNG", prefix: str = "", seed: int = 0) -> dict[str, bytes]:
    """``{<prefix><split>/<class>/NNNN.<ext>: bytes}`` of random 32x32 colour images."""
    rng = np.random.default_rng(seed)
    ext = {"PNG": "png", "JPEG": "jpg"}[fmt]
    files = {}
    for split in ("train", "test") if test else ("train",):
        for c in classes:
            for i in range(n_per_class):
                arr = rng.integers(0, 256, size=(32, 32, 3), dtype=np.uint8)
                files[f"{prefix}{split}/{c}/{i:04d}.{ext}"] = encode_image(arr, fmt)
    return files


def make_pathfinder_tree(tmp: Path, per_level: int = 4, levels=None) -> Path:
    """``tmp/lra/pathfinder32/<level>`` for each level with ``per_level`` generated images; returns ``tmp/lra``."""
    from .pathfinder import LEVELS, contour_length_of, generate_pathfinder, write_pathfinder_level

    root = tmp / "lra"
    for k, level in enumerate(levels or LEVELS):
        images, labels = generate_pathfinder(per_level, contour_length=contour_length_of(level), seed=k)
        write_pathfinder_level(root, level, images, labels)
    return root
