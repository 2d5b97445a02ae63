"""WikiText-103 / WikiText-2: word-level corpus, vocabulary from the train split, cached encoded tensors.

Files (the WikiText release of Merity et al. 2017, "Pointer Sentinel Mixture Models"):
``wiki.{train,valid,test}.tokens`` or ``{train,valid,test}.txt`` in one folder (the ``.tokens`` name wins when both
exist). The split name ``val`` / ``validation`` means ``valid``. Files are UTF-8; a byte-order mark at the start is
skipped. Bytes that are not UTF-8 and empty files are errors (:class:`WikiTextFormatError`) naming the file and the
line.

Conventions (those of the published WikiText-103 token counts and of the Transformer-XL / fairseq / pytorch
``word_language_model`` readers):

- A line is split on whitespace (``str.split()``), case kept, and ``<eos>`` is appended to *every* line, empty
  lines included, so an empty line is one ``<eos>`` token. Lines end at ``\\n`` (also ``\\r\\n`` and ``\\r``); a
  last line without a newline is still a line. With this rule the full WT-103 valid split has 213,886 words + 3,760
  lines = 217,646 tokens, the published count.
- The vocabulary is built from the train split only: every word type of train plus ``<eos>``, ordered by
  frequency (most frequent first), ties broken by the word itself (Unicode code point order), so the order does not
  depend on where a word first occurs. WikiText writes rare words as the literal token ``<unk>``, which is therefore
  an ordinary, counted word of the vocabulary.
- A word of valid/test that is not in the vocabulary maps to ``<unk>`` when the vocabulary has it (the count of such
  words is reported), otherwise :class:`UnknownWordError` names the file, the line and the word.

Encoded splits are int32 tensors (one id per token, ``<eos>`` included), cached by :mod:`mgk.data.cache` (``.npz``
entries, loaded without pickle): an entry is keyed by the absolute path, size and mtime of the files it was made from
and by the settings above (a format version), so editing a file invalidates its entries, and it is written
atomically, so a crashed or concurrent writer never leaves a truncated entry.
"""
from __future__ import annotations

import array
import hashlib
import os
import random
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..atomic import write_text_atomic
from .cache import OFF, cached_arrays, resolve_cache_dir

__all__ = [
    "CACHE_VERSION",
    "EOS",
    "SPLITS",
    "UNK",
    "Corpus",
    "UnknownWordError",
    "Vocabulary",
    "WikiTextFormatError",
    "check_corpus",
    "count_words",
    "default_cache_dir",
    "encode_file",
    "find_split_file",
    "generate_corpus",
    "iter_line_words",
    "load_corpus",
    "load_split",
    "load_vocabulary",
    "split_name",
]

EOS = "<eos>"
UNK = "<unk>"
SPLITS: tuple[str, ...] = ("train", "valid", "test")
CACHE_VERSION = 1  # bump when the tokenisation or ordering rules above change
_ALIASES = {"train": "train", "valid": "valid", "val": "valid", "validation": "valid", "test": "test"}
_SETTINGS = {"version": CACHE_VERSION, "eos": EOS, "unk": UNK, "eos_per_line": "every line, empty included",
             "order": "count desc, then word"}


class WikiTextFormatError(ValueError):
    """A WikiText file that cannot be read as UTF-8 text, or is empty; the message names the file and the line."""


class UnknownWordError(ValueError):
    """A word of an evaluation split is missing from the vocabulary, which has no ``<unk>`` to map it to."""


def split_name(name: str) -> str:
    """Canonical split name: "train", "valid" or "test" ("val" and "validation" mean "valid")."""
    if name not in _ALIASES:
        raise ValueError(f"unknown split {name!r}; choose one of {SPLITS} (or 'val')")
    return _ALIASES[name]


def _candidates(data_dir: Path, split: str) -> list[Path]:
    s = split_name(split)
    return [data_dir / f"wiki.{s}.tokens", data_dir / f"{s}.txt"]


def find_split_file(data_dir: str | os.PathLike, split: str) -> Path | None:
    """``wiki.<split>.tokens`` or ``<split>.txt`` in ``data_dir`` (the first that exists), else None."""
    for path in _candidates(Path(data_dir), split):
        if path.is_file():
            return path
    return None


def _first_bad_utf8_line(path: Path) -> int:
    """1-based line (line ends as in text mode: ``\\n``, ``\\r\\n``, ``\\r``) of the first bytes that are not UTF-8.
    A line end byte never occurs inside a multi-byte UTF-8 character, so lines can be cut before decoding."""
    lineno = 0
    with open(path, "rb") as f:
        for raw in f:
            for part in raw.splitlines() or [raw]:
                lineno += 1
                try:
                    part.decode("utf-8")
                except UnicodeDecodeError:
                    return lineno
    return max(lineno, 1)


def iter_line_words(path: str | os.PathLike) -> Iterator[list[str]]:
    """The words of each line of ``path`` with ``<eos>`` appended (an empty line gives ``["<eos>"]``).

    A UTF-8 byte-order mark at the start of the file is skipped (it is not a word).

    Raises:
        WikiTextFormatError: naming the file and line: bytes that are not UTF-8, or an empty file (no line at all).
    """
    path = Path(path)
    num_lines = 0
    try:
        with open(path, encoding="utf-8-sig") as f:
            for line in f:
                num_lines += 1
                words = line.split()
                words.append(EOS)
                yield words
    except UnicodeDecodeError as exc:
        bad = _first_bad_utf8_line(path)
        raise WikiTextFormatError(f"{path}: line {bad}: not valid UTF-8 ({exc.reason}); WikiText files are UTF-8 "
                                  "text") from None
    if num_lines == 0:
        raise WikiTextFormatError(f"{path}: line 1: empty file (a WikiText split has at least one line)")


def count_words(path: str | os.PathLike) -> Counter:
    """Word counts of a file, ``<eos>`` counted once per line. Raises WikiTextFormatError as
    :func:`iter_line_words`."""
    counts: Counter = Counter()
    for words in iter_line_words(path):
        counts.update(words)
    return counts


class Vocabulary:
    """Words <-> ids. ``words[i]`` is the word of id i; ``counts[i]`` its train count (0 when unknown).

    Build one with :meth:`from_counts` / :meth:`from_file`; ``unk_id`` is the id of ``<unk>`` or None."""

    def __init__(self, words: Sequence[str], counts: Sequence[int] | None = None):
        self.words = list(words)
        self.counts = list(counts) if counts is not None else [0] * len(self.words)
        self.index = {w: i for i, w in enumerate(self.words)}
        if len(self.index) != len(self.words):
            raise ValueError("vocabulary words must be unique")
        if EOS not in self.index:
            raise ValueError(f"vocabulary has no {EOS}")
        self.eos_id = self.index[EOS]
        self.unk_id = self.index.get(UNK)

    @classmethod
    def from_counts(cls, counts: Counter) -> Vocabulary:
        """Most frequent first; equal counts ordered by the word (code point order)."""
        ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        return cls([w for w, _ in ordered], [c for _, c in ordered])

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Vocabulary:
        """The vocabulary of a train file."""
        return cls.from_counts(count_words(path))

    def __len__(self) -> int:
        return len(self.words)

    def __contains__(self, word: str) -> bool:
        return word in self.index

    def __eq__(self, other) -> bool:
        return isinstance(other, Vocabulary) and self.words == other.words

    def id(self, word: str) -> int:
        """Id of ``word`` (``<unk>``'s id when absent and the vocabulary has ``<unk>``); KeyError otherwise."""
        i = self.index.get(word, self.unk_id)
        if i is None:
            raise KeyError(word)
        return i

    def decode(self, ids) -> list[str]:
        """Words of a sequence of ids."""
        return [self.words[int(i)] for i in ids]

    def save(self, path: str | os.PathLike) -> None:
        """Write ``word<TAB>count`` lines (words never contain whitespace), atomically."""
        write_text_atomic(path, "".join(f"{w}\t{c}\n" for w, c in zip(self.words, self.counts)))

    @classmethod
    def load(cls, path: str | os.PathLike) -> Vocabulary:
        """Inverse of :meth:`save`. Raises WikiTextFormatError naming the file and line for a line that is not
        ``word<TAB>count``, and ValueError naming the file for a vocabulary without ``<eos>`` or with repeated
        words."""
        words, counts = [], []
        for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").split("\n"), start=1):
            if line:
                w, tab, c = line.rpartition("\t")
                if not tab or not w or not c.isdigit():
                    raise WikiTextFormatError(f"{path}: line {lineno}: expected word<TAB>count, got {line[:60]!r}")
                words.append(w)
                counts.append(int(c))
        try:
            return cls(words, counts)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None


def encode_file(path: str | os.PathLike, vocab: Vocabulary) -> tuple[Tensor, int]:
    """Ids of every token of ``path`` as an int32 tensor, and how many words were mapped to ``<unk>``.

    Raises UnknownWordError (naming file, 1-based line and word) for a word outside a vocabulary without ``<unk>``.
    """
    index, unk = vocab.index, vocab.unk_id
    ids = array.array("i")
    mapped = 0
    for lineno, words in enumerate(iter_line_words(path), start=1):
        try:
            ids.extend([index[w] for w in words])
        except KeyError:
            if unk is None:
                missing = next(w for w in words if w not in index)
                raise UnknownWordError(f"{path}: line {lineno}: word {missing!r} is not in the vocabulary (built "
                                       f"from the train split) and the vocabulary has no {UNK} to map it to") from None
            line_ids = [index.get(w, unk) for w in words]
            mapped += sum(1 for w in words if w not in index)
            ids.extend(line_ids)
    return torch.frombuffer(ids, dtype=torch.int32).clone() if len(ids) else torch.zeros(0, dtype=torch.int32), mapped


def default_cache_dir(data_dir: str | os.PathLike) -> Path:
    """``<data_dir>/.mgk-cache`` when ``data_dir`` is writable (by its permission bits, even for root), else
    ``$XDG_CACHE_HOME/mgk/wikitext`` (default ``~/.cache/mgk/wikitext``): shared data folders are often read-only.
    See :func:`mgk.data.cache.resolve_cache_dir`."""
    data_dir = Path(data_dir)
    return resolve_cache_dir(None, data_dir if data_dir.is_dir() else None, user_subdir="wikitext")


def _cache_folder(cache_dir) -> Path | None:
    """None (no cache) for None, False or ``"off"``; else the folder."""
    if cache_dir is None or cache_dir is False or str(cache_dir).strip().lower() == OFF:
        return None
    return Path(cache_dir)


def load_vocabulary(train_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Vocabulary:
    """The vocabulary of ``train_path``, from ``cache_dir`` when an entry for this exact file exists (else built
    and, when ``cache_dir`` is given and writable, cached; see :mod:`mgk.data.cache`)."""
    train_path = Path(train_path)

    def build():
        """``words``: the words joined by newlines as UTF-8 bytes (uint8); ``counts``: int64 train counts."""
        vocab = Vocabulary.from_file(train_path)
        return {"words": np.frombuffer("\n".join(vocab.words).encode("utf-8"), dtype=np.uint8),
                "counts": np.asarray(vocab.counts, dtype=np.int64)}

    a, _ = cached_arrays(_cache_folder(cache_dir), "wikitext-vocab", [train_path], {"kind": "vocab", **_SETTINGS},
                         build)
    return Vocabulary(a["words"].tobytes().decode("utf-8").split("\n"), a["counts"].tolist())


def load_split(path: str | os.PathLike, vocab: Vocabulary, *, train_path: str | os.PathLike | None = None,
               cache_dir: str | os.PathLike | None = None) -> tuple[Tensor, int]:
    """Encoded tokens of ``path`` (int32) and the number of words mapped to ``<unk>``, cached under ``cache_dir``.

    ``train_path`` (the file the vocabulary came from) keys the entry; without it the entry is keyed by the
    vocabulary's content instead."""
    path = Path(path)
    sources = [Path(train_path), path] if train_path is not None else [path]
    settings = {"kind": "split", "vocab_size": len(vocab), **_SETTINGS}
    if train_path is None:
        settings["vocab_sha256"] = hashlib.sha256("\n".join(vocab.words).encode()).hexdigest()

    def build():
        """``tokens`` int32 (one id per token), ``unk_mapped`` (words mapped to ``<unk>``)."""
        tokens, mapped = encode_file(path, vocab)
        return {"tokens": tokens.numpy(), "unk_mapped": np.array(mapped, dtype=np.int64)}

    a, _ = cached_arrays(_cache_folder(cache_dir), f"wikitext-{path.name}", sources, settings, build)
    return torch.from_numpy(np.ascontiguousarray(a["tokens"], dtype=np.int32)), int(a["unk_mapped"])


@dataclass
class Corpus:
    """Vocabulary and encoded splits. ``tokens[s]`` is None for a split absent from the folder."""

    vocab: Vocabulary
    tokens: dict
    files: dict
    unk_mapped: dict
    cache_dir: Path | None = None
    notes: list = field(default_factory=list)


def load_corpus(data_dir: str | os.PathLike, *, splits: Sequence[str] = SPLITS,
                cache_dir: str | os.PathLike | None | bool = None, vocab: Vocabulary | None = None) -> Corpus:
    """Read a WikiText folder: the vocabulary from its train split (or ``vocab`` when given), then ``splits``.

    ``cache_dir``: a folder, None for :func:`default_cache_dir`, or False (or ``"off"``) for no cache.

    Raises:
        FileNotFoundError: the train split is needed (no ``vocab`` given) and absent; names the file names tried.
        WikiTextFormatError, UnknownWordError: naming the file and line (see :func:`iter_line_words`,
            :func:`encode_file`).
    """
    data_dir = Path(data_dir)
    cache = default_cache_dir(data_dir) if cache_dir is None else _cache_folder(cache_dir)
    train_path = find_split_file(data_dir, "train")
    if vocab is None:
        if train_path is None:
            tried = ", ".join(p.name for p in _candidates(data_dir, "train"))
            raise FileNotFoundError(f"no train split ({tried}) in {data_dir}: the vocabulary is built from it")
        vocab = load_vocabulary(train_path, cache)
        key_train = train_path
    else:
        key_train = None
    tokens, files, mapped, notes = {}, {}, {}, []
    for s in splits:
        s = split_name(s)
        path = find_split_file(data_dir, s)
        files[s] = path
        if path is None:
            tokens[s], mapped[s] = None, 0
            notes.append(f"data: {s}: absent in {data_dir}")
            continue
        tokens[s], mapped[s] = load_split(path, vocab, train_path=key_train, cache_dir=cache)
        extra = f", {mapped[s]} words not in the train vocabulary mapped to {UNK}" if mapped[s] else ""
        notes.append(f"data: {s}: {path} ({tokens[s].numel():,} tokens{extra})")
    notes.append(f"data: vocabulary {len(vocab):,} types (train split, {EOS} per line, by frequency)")
    return Corpus(vocab, tokens, files, mapped, cache, notes)


def check_corpus(data_dir: str | os.PathLike) -> tuple[list[str], list[str]]:
    """What ``mgk data check --task lm`` reports for a WikiText folder: ``(report lines, errors)``.

    Reads every split without the cache: tokens and lines per split, words of valid/test mapped to ``<unk>``, the
    vocabulary size. Each error names the file (and the line): a missing train split, bytes that are not UTF-8, an
    empty file, a valid/test word missing from a vocabulary without ``<unk>``.
    """
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        return [], [f"{data_dir}: not a folder (expected wiki.{{train,valid,test}}.tokens or {{train,valid,test}}.txt)"]
    lines: list[str] = []
    errors: list[str] = []
    vocab = None
    for s in SPLITS:
        path = find_split_file(data_dir, s)
        if path is None:
            tried = " or ".join(p.name for p in _candidates(data_dir, s))
            (errors if s == "train" else lines).append(f"{s}: {tried} absent in {data_dir}")
            continue
        try:
            if s == "train":
                vocab = Vocabulary.from_file(path)
            if vocab is None:
                lines.append(f"{s}: {path} not encoded (no train split to build the vocabulary from)")
                continue
            tokens, mapped = encode_file(path, vocab)
        except (WikiTextFormatError, UnknownWordError) as exc:
            errors.append(str(exc))
            continue
        unk = f", {mapped:,} words not in the train vocabulary mapped to {UNK}" if mapped else ""
        lines.append(f"{s}: {path} ({tokens.numel():,} tokens, {int((tokens == vocab.eos_id).sum()):,} lines{unk})")
    if vocab is not None:
        lines.append(f"vocabulary: {len(vocab):,} types (train split, {EOS} per line"
                     + (f", with {UNK})" if vocab.unk_id is not None else f", no {UNK})"))
    return lines, errors


# ---------------------------------------------------------------------------------------------------------------
# A small generated corpus in the WikiText layout, so that `mgk train --task lm` works without a download.

_SYLLABLES = ("ka", "to", "ri", "na", "mo", "se", "lu", "vi", "de", "po", "ga", "shi", "ber", "ton", "al", "en")


def _make_words(n: int, rng: random.Random) -> list[str]:
    words: list[str] = []
    seen = set()
    while len(words) < n:
        w = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


def generate_corpus(out_dir: str | os.PathLike, *, train_lines: int = 2000, valid_lines: int = 200,
                    test_lines: int = 200, num_words: int = 400, seed: int = 0) -> Path:
    """Write ``wiki.{train,valid,test}.tokens`` of a synthetic corpus with WikiText's layout and return the folder.

    Text: articles (a `` = Title = `` heading between empty lines, then paragraph lines), sentences drawn from a
    first-order Markov chain over ``num_words`` made-up words with Zipf-like frequencies (each word has a few
    likely successors, so context helps), ending in `` . ``; the rarest words are written as ``<unk>`` the way
    WikiText does. ``*_lines`` count lines of each file (headings and empty lines included). Deterministic in
    ``seed``; the splits come from one chain with disjoint random streams."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    words = _make_words(num_words, rng)
    keep = int(num_words * 0.9)  # the rarest 10% appear as <unk>
    zipf = [1.0 / (r + 1) for r in range(num_words)]
    successors = [rng.choices(range(num_words), weights=zipf, k=4) for _ in range(num_words)]

    def sentence(r: random.Random) -> list[str]:
        """One sentence from the chain: 4-14 words (the rarest written as ``<unk>``), then ``"."``."""
        w = r.choices(range(num_words), weights=zipf)[0]
        out_words = []
        for _ in range(r.randint(4, 14)):
            out_words.append(words[w] if w < keep else UNK)
            w = r.choice(successors[w]) if r.random() < 0.8 else r.choices(range(num_words), weights=zipf)[0]
        return out_words + ["."]

    for split, n_lines, offset in (("train", train_lines, 1), ("valid", valid_lines, 2), ("test", test_lines, 3)):
        r = random.Random(seed * 1000 + offset)
        lines: list[str] = []
        while len(lines) < n_lines:
            title = " ".join(words[i].capitalize() for i in r.sample(range(keep), r.randint(1, 3)))
            lines += ["", f" = {title} = ", ""]
            for _ in range(r.randint(2, 5)):
                lines.append(" " + " ".join(w for _ in range(r.randint(1, 4)) for w in sentence(r)) + " ")
        text = "\n".join(lines[:n_lines]) + "\n"
        write_text_atomic(out / f"wiki.{split}.tokens", text)
    return out
