"""Arrays a check keeps from one audit to the next in sftaudit's cache: one file, their names then each array in
NumPy's ``.npy`` format, one after another. Not ``np.savez``: its zip checksums every byte when written and read
(some 0.1 s of CPU an audit for the 150 MB carried at 10^6 steps). Written whole (a temporary file renamed) or not
at all; read back only when whole and of this format, never unpickled."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

MAGIC = b"sftaudit-arrays 1\n"


def save_arrays(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """`arrays` into `path`, replacing it whole; OSError when it cannot be written (nothing is left half written)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC)
            np.lib.format.write_array(f, np.array(list(arrays), dtype=str), allow_pickle=False)
            for values in arrays.values():
                np.lib.format.write_array(f, np.asarray(values), allow_pickle=False)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_arrays(path: Path) -> dict[str, np.ndarray] | None:
    """The arrays `save_arrays` wrote into `path`; None when it is absent, torn or not such a file."""
    try:
        with open(path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                return None
            names = np.lib.format.read_array(f, allow_pickle=False)
            if names.ndim != 1 or names.dtype.kind != "U":
                return None
            arrays = {str(name): np.lib.format.read_array(f, allow_pickle=False) for name in names}
            if f.read(1):  # more than was written
                return None
    except (OSError, ValueError, EOFError, MemoryError):  # MemoryError: a header naming a shape far past the file
        return None
    return arrays if len(arrays) == len(names) else None
