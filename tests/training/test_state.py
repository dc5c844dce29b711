import os

import numpy as np
import pytest

from relaxgrad.training.state import META_KEY, read_state, write_state


def test_round_trip_keeps_values_dtypes_and_meta(tmp_path):
    arrays = {"w": np.arange(6, dtype="float32").reshape(2, 3), "step": np.array(7, "int64"),
              "key": np.array([1, 2], "uint32")}
    path = tmp_path / "ckpt.params"
    write_state(path, arrays, {"step": 7, "names": ["w"]})
    got, meta = read_state(path)
    assert meta == {"step": 7, "names": ["w"]}
    assert set(got) == set(arrays)
    for name, value in arrays.items():
        assert got[name].dtype == value.dtype
        np.testing.assert_array_equal(got[name], value)


def test_a_failed_write_leaves_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.params"
    write_state(path, {"w": np.ones(3, "float32")}, {"step": 1})

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        write_state(path, {"w": np.zeros(3, "float32")}, {"step": 2})
    monkeypatch.undo()
    got, meta = read_state(path)
    assert meta == {"step": 1}
    np.testing.assert_array_equal(got["w"], np.ones(3, "float32"))
    assert os.listdir(tmp_path) == ["ckpt.params"]


def test_reserved_name_and_foreign_file_are_refused(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        write_state(tmp_path / "a", {META_KEY: np.zeros(1)}, {})
    import tvm

    (tmp_path / "b").write_bytes(bytes(tvm.runtime.save_param_dict(
        {"w": tvm.runtime.tensor(np.zeros(1, "float32"))})))
    with pytest.raises(ValueError, match="not a relaxgrad state file"):
        read_state(tmp_path / "b")
