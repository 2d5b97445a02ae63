"""Text <-> token ids for the tasks whose inputs are text, with the encodings their readers use: words of a
WikiText vocabulary, ListOps symbols, UTF-8 bytes (IMDb, AAN). Each has ``encode(text) -> list[int]`` and
``decode(ids) -> str``; padding ids (0) decode to nothing.

Used by :func:`mgk.load_run` to give a trained run's model its inputs back; the readers themselves encode whole
files (:mod:`.wikitext`, :mod:`.listops`, :mod:`.text`).
"""
from __future__ import annotations

from typing import Iterable

from . import listops as lo
from . import text as tx
from .wikitext import EOS, UNK, Vocabulary

__all__ = ["ByteTokenizer", "ListOpsTokenizer", "WordTokenizer"]


class WordTokenizer:
    """Words of a :class:`~mgk.data.wikitext.Vocabulary` (WikiText-103's tokenisation: words split on white space
    with the case kept, each line ended by ``<eos>``). ``encode`` maps a word outside the vocabulary to ``<unk>``
    (:meth:`unknown_words` lists them; ValueError naming them when the vocabulary has no ``<unk>``); ``decode``
    writes ``<eos>`` as a line end."""

    def __init__(self, vocab: Vocabulary):
        self.vocab = vocab

    def __len__(self) -> int:
        return len(self.vocab)

    @staticmethod
    def words(text: str) -> list[str]:
        """The words of ``text``, ``<eos>`` after every line that ends with a line end (as the corpus ends each)."""
        out: list[str] = []
        for line in text.splitlines(keepends=True):
            out.extend(line.split())
            if line.endswith(("\n", "\r")):
                out.append(EOS)
        return out

    def unknown_words(self, text: str) -> list[str]:
        """The words of ``text`` outside the vocabulary, in order, once each."""
        return list(dict.fromkeys(w for w in self.words(text) if w not in self.vocab))

    def encode(self, text: str) -> list[int]:
        """Ids of the words of ``text`` (:meth:`words`); unknown words as ``<unk>``. ValueError naming the unknown
        words when the vocabulary has no ``<unk>``."""
        unknown = self.unknown_words(text)
        if unknown and UNK not in self.vocab:
            shown = ", ".join(repr(w) for w in unknown[:5]) + (", ..." if len(unknown) > 5 else "")
            raise ValueError(f"{len(unknown)} word(s) are not in the run's vocabulary, which has no {UNK} to read "
                             f"them as: {shown}")
        return [self.vocab.id(w) for w in self.words(text)]

    def decode(self, ids: Iterable[int]) -> str:
        """The words of ``ids`` joined by spaces, ``<eos>`` as a line end."""
        lines, line = [], []
        for word in self.vocab.decode(ids):
            if word == EOS:
                lines.append(" ".join(line))
                line = []
            else:
                line.append(word)
        return "\n".join([*lines, " ".join(line)])


class ListOpsTokenizer:
    """ListOps sources (``"[MAX 2 ( [MIN 3 4 ] ) ]"``) <-> the release reader's ids; the grouping marks ``(`` and
    ``)`` carry no id, as in the reader (:func:`mgk.data.listops.tokenize_source`)."""

    def __len__(self) -> int:
        return len(lo.VOCAB)

    def encode(self, text: str) -> list[int]:
        """Ids of a source; ListOpsFormatError naming an unknown token."""
        return lo.tokenize_source(text, source="text")

    def decode(self, ids: Iterable[int]) -> str:
        """Space-separated symbols (no padding)."""
        return " ".join(lo.VOCAB[int(i)] for i in ids if int(i) != lo.PAD_ID)


class ByteTokenizer:
    """UTF-8 bytes, byte ``b`` -> id ``b + 1`` (0 is padding), the encoding of the IMDb and AAN readers
    (:func:`mgk.data.text.encode_text`). ``decode`` replaces bytes that are not UTF-8 (a cut-off character)."""

    def __len__(self) -> int:
        return tx.VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        """Ids of the UTF-8 bytes of ``text``."""
        return tx.encode_text(text).tolist()

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids`` (padding dropped)."""
        return bytes(int(i) - 1 for i in ids if int(i) != tx.PAD_ID).decode("utf-8", errors="replace")
