"""What the LRA task modules share: the task class over compact token arrays and the data-check report helpers."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..config import RunConfig
from ..data.cache import length_stats
from ..data.image import SEQ_LEN as SEQ_LEN_IMAGE
from .classification import ClassificationTask

__all__ = ["LRAClassificationTask", "check_max_len", "label_line", "length_line", "require_data"]


@dataclass
class LRAClassificationTask(ClassificationTask):
    """:class:`ClassificationTask` over :class:`~mgk.data.cache.TokenDataset` splits, whose tokens are stored in a
    compact dtype (uint8 / int16; the base class casts batches to int64). ``describe`` adds the truncation count and
    ``extra`` (e.g. the max_len or the Pathfinder level) to each split's entry in results.json."""

    extra: dict = field(default_factory=dict)

    def describe(self, dataset) -> dict:
        """Split facts for results.json: majority-class accuracy, truncated rows, and ``extra``. ValueError for an
        empty split."""
        return {"majority_acc": dataset.majority_acc(), "num_truncated": int(dataset.num_truncated), **self.extra}


def label_line(counts, names) -> str:
    """``"labels: neg 12500 (50.0%), pos 12500 (50.0%)"``."""
    total = max(1, sum(counts))
    names = list(names) or [str(i) for i in range(len(counts))]
    return "labels: " + ", ".join(f"{n} {c} ({100 * c / total:.1f}%)" for n, c in zip(names, counts))


def length_line(lengths, max_len: int | None, unit: str = "tokens") -> str:
    """``"length (bytes): min 10 / mean 1325.1 / median 979 / max 13704; 8000 longer than max_len=1000"``."""
    st = length_stats(lengths)
    line = (f"length ({unit}): min {st['min']} / mean {st['mean']:.1f} / median {st['median']:g} / "
            f"max {st['max']}")
    if max_len is not None:
        over = int(sum(1 for n in lengths if n > max_len))
        line += f"; {over} longer than max_len={max_len}"
    return line


def require_data(cfg: RunConfig, what: str) -> Path:
    """``Path(cfg.data.path)``; FileNotFoundError with the expected layout when it is None or absent."""
    if cfg.data.path is None:
        raise FileNotFoundError(f"task {cfg.task} has no embedded default data: pass --data with {what}")
    path = Path(cfg.data.path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: --data not found (task {cfg.task} expects {what})")
    return path


def check_max_len(cfg: RunConfig) -> None:
    """ValueError unless ``cfg.data.max_len >= 1024`` (every image sequence has all 1,024 pixels)."""
    if cfg.data.max_len < SEQ_LEN_IMAGE:
        raise ValueError(f"task {cfg.task}: every sequence has {SEQ_LEN_IMAGE} pixels (32x32, no padding, no cut); "
                         f"set max_len={SEQ_LEN_IMAGE} (got {cfg.data.max_len})")
