"""Words in, words out: a prompt read into a word-level vocabulary's ids (WikiText's conventions,
:mod:`mgk.data.wikitext`), and ids written back as text."""
from __future__ import annotations

from ..data.wikitext import EOS, UNK

__all__ = ["decode_words", "encode_prompt"]


def encode_prompt(text: str, vocab) -> tuple[list[int], list[str]]:
    """(ids, unknown words) of ``text``: split on whitespace with the case kept, as the corpus; ``<eos>`` after every
    line that ends with a newline (the corpus ends every line with one). Words outside the vocabulary become
    ``<unk>`` and are returned, in order, once each. An empty prompt is ``[<eos>]``: generation starts at a line
    boundary.

    Raises ValueError naming the words when some are unknown and the vocabulary has no ``<unk>``."""
    words = []
    for line in text.splitlines(keepends=True):
        words.extend(line.split())
        if line.endswith(("\n", "\r")):
            words.append(EOS)
    unknown = list(dict.fromkeys(w for w in words if w not in vocab))
    if unknown and UNK not in vocab:
        shown = ", ".join(repr(w) for w in unknown[:5]) + (", ..." if len(unknown) > 5 else "")
        raise ValueError(f"{len(unknown)} prompt word(s) are not in the run's vocabulary, which has no {UNK} to read "
                         f"them as: {shown}")
    return [vocab.id(w) for w in words] or [vocab.id(EOS)], unknown


def decode_words(ids, vocab) -> str:
    """The words of ``ids`` separated by spaces, ``<eos>`` written as a line break."""
    out, line = [], []
    for word in vocab.decode(ids):
        if word == EOS:
            out.append(" ".join(line))
            line = []
        else:
            line.append(word)
    return "\n".join([*out, " ".join(line)]) if line else "\n".join(out) + ("\n" if out else "")
