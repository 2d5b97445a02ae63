"""mgk.data.dretrieval: the generalized D-retrieval definition on hand-computed cases, determinism, disjoint splits,
and the file checks."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from mgk.data import dretrieval as dr


def _reference_targets(tables, inputs):
    """min over positions of each feature, then the mean of square roots: written out with loops."""
    out = []
    for row in inputs:
        z = [min(tables[i][int(v)] for v in row) for i in range(len(tables))]
        out.append(sum(math.sqrt(zi) for zi in z) / len(z))
    return np.array(out)


def test_retrieval_and_outer_function_on_a_hand_computed_case():
    tables = np.array([[0.0, 1 / 3, 2 / 3, 1.0],    # f_1 grows with the token
                       [1.0, 2 / 3, 1 / 3, 0.0]])   # f_2 falls with it
    inputs = np.array([[1, 2, 2], [0, 3, 3], [2, 2, 2]])
    z = dr.retrieve(tables, inputs)
    np.testing.assert_allclose(z, [[1 / 3, 1 / 3], [0.0, 0.0], [2 / 3, 1 / 3]])
    np.testing.assert_allclose(dr.outer_function(z), [math.sqrt(1 / 3), 0.0, (math.sqrt(2 / 3) + math.sqrt(1 / 3)) / 2])


def test_feature_tables_are_distinct_scaled_permutations_fixed_by_the_task_seed():
    spec = dr.DRetrievalSpec(seq_len=5, num_features=6, vocab=9)
    t = dr.feature_tables(spec)
    assert t.shape == (6, 9)
    for row in t:
        assert sorted(np.rint(row * 8).astype(int)) == list(range(9))  # pi_i(v) / (V - 1), a permutation
    assert len({row.tobytes() for row in t}) == 6
    np.testing.assert_array_equal(t, dr.feature_tables(spec))
    assert not np.array_equal(t, dr.feature_tables(dr.DRetrievalSpec(5, 6, 9, task_seed=1)))


def test_generate_follows_the_definition_and_is_deterministic():
    spec = dr.DRetrievalSpec(seq_len=7, num_features=3, vocab=20)
    a, b = dr.generate(spec, 50, seed=3), dr.generate(spec, 50, seed=3)
    np.testing.assert_array_equal(a.inputs, b.inputs)
    np.testing.assert_array_equal(a.targets, b.targets)
    assert not np.array_equal(a.inputs, dr.generate(spec, 50, seed=4).inputs)
    assert a.inputs.shape == (50, 7) and a.inputs.min() >= 0 and a.inputs.max() < 20
    np.testing.assert_allclose(a.targets, _reference_targets(a.tables, a.inputs))
    np.testing.assert_allclose(a.features, dr.retrieve(a.tables, a.inputs.astype(int)))


def test_tiny_tasks_and_two_features_of_two_points():
    spec = dr.DRetrievalSpec(seq_len=1, num_features=2, vocab=2)  # the two permutations of two points
    t = dr.feature_tables(spec)
    assert sorted(map(tuple, t.tolist())) == [(0.0, 1.0), (1.0, 0.0)]
    with pytest.raises(ValueError, match="3 distinct features need more than 2 grid points"):
        dr.DRetrievalSpec(seq_len=1, num_features=3, vocab=2)


@pytest.mark.parametrize("field, value", [("seq_len", 0), ("num_features", 0), ("vocab", 1), ("vocab", 40000),
                                          ("seq_len", 2.5)])
def test_bad_settings_are_named(field, value):
    kwargs = {"seq_len": 4, "num_features": 2, "vocab": 8, field: value}
    with pytest.raises(ValueError, match=field):
        dr.DRetrievalSpec(**kwargs)


def test_written_splits_are_disjoint_and_read_back(tmp_path):
    spec = dr.DRetrievalSpec(seq_len=3, num_features=2, vocab=3)  # 27 possible sequences: repeats are certain
    dr.generate_dir(tmp_path, spec, num_train=30, num_val=30, num_test=30)
    splits = {s: dr.load_split(tmp_path, s) for s in dr.SPLITS}
    rows = {s: {r.tobytes() for r in sp.inputs} for s, sp in splits.items()}
    assert not rows["train"] & rows["val"] and not rows["train"] & rows["test"] and not rows["val"] & rows["test"]
    assert len(splits["train"]) == 30 and len(splits["val"]) < 30  # repeats dropped from val, not from train
    for sp in splits.values():
        assert sp.spec == spec and np.array_equal(sp.tables, splits["train"].tables)
        np.testing.assert_allclose(sp.targets, _reference_targets(sp.tables, sp.inputs))


def test_the_same_settings_write_the_same_files(tmp_path):
    spec = dr.DRetrievalSpec(seq_len=4, num_features=2, vocab=16)
    for name in ("a", "b"):
        dr.generate_dir(tmp_path / name, spec, num_train=20, num_val=5, num_test=5)
    for s in dr.SPLITS:
        a, b = dr.load_split(tmp_path / "a", s), dr.load_split(tmp_path / "b", s)
        np.testing.assert_array_equal(a.inputs, b.inputs)
    assert dr.load_split(tmp_path / "missing", "train") is None


def _rewrite(path, **changes):
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    arrays.update(changes)
    np.savez(path, **arrays)


def test_malformed_files_are_errors_naming_the_file(tmp_path):
    spec = dr.DRetrievalSpec(seq_len=4, num_features=2, vocab=16)
    dr.generate_dir(tmp_path, spec, num_train=10, num_val=5, num_test=5)
    path = dr.split_path(tmp_path, "train")
    with np.load(path) as z:
        targets = z["targets"].copy()
    targets[3] += 0.5
    _rewrite(path, targets=targets)
    with pytest.raises(dr.DRetrievalFormatError, match=r"dretrieval_train.npz: row 3 .*differ from F_0"):
        dr.load_split(tmp_path, "train")
    _rewrite(path, meta=np.array(json.dumps({"task": "other"})))
    with pytest.raises(dr.DRetrievalFormatError, match="dretrieval_train.npz: bad meta"):
        dr.load_split(tmp_path, "train")
    path.write_bytes(b"not a zip")
    with pytest.raises(dr.DRetrievalFormatError, match="dretrieval_train.npz: not a readable"):
        dr.load_split(tmp_path, "train")
    val = dr.split_path(tmp_path, "val")
    _rewrite(val, inputs=np.full((5, 4), 99, dtype=np.int16))
    with pytest.raises(dr.DRetrievalFormatError, match="dretrieval_val.npz: input tokens outside 0..15"):
        dr.load_split(tmp_path, "val")


def test_nmse_is_one_for_the_mean_and_zero_for_the_truth():
    y = np.array([0.1, 0.4, 0.2, 0.7])
    assert dr.nmse(y, y) == 0.0
    assert dr.nmse(np.full(4, y.mean()), y) == pytest.approx(1.0)
    assert dr.nmse(y + 0.1, y) == pytest.approx(0.01 / y.var())
    assert math.isnan(dr.nmse([1.0, 2.0], [3.0, 3.0]))
