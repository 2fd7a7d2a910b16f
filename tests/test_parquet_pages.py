"""The page-header walk (sftaudit/readers/parquet_pages.py) on real parts of the shim's and on the same parts with
one page header lying (tests/page_bombs.py), and on random bytes: it says what is wrong in one line, never
raises, never reads outside a column chunk."""

from __future__ import annotations

import functools
import io
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sftaudit.core.artifacts import series_dir
from sftaudit.errors import InputError
from sftaudit.readers.parquet_pages import MalformedHeader, chunk_fault, page_header_fault, parse_struct
from sftaudit.shim.writer import _PART_OPTIONS
from sftaudit.store.ingest import ingest

from .hostile.builders import recorded_run
from .page_bombs import encode_struct, lie_in_page_header

ROWS = 50_000  # three pages a column (pyarrow starts one every 20,000 values)


@functools.cache
def _part_bytes(rows: int = ROWS) -> bytes:
    """A part as the shim writes it (its options), of `rows` noisy norms."""
    rng = np.random.default_rng(0)
    table = pa.table(
        {
            "step": pa.array(np.arange(rows, dtype=np.int64) // 16 + 1),
            "idx": pa.array(np.arange(rows, dtype=np.int32) % 16),
            "norm": pa.array(rng.lognormal(-3, 0.1, rows).astype(np.float32)),
        }
    )
    out = io.BytesIO()
    pq.write_table(table, out, row_group_size=max(rows, 1), **_PART_OPTIONS)
    return out.getvalue()


def _part(path: Path, rows: int = ROWS) -> Path:
    path.write_bytes(_part_bytes(rows))
    return path


def _fault(path: Path) -> str | None:
    fd = os.open(path, os.O_RDONLY)
    try:
        return page_header_fault(
            lambda offset, size: os.pread(fd, size, offset), pq.read_metadata(path), os.fstat(fd).st_size
        )
    finally:
        os.close(fd)


def _norm_chunk(part: Path | bytes):
    group = pq.read_metadata(pa.BufferReader(part) if isinstance(part, bytes) else part).row_group(0)
    return next(group.column(c) for c in range(group.num_columns) if group.column(c).path_in_schema == "norm")


def _norm_chunk_fault(part: Path, **options) -> tuple[str | None, int]:
    """`chunk_fault` of the part's `norm` column, as its footer describes it (FLOAT: 4 bytes a value)."""
    chunk, data = _norm_chunk(part), part.read_bytes()
    return chunk_fault(
        lambda offset, size: data[offset : offset + size],
        chunk.data_page_offset,
        chunk.total_compressed_size,
        chunk.num_values,
        4,
        chunk.total_uncompressed_size,
        **options,
    )


def test_the_shims_part_passes_and_its_pages_fill_each_chunk(tmp_path):
    part = _part(tmp_path / "part.parquet")
    assert _fault(part) is None
    assert _norm_chunk_fault(part) == (None, 3)


@pytest.mark.parametrize("rows", [1, 3, 5_000])
def test_an_imports_metrics_file_as_the_import_writes_it_passes(tmp_path, rows):
    """An import's ``metrics.parquet`` (polars' writer, its names an Enum of every name logged): a chunk of one
    row still has a dictionary page of every name."""
    import polars as pl

    from sftaudit.imports.writer import _write_columnar

    names = ["epoch", "eval_loss", "grad_norm", "learning_rate"]
    table = pl.DataFrame(
        {
            "seg": pl.Series(np.zeros(rows, np.int32)),
            "step": pl.Series(np.arange(1, rows + 1, dtype=np.int64)),
            "name": pl.Series([names[i % 4] for i in range(rows)], dtype=pl.Enum(names)),
            "value": pl.Series(np.linspace(0.1, 2.0, rows)),
        }
    )
    _write_columnar(tmp_path, "metrics", table)
    assert _fault(tmp_path / "metrics.parquet") is None


def test_an_empty_part_passes(tmp_path):
    """No rows: each column chunk is empty, no page, at offset 0."""
    assert _fault(_part(tmp_path / "part.parquet", rows=0)) is None


def test_a_header_rewritten_at_its_own_claim_still_reads_and_passes(tmp_path):
    """The crafting is faithful: the same header encoded again and padded with an unknown field reads the same
    in pyarrow (so only the claim differs in the lying parts below)."""
    part = _part(tmp_path / "part.parquet")
    before = pq.read_table(part)
    start = _norm_chunk(part).data_page_offset
    honest = parse_struct(part.read_bytes()[start : start + 4096])[0][2]
    lie_in_page_header(part, honest)
    assert pq.read_table(part).equals(before)
    assert _fault(part) is None


@pytest.mark.parametrize("bomb", [False, True], ids=["lie", "bomb"])
def test_a_page_claiming_a_gigabyte_is_a_decompression_bomb(tmp_path, bomb):
    part = _part(tmp_path / "part.parquet")
    lie_in_page_header(part, 1 << 30, bomb=bomb)
    fault = _fault(part)
    assert fault.startswith("norm: the page at byte") and f"claims {1 << 30} bytes uncompressed" in fault
    assert "decompression bomb" in fault and "\n" not in fault


def test_a_page_claiming_a_byte_less_disagrees_with_the_footer(tmp_path):
    part = _part(tmp_path / "part.parquet")
    chunk = _norm_chunk(part)
    start = chunk.data_page_offset
    honest = parse_struct(part.read_bytes()[start : start + 4096])[0][2]
    lie_in_page_header(part, honest - 1)
    assert _fault(part) == (
        f"norm: the pages of the column chunk at byte {start} hold {ROWS} values in "
        f"{chunk.total_uncompressed_size - 1} bytes uncompressed; its footer says {ROWS} in "
        f"{chunk.total_uncompressed_size}"
    )


def test_more_pages_than_the_budget_are_refused(tmp_path):
    fault, pages = _norm_chunk_fault(_part(tmp_path / "part.parquet"), max_pages=2)
    assert pages == 2 and fault.startswith("more than")


def test_ingest_refuses_a_lying_part_in_one_line_naming_it(tmp_path):
    run = recorded_run(tmp_path)
    part = sorted(series_dir(run, 0, 0).glob("part-*.parquet"))[1]
    lie_in_page_header(part, 2**31 - 1)
    with pytest.raises(InputError) as refused:
        ingest(run)
    said = str(refused.value)
    assert said.startswith(f"{part}: norm: the page at byte") and "decompression bomb" in said and "\n" not in said


_FIELDS = st.recursive(
    st.integers(-(2**31), 2**31 - 1),
    lambda inner: st.dictionaries(st.integers(1, 40), inner, max_size=4),
    max_leaves=12,
)


@given(st.dictionaries(st.integers(1, 40), _FIELDS, max_size=6))
@settings(max_examples=200, deadline=None)
def test_parse_struct_reads_back_what_the_compact_protocol_encodes(fields):
    encoded = encode_struct(fields) + b"\x00"
    assert parse_struct(encoded + b"tail") == (fields, len(encoded))


@given(st.binary(max_size=600), st.integers(0, 40), st.integers(0, 700), st.integers(0, 10**6))
@settings(max_examples=500, deadline=None)
def test_the_walk_of_random_bytes_says_one_line_and_stays_in_its_chunk(chunk, before, values, unpacked):
    """Random bytes as a column chunk between other bytes: a fault in one line or none, nothing raised, no byte
    read outside the chunk, every header read parsed within what was read."""
    data = bytes(before) + chunk + b"\xff" * 32
    start, end = before, before + len(chunk)

    def read(offset: int, size: int) -> bytes:
        assert start <= offset and offset + size <= end and size > 0
        return data[offset : offset + size]

    fault, pages = chunk_fault(read, start, len(chunk), values, 4, unpacked, max_pages=64)
    assert fault is None or ("\n" not in fault and fault), fault
    assert pages <= 64


@given(st.binary(max_size=300))
@settings(max_examples=500, deadline=None)
def test_parse_struct_of_random_bytes_raises_only_malformed_header(buf):
    try:
        fields, end = parse_struct(buf)
    except MalformedHeader:
        return
    assert 0 < end <= len(buf) and isinstance(fields, dict)


@given(st.lists(st.tuples(st.integers(0, 52), st.integers(0, 255)), min_size=1, max_size=6))
@example([(0, 28)])  # the page type's field made a struct: CI's first draw of it raised TypeError
@settings(max_examples=300, deadline=None)
def test_a_real_page_header_with_bytes_changed_is_judged_not_raised(changes):
    """The first page header of a real part with a few of its bytes replaced: walked without raising."""
    chunk = _norm_chunk(_part_bytes(100))
    data = bytearray(_part_bytes(100))
    start, end = chunk.data_page_offset, chunk.data_page_offset + chunk.total_compressed_size
    for at, byte in changes:
        data[start + at] = byte

    def read(offset: int, size: int) -> bytes:
        assert start <= offset and offset + size <= end
        return bytes(data[offset : offset + size])

    fault, _ = chunk_fault(read, start, chunk.total_compressed_size, 100, 4, chunk.total_uncompressed_size)
    assert fault is None or "\n" not in fault
