"""WikiText reader: vocabulary from train only, ordering, <eos> per line, <unk> mapping, errors, cache."""
from pathlib import Path

import pytest
import torch

from mgk.data import wikitext as wt

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data" / "wikitext-103"


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_vocabulary_from_train_only_by_frequency_with_eos_per_line(tmp_path):
    # 4 lines (one empty, the last without a newline): <eos> x4, b x3, '=' x2, c x2, A x1, a x1
    write(tmp_path / "wiki.train.tokens", " = A = \n\n b a b c \nc b")
    write(tmp_path / "wiki.valid.tokens", "a never_in_train\n")
    vocab = wt.Vocabulary.from_file(tmp_path / "wiki.train.tokens")
    # frequency first, equal counts by the word itself ('=' < 'c', 'A' < 'a'); case is kept
    assert vocab.words == ["<eos>", "b", "=", "c", "A", "a"]
    assert vocab.counts == [4, 3, 2, 2, 1, 1]
    assert "never_in_train" not in vocab and vocab.unk_id is None
    ids, mapped = wt.encode_file(tmp_path / "wiki.train.tokens", vocab)
    assert ids.dtype == torch.int32 and mapped == 0
    assert vocab.decode(ids) == ["=", "A", "=", "<eos>", "<eos>", "b", "a", "b", "c", "<eos>", "c", "b", "<eos>"]


def test_missing_word_without_unk_names_file_line_and_word(tmp_path):
    write(tmp_path / "wiki.train.tokens", "x y\n")
    write(tmp_path / "wiki.valid.tokens", "x\n\ny zebra x\n")
    with pytest.raises(wt.UnknownWordError, match=r"wiki\.valid\.tokens: line 3: word 'zebra'"):
        wt.load_corpus(tmp_path, cache_dir=False)


def test_missing_words_map_to_unk_and_are_counted(tmp_path):
    write(tmp_path / "train.txt", "the <unk> cat\nthe dog\n")
    write(tmp_path / "valid.txt", "the zebra\nokapi dog\n")
    corpus = wt.load_corpus(tmp_path, cache_dir=False)
    v = corpus.vocab
    assert corpus.unk_mapped["valid"] == 2 and corpus.tokens["test"] is None
    assert v.decode(corpus.tokens["valid"]) == ["the", "<unk>", "<eos>", "<unk>", "dog", "<eos>"]
    assert any("test: absent" in n for n in corpus.notes)


def test_split_names_and_file_name_variants(tmp_path):
    write(tmp_path / "valid.txt", "a\n")
    assert wt.find_split_file(tmp_path, "val") == tmp_path / "valid.txt"
    write(tmp_path / "wiki.valid.tokens", "a\n")
    assert wt.find_split_file(tmp_path, "validation") == tmp_path / "wiki.valid.tokens"  # .tokens wins
    assert wt.find_split_file(tmp_path, "test") is None
    with pytest.raises(ValueError, match="unknown split"):
        wt.split_name("dev")
    with pytest.raises(FileNotFoundError, match="wiki.train.tokens, train.txt"):
        wt.load_corpus(tmp_path, cache_dir=False)


def test_cache_is_reused_and_invalidated_by_a_changed_file(tmp_path, monkeypatch):
    write(tmp_path / "wiki.train.tokens", "a b <unk>\nb\n")
    valid = write(tmp_path / "wiki.valid.tokens", "b a\n")
    first = wt.load_corpus(tmp_path)
    cache = tmp_path / ".mgk-cache"
    assert first.cache_dir == cache and len(list(cache.glob("*.npz"))) == 3  # vocab, train, valid
    assert not list(cache.glob("*.tmp"))

    def boom(*a, **k):
        raise AssertionError("should have been read from the cache")

    with monkeypatch.context() as m:
        m.setattr(wt, "encode_file", boom)
        m.setattr(wt.Vocabulary, "from_file", boom)
        again = wt.load_corpus(tmp_path)
    assert again.vocab == first.vocab and torch.equal(again.tokens["valid"], first.tokens["valid"])

    write(valid, "b a b q\n")  # new size and mtime: the valid entry is stale
    changed = wt.load_corpus(tmp_path)
    assert changed.vocab.decode(changed.tokens["valid"]) == ["b", "a", "b", "<unk>", "<eos>"]
    assert changed.unk_mapped["valid"] == 1


def test_read_only_data_folders_are_never_written_into(tmp_path, monkeypatch):
    data = tmp_path / "ro"
    write(data / "wiki.train.tokens", "a b\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    data.chmod(0o555)  # root passes os.access on this: the permission bits decide
    try:
        assert wt.default_cache_dir(data) == tmp_path / "xdg" / "mgk" / "wikitext"
        wt.load_corpus(data)
        assert sorted(p.name for p in data.iterdir()) == ["wiki.train.tokens"]
        assert list((tmp_path / "xdg" / "mgk" / "wikitext").glob("*.npz"))
    finally:
        data.chmod(0o755)


def test_vocabulary_file_round_trip(tmp_path):
    v = wt.Vocabulary.from_counts(wt.Counter({"<eos>": 3, "x": 5, "é": 1}))
    v.save(tmp_path / "vocab.txt")
    assert wt.Vocabulary.load(tmp_path / "vocab.txt") == v and v.words[0] == "x"


def test_generated_corpus_is_deterministic_and_loads(tmp_path):
    a = wt.generate_corpus(tmp_path / "a", train_lines=60, valid_lines=20, test_lines=20, seed=3)
    b = wt.generate_corpus(tmp_path / "b", train_lines=60, valid_lines=20, test_lines=20, seed=3)
    for s in wt.SPLITS:
        text = (a / f"wiki.{s}.tokens").read_text()
        assert text == (b / f"wiki.{s}.tokens").read_text()
        assert len(text.splitlines()) == {"train": 60, "valid": 20, "test": 20}[s]
    corpus = wt.load_corpus(a, cache_dir=False)
    assert "<unk>" in corpus.vocab and all(corpus.tokens[s].numel() > 20 for s in wt.SPLITS)


@pytest.mark.skipif(not (SHARED / "wiki.valid.tokens").is_file(), reason="shared WikiText-103 copy not present")
def test_shared_valid_split_has_the_published_token_count():
    vocab = wt.Vocabulary.from_file(SHARED / "wiki.train.tokens")
    tokens, mapped = wt.encode_file(SHARED / "wiki.valid.tokens", vocab)
    assert tokens.numel() == 217_646  # 213,886 words + one <eos> for each of the 3,760 lines
    assert vocab.words[0] == "the" and mapped > 0


# ----------------------------------------------------------------- errors name the file and line; BOM


def test_empty_train_file_is_an_error_naming_it(tmp_path):
    write(tmp_path / "wiki.train.tokens", "")
    with pytest.raises(wt.WikiTextFormatError, match=r"wiki\.train\.tokens: line 1: empty file"):
        wt.load_corpus(tmp_path, cache_dir=False)


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
def test_bytes_that_are_not_utf8_name_the_file_and_line(tmp_path, eol):
    (tmp_path / "wiki.train.tokens").write_bytes(b"a b" + eol + b"c" + eol + bytes(range(128, 256)) + eol)
    with pytest.raises(wt.WikiTextFormatError, match=r"wiki\.train\.tokens: line 3: not valid UTF-8"):
        wt.load_corpus(tmp_path, cache_dir=False)
    write(tmp_path / "wiki.train.tokens", "a b\n")
    (tmp_path / "wiki.valid.tokens").write_bytes(b"a\n\xff\xfe b\n")
    with pytest.raises(wt.WikiTextFormatError, match=r"wiki\.valid\.tokens: line 2: not valid UTF-8"):
        wt.load_corpus(tmp_path, cache_dir=False)


def test_a_byte_order_mark_is_not_a_word(tmp_path):
    (tmp_path / "wiki.train.tokens").write_bytes("\ufeff = A = \nb A\n".encode("utf-8"))
    (tmp_path / "wiki.valid.tokens").write_bytes("\ufeffb\n".encode("utf-8"))
    corpus = wt.load_corpus(tmp_path, cache_dir=False)
    assert sorted(corpus.vocab.words) == sorted(["<eos>", "=", "A", "b"])
    assert corpus.vocab.decode(corpus.tokens["valid"]) == ["b", "<eos>"]
    assert corpus.vocab.decode(corpus.tokens["train"])[:4] == ["=", "A", "=", "<eos>"]


def test_malformed_vocabulary_file_names_file_and_line(tmp_path):
    write(tmp_path / "vocab.txt", "<eos>\t3\nword without count\n")
    with pytest.raises(wt.WikiTextFormatError, match=r"vocab\.txt: line 2: expected word<TAB>count"):
        wt.Vocabulary.load(tmp_path / "vocab.txt")
    write(tmp_path / "vocab.txt", "a\t3\n")
    with pytest.raises(ValueError, match=r"vocab\.txt: vocabulary has no <eos>"):
        wt.Vocabulary.load(tmp_path / "vocab.txt")


def test_mgk_data_check_lm(tmp_path, capsys):
    from mgk.cli import main

    data = wt.generate_corpus(tmp_path / "wt", train_lines=40, valid_lines=10, test_lines=10, seed=1)
    assert main(["data", "check", "--task", "lm", "--data", str(data)]) == 0
    out = capsys.readouterr().out
    assert "train: " in out and "valid: " in out and "test: " in out and "10 lines" in out
    assert "vocabulary: " in out and "ok" in out.splitlines()[-1]
    (data / "wiki.valid.tokens").write_bytes(b"ok\n\x80\n")
    (data / "wiki.test.tokens").unlink()
    assert main(["data", "check", "--task", "lm", "--data", str(data)]) == 1
    out = capsys.readouterr()
    assert "wiki.valid.tokens: line 2: not valid UTF-8" in out.err and "test: wiki.test.tokens or test.txt absent" \
        in out.out
    (data / "wiki.train.tokens").write_bytes(b"")
    assert main(["data", "check", "--task", "lm", "--data", str(data)]) == 1
    assert "wiki.train.tokens: line 1: empty file" in capsys.readouterr().err
