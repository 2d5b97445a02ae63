"""mgk.data.retrieval: the AAN pairs TSV reader, its errors, and encoding of both documents."""
from __future__ import annotations

import gzip

import pytest
import torch

from mgk.data import retrieval as rv
from mgk.data.samples import aan_rows, make_aan_dir


def _write(path, lines, newline="\n"):
    path.write_bytes((newline.join(lines) + newline).encode("utf-8"))
    return path


def test_read_rows_header_crlf_and_gzip(tmp_path):
    rows = aan_rows(6)
    labels, t1, t2, ids = rv.read_aan_tsv(_write(tmp_path / "a.tsv", rows))
    assert labels == [0, 1, 0, 1, 0, 1] and ids[0] == ("P0a", "P0b") and t1[0].endswith(b"paper")
    crlf = rv.read_aan_tsv(_write(tmp_path / "b.tsv", ["label\tid1\tid2\ttext1\ttext2", *rows], "\r\n"))
    assert crlf[0] == labels and crlf[1] == t1
    gz = tmp_path / "c.tsv.gz"
    gz.write_bytes(gzip.compress(("\n".join(rows) + "\n").encode()))
    assert rv.read_aan_tsv(gz)[2] == t2
    floats = rv.read_aan_tsv(_write(tmp_path / "d.tsv", ["1.0\ta\tb\tx\ty", "0.0\ta\tb\tx\ty"]))
    assert floats[0] == [1, 0]


@pytest.mark.parametrize("line, match", [
    ("1\ta\tb\tonly four", r"line 2: 4 tab-separated columns, expected 5"),
    ("1\ta\tb\tx\ty\tz", r"line 2: 6 tab-separated columns"),
    ("", r"line 2: blank line"),
    ("2\ta\tb\tx\ty", r"line 2: label '2' is not 0 or 1"),
    ("yes\ta\tb\tx\ty", r"line 2: label 'yes' is not 0 or 1"),
])
def test_malformed_rows_name_file_and_line(tmp_path, line, match):
    path = tmp_path / "new_aan_pairs.train.tsv"
    path.write_bytes(("0\ta\tb\tx\ty\n" + line + "\n1\ta\tb\tx\ty\n").encode())
    with pytest.raises(rv.RetrievalFormatError, match="new_aan_pairs.train.tsv: " + match):
        rv.read_aan_tsv(path)


def test_bad_utf8_empty_file_and_truncated_gzip(tmp_path):
    bad = tmp_path / "bad.tsv"
    bad.write_bytes(b"0\ta\tb\t\xff\xfe\ty\n")
    with pytest.raises(rv.RetrievalFormatError, match=r"bad.tsv: line 1: text1 is not valid UTF-8"):
        rv.read_aan_tsv(bad)
    empty = tmp_path / "empty.tsv"
    empty.write_bytes(b"")
    with pytest.raises(rv.RetrievalFormatError, match="empty.tsv: line 1: empty file"):
        rv.read_aan_tsv(empty)
    gz = tmp_path / "cut.tsv.gz"
    gz.write_bytes(gzip.compress(("\n".join(aan_rows(200)) + "\n").encode())[:300])
    with pytest.raises(rv.RetrievalFormatError, match="cut.tsv.gz: truncated or corrupt gzip"):
        rv.read_aan_tsv(gz)
    with pytest.raises(FileNotFoundError):
        rv.read_aan_tsv(tmp_path / "absent.tsv")


def test_find_files_in_folder_or_tsv_data(tmp_path):
    data = make_aan_dir(tmp_path)
    assert rv.find_aan_file(data, "val").name == "new_aan_pairs.eval.tsv"
    nested = tmp_path / "lra"
    (nested / "tsv_data").mkdir(parents=True)
    (data / "new_aan_pairs.train.tsv").rename(nested / "tsv_data" / "new_aan_pairs.train.tsv")
    assert rv.find_aan_file(nested, "train") is not None and rv.find_aan_file(nested, "test") is None
    with pytest.raises(ValueError):
        rv.find_aan_file(data, "eval")


def test_load_encodes_both_documents_with_truncation_counted(tmp_path):
    data = make_aan_dir(tmp_path, n=10)
    ds, status = rv.load_aan_split(data, "train", 20, cache_dir=tmp_path / "cache")
    assert status.startswith("stored") and len(ds) == 10 and ds.tokens1.shape == (10, 20)
    assert ds.tokens1.dtype == torch.int16 and int(ds.lengths1.max()) <= 20
    raw = rv.read_aan_tsv(data / "new_aan_pairs.train.tsv")
    assert ds.num_truncated == sum(len(t) > 20 for t in raw[1] + raw[2]) > 0
    k = int(torch.argmin(ds.lengths1))
    assert ds.tokens1[k, :ds.lengths1[k]].tolist() == [b + 1 for b in raw[1][k]]
    assert (ds.tokens1[k, ds.lengths1[k]:] == rv.PAD_ID).all()
    assert torch.equal(ds.lengths, torch.maximum(ds.lengths1, ds.lengths2))
    again, status2 = rv.load_aan_split(data, "train", 20, cache_dir=tmp_path / "cache")
    assert status2.startswith("hit") and torch.equal(again.tokens2, ds.tokens2)
    assert rv.load_aan_split(tmp_path, "test", 20) == (None, "absent")
