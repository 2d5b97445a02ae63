"""mgk.data.mqar: the layout of plain and compositional MQAR checked row by row against the definition, the gap
distribution, determinism, disjoint splits and the file checks."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from mgk.data import mqar as mq

IGN = mq.IGNORE_INDEX


def _check_plain_row(x, y, spec):
    n, half = spec.num_kv_pairs, spec.vocab // 2
    keys, values = x[0:2 * n:2], x[1:2 * n:2]
    assert len(set(keys)) == n and all(1 <= k < half for k in keys)
    assert len(set(values)) == n and all(half <= v < spec.vocab for v in values)
    bound = dict(zip(keys, values))
    answers = np.flatnonzero(y != IGN)
    assert len(answers) == n and (y[:2 * n] == IGN).all()
    assert sorted(x[answers]) == sorted(keys)  # every key asked once
    for pos in answers:
        assert (pos - 2 * n) % 2 == 0  # query slots are the even positions of the query region
        assert y[pos] == bound[x[pos]]


def test_plain_rows_follow_the_definition():
    spec = mq.MQARSpec(vocab=12, seq_len=16, num_kv_pairs=2)  # the size of Zoology's docstring example
    split = mq.generate(spec, 200, seed=0)
    for x, y in zip(split.inputs.astype(int), split.targets.astype(int)):
        _check_plain_row(x, y, spec)
    assert split.inputs.min() >= 0 and split.inputs.max() < 12
    assert mq.check_answers(split.inputs, split.targets, spec).all()


def test_compositional_rows_follow_the_definition_and_neither_half_decides():
    spec = mq.MQARSpec(vocab=60, seq_len=36, num_kv_pairs=4, compositional=True)
    split = mq.generate(spec, 100, seed=1)
    third = 20
    for x, y in zip(split.inputs.astype(int), split.targets.astype(int)):
        triples = x[:12].reshape(4, 3)
        a, b, v = triples.T
        assert all(1 <= t < third for t in a) and all(third <= t < 2 * third for t in b)
        assert all(2 * third <= t < 60 for t in v) and len(set(v)) == 4
        assert len(set(zip(a, b))) == 4 and len(set(a)) == 2 and len(set(b)) == 2  # the 2 x 2 grid
        for half in (a, b):  # each half occurs with two different values
            for t in set(half):
                assert len({val for h, val in zip(half, v) if h == t}) == 2
        bound = {(p, q): w for p, q, w in triples}
        answers = np.flatnonzero(y != IGN)
        assert len(answers) == 4
        for pos in answers:
            assert (pos - 12) % 3 == 1 and y[pos] == bound[(x[pos - 1], x[pos])]
    assert mq.check_answers(split.inputs, split.targets, spec).all()


def test_gap_probabilities_by_hand_and_the_power_law_favours_short_gaps():
    p = mq.gap_probabilities(3, 0.5)
    w = np.array([1.0, 2 ** -0.5, 3 ** -0.5])
    np.testing.assert_allclose(p, w / w.sum())
    np.testing.assert_allclose(mq.gap_probabilities(4, 1.0), [0.25] * 4)
    slots = {}
    for a in (0.01, 1.0):
        spec = mq.MQARSpec(vocab=64, seq_len=64, num_kv_pairs=2, power_a=a)  # 30 query slots for 2 queries
        s = mq.generate(spec, 400, seed=0)
        slots[a] = (np.flatnonzero(s.targets.reshape(-1) != IGN) % 64 - 4).mean()
    assert slots[0.01] < 0.6 * slots[1.0]  # uniform: mean position ~ 29; a = 0.01: mostly the first slots


def test_generation_is_deterministic_per_seed():
    spec = mq.MQARSpec(vocab=32, seq_len=24, num_kv_pairs=4)
    a, b, c = (mq.generate(spec, 30, seed=s) for s in (5, 5, 6))
    np.testing.assert_array_equal(a.inputs, b.inputs)
    np.testing.assert_array_equal(a.targets, b.targets)
    assert not np.array_equal(a.inputs, c.inputs)


@pytest.mark.parametrize("kwargs, match", [
    ({"vocab": 12, "seq_len": 16, "num_kv_pairs": 6}, "leaves 5 key tokens, fewer than the 6"),
    ({"vocab": 64, "seq_len": 16, "num_kv_pairs": 5}, "need seq_len >= 20"),
    ({"vocab": 64, "seq_len": 64, "num_kv_pairs": 5, "compositional": True}, "a square"),
    ({"vocab": 64, "seq_len": 64, "num_kv_pairs": 4, "power_a": 0.0}, "power_a"),
    ({"vocab": 2, "seq_len": 64, "num_kv_pairs": 4}, "vocab"),
])
def test_impossible_settings_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mq.MQARSpec(**kwargs)


def test_written_splits_are_disjoint_and_checked_on_read(tmp_path):
    spec = mq.MQARSpec(vocab=6, seq_len=4, num_kv_pairs=1, power_a=1.0)  # few distinct rows: repeats certain
    mq.generate_dir(tmp_path, spec, num_train=200, num_val=200, num_test=200)
    splits = {s: mq.load_split(tmp_path, s) for s in mq.SPLITS}
    rows = {s: {r.tobytes() for r in sp.inputs} for s, sp in splits.items()}
    assert not rows["train"] & rows["val"] and not rows["train"] & rows["test"] and not rows["val"] & rows["test"]
    assert len(splits["train"]) == 200 and len(splits["val"]) < 200
    assert all(sp.spec == spec for sp in splits.values())


def _rewrite(path, **changes):
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    arrays.update(changes)
    np.savez(path, **arrays)


def test_a_wrong_answer_or_bad_file_is_an_error_naming_it(tmp_path):
    spec = mq.MQARSpec(vocab=32, seq_len=16, num_kv_pairs=2)
    mq.generate_dir(tmp_path, spec, num_train=10, num_val=4, num_test=4)
    path = mq.split_path(tmp_path, "train")
    with np.load(path) as z:
        targets = z["targets"].copy()
    pos = np.flatnonzero(targets[2] != IGN)[0]
    targets[2, pos] = 16 + (targets[2, pos] - 16 + 1) % 16  # another value
    _rewrite(path, targets=targets)
    with pytest.raises(mq.MQARFormatError, match=r"mqar_train.npz: row 2 .*key-value bindings"):
        mq.load_split(tmp_path, "train")
    _rewrite(path, meta=np.array(json.dumps({"task": "mqar", "version": 99})))
    with pytest.raises(mq.MQARFormatError, match="bad meta"):
        mq.load_split(tmp_path, "train")
    val = mq.split_path(tmp_path, "val")
    _rewrite(val, inputs=np.zeros((4, 15), dtype=np.int16))
    with pytest.raises(mq.MQARFormatError, match=r"mqar_val.npz: inputs \(4, 15\)"):
        mq.load_split(tmp_path, "val")
    assert mq.load_split(tmp_path / "none", "test") is None


def test_answers_per_sequence_and_chance():
    spec = mq.MQARSpec(vocab=128, seq_len=64, num_kv_pairs=8)
    s = mq.generate(spec, 500, seed=0)
    answers = s.targets[s.targets != IGN]
    assert answers.size == 500 * 8
    share = np.bincount(answers).max() / answers.size
    assert share < 3 / 64 and math.isclose(len(np.unique(answers)), 64, abs_tol=2)  # values spread over 64 tokens
