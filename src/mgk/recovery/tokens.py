"""Token windows for `mgk convert`: a text file (or a WikiText folder's split) cut into the source tokenizer's tokens,
then into non-overlapping windows from its start: what recovery trains on and what perplexity is scored on."""
from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["PIECE", "text_file", "token_windows"]

PIECE = 1 << 18  # characters tokenised at once (then to the end of the line)

# A folder's split, in the names WikiText releases use (the raw and tokenised forms)
_SPLIT_FILES = {"train": ("wiki.train.tokens", "train.txt", "wiki.train.raw"),
                "valid": ("wiki.valid.tokens", "valid.txt", "wiki.valid.raw"),
                "test": ("wiki.test.tokens", "test.txt", "wiki.test.raw")}


def text_file(path: str | Path, split: str) -> Path:
    """``path`` itself when it is a file, else its ``split`` file in one of WikiText's names; ValueError naming the
    path and the names looked for."""
    path = Path(path)
    if path.is_file():
        return path
    if path.is_dir():
        for name in _SPLIT_FILES[split]:
            if (path / name).is_file():
                return path / name
        raise ValueError(f"{path}: no {split} text in it (looked for {', '.join(_SPLIT_FILES[split])})")
    raise ValueError(f"{path}: no such file or folder")


def token_windows(tokenizer, path: Path, tokens: int, window: int) -> torch.Tensor:
    """(N, window) int64: the first ``tokens`` tokens of the text at ``path`` (rounded down to whole windows, at least
    one), tokenised whole with ``tokenizer`` (no special tokens added), in consecutive non-overlapping windows.

    The text is tokenised in pieces of :data:`PIECE` characters extended to the end of their line, so that a budget
    of 0.1M tokens does not tokenise a 540 MB file; the pieces do not depend on the budget, so a smaller budget's
    tokens are the first of a larger one's. ValueError naming the file when it holds fewer tokens than asked
    (naming both counts): a budget is never cut silently."""
    if tokens < window:
        raise ValueError(f"{tokens} tokens is less than one window of {window}")
    want = tokens // window * window
    ids: list[int] = []
    with open(path, encoding="utf-8") as f:
        while len(ids) < want:
            text = f.read(PIECE)
            if not text:
                break
            rest = f.readline()  # end on a line boundary: a word is never cut between two pieces
            ids += tokenizer(text + rest, add_special_tokens=False)["input_ids"]
    if len(ids) < want:
        raise ValueError(f"{path}: holds {len(ids)} tokens, fewer than the {want} asked for")
    return torch.tensor(ids[:want], dtype=torch.int64).view(-1, window)
