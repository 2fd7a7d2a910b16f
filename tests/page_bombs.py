"""Test data: a Parquet part whose footer is honest and one page header lies, the first page of a column claiming
`claim` bytes uncompressed. Used by tests/test_parquet_pages.py, tests/hostile/test_malformed.py and
benchmarks/page_header_bomb.py, with `peak_rss`: what a reader of such a part takes.

The page is rewritten in place at its own length, so nothing else in the file moves (no footer offset to mend):
its header is encoded again (its type, the claim, its compressed size, its data page header without its
statistics) and padded to its old length with a field no reader knows (a reader skips those); with
``bomb=True`` its payload becomes a zstd frame of `claim` zero bytes (run-length blocks, 4 bytes per 128 KiB)
padded with a skippable frame to its old length, so a reader that trusts the header decompresses all of it.
"""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

from sftaudit.readers.parquet_pages import parse_struct

_ZSTD_MAGIC, _ZSTD_SKIPPABLE_MAGIC = b"\x28\xb5\x2f\xfd", b"\x50\x2a\x4d\x18"
_ZSTD_BLOCK = 1 << 17  # a zstd block's most bytes
_PADDING_FIELD = 15  # a PageHeader field id Parquet does not define


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


def encode_struct(fields: dict) -> bytes:
    """A compact-protocol struct of i32 fields and nested structs (what `parse_struct` returns), its STOP left
    off."""
    out, last = bytearray(), 0
    for field in sorted(fields):
        value, delta = fields[field], field - last
        kind = 12 if isinstance(value, dict) else 5
        out += bytes([delta << 4 | kind]) if 0 < delta <= 15 else bytes([kind]) + _varint(field << 1)
        out += encode_struct(value) + b"\x00" if kind == 12 else _varint((value << 1) ^ (value >> 63))
        last = field
    return bytes(out)


def zstd_zeros(size: int, length: int) -> bytes:
    """A zstd frame of `size` zero bytes, padded with a skippable frame to `length` bytes."""
    frame = bytearray(_ZSTD_MAGIC + b"\xe0" + struct.pack("<Q", size))  # one segment, an 8-byte content size
    for start in range(0, size, _ZSTD_BLOCK):
        block = min(_ZSTD_BLOCK, size - start)
        last = start + block == size
        frame += struct.pack("<I", block << 3 | 1 << 1 | last)[:3] + b"\x00"  # a run-length block of zeros
    pad = length - len(frame) - 8
    if pad < 0:
        raise ValueError(f"{size} zero bytes take {len(frame) + 8} bytes of zstd, more than the page's {length}")
    return bytes(frame + _ZSTD_SKIPPABLE_MAGIC + struct.pack("<I", pad) + bytes(pad))


def lie_in_page_header(part: Path, claim: int, column: str = "norm", bomb: bool = False) -> None:
    """Rewrite the first page of `column` in `part` (in place) to claim `claim` bytes uncompressed."""
    meta = pq.read_metadata(part)
    group = meta.row_group(0)
    chunk = next(group.column(c) for c in range(group.num_columns) if group.column(c).path_in_schema == column)
    data = bytearray(part.read_bytes())
    start = chunk.data_page_offset
    header, size = parse_struct(bytes(data[start : start + 4096]))
    header[2] = claim
    header[5].pop(5, None)  # the page's statistics (binaries: parse_struct leaves them out)
    body = encode_struct(header)
    pad = size - len(body) - 3  # the padding field's byte, its one-byte length, the STOP
    if not 0 <= pad < 0x80:
        raise ValueError(f"the page header at byte {start} is {size} bytes: too short to rewrite at its length")
    new = body + bytes([(_PADDING_FIELD - max(header)) << 4 | 8, pad]) + bytes(pad) + b"\x00"
    data[start : start + size] = new
    if bomb:
        data[start + size : start + size + header[3]] = zstd_zeros(claim, header[3])
    part.write_bytes(bytes(data))


# Linux carries a process's peak RSS over fork and exec: a child of this process (hundreds of MB) would report
# this one's. So a lean interpreter starts each command and reports its ru_maxrss from os.wait4.
_LAUNCHER = (
    "import os, subprocess, sys\n"
    "proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)\n"
    "_, status, usage = os.wait4(proc.pid, 0)\n"
    "print(os.waitstatus_to_exitcode(status), usage.ru_maxrss, usage.ru_utime + usage.ru_stime)"
)


def peak_rss(args: list[str], env: dict | None = None, timeout: float | None = None) -> tuple[int, float, float, str]:
    """(exit status, peak RSS in MB, CPU seconds, stderr) of a command."""
    done = subprocess.run(
        [sys.executable, "-S", "-c", _LAUNCHER, *args], capture_output=True, text=True, env=env, timeout=timeout
    )
    status, rss, cpu = done.stdout.split()
    return int(status), int(rss) / 1024, float(cpu), done.stderr.strip()
