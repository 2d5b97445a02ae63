"""Tests for mgk.data.listops: TSV reading/validation, encoding, our generator, dataset, real LRA-format data."""
from __future__ import annotations

import gzip
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from mgk.data import listops as lo
from mgk.data.listops import (
    NUM_CLASSES,
    OPERATORS,
    PAD_ID,
    VOCAB,
    ListOpsFormatError,
    dataset_from_rows,
    encode_rows,
    find_split_file,
    generate_listops,
    generate_listops_dir,
    listops_value,
    load_listops_split,
    read_listops_tsv,
    tokenize_source,
    write_listops_tsv,
)

REAL_DIR = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "listops"

ID = {t: i for i, t in enumerate(VOCAB)}


# ----------------------------------------------------------------- independent evaluator (test-only)


def _parse_parens(tokens: list[str], i: int = 0):
    """Parse the parenthesised LRA form into nested 2-tuples; return (node, next index)."""
    if tokens[i] == "(":
        left, i = _parse_parens(tokens, i + 1)
        right, i = _parse_parens(tokens, i)
        assert tokens[i] == ")", f"expected ) at {i}, got {tokens[i]}"
        return (left, right), i + 1
    assert tokens[i] != ")"
    return tokens[i], i + 1


def _spine(node) -> list:
    """Flatten ((((op, a1), a2) ...), ']') into [op, a1, ..., ak, ']']."""
    items = []
    while isinstance(node, tuple):
        items.append(node[1])
        node = node[0]
    items.append(node)
    return items[::-1]


def _median_numpy_int(v):
    # independent of the library: numpy's median, truncated like the LRA generator does
    return int(np.median(v))


def _evaluate(node, med=_median_numpy_int, stats=None, depth=1):
    """Evaluate a parsed expression; stats (dict) collects max depth and max argument count."""
    if isinstance(node, str):
        assert node.isdigit() and len(node) == 1, node
        return int(node)
    items = _spine(node)
    op, args, close = items[0], items[1:-1], items[-1]
    assert op in ("[MIN", "[MAX", "[MED", "[SM"), op
    assert close == "]"
    assert args, "operator without arguments"
    vals = [_evaluate(a, med, stats, depth + 1) for a in args]
    if stats is not None:
        stats["depth"] = max(stats.get("depth", 0), depth)
        stats["args"] = max(stats.get("args", 0), len(args))
    if op == "[MIN":
        return min(vals)
    if op == "[MAX":
        return max(vals)
    if op == "[MED":
        return med(vals)
    return sum(vals) % 10


def _eval_source(src: str, med=_median_numpy_int, stats=None) -> int:
    toks = src.split()
    tree, end = _parse_parens(toks)
    assert end == len(toks), "trailing tokens"
    return _evaluate(tree, med, stats)


def test_evaluator_self_check():
    assert _eval_source("( ( ( [MAX 2 ) 9 ) ] )") == 9
    assert _eval_source("( ( ( ( ( [MED 4 ) 1 ) 3 ) 2 ) ] )") == 2
    assert _eval_source("( ( ( ( [SM 9 ) ( ( ( [MIN 7 ) 8 ) ] ) ) 5 ) ] )") == (9 + 7 + 5) % 10


# ----------------------------------------------------------------- vocabulary


def test_vocabulary_layout():
    assert PAD_ID == 0 and VOCAB[PAD_ID] == "<pad>"
    assert VOCAB[1:11] == [str(d) for d in range(10)]
    assert VOCAB[11:] == ["[MIN", "[MAX", "[MED", "[SM", "]"]
    assert NUM_CLASSES == 10
    assert tokenize_source("( ( ( [MAX 2 ) 9 ) ] )") == [ID["[MAX"], ID["2"], ID["9"], ID["]"]]


# ----------------------------------------------------------------- reading

ROWS_TEXT = [
    ("( ( ( [MAX 2 ) 9 ) ] )", "9"),
    ("( ( ( ( [SM 5 ) ( ( ( [MIN 7 ) 3 ) ] ) ) 8 ) ] )", "6"),
]
EXPECTED = [
    ([ID["[MAX"], ID["2"], ID["9"], ID["]"]], 9),
    ([ID["[SM"], ID["5"], ID["[MIN"], ID["7"], ID["3"], ID["]"], ID["8"], ID["]"]], 6),
]


def _write(path: Path, text: str, *, gz: bool = False) -> Path:
    data = text.encode("utf-8")
    if gz:
        with gzip.open(path, "wb") as fh:
            fh.write(data)
    else:
        path.write_bytes(data)
    return path


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
@pytest.mark.parametrize("gz", [False, True])
def test_read_fixture(tmp_path, newline, gz):
    text = newline.join(["Source\tTarget"] + [f"{s}\t{t}" for s, t in ROWS_TEXT]) + newline
    path = _write(tmp_path / ("basic_val.tsv.gz" if gz else "basic_val.tsv"), text, gz=gz)
    assert read_listops_tsv(path) == EXPECTED


def test_read_without_final_newline_and_header_only(tmp_path):
    p = _write(tmp_path / "a.tsv", "Source\tTarget\r\n" + f"{ROWS_TEXT[0][0]}\t{ROWS_TEXT[0][1]}")
    assert read_listops_tsv(p) == EXPECTED[:1]
    assert read_listops_tsv(_write(tmp_path / "b.tsv", "Source\tTarget\n")) == []


GOOD = "( ( [MIN 4 ) ] )\t4"
MALFORMED = [
    # (file body, line of the error, fragment expected in the message)
    ("( ( [MIN 4 ) ] )\t4\n", 1, "header"),  # header missing
    ("source\ttarget\n" + GOOD + "\n", 1, "header"),  # wrong header
    ("", 1, "header"),  # empty file
    ("Source\tTarget\n" + GOOD + "\n" + "( ( [MIN 4 ) ] )\t4\textra\n", 3, "3 tab-separated columns"),
    ("Source\tTarget\n" + GOOD + "\n" + GOOD + "\n" + "( ( [MIN 4 ) ] ) 4\n", 4, "1 tab-separated columns"),
    ("Source\tTarget\n" + GOOD + "\n\n" + GOOD + "\n", 3, "blank line"),
    ("Source\tTarget\n" + GOOD + "\n" + "( ( [AVG 4 ) ] )\t4\n", 3, "unknown token '[AVG'"),
    ("Source\tTarget\n" + "( ( [MIN 12 ) ] )\t4\n", 2, "unknown token '12'"),
    ("Source\tTarget\n" + GOOD + "\n" + "( )\t4\n", 3, "empty Source"),
    ("Source\tTarget\n" + GOOD + "\n" + "\t4\n", 3, "empty Source"),
    ("Source\tTarget\n" + "( ( [MIN 4 ) ] )\tx\n", 2, "not an integer"),
    ("Source\tTarget\n" + "( ( [MIN 4 ) ] )\t4.0\n", 2, "not an integer"),
    ("Source\tTarget\n" + "( ( [MIN 4 ) ] )\t-1\n", 2, "not an integer"),
    ("Source\tTarget\n" + "( ( [MIN 4 ) ] )\t\n", 2, "not an integer"),
    ("Source\tTarget\n" + GOOD + "\n" + GOOD + "\n" + "( ( [MIN 4 ) ] )\t10\n", 4, "outside 0-9"),
]


@pytest.mark.parametrize("body,line,fragment", MALFORMED)
@pytest.mark.parametrize("variant", ["lf", "crlf_gz"])
def test_malformed_input_names_file_and_line(tmp_path, body, line, fragment, variant):
    if variant == "crlf_gz":
        body = body.replace("\n", "\r\n")
        path = _write(tmp_path / "bad_file.tsv.gz", body, gz=True)
    else:
        path = _write(tmp_path / "bad_file.tsv", body)
    with pytest.raises(ListOpsFormatError) as info:
        read_listops_tsv(path)
    msg = str(info.value)
    assert path.name in msg
    assert f"line {line}:" in msg
    assert fragment in msg
    assert "\r" not in msg and "\\r" not in msg  # CR of CRLF files is stripped, never reported
    assert isinstance(info.value, ValueError)


def test_label_10_rejected(tmp_path):
    path = _write(tmp_path / "ten.tsv", "Source\tTarget\n( ( [MAX 9 ) ] )\t10\n")
    with pytest.raises(ListOpsFormatError, match=r"ten\.tsv: line 2: Target 10 is outside 0-9"):
        read_listops_tsv(path)


def test_truncated_gzip_raises_format_error(tmp_path):
    text = "Source\tTarget\n" + "".join(f"{s}\t{t}\n" for s, t in ROWS_TEXT * 200)
    full = _write(tmp_path / "full.tsv.gz", text, gz=True)
    cut = tmp_path / "cut_basic.tsv.gz"
    cut.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    with pytest.raises(ListOpsFormatError) as info:
        read_listops_tsv(cut)
    assert "cut_basic.tsv.gz" in str(info.value)
    assert "truncated or corrupt gzip" in str(info.value)
    assert not isinstance(info.value, EOFError)


def test_corrupt_gzip_body_raises_format_error(tmp_path):
    data = bytearray(gzip.compress(("Source\tTarget\n" + (GOOD + "\n") * 50).encode()))
    data[20:30] = b"\xff" * 10
    p = tmp_path / "corrupt.tsv.gz"
    p.write_bytes(bytes(data))
    with pytest.raises(ListOpsFormatError, match="corrupt.tsv.gz"):
        read_listops_tsv(p)


def test_invalid_utf8_names_line(tmp_path):
    p = tmp_path / "enc.tsv"
    p.write_bytes(b"Source\tTarget\n" + GOOD.encode() + b"\n( ( [MIN \xff ) ] )\t4\n")
    with pytest.raises(ListOpsFormatError, match=r"enc\.tsv: line 3: not valid UTF-8"):
        read_listops_tsv(p)


# ----------------------------------------------------------------- encoding


def test_encode_rows_shapes_and_padding():
    tokens, labels, lengths, n_cut = encode_rows(EXPECTED, 10)
    assert tokens.shape == (2, 10) and tokens.dtype == torch.long
    assert labels.tolist() == [9, 6] and labels.dtype == torch.long
    assert lengths.tolist() == [4, 8] and lengths.dtype == torch.long
    assert n_cut == 0
    assert tokens[0, :4].tolist() == EXPECTED[0][0]
    assert tokens[0, 4:].eq(PAD_ID).all()
    assert tokens[1, :8].tolist() == EXPECTED[1][0]
    assert tokens[1, 8:].eq(PAD_ID).all()


def test_encode_too_long_raises_unless_truncate():
    rows = [EXPECTED[0], EXPECTED[1]]  # lengths 4 and 8
    with pytest.raises(ListOpsFormatError) as info:
        encode_rows(rows, 5, source="data/basic_val.tsv")
    msg = str(info.value)
    assert "data/basic_val.tsv: line 3:" in msg  # row index 1 -> line 3 (header is line 1)
    assert "8 tokens" in msg and "max_len=5" in msg and "--set max_len=8" in msg
    assert "truncate" not in msg  # cutting a ListOps expression changes its value: never suggested
    with pytest.raises(ListOpsFormatError, match=r"row 1: sequence has 8 tokens"):
        encode_rows(rows, 5)

    tokens, labels, lengths, n_cut = encode_rows(rows, 5, truncate=True)
    assert n_cut == 1
    assert tokens[1].tolist() == EXPECTED[1][0][:5]
    assert tokens[0].tolist() == EXPECTED[0][0] + [PAD_ID]
    assert lengths.tolist() == [4, 5]
    assert labels.tolist() == [9, 6]


def test_encode_rejects_bad_labels_ids_and_max_len():
    with pytest.raises(ListOpsFormatError, match="label 10"):
        encode_rows([([1, 2], 10)], 4)
    with pytest.raises(ListOpsFormatError, match="label -1"):
        encode_rows([([1, 2], -1)], 4)
    with pytest.raises(ListOpsFormatError, match="token id outside"):
        encode_rows([([1, 2], 1), ([1, PAD_ID], 1)], 4, source="f.tsv")
    with pytest.raises(ListOpsFormatError, match="token id outside"):
        encode_rows([([len(VOCAB)], 1)], 4)
    with pytest.raises(ListOpsFormatError, match="empty"):
        encode_rows([([], 1)], 4)
    with pytest.raises(ValueError, match="max_len"):
        encode_rows(EXPECTED, 0)
    tokens, labels, lengths, n_cut = encode_rows([], 7)
    assert tokens.shape == (0, 7) and labels.shape == (0,) and n_cut == 0


# ----------------------------------------------------------------- finding files


def test_find_split_file(tmp_path):
    assert find_split_file(tmp_path, "train") is None
    assert find_split_file(tmp_path / "missing", "val") is None
    sub = tmp_path / "listops-1000"
    sub.mkdir()
    (sub / "basic_test.tsv.gz").write_bytes(b"")
    assert find_split_file(tmp_path, "test") == sub / "basic_test.tsv.gz"
    (sub / "basic_test.tsv").write_bytes(b"")
    assert find_split_file(tmp_path, "test") == sub / "basic_test.tsv"
    (tmp_path / "basic_test.tsv.gz").write_bytes(b"")
    assert find_split_file(tmp_path, "test") == tmp_path / "basic_test.tsv.gz"
    (tmp_path / "basic_test.tsv").write_bytes(b"")
    assert find_split_file(tmp_path, "test") == tmp_path / "basic_test.tsv"
    assert find_split_file(tmp_path, "val") is None
    with pytest.raises(ValueError, match="split"):
        find_split_file(tmp_path, "valid")


# ----------------------------------------------------------------- generator


def test_listops_value_operators():
    assert listops_value("[MED", [4, 1, 3, 2]) == 2  # floor((2 + 3) / 2)
    assert listops_value("[MED", [9, 0]) == 4  # floor((0 + 9) / 2), not an argument
    assert listops_value("[MED", [1, 2, 3, 7]) == 2
    assert listops_value("[MED", [5, 1, 7]) == 5
    assert listops_value("[SM", [9, 8, 7]) == 4
    assert listops_value("[MIN", [3, 1, 2]) == 1
    assert listops_value("[MAX", [3, 1, 2]) == 3
    with pytest.raises(ValueError):
        listops_value("[AVG", [1])


def test_generator_values_match_independent_evaluator():
    rows = generate_listops(200, seed=123)
    assert len(rows) == 200
    for src, value in rows:
        assert _eval_source(src) == value, src
        assert 0 <= value <= 9


def test_generator_respects_depth_args_and_length_bounds():
    kw = dict(max_depth=4, max_args=3, min_length=15, max_length=40, branch_prob=0.5)
    rows = generate_listops(150, seed=7, **kw)
    for src, value in rows:
        n = len(tokenize_source(src))
        assert 15 <= n <= 40
        stats = {}
        assert _eval_source(src, stats=stats) == value
        assert stats["depth"] <= 4
        assert 2 <= stats["args"] <= 3
    lengths = [len(tokenize_source(s)) for s, _ in generate_listops(300, seed=0)]
    assert min(lengths) >= 10 and max(lengths) <= 100


def test_generator_deterministic_by_seed():
    a = generate_listops(50, seed=5)
    assert a == generate_listops(50, seed=5)
    assert a != generate_listops(50, seed=6)
    # all operators appear and labels are not degenerate
    text = " ".join(s for s, _ in generate_listops(200, seed=5))
    assert all(op in text for op in OPERATORS)
    assert len({v for _, v in generate_listops(200, seed=5)}) == 10


def test_generator_rejects_impossible_settings():
    with pytest.raises(ValueError, match="min_length"):
        generate_listops(1, seed=0, min_length=50, max_length=10)
    with pytest.raises(ValueError, match="no tree"):
        generate_listops(1, seed=0, max_depth=1, max_args=5, min_length=8, max_length=20)  # longest is 7
    with pytest.raises(ValueError, match="no tree"):
        generate_listops(1, seed=0, min_length=1, max_length=3)  # shortest is 4
    assert generate_listops(0, seed=0) == []


def test_write_read_roundtrip(tmp_path):
    rows = generate_listops(30, seed=3)
    for name in ("rt.tsv", "rt.tsv.gz"):
        path = write_listops_tsv(tmp_path / name, rows)
        back = read_listops_tsv(path)
        assert [lab for _, lab in back] == [v for _, v in rows]
        assert [ids for ids, _ in back] == [tokenize_source(s) for s, _ in rows]
    assert (tmp_path / "rt.tsv").read_text().startswith("Source\tTarget\n")
    with pytest.raises(ValueError):
        write_listops_tsv(tmp_path / "x.tsv", [("( ( [MAX 1 ) ] )", 10)])


def test_generate_dir_seeds_and_dedupe(tmp_path):
    # A tiny expression space (one operator over two digits: 400 strings) forces train/val overlap.
    kw = dict(max_depth=1, max_args=2, min_length=4, max_length=4)
    out = generate_listops_dir(tmp_path / "gen", num_train=300, num_val=100, num_test=100, seed=2, **kw)
    assert out == tmp_path / "gen"
    train = generate_listops(300, seed=6, **kw)
    val_raw = generate_listops(100, seed=7, **kw)
    test_raw = generate_listops(100, seed=8, **kw)
    train_src = {s for s, _ in train}
    files = {split: read_listops_tsv(out / f"basic_{split}.tsv") for split in ("train", "val", "test")}
    assert files["train"] == [(tokenize_source(s), v) for s, v in train]
    for split, raw in (("val", val_raw), ("test", test_raw)):
        kept = [(s, v) for s, v in raw if s not in train_src]
        assert len(kept) < len(raw)  # the overlap exists and was dropped
        assert files[split] == [(tokenize_source(s), v) for s, v in kept]
        train_ids = {tuple(ids) for ids, _ in files["train"]}
        assert not any(tuple(ids) in train_ids for ids, _ in files[split])


# ----------------------------------------------------------------- dataset


def test_dataset_items_and_majority_acc():
    rows = [([1, 2, 3], 1), ([4, 5], 1), ([6], 2), ([7, 8], 3)]
    ds = dataset_from_rows(rows, 4, source="s.tsv")
    assert len(ds) == 4 and ds.max_len == 4 and ds.source == "s.tsv" and ds.num_truncated == 0
    item = ds[1]
    assert set(item) == {"tokens", "label"}
    assert item["tokens"].shape == (4,) and item["tokens"].dtype == torch.long
    assert item["tokens"].tolist() == [4, 5, 0, 0]
    assert item["label"].shape == () and item["label"].dtype == torch.long and int(item["label"]) == 1
    assert ds.majority_acc() == pytest.approx(0.5)
    assert ds.lengths.tolist() == [3, 2, 1, 2]
    empty = dataset_from_rows([], 4)
    with pytest.raises(ValueError, match="empty"):
        empty.majority_acc()


def test_load_listops_split(tmp_path):
    rows = generate_listops(40, seed=11, min_length=10, max_length=30)
    write_listops_tsv(tmp_path / "listops-1000" / "basic_val.tsv.gz", rows)
    assert load_listops_split(tmp_path, "train", 64) is None
    ds = load_listops_split(tmp_path, "val", 64)
    assert ds is not None and len(ds) == 40
    assert ds.source == str(tmp_path / "listops-1000" / "basic_val.tsv.gz")
    assert ds.num_truncated == 0
    assert ds.labels.tolist() == [v for _, v in rows]
    assert ds.majority_acc() == pytest.approx(max(Counter(v for _, v in rows).values()) / 40)
    longest = max(len(tokenize_source(s)) for s, _ in rows)
    n_long = sum(len(tokenize_source(s)) > 12 for s, _ in rows)
    assert longest > 12 and n_long > 0
    with pytest.raises(ListOpsFormatError, match=r"basic_val\.tsv\.gz: line \d+: .*max_len=12"):
        load_listops_split(tmp_path, "val", 12)
    cut = load_listops_split(tmp_path, "val", 12, truncate=True)
    assert cut.num_truncated == n_long
    assert int(cut.lengths.max()) == 12


# ----------------------------------------------------------------- real data (shared/, not in the repo)


def test_real_val_file():
    path = REAL_DIR / "basic_val.tsv.gz"
    if not path.is_file():
        pytest.skip(f"real LRA-format ListOps val file not present at {path} (see shared/data/listops/PROVENANCE.md)")
    rows = read_listops_tsv(path)
    assert len(rows) == 2000
    labels = [lab for _, lab in rows]
    assert all(0 <= lab <= 9 for lab in labels)
    lengths = [len(ids) for ids, _ in rows]
    assert min(lengths) >= 1 and max(lengths) <= 2000
    ds = load_listops_split(REAL_DIR, "val", 2000)
    assert ds.num_truncated == 0 and ds.tokens.shape == (2000, 2000)
    assert 0.1 < ds.majority_acc() < 0.25  # PROVENANCE: majority class ~17%
    # Our textual form matches the real one: the test parser reads real rows, and with the LRA median
    # (int(numpy.median): floor of the mean of the two middle values) it reproduces their labels.
    with gzip.open(path, "rt", newline="") as fh:
        next(fh)
        for _ in range(50):
            src, target = fh.readline().rstrip("\r\n").split("\t")
            assert _eval_source(src, med=_median_numpy_int) == int(target)


# ----------------------------------------------------------------- rows longer than max_len (the LRA release)


def _long_rows_dir(tmp_path, lengths):
    """basic_train.tsv with one [SM row per length (tokens after dropping ( ): 2 + number of digits)."""
    rows = [("( [SM " + " ".join("1" * (n - 2)) + " ] )", (n - 2) % 10) for n in lengths]
    lo.write_listops_tsv(tmp_path / "basic_train.tsv", rows)
    return tmp_path


def test_too_long_rows_name_the_longest_and_the_setting_that_fits(tmp_path):
    data = _long_rows_dir(tmp_path, [20, 150, 300, 140])
    with pytest.raises(ListOpsFormatError) as info:
        load_listops_split(data, "train", 128)
    msg = str(info.value)
    assert "basic_train.tsv: line 3: sequence has 150 tokens, more than max_len=128" in msg
    assert "3 of 4 rows are longer" in msg and "line 4" in msg and "300 tokens" in msg
    assert "--set max_len=300" in msg and "--preset listops-paper" in msg
    assert "truncate" not in msg  # cutting an expression changes its answer: not offered for ListOps
    ds = load_listops_split(data, "train", 300)
    assert ds.lengths.tolist() == [20, 150, 300, 140] and ds.num_truncated == 0


def test_rows_longer_than_the_release_get_no_preset_hint(tmp_path):
    data = _long_rows_dir(tmp_path, [10, 2500])
    with pytest.raises(ListOpsFormatError, match=r"--set max_len=2500; a ListOps") as info:
        load_listops_split(data, "train", 2000)
    assert "listops-paper" not in str(info.value)


def test_mgk_train_on_long_rows_stops_with_one_line_naming_the_fix(tmp_path):
    from mgk.cli import main

    data = _long_rows_dir(tmp_path / "lo", [20, 1454, 30])
    with pytest.raises(SystemExit) as info:
        main(["train", "--task", "listops", "--data", str(data), "--steps", "1", "--out", str(tmp_path / "run"),
              "--set", "progress=false"])
    msg = str(info.value)
    assert msg.startswith("mgk train: ") and "\n" not in msg
    assert "line 3: sequence has 1454 tokens" in msg and "--set max_len=1454" in msg and "listops-paper" in msg
    assert "truncate" not in msg


def test_cache_holds_unpadded_rows_for_every_max_len(tmp_path, monkeypatch):
    data = _long_rows_dir(tmp_path, [12, 40])
    cache = tmp_path / "cache"
    a = load_listops_split(data, "train", 40, cache_dir=cache)

    def boom(*args, **kw):
        raise AssertionError("should have been read from the cache")

    monkeypatch.setattr(lo, "read_listops_tsv", boom)
    b = load_listops_split(data, "train", 64, cache_dir=cache)
    assert torch.equal(b.tokens[:, :40], a.tokens) and b.tokens[:, 40:].eq(PAD_ID).all()
    with pytest.raises(ListOpsFormatError, match="line 3: sequence has 40 tokens"):
        load_listops_split(data, "train", 20, cache_dir=cache)
    assert len(list(cache.glob("*.npz"))) == 1


def test_real_release_rows_need_the_release_length(tmp_path):
    src = REAL_DIR / "basic_val.tsv.gz"
    if not src.is_file():
        pytest.skip(f"real LRA-format ListOps val file not present at {src}")
    with gzip.open(src, "rt", newline="") as fh:  # a few real rows: reading all 2,000 long rows is slow
        head = [next(fh) for _ in range(41)]
    (tmp_path / "basic_train.tsv").write_text("".join(head))
    longest = max(len(tokenize_source(line.split("\t")[0])) for line in head[1:])
    assert longest > 128
    with pytest.raises(ListOpsFormatError, match=rf"--set max_len={longest} \(or --preset listops-paper"):
        load_listops_split(tmp_path, "train", 128)
    ds = load_listops_split(tmp_path, "train", lo.RELEASE_MAX_LEN)
    assert len(ds) == 40 and ds.num_truncated == 0
