"""Bounded reads of untrusted files: regular files only, inside a root folder, under a size limit.

Everything sftaudit reads comes from a run folder it does not control. A FIFO blocks `open()`,
`/dev/zero` never ends, a symlink can point at `/etc/passwd` or `/`: so a file is resolved, kept
inside its root, stat'ed (which never blocks) and opened only when it is a regular file, with
``O_NONBLOCK`` so that a file swapped for a FIFO between the two cannot block either.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import InputError, one_line

# A file read whole (a JSON file, a pickle, a tokenizer file) larger than this is refused.
MAX_WHOLE_FILE_BYTES = 256 * 1024 * 1024

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class UnsafeFile(InputError):
    """A path that is not a regular file inside its root, or too large to read."""


def kind_of(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def inside(root: str | Path, path: str | Path) -> Path:
    """`path` with its symlinks resolved; refused when it lands outside `root` (itself resolved)."""
    base = Path(root).resolve()
    target = (base / path).resolve()
    if target != base and base not in target.parents:
        raise UnsafeFile(f"{path}: resolves to {target}, outside {base}; not read")
    return target


def regular_file(path: str | Path, root: str | Path | None = None, max_bytes: int | None = None) -> Path:
    """`path` resolved, when it is a regular file (inside `root` when given) of at most `max_bytes`."""
    target = inside(root, path) if root is not None else Path(path).resolve()
    try:
        st = os.stat(target)
    except OSError as exc:
        raise UnsafeFile(f"{path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFile(f"{path}: {kind_of(st.st_mode)}, not a regular file; not read")
    if max_bytes is not None and st.st_size > max_bytes:
        raise UnsafeFile(f"{path}: {st.st_size} bytes, over the {max_bytes}-byte limit for this file; not read")
    return target


def open_regular(path: str | Path, root: str | Path | None = None, max_bytes: int | None = None) -> BinaryIO:
    """A regular file opened for reading in binary (see `regular_file`), never blocking on open."""
    target = regular_file(path, root, max_bytes)
    try:
        fd = os.open(target, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as exc:
        raise UnsafeFile(f"{path}: {exc.strerror or exc}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # swapped after the stat above
        os.close(fd)
        raise UnsafeFile(f"{path}: {kind_of(mode)}, not a regular file; not read")
    return os.fdopen(fd, "rb")


def read_bytes(path: str | Path, root: str | Path | None = None, max_bytes: int = MAX_WHOLE_FILE_BYTES) -> bytes:
    """The whole of a regular file of at most `max_bytes` (a file growing past it is refused too)."""
    with open_regular(path, root, max_bytes) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise UnsafeFile(f"{path}: over the {max_bytes}-byte limit for this file; not read")
    return data


def read_text(path: str | Path, root: str | Path | None = None, max_bytes: int = MAX_WHOLE_FILE_BYTES) -> str:
    """`read_bytes` decoded as UTF-8 (undecodable bytes replaced)."""
    return read_bytes(path, root, max_bytes).decode("utf-8", errors="replace")


def read_json(path: str | Path, root: str | Path | None = None, max_bytes: int = MAX_WHOLE_FILE_BYTES) -> Any:
    """A regular file's JSON value (see `read_bytes`); InputError in one line when it is not JSON, or nested
    deeper than the parser's recursion limit (a JSON file of brackets a few MB long)."""
    data = read_bytes(path, root, max_bytes)
    try:
        return json.loads(data)
    except RecursionError:
        raise InputError(f"{path}: nested too deeply to read") from None
    except ValueError as exc:  # UnicodeDecodeError is one
        raise InputError(f"{path}: not JSON ({one_line(exc, 120)})") from None


def head(path: str | Path, n: int, root: str | Path | None = None) -> bytes:
    """The first `n` bytes of a regular file."""
    with open_regular(path, root) as f:
        return f.read(n)


# The first line of every Git LFS pointer file (https://github.com/git-lfs/git-lfs/blob/main/docs/spec.md); a
# pointer is three short lines (version, oid, size), under 1024 bytes by the spec.
LFS_POINTER_PREFIX = b"version https://git-lfs.github.com/spec/v1"
LFS_POINTER_MAX_BYTES = 1024
LFS_HINT = "Git LFS pointer, not the data: run `git lfs pull`"


def is_lfs_pointer(path: str | Path, root: str | Path | None = None) -> bool:
    """Whether the file is a Git LFS pointer where data should be (a clone made without git-lfs): a small regular
    file (inside `root` when given) that starts as a pointer does; nothing else is read, and anything else is none."""
    try:
        with open_regular(Path(path).absolute(), root, LFS_POINTER_MAX_BYTES) as f:
            return f.read(len(LFS_POINTER_PREFIX)) == LFS_POINTER_PREFIX
    except (OSError, InputError):
        return False
