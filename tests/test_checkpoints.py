"""The safe checkpoint readers: hostile safetensors headers are clear errors without big allocations,
pickles are read without running anything, paths stay inside the run."""

import json
import pickle
import struct
import tracemalloc

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from sftaudit.readers.checkpoints import (
    CheckpointError,
    inside_run,
    read_pickle,
    read_safetensors_header,
    safetensors_files,
    scan_safetensors,
    scan_torch_zip,
    state_dict_tensors,
)


def write_header(path, header, data=b""):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_scan_counts_nonfinite_per_dtype_and_digests(tmp_path):
    bf16 = torch.tensor([1.0, float("nan"), float("inf"), -2.0], dtype=torch.bfloat16)
    f16 = torch.tensor([float("-inf"), 0.5], dtype=torch.float16)
    path = tmp_path / "w.safetensors"
    save_file({"a": bf16, "b": f16, "c": torch.arange(4), "d": torch.ones(3)}, str(path))
    entries, _ = read_safetensors_header(path)
    scans = {e.name: (e.dtype, s.nonfinite) for e, s in scan_safetensors(path, entries)}
    assert scans == {"a": ("bfloat16", 2), "b": ("float16", 1), "c": ("int64", 0), "d": ("float32", 0)}


def test_a_huge_header_length_is_refused_without_allocating_it(tmp_path):
    path = tmp_path / "h.safetensors"
    path.write_bytes(struct.pack("<Q", 2**62) + b"{}")
    tracemalloc.start()
    with pytest.raises(CheckpointError, match="header claims"):
        read_safetensors_header(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.parametrize(
    "header, data, message",
    [
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "truncated"),
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [2**50, 2**50 + 8]}}, b"\0" * 8, "pointing outside"),
        ({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "needs 12 bytes"),
        ({"t": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 8]}}, b"\0" * 8, "needs"),
        ({"t": {"dtype": "PY_OBJECT", "shape": [1], "data_offsets": [0, 1]}}, b"\0", "unknown dtype"),
        (
            {
                "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]},
            },
            b"\0" * 6,
            "overlap",
        ),
        ({"t": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}, b"\0", "malformed shape"),
    ],
)
def test_hostile_headers_are_one_line_errors(tmp_path, header, data, message):
    with pytest.raises(CheckpointError, match=message):
        read_safetensors_header(write_header(tmp_path / "x.safetensors", header, data))


def test_shard_index_cannot_point_outside_the_checkpoint(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../../etc/passwd"}}))
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        safetensors_files(tmp_path)


def test_paths_stay_inside_the_run(tmp_path):
    assert (
        inside_run(tmp_path, "checkpoint-1/model.safetensors") == tmp_path.resolve() / "checkpoint-1/model.safetensors"
    )
    for escape in ("../elsewhere", "/etc", "checkpoint-1/../../x"):
        with pytest.raises(CheckpointError, match="outside the run directory"):
            inside_run(tmp_path, escape)


class Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def test_pickles_are_read_without_running_them(tmp_path):
    marker = tmp_path / "ran"
    state = {
        "step": 3,
        "rng_states": {"numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        "evil": Payload(marker),
    }
    path = tmp_path / "state.pt"
    torch.save(state, path)
    contents = read_pickle(path)
    assert not marker.exists()
    assert contents.value["step"] == 3
    assert contents.value["rng_states"]["torch"].dtype == "uint8"
    assert contents.unsafe_globals() == ["builtins.exec"]
    bare = tmp_path / "bare.bin"
    bare.write_bytes(pickle.dumps({"x": Payload(marker)}, protocol=0))
    assert read_pickle(bare).unsafe_globals() == ["builtins.exec"] and not marker.exists()


def test_garbage_is_not_a_pickle(tmp_path):
    path = tmp_path / "junk.pt"
    path.write_bytes(b"\x80\x05\x95garbage")
    with pytest.raises(CheckpointError, match="unreadable pickle.*refuse to load"):
        read_pickle(path)


def test_torch_save_state_dicts_are_scanned_from_their_records(tmp_path):
    weights = {"w": torch.tensor([[1.0, float("nan")], [float("inf"), 0.0]]), "b": torch.zeros(3, dtype=torch.float16)}
    path = tmp_path / "pytorch_model.bin"
    torch.save({"state_dict": weights}, path)
    refs = state_dict_tensors(read_pickle(path))
    assert {n: (r.dtype, r.shape) for n, r in refs.items()} == {"w": ("float32", (2, 2)), "b": ("float16", (3,))}
    scans = scan_torch_zip(path, refs)
    assert scans["w"].nonfinite == 2 and scans["b"].nonfinite == 0
