"""The file a check's carried state is kept in: read back as written, or not at all."""

import numpy as np

from sftaudit.checks.carried_arrays import MAGIC, load_arrays, save_arrays


def test_arrays_come_back_as_written(tmp_path):
    path = tmp_path / "state.arrays"
    written = {
        "meta": np.array('{"rows": 3}'),  # a 0-d string stays 0-d
        "sums": np.arange(12.0).reshape(3, 4)[:, ::2],  # not contiguous
        "none": np.zeros(0, dtype=np.intp),
        "flags": np.array([True, False]),
    }
    save_arrays(path, written)
    read = load_arrays(path)
    assert list(read) == list(written)
    for name, values in written.items():
        assert read[name].dtype == values.dtype and read[name].shape == values.shape
        assert np.array_equal(read[name], values)
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_torn_or_foreign_file_is_none(tmp_path):
    path = tmp_path / "state.arrays"
    save_arrays(path, {"x": np.arange(100.0)})
    whole = path.read_bytes()
    for bad in (whole[:-8], whole + b"\0", b"PK\x03\x04 an npz", b"", MAGIC):
        path.write_bytes(bad)
        assert load_arrays(path) is None
    assert load_arrays(tmp_path / "absent.arrays") is None


def test_a_pickled_array_is_never_loaded(tmp_path):
    path = tmp_path / "state.arrays"
    with open(path, "wb") as f:
        f.write(MAGIC)
        np.lib.format.write_array(f, np.array(["x"]))
        np.lib.format.write_array(f, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    assert load_arrays(path) is None
