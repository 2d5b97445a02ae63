"""Pathfinder-32 (LRA): read one difficulty level of the release, and our own generator of such images.

Release layout (``lra_release/pathfinder32/<level>/``; Tay et al. 2021, "Long Range Arena", section 2.2.5)::

    <level>/imgs/<n>/sample_<k>.png     32x32 grey PNGs
    <level>/metadata/<n>.npy            one line per image

Levels: ``curv_baseline`` (easy), ``curv_contour_length_9`` (intermediate), ``curv_contour_length_14`` (hard, the
LRA task and our default). ``easy``/``intermediate``/``hard`` are accepted as aliases. Only the named level folder
is read.

Metadata format, and why we believe it: despite the ``.npy`` suffix the LRA release's metadata files are UTF-8
text, one image per line, space-separated fields: ``<imgs subfolder> <file name> <index> <label> ...``, e.g.
``imgs/0 sample_0.png 0 1 ...``. Evidence: the LRA TFDS builder (``lra_benchmarks/data/pathfinder.py``) reads each
file with ``tf.io.read_file(...).decode('utf-8').split('\\n')[:-1]``, splits each line on spaces, opens
``<level>/<field 0>/<field 1>`` and takes ``int(field 3)`` as the label; the Nystromformer LRA scripts (which the
MGK paper follows) do the same. A text line cannot be parsed any other way, so field 0 = folder relative to the
level folder, field 1 = file name, field 3 = label (0/1); the other fields (index, generator settings) are ignored.
Files that really are numpy ``.npy`` arrays (``\\x93NUMPY`` magic; a 2-D array of strings with the same columns,
as the original Pathfinder generator's ``np.save`` would write) are read too, with ``allow_pickle=False``.

Known quirk of the release: a few PNGs are empty (0 bytes); the LRA/Nystromformer pipelines skip them. We skip
them too and count them (reported in the task notes and by ``mgk data check``). Any other unreadable image,
missing file, or malformed metadata line is an error naming the file (and line).

Splits: the release has no split; LRA ports shuffle all images unseeded and cut 80/10/10. We shuffle with
``split_seed`` (numpy ``default_rng``) and cut ``test = 10%``, ``val = val_fraction`` (default 10%), train = the
rest (80% by default); see :func:`mgk.data.cache.seeded_split`.

Tokens: the 1,024 grey values row by row, value ``p`` -> id ``p`` (vocabulary 256), no padding (pixel 0 is a real
pixel), as :mod:`mgk.data.image`.

Generator (our own, written from the task description of Linsley et al. 2018 and Kim et al. 2020, not from their
code): :func:`generate_pathfinder`. Each image holds two *target* contours of ``contour_length`` dashes (short line
segments of ``dash`` pixels with ``gap`` pixels between them, each dash turning by at most ``max_turn`` radians
from the previous one) and several shorter *distractor* contours (``contour_length // 3`` dashes, ``20 //`` that
many of them, as in the LRA settings), none touching another. Two round markers are drawn: at both ends of the
first target contour (label 1, "connected"), or at one end of each target contour (label 0). Both classes thus have
the same strokes; only the markers' placement differs. Difficulty is the contour length (the release's level
names map to 6, 9 and 14 dashes). Lines are anti-aliased from their exact distance to each pixel centre; strokes
have grey level ``stroke`` (0.75 = 191), markers 255, background 0. Labels are balanced: ``num // 2`` positives
(exactly 50/50 for even ``num``), their positions drawn from the seed. Everything is a pure function of
``(num, seed)``: the labels come from ``numpy.random.default_rng([seed, 2**31])``, image ``i`` (given its label)
from ``default_rng([seed, i])``.
"""
from __future__ import annotations

import io
import os
import re
import shutil
from pathlib import Path

import numpy as np

from ..atomic import write_text_atomic
from .cache import TokenDataset, cached_arrays, seeded_split
from .image import SEQ_LEN, SIDE, ImageFormatError, decode_grey

__all__ = ["LEVELS", "LEVEL_ALIASES", "DEFAULT_LEVEL", "VOCAB_SIZE", "TEST_FRACTION", "READER_VERSION",
           "PathfinderFormatError", "resolve_level", "find_level_dir", "read_metadata", "read_pathfinder_level",
           "load_pathfinder", "split_pathfinder", "contour_length_of", "generate_pathfinder",
           "write_pathfinder_level"]

LEVELS = ("curv_baseline", "curv_contour_length_9", "curv_contour_length_14")
LEVEL_ALIASES = {"easy": "curv_baseline", "intermediate": "curv_contour_length_9", "hard": "curv_contour_length_14"}
DEFAULT_LEVEL = "curv_contour_length_14"
VOCAB_SIZE = 256
TEST_FRACTION = 0.1
READER_VERSION = 1
CLASS_NAMES = ("disconnected", "connected")
_NPY_MAGIC = b"\x93NUMPY"


class PathfinderFormatError(ImageFormatError):
    """Malformed or missing Pathfinder input; the message names the file (and line for metadata)."""


def resolve_level(level: str) -> str:
    """The level folder name for ``level`` (an alias easy/intermediate/hard, or a folder name, kept as is)."""
    return LEVEL_ALIASES.get(level, level)


def find_level_dir(data: str | os.PathLike, level: str) -> Path:
    """The folder of ``level``: ``data/pathfinder32/<level>``, ``data/<level>``, or ``data`` itself when its name is
    the level.

    Raises:
        FileNotFoundError: none of them exists; the message lists the level folders that do.
    """
    data, level = Path(data), resolve_level(level)
    candidates = [data / "pathfinder32" / level, data / level]
    if data.name == level:
        candidates.append(data)
    for c in candidates:
        if (c / "metadata").is_dir():
            return c
    present = sorted({p.name for base in (data, data / "pathfinder32") if base.is_dir() for p in base.iterdir()
                      if (p / "metadata").is_dir()})
    raise FileNotFoundError(f"{data}: no Pathfinder level {level!r} (looked for {candidates[0]} and {candidates[1]} "
                            f"with a metadata/ folder); level folders present: {present or 'none'}")


def _meta_sort_key(p: Path):
    return (0, int(p.stem), p.name) if p.stem.isdigit() else (1, 0, p.name)


def read_metadata(path: str | os.PathLike) -> list[tuple[str, str, int, int]]:
    """Rows of one metadata file: ``(folder, file name, line number, label)``.

    Raises:
        PathfinderFormatError: naming the file and line: fewer than 4 fields, a label other than 0/1, an absolute
            or ``..`` path, text that is not UTF-8, an unreadable ``.npy`` array.
    """
    path = Path(path)
    raw = path.read_bytes()
    if raw.startswith(_NPY_MAGIC):
        try:
            arr = np.load(io.BytesIO(raw), allow_pickle=False)
        except ValueError as exc:
            raise PathfinderFormatError(f"{path}: unreadable .npy metadata ({exc})") from None
        if arr.ndim != 2:
            raise PathfinderFormatError(f"{path}: .npy metadata must be a 2-D array of strings, got shape "
                                        f"{arr.shape}")
        lines = [" ".join(str(x) for x in row) for row in arr]
    else:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PathfinderFormatError(f"{path}: neither a .npy array nor UTF-8 text ({exc.reason})") from None
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
    rows = []
    for lineno, line in enumerate(lines, start=1):
        fields = line.strip().split()
        if len(fields) < 4:
            raise PathfinderFormatError(f"{path}: line {lineno}: {len(fields)} fields, expected at least 4 "
                                        "(folder, file name, index, label)")
        folder, name, label = fields[0], fields[1], fields[3]
        if label not in ("0", "1"):
            raise PathfinderFormatError(f"{path}: line {lineno}: label {label!r} is not 0 or 1")
        if folder.startswith("/") or ".." in Path(folder).parts or "/" in name or name == "..":
            raise PathfinderFormatError(f"{path}: line {lineno}: image path {folder}/{name} leaves the level folder")
        rows.append((folder, name, lineno, int(label)))
    return rows


def read_pathfinder_level(level_dir: str | os.PathLike) -> tuple[np.ndarray, np.ndarray, int, list[str]]:
    """Read every image listed by ``level_dir/metadata/*.npy`` (files in numeric order, lines in file order).

    Returns:
        ``(grey, labels, num_empty, names)``: uint8 ``(N, 32, 32)``, int64 ``(N,)`` 0/1, the number of 0-byte PNGs
        skipped, and each image's path relative to ``level_dir``.

    Raises:
        PathfinderFormatError: no metadata files, a malformed metadata line, a listed image that is missing or not
            a decodable 32x32 image (the message names it and the metadata line).
    """
    level_dir = Path(level_dir)
    files = _metadata_files(level_dir)
    if not files:
        raise PathfinderFormatError(f"{level_dir / 'metadata'}: no metadata/*.npy files")
    grey, labels, names, empty = [], [], [], 0
    for mfile in files:
        for folder, name, lineno, label in read_metadata(mfile):
            img = level_dir / folder / name
            where = f"{img} (listed in {mfile}: line {lineno})"
            if not img.is_file():
                raise PathfinderFormatError(f"{where}: image file missing")
            data = img.read_bytes()
            if not data:
                empty += 1
                continue
            try:
                grey.append(decode_grey(data, where, side=SIDE))
            except ImageFormatError as exc:
                raise PathfinderFormatError(str(exc)) from None
            labels.append(label)
            names.append(f"{folder}/{name}")
    if not grey:
        raise PathfinderFormatError(f"{level_dir}: no readable images")
    return np.stack(grey), np.asarray(labels, dtype=np.int64), empty, names


def _metadata_files(level_dir: Path) -> list[Path]:
    meta_dir = level_dir / "metadata"
    return sorted((p for p in meta_dir.iterdir() if p.suffix == ".npy" and p.is_file()), key=_meta_sort_key) \
        if meta_dir.is_dir() else []


def _sources(level_dir: Path) -> list[Path]:
    """Files whose size and mtime key the cache: the metadata folder and files, and every image they list (a PNG
    rewritten in place changes the key even when its folder's mtime does not). A listed image that is missing is
    left out here; reading the level then reports it with its metadata line."""
    meta = _metadata_files(level_dir)
    images = []
    for mfile in meta:
        for folder, name, _, _ in read_metadata(mfile):
            img = level_dir / folder / name
            if img.is_file():
                images.append(img)
    return [level_dir / "metadata", *meta, *images]


def load_pathfinder(data: str | os.PathLike, level: str = DEFAULT_LEVEL, *,
                    cache_dir: str | os.PathLike | None = None) -> tuple[TokenDataset, int, Path, str]:
    """Read one level through the cache (keyed by the size and mtime of the metadata files and of every listed image).

    Returns:
        ``(dataset, num_empty, level_dir, cache_status)``: all images as a :class:`~mgk.data.cache.TokenDataset`
        (tokens uint8 ``(N, 1024)``, lengths all 1024, labels 0/1), the number of empty PNGs skipped.

    Raises:
        FileNotFoundError: the level folder is absent. PathfinderFormatError: as :func:`read_pathfinder_level`.
    """
    level_dir = find_level_dir(data, level)

    def build():
        """Arrays to cache: ``tokens`` uint8 (N, 1024), ``labels`` int64 (N,) 0/1, ``empty`` (0-byte PNGs skipped)."""
        grey, labels, empty, _ = read_pathfinder_level(level_dir)
        return {"tokens": grey.reshape(-1, SEQ_LEN), "labels": labels, "empty": np.array(empty)}

    a, status = cached_arrays(cache_dir, f"pathfinder-{level_dir.name}", _sources(level_dir),
                              {"reader": READER_VERSION}, build)
    ds = TokenDataset(a["tokens"], a["labels"], np.full(a["tokens"].shape[0], SEQ_LEN, np.int64),
                      source=str(level_dir), class_names=CLASS_NAMES)
    return ds, int(a["empty"]), level_dir, status


def split_pathfinder(ds: TokenDataset, *, val_fraction: float, split_seed: int,
                     test_fraction: float = TEST_FRACTION) -> dict[str, TokenDataset | None]:
    """Seeded train/val/test split (:func:`~mgk.data.cache.seeded_split` with fractions ``(test, val)``); a
    fraction of 0 gives None for that split."""
    test_idx, val_idx, train_idx = seeded_split(len(ds), [test_fraction, val_fraction], split_seed)
    return {"train": ds.subset(train_idx), "val": ds.subset(val_idx) if val_fraction > 0 else None,
            "test": ds.subset(test_idx) if test_fraction > 0 else None}


# --------------------------------------------------------------------------- generator


def contour_length_of(level: str) -> int:
    """Dashes per target contour for a level name: curv_baseline 6, curv_contour_length_<n> n.

    Raises:
        ValueError: a name that is neither.
    """
    level = resolve_level(level)
    if level == "curv_baseline":
        return 6
    m = re.fullmatch(r"curv_contour_length_(\d+)", level)
    if not m or int(m.group(1)) < 2:
        raise ValueError(f"cannot tell the contour length of level {level!r}: use curv_baseline, "
                         "curv_contour_length_<n> (n >= 2) or easy/intermediate/hard")
    return int(m.group(1))


_GRID = 4  # cells per pixel of the clearance grid


def _forbidden_grid(obstacles: np.ndarray, clearance: np.ndarray, side: int) -> np.ndarray:
    """Bool grid ``(side * _GRID, side * _GRID)``: True where a cell centre is closer than ``clearance[m]`` to some
    obstacle point ``obstacles[m]``."""
    n = side * _GRID
    grid = np.zeros((n, n), dtype=bool)
    c = (np.arange(n) + 0.5) / _GRID
    for (x, y), r in zip(obstacles, clearance):
        lo_x, hi_x = max(0, int((x - r) * _GRID)), min(n, int((x + r) * _GRID) + 1)
        lo_y, hi_y = max(0, int((y - r) * _GRID)), min(n, int((y + r) * _GRID) + 1)
        dx = c[lo_x:hi_x][None, :] - x
        dy = c[lo_y:hi_y][:, None] - y
        grid[lo_y:hi_y, lo_x:hi_x] |= dx * dx + dy * dy < r * r
    return grid


def _grow_contour(rng, n_dashes: int, forbidden: np.ndarray | None, *, dash: float, gap: float, max_turn: float,
                  side: int, margin: float, self_clearance: float, walks: int = 32, candidates: int = 8,
                  lookahead: float = 6.0):
    """One dashed contour, or None when none of ``walks`` attempts (grown side by side, vectorised) succeeds.

    Each walk starts at a random point and grows dash by dash; each dash turns by at most ``max_turn`` from the
    previous one (the first may point anywhere). Of ``candidates`` random turns, the admissible ones keep the dash
    inside ``[margin, side - margin]`` and off the ``forbidden`` grid (:func:`_forbidden_grid` of the contours
    already drawn); among them the one heading where there is room (the border distance of the point ``lookahead``
    pixels further on, capped at ``margin + 2``, plus a random tie-break in [0, 1)) is taken. A walk with no
    admissible turn dies. A finished walk must also keep ``self_clearance`` from its own dashes other than the
    neighbouring ones. The first such walk is returned.

    Returns:
        segments ``(n_dashes, 2, 2)``: ``[start, end]`` points ``(x, y)``; or None.
    """
    W, C = walks, candidates
    t = np.linspace(0.0, 1.0, 3)
    n_cells = side * _GRID
    pos = rng.uniform(margin, side - margin, size=(W, 2))
    theta = np.zeros(W)
    alive = np.ones(W, dtype=bool)
    starts_all = np.empty((W, n_dashes, 2))
    ends_all = np.empty((W, n_dashes, 2))
    rows = np.arange(W)
    for i in range(n_dashes):
        if i == 0:
            angles = rng.uniform(0, 2 * np.pi, size=(W, 1)) + np.linspace(0.0, 2 * np.pi, C, endpoint=False)
        else:
            angles = theta[:, None] + rng.uniform(-max_turn, max_turn, size=(W, C))
        d = np.stack([np.cos(angles), np.sin(angles)], axis=-1)  # (W, C, 2)
        pts = pos[:, None, None, :] + (t[:, None] * dash)[None, None] * d[:, :, None, :]  # (W, C, 3, 2)
        ok = ((pts >= margin) & (pts <= side - margin)).all(axis=(2, 3))
        if forbidden is not None:
            cell = np.clip((pts * _GRID).astype(np.int64), 0, n_cells - 1)
            ok &= ~forbidden[cell[..., 1], cell[..., 0]].any(axis=2)
        ahead = pos[:, None, :] + d * (dash + lookahead)
        room = np.minimum(np.minimum(ahead, side - ahead).min(axis=-1), margin + 2.0)
        score = np.where(ok, room + rng.uniform(0.0, 1.0, size=(W, C)), -np.inf)
        j = np.argmax(score, axis=1)
        alive &= ok[rows, j]
        if not alive.any():
            return None
        theta = angles[rows, j]
        step = d[rows, j]
        starts_all[:, i] = pos
        ends_all[:, i] = pos + step * dash
        pos = ends_all[:, i] + step * gap
    cand = np.flatnonzero(alive)
    pts = starts_all[cand, :, None, :] + t[None, None, :, None] * (ends_all - starts_all)[cand, :, None, :]
    flat = pts.reshape(len(cand), -1, 2)
    if n_dashes > 2:
        dash_of = np.repeat(np.arange(n_dashes), len(t))
        apart = np.abs(dash_of[:, None] - dash_of[None, :]) >= 2
        d2 = ((flat[:, :, None, :] - flat[:, None, :, :]) ** 2).sum(-1)
        good = cand[(d2[:, apart] >= self_clearance ** 2).all(axis=1)]
    else:
        good = cand
    if good.size == 0:
        return None
    k = good[0]
    return np.stack([starts_all[k], ends_all[k]], axis=1)


def _sample_points(segs: np.ndarray, k: int = 4) -> np.ndarray:
    t = np.linspace(0.0, 1.0, k)[None, :, None]
    return (segs[:, :1] + t * (segs[:, 1:] - segs[:, :1])).reshape(-1, 2)


def _seg_distance(px: np.ndarray, segs: np.ndarray) -> np.ndarray:
    """Distance of each pixel centre (P, 2) to the nearest segment of ``segs`` (S, 2, 2) -> (P,)."""
    a, b = segs[:, 0], segs[:, 1]
    ab = b - a
    t = ((px[:, None, :] - a[None]) * ab[None]).sum(-1) / np.maximum((ab ** 2).sum(-1), 1e-12)[None]
    t = np.clip(t, 0.0, 1.0)
    nearest = a[None] + t[..., None] * ab[None]
    return np.sqrt(((px[:, None, :] - nearest) ** 2).sum(-1)).min(axis=1)


def _render_one(rng, label: int, contour_length: int, side: int, *, dash: float, gap: float, max_turn: float,
                width: float, marker_radius: float, stroke: float, min_dist: float) -> np.ndarray:
    margin = marker_radius + 0.5
    distractor_len = max(2, contour_length // 3)
    num_distractors = 20 // distractor_len
    end_clear = marker_radius + min_dist  # a marker never touches another contour
    grow = dict(dash=dash, gap=gap, max_turn=max_turn, side=side, self_clearance=min_dist)
    for _ in range(1000):  # restart until both targets fit
        a = _grow_contour(rng, contour_length, None, margin=margin, **grow)
        if a is None:
            continue
        pa, ends_a = _sample_points(a), np.stack([a[0, 0], a[-1, 1]])
        obstacles = np.concatenate([pa, ends_a])
        clearance = np.concatenate([np.full(len(pa), min_dist), np.full(2, end_clear)])
        b = _grow_contour(rng, contour_length, _forbidden_grid(obstacles, clearance, side), margin=margin, **grow)
        if b is None:
            continue
        ends_b = np.stack([b[0, 0], b[-1, 1]])
        if (((ends_b[:, None] - pa[None]) ** 2).sum(-1) >= end_clear ** 2).all():
            break
    else:  # pragma: no cover - only with settings that cannot fit
        raise RuntimeError(f"could not place two contours of {contour_length} dashes in a {side}x{side} image")
    segments = [a, b]
    pb = _sample_points(b)
    forbidden = _forbidden_grid(np.concatenate([pa, pb, ends_a, ends_b]),
                                np.concatenate([np.full(len(pa) + len(pb), min_dist), np.full(4, end_clear)]), side)
    for _d in range(num_distractors):
        c = _grow_contour(rng, distractor_len, forbidden, margin=1.0, walks=16, **grow)
        if c is not None:
            pc = _sample_points(c)
            segments.append(c)
            forbidden |= _forbidden_grid(pc, np.full(len(pc), min_dist), side)
    if label == 1:
        markers = [a[0, 0], a[-1, 1]]
    else:
        markers = [a[0, 0] if rng.random() < 0.5 else a[-1, 1], b[0, 0] if rng.random() < 0.5 else b[-1, 1]]
    ys, xs = np.mgrid[0:side, 0:side]
    px = np.stack([xs.ravel() + 0.5, ys.ravel() + 0.5], axis=1)
    d = _seg_distance(px, np.concatenate(segments))
    img = stroke * np.clip(width / 2 + 0.5 - d, 0.0, 1.0)
    for m in markers:
        dm = np.sqrt(((px - m) ** 2).sum(-1))
        img = np.maximum(img, np.clip(marker_radius + 0.5 - dm, 0.0, 1.0))
    return np.round(img * 255).astype(np.uint8).reshape(side, side)


def generate_pathfinder(num: int, *, contour_length: int = 14, seed: int = 0, side: int = SIDE,
                        dash: float = 2.0, gap: float = 1.0, max_turn: float = np.pi / 4, width: float = 1.0,
                        marker_radius: float = 1.5, stroke: float = 0.75, min_dist: float = 2.0
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Generate ``num`` Pathfinder images (see the module docstring), deterministic in ``seed``.

    Returns:
        ``(images, labels)``: uint8 ``(num, side, side)`` and int64 ``(num,)`` with ``num // 2`` ones.

    Raises:
        ValueError: ``num < 0`` or ``contour_length < 2``.
    """
    if isinstance(num, bool) or not isinstance(num, int) or num < 0:
        raise ValueError(f"num must be an int >= 0, got {num!r}")
    if contour_length < 2:
        raise ValueError(f"contour_length must be >= 2, got {contour_length}")
    labels = np.zeros(num, dtype=np.int64)
    labels[np.random.default_rng([seed, 2 ** 31]).permutation(num)[:num // 2]] = 1
    images = np.empty((num, side, side), dtype=np.uint8)
    for i in range(num):
        rng = np.random.default_rng([seed, i])
        images[i] = _render_one(rng, int(labels[i]), contour_length, side, dash=dash, gap=gap, max_turn=max_turn,
                                width=width, marker_radius=marker_radius, stroke=stroke, min_dist=min_dist)
    return images, labels


def write_pathfinder_level(out: str | os.PathLike, level: str, images: np.ndarray, labels: np.ndarray, *,
                           per_folder: int = 1000) -> Path:
    """Write images in the release layout: ``out/pathfinder32/<level>/imgs/<n>/sample_<k>.png`` and
    ``metadata/<n>.npy`` text lines ``imgs/<n> sample_<k>.png <k> <label>`` (``per_folder`` images per folder).

    The metadata folder appears last, whole (written beside it, then renamed): a crash part-way leaves no
    ``metadata``, so a run that generates its data into its run directory generates it again on resume instead of
    reading part of it.

    Returns:
        the level folder. Requires Pillow.
    """
    from PIL import Image

    level_dir = Path(out) / "pathfinder32" / resolve_level(level)
    partial, metadata = level_dir / ".metadata.partial", level_dir / "metadata"
    shutil.rmtree(partial, ignore_errors=True)
    for f in range(0, max(1, len(images)), per_folder):
        n = f // per_folder
        folder = level_dir / "imgs" / str(n)
        folder.mkdir(parents=True, exist_ok=True)
        lines = []
        for k in range(f, min(f + per_folder, len(images))):
            Image.fromarray(np.ascontiguousarray(images[k], dtype=np.uint8)).save(folder / f"sample_{k}.png")
            lines.append(f"imgs/{n} sample_{k}.png {k} {int(labels[k])}\n")
        write_text_atomic(partial / f"{n}.npy", "".join(lines))
    shutil.rmtree(metadata, ignore_errors=True)
    os.replace(partial, metadata)
    return level_dir
