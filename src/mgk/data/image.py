"""CIFAR-10 as grey pixel sequences (LRA "Image"): python pickle batches or image folders, plain or in a tar archive.

Accepted sources (``--data``):

- the official python batches (Krizhevsky 2009, "Learning Multiple Layers of Features from Tiny Images",
  https://www.cs.toronto.edu/~kriz/cifar.html): a ``cifar-10-batches-py`` folder (or a folder containing it) with
  ``data_batch_1`` .. ``data_batch_5`` (train) and ``test_batch`` (test), or the ``cifar-10-python.tar.gz`` archive.
  Each batch is a pickled dict with ``data`` (uint8 ``(N, 3072)``: the red, green and blue 32x32 planes, row by row)
  and ``labels`` (N ints 0-9). Batches are unpickled with a restricted unpickler that only rebuilds numpy arrays,
  so a crafted file cannot run code.
- an image-folder layout ``{train,test}/<class>/*.{png,jpg,jpeg}`` (``test`` optional), as a folder or a tar
  archive, optionally under one top folder (the shared ``cifar10_jpeg_train.tar.gz`` holds
  ``cifar10-jpeg/train/<class>/NNNN.jpg``; its ``README.md`` is ignored). Class ids are the class folder names in
  sorted order (for CIFAR-10: airplane, automobile, bird, cat, deer, dog, frog, horse, ship, truck = the official
  label order). Images must be 32x32.

Grey conversion (both sources alike): ITU-R 601-2 luma, ``L = (19595 R + 38470 G + 7471 B + 32768) >> 16``, i.e.
``0.299 R + 0.587 G + 0.114 B`` rounded to the nearest integer: exactly Pillow's ``convert("L")`` for RGB, so the
pickle path and the image path agree. Grey images are taken as they are.

Tokens: the 1,024 grey values row by row, pixel value ``p`` -> id ``p`` (vocabulary 256). There is no padding id:
every sequence has its full 1,024 length, so a black pixel (0) is a real pixel, never padding (the known quirk of
earlier harnesses: Tay et al. 2021, "Long Range Arena", section 2.2.4, define the task on all 1,024 pixels).
"""
from __future__ import annotations

import gzip
import io
import os
import pickle
import re
import tarfile
import zlib
from pathlib import Path
from typing import Sequence

import numpy as np

from .cache import TokenDataset, cached_arrays

__all__ = ["SIDE", "SEQ_LEN", "VOCAB_SIZE", "CIFAR10_CLASSES", "READER_VERSION", "ImageFormatError", "rgb_to_grey",
           "decode_grey", "read_cifar_batch", "read_image_source", "load_images", "ImageSplit"]

SIDE = 32
SEQ_LEN = SIDE * SIDE
VOCAB_SIZE = 256
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
READER_VERSION = 1
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"
_IMAGE_EXT = (".png", ".jpg", ".jpeg")
_FOLDER_RE = re.compile(r"^(?:(.+)/)?(train|test)/([^/]+)/([^/]+)$")


class ImageFormatError(ValueError):
    """Malformed or missing image input; the message names the file (or ``archive:member``)."""


# --------------------------------------------------------------------------- pixels


def rgb_to_grey(rgb: np.ndarray) -> np.ndarray:
    """ITU-R 601-2 luma of uint8 RGB values (last axis R, G, B), rounded like Pillow's ``convert("L")``.

    Returns:
        uint8 array of ``rgb.shape[:-1]``.
    """
    rgb = np.asarray(rgb, dtype=np.uint32)
    return ((rgb[..., 0] * 19595 + rgb[..., 1] * 38470 + rgb[..., 2] * 7471 + 32768) >> 16).astype(np.uint8)


def decode_grey(data: bytes, where: str, *, side: int = SIDE) -> np.ndarray:
    """Decode an encoded image (PNG, JPEG, ... anything Pillow reads) to grey ``(side, side)`` uint8.

    Colour images are converted with Pillow's ``convert("L")`` (the formula of :func:`rgb_to_grey`); grey ones are
    kept; an alpha channel is dropped.

    Raises:
        ImageFormatError: naming ``where``: undecodable or empty data, a size other than ``side`` x ``side``, or a
            mode without 8-bit colour or grey values (16-bit, float).
    """
    from PIL import Image, UnidentifiedImageError  # Pillow: only needed for image files

    if not data:
        raise ImageFormatError(f"{where}: empty file")
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            if img.size != (side, side):
                raise ImageFormatError(f"{where}: image is {img.size[0]}x{img.size[1]}, expected {side}x{side}")
            if img.mode == "L":
                grey = img
            elif img.mode in ("LA", "1"):
                grey = img.convert("L")
            elif img.mode in ("RGB", "RGBA", "RGBX", "P", "PA", "CMYK", "YCbCr"):
                grey = img.convert("RGB").convert("L")
            else:
                raise ImageFormatError(f"{where}: unsupported image mode {img.mode!r} (need 8-bit grey or colour)")
            return np.asarray(grey, dtype=np.uint8).copy()
    except ImageFormatError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise ImageFormatError(f"{where}: cannot decode image ({type(exc).__name__}: {exc})") from None


# --------------------------------------------------------------------------- pickle batches


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickler that rebuilds numpy arrays and nothing else."""

    _ALLOWED = {("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
                ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
                ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer")}

    def find_class(self, module, name):
        """The numpy global ``module.name`` if it is in ``_ALLOWED`` (``numpy.core`` read as ``numpy._core`` under
        numpy 2); pickle.UnpicklingError for anything else."""
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} (only numpy arrays are allowed)")
        if module.startswith("numpy.core.") and hasattr(np, "_core"):
            module = "numpy._core." + module[len("numpy.core."):]  # old pickles under numpy 2, without warnings
        return super().find_class(module, name)


def read_cifar_batch(data: bytes, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Parse one CIFAR-10 python batch (the bytes of ``data_batch_N`` / ``test_batch``).

    Returns:
        ``(grey, labels)``: uint8 ``(N, 32, 32)`` (see :func:`rgb_to_grey`) and int64 ``(N,)`` in 0-9.

    Raises:
        ImageFormatError: naming ``where``: not a pickle (or truncated), objects other than numpy arrays, no
            ``data``/``labels`` entries, ``data`` not uint8 ``(N, 3072)``, a label count other than N, labels outside
            0-9.
    """
    try:
        obj = _ArrayUnpickler(io.BytesIO(data), encoding="bytes").load()
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is a format error naming the file
        raise ImageFormatError(f"{where}: not a readable CIFAR python batch ({type(exc).__name__}: {exc})") from None
    if not isinstance(obj, dict):
        raise ImageFormatError(f"{where}: expected a pickled dict, got {type(obj).__name__}")
    d = {(k.decode("latin1") if isinstance(k, bytes) else k): v for k, v in obj.items()}
    if "data" not in d or "labels" not in d:
        raise ImageFormatError(f"{where}: batch has no 'data'/'labels' entries (keys: {sorted(map(str, d))})")
    arr = d["data"]
    if not isinstance(arr, np.ndarray) or arr.dtype != np.uint8 or arr.ndim != 2 or arr.shape[1] != 3 * SEQ_LEN:
        shape = getattr(arr, "shape", None)
        raise ImageFormatError(f"{where}: 'data' must be uint8 (N, {3 * SEQ_LEN}), got "
                               f"{getattr(arr, 'dtype', type(arr).__name__)} {shape}")
    try:
        labels = np.asarray(d["labels"], dtype=np.int64).reshape(-1)
    except (TypeError, ValueError):
        raise ImageFormatError(f"{where}: 'labels' is not a list of integers") from None
    if labels.shape[0] != arr.shape[0]:
        raise ImageFormatError(f"{where}: {labels.shape[0]} labels for {arr.shape[0]} images")
    bad = (labels < 0) | (labels >= len(CIFAR10_CLASSES))
    if bad.any():
        i = int(np.argmax(bad))
        raise ImageFormatError(f"{where}: label {labels[i]} of image {i} is outside 0-{len(CIFAR10_CLASSES) - 1}")
    rgb = arr.reshape(-1, 3, SIDE, SIDE).transpose(0, 2, 3, 1)
    return rgb_to_grey(rgb), labels


# --------------------------------------------------------------------------- sources


class ImageSplit:
    """Decoded images of one split: ``grey`` uint8 ``(N, 32, 32)``, ``labels`` int64 ``(N,)``, ``class_names``,
    ``source`` (folder, file or archive)."""

    def __init__(self, grey: np.ndarray, labels: np.ndarray, class_names: Sequence[str], source: str):
        self.grey, self.labels, self.class_names, self.source = grey, labels, tuple(class_names), source

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def _pickle_dir(path: Path) -> Path | None:
    for folder in (path, path / "cifar-10-batches-py"):
        if (folder / TRAIN_BATCHES[0]).is_file():
            return folder
    return None


def _folder_root(path: Path) -> Path | None:
    if (path / "train").is_dir():
        return path
    subs = [p for p in path.iterdir() if p.is_dir() and (p / "train").is_dir()] if path.is_dir() else []
    return subs[0] if len(subs) == 1 else None


def _batches_from_pickles(named: dict[str, tuple[bytes, str]], source: str) -> dict[str, ImageSplit | None]:
    """``named``: batch name -> (bytes, where)."""
    out: dict[str, ImageSplit | None] = {}
    missing = [b for b in TRAIN_BATCHES if b not in named]
    if missing:
        raise ImageFormatError(f"{source}: missing CIFAR batch file(s) {', '.join(missing)}")
    for split, names in (("train", TRAIN_BATCHES), ("test", (TEST_BATCH,))):
        if split == "test" and TEST_BATCH not in named:
            out[split] = None
            continue
        parts = [read_cifar_batch(*named[n]) for n in names]
        grey = np.concatenate([p[0] for p in parts])
        labels = np.concatenate([p[1] for p in parts])
        out[split] = ImageSplit(grey, labels, CIFAR10_CLASSES, source)
    return out


def _from_folder_items(items: dict[str, list], source: str) -> dict[str, ImageSplit | None]:
    """``items``: split -> [(class, file name, bytes, where)]."""
    if not items.get("train"):
        raise ImageFormatError(f"{source}: no train/<class>/*.png|jpg images")
    classes = sorted({c for c, *_ in items["train"]})
    out: dict[str, ImageSplit | None] = {}
    for split in ("train", "test"):
        rows = items.get(split) or []
        if not rows:
            out[split] = None
            continue
        unknown = sorted({c for c, *_ in rows} - set(classes))
        if unknown:
            raise ImageFormatError(f"{source}: {split} has class folder(s) {unknown} that train does not have "
                                   f"(train classes: {classes})")
        rows.sort(key=lambda r: (classes.index(r[0]), r[1]))
        grey = np.stack([decode_grey(data, where) for _, _, data, where in rows])
        labels = np.asarray([classes.index(c) for c, *_ in rows], dtype=np.int64)
        out[split] = ImageSplit(grey, labels, classes, source)
    return out


def _read_folder_tree(root: Path) -> dict[str, ImageSplit | None]:
    items: dict[str, list] = {}
    for split in ("train", "test"):
        folder = root / split
        if not folder.is_dir():
            continue
        class_dirs = sorted(p for p in folder.iterdir() if p.is_dir())
        if not class_dirs:
            raise ImageFormatError(f"{folder}: no class folders")
        for cdir in class_dirs:
            files = sorted(e.name for e in os.scandir(cdir) if e.name.lower().endswith(_IMAGE_EXT))
            if not files:
                raise ImageFormatError(f"{cdir}: no .png/.jpg images")
            for name in files:
                p = cdir / name
                items.setdefault(split, []).append((cdir.name, name, p.read_bytes(), str(p)))
    return _from_folder_items(items, str(root))


def _read_archive(path: Path) -> dict[str, ImageSplit | None]:
    pickles: dict[str, tuple[bytes, str]] = {}
    folder_items: dict[str, list] = {}
    try:
        with tarfile.open(path, "r:*") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                base = member.name.rsplit("/", 1)[-1]
                m = _FOLDER_RE.match(member.name)
                is_pickle = base in TRAIN_BATCHES or base == TEST_BATCH
                is_image = m is not None and base.lower().endswith(_IMAGE_EXT)
                if not (is_pickle or is_image):
                    continue
                where = f"{path}:{member.name}"
                data = tar.extractfile(member).read()
                if len(data) != member.size:
                    raise ImageFormatError(f"{where}: truncated member ({len(data)} of {member.size} bytes)")
                if is_pickle:
                    pickles[base] = (data, where)
                else:
                    folder_items.setdefault(m.group(2), []).append((m.group(3), m.group(4), data, where))
    except tarfile.ReadError as exc:
        raise ImageFormatError(f"{path}: not a readable tar archive, or truncated ({exc})") from None
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise ImageFormatError(f"{path}: truncated or corrupt archive ({type(exc).__name__}: {exc})") from None
    if pickles:
        return _batches_from_pickles(pickles, str(path))
    if folder_items:
        return _from_folder_items(folder_items, str(path))
    raise ImageFormatError(f"{path}: no CIFAR batches (data_batch_1..5, test_batch) and no "
                           "train/<class>/*.png|jpg images in the archive")


def _source_kind(path: Path) -> tuple[str, Path]:
    if not path.exists():
        raise FileNotFoundError(f"{path}: image data not found (give cifar-10-batches-py, an image folder "
                                "{train,test}/<class>/*.png|jpg, or a tar archive of either)")
    if path.is_file():
        return "archive", path
    pk = _pickle_dir(path)
    if pk is not None:
        return "pickle", pk
    root = _folder_root(path)
    if root is not None:
        return "folder", root
    raise FileNotFoundError(f"{path}: neither CIFAR python batches ({path}/data_batch_1 or "
                            f"{path}/cifar-10-batches-py/data_batch_1) nor an image folder ({path}/train/<class>/)")


def read_image_source(path: str | os.PathLike) -> dict[str, ImageSplit | None]:
    """Read and decode every image of a source (see the module docstring for the layouts).

    Returns:
        "train"/"test" -> :class:`ImageSplit`, or None for an absent test split.

    Raises:
        FileNotFoundError: ``path`` missing or of no known layout (the message names the paths looked for).
        ImageFormatError: naming the file or member: bad or truncated pickle, wrong array shapes, labels out of
            range, missing batch files, undecodable images, wrong image size, class folders without images,
            test classes unknown to train, a truncated or corrupt archive.
    """
    kind, where = _source_kind(Path(path))
    if kind == "archive":
        return _read_archive(where)
    if kind == "pickle":
        named = {n: ((where / n).read_bytes(), str(where / n))
                 for n in (*TRAIN_BATCHES, TEST_BATCH) if (where / n).is_file()}
        return _batches_from_pickles(named, str(where))
    return _read_folder_tree(where)


def _sources(path: Path) -> list[Path]:
    kind, where = _source_kind(path)
    if kind == "archive":
        return [where]
    if kind == "pickle":
        return [where / n for n in (*TRAIN_BATCHES, TEST_BATCH) if (where / n).is_file()]
    files: list[Path] = []
    for split in ("train", "test"):
        folder = where / split
        if folder.is_dir():
            for cdir in sorted(p for p in folder.iterdir() if p.is_dir()):
                files.append(cdir)
                files.extend(cdir / n for n in sorted(os.listdir(cdir)) if n.lower().endswith(_IMAGE_EXT))
    return files


def load_images(path: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None
                ) -> tuple[dict[str, TokenDataset | None], str]:
    """Read a CIFAR-style source as pixel-token datasets (through the cache).

    Returns:
        ``(splits, cache_status)``: "train"/"test" -> :class:`~mgk.data.cache.TokenDataset` with tokens uint8
        ``(N, 1024)`` (grey value = token id), lengths all 1024, ``class_names``; None for an absent test split.

    Raises:
        as :func:`read_image_source`.
    """
    path = Path(path)

    def build():
        """Arrays to cache, per present split: ``<split>_tokens`` uint8 (N, 1024), ``_labels`` int64 (N,), ``_classes``,
        ``_source``."""
        arrays = {}
        for split, sp in read_image_source(path).items():
            if sp is None:
                continue
            arrays.update({f"{split}_tokens": sp.grey.reshape(len(sp), SEQ_LEN), f"{split}_labels": sp.labels,
                           f"{split}_classes": np.array(sp.class_names), f"{split}_source": np.array(sp.source)})
        return arrays

    arrays, status = cached_arrays(cache_dir, "images", _sources(path),
                                   {"reader": READER_VERSION, "grey": "itu601-rounded"}, build)
    out: dict[str, TokenDataset | None] = {}
    for split in ("train", "test"):
        if f"{split}_tokens" not in arrays:
            out[split] = None
            continue
        tokens = arrays[f"{split}_tokens"]
        out[split] = TokenDataset(tokens, arrays[f"{split}_labels"], np.full(tokens.shape[0], SEQ_LEN, np.int64),
                                  source=str(arrays[f"{split}_source"]),
                                  class_names=[str(c) for c in arrays[f"{split}_classes"]])
    return out, status
