"""The generated splits of a synthetic task (D-retrieval, MQAR) as ``mgk data check`` reads them: each split file
loaded or reported (malformed: an error naming the file; absent: an error for train, a note otherwise), and the
input sequences that two splits share (a split that repeats another's inputs measures memorisation)."""
from __future__ import annotations

from pathlib import Path
from types import ModuleType

SPLIT_PAIRS = (("train", "val"), ("train", "test"), ("val", "test"))


def present_splits(data: Path, module: ModuleType, format_error: type[Exception], lines: list[str],
                   errors: list[str]):
    """Yield ``(name, split)`` for each of ``module.SPLITS`` that loads from ``data`` (``module.load_split``),
    appending to ``errors`` the message of each malformed file (``format_error``) and a missing train split, and to
    ``lines`` each other missing split, in split order."""
    for name in module.SPLITS:
        try:
            split = module.load_split(data, name)
        except format_error as exc:
            errors.append(str(exc))
            continue
        if split is None:
            (errors if name == "train" else lines).append(
                f"{name}: {module.split_path(data, name).name} absent in {data}")
            continue
        yield name, split


def shared_inputs(splits: dict, a: str, b: str) -> str | None:
    """The error for split ``b`` repeating input sequences of split ``a`` (each split has ``inputs`` (N, T) and a
    ``source``), or None."""
    seen = {row.tobytes() for row in splits[a].inputs}
    k = sum(row.tobytes() in seen for row in splits[b].inputs)
    return f"{splits[b].source}: {k} input sequences also in {a} ({splits[a].source})" if k else None
