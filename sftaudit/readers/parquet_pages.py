"""The page headers of a Parquet file, walked before any page is read: a footer can be honest while a page
header lies about its sizes, and a reader allocates what the header claims before it decompresses (a 0.5 MB
part whose one page claims 1 GB of zeros, its payload a zstd frame of them, takes pyarrow and DuckDB to 1.1 GB:
benchmarks/page_header_bomb.py).

Each column chunk's pages are walked from its offset in the footer: each header is parsed with a bounded
reader of Thrift's compact protocol (the format's own encoding of ``PageHeader``), a few kilobytes read per
page, within the chunk only, and its sizes are held against the footer's: the pages must fill the chunk
exactly, say as many values and as many bytes uncompressed as the footer does, and no page may claim more
bytes than its values take in their physical type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# A page header of the shim's (numbers, their statistics included) takes about 60 bytes; one claiming more than
# this is not read further. A part may hold no more pages than this (the shim writes about 4 per column and
# 10,000 steps: pyarrow starts a page every 20,000 values).
MAX_HEADER_BYTES = 4096
MAX_PART_PAGES = 4096
# Thrift structs nest this deep at most in a page header (PageHeader > DataPageHeader > Statistics).
_MAX_DEPTH = 8

# Parquet's page types (parquet.thrift `PageType`) and the field of PageHeader that holds each one's header.
_DATA_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2 = 0, 2, 3
_PAGE_TYPE_HEADER = {_DATA_PAGE: 5, _DICTIONARY_PAGE: 7, _DATA_PAGE_V2: 8}
# Bytes a value takes in each physical type; a BYTE_ARRAY's is unbounded (its pages are bounded by the chunk's).
_VALUE_BYTES = {"BOOLEAN": 1, "INT32": 4, "FLOAT": 4, "INT64": 8, "DOUBLE": 8, "INT96": 12}
# What a page may take beyond its values' bytes: its definition levels (at most a byte a value as pyarrow and
# DuckDB encode them, an eighth of that in practice) and a delta encoding's block headers, plus a few bytes.
_LEVEL_BYTES_PER_VALUE, _PAGE_SLACK_BYTES = 1, 64


class MalformedHeader(Exception):
    """A page header that is no compact-protocol struct within its bytes (caught inside this module)."""


def parse_struct(buf: bytes, pos: int = 0, depth: int = 0) -> tuple[dict[int, Any], int]:
    """The compact-protocol struct at `pos` of `buf`: its integer fields (by field id) and nested structs
    (dicts); booleans, doubles, binaries and containers are skipped. Returns (the fields, where the struct
    ends). Raises MalformedHeader on anything that overruns `buf`, nests too deep or is no compact type.
    (Integers and binaries are read inline, an overrun caught as IndexError: a part's few dozen headers are
    most of the walk's time.)"""
    if depth > _MAX_DEPTH:
        raise MalformedHeader("structs nested too deep")
    fields: dict[int, Any] = {}
    field = 0
    try:
        while True:
            byte = buf[pos]
            pos += 1
            if byte == 0:  # STOP
                return fields, pos
            kind = byte & 0x0F
            if byte > 0x0F:  # the field id as a delta from the last one's
                field += byte >> 4
            else:
                field, pos = _varint(buf, pos)
                field = _unzigzag(field)
            if kind in (4, 5, 6, 8):  # i16, i32, i64 (zigzag varints), binary (a varint length, then its bytes)
                value = buf[pos]
                pos += 1
                if value > 0x7F:
                    value &= 0x7F
                    shift = 7
                    while True:
                        byte = buf[pos]
                        pos += 1
                        value |= (byte & 0x7F) << shift
                        if byte < 0x80:
                            break
                        shift += 7
                        if shift > 63:
                            raise MalformedHeader("a varint longer than 10 bytes")
                if kind == 8:
                    pos += value
                    if pos > len(buf):
                        raise MalformedHeader("cut short")
                else:
                    fields[field] = (value >> 1) ^ -(value & 1)
            elif kind == 12:
                fields[field], pos = parse_struct(buf, pos, depth + 1)
            elif kind > 2:  # booleans hold their value in the field's type
                pos = _skip(buf, pos, kind, depth)
    except IndexError:
        raise MalformedHeader("cut short") from None


def _skip(buf: bytes, pos: int, kind: int, depth: int) -> int:
    """Past one value of compact type `kind` (every value takes at least a byte: a container's elements are
    bounded by the buffer's length)."""
    if kind in (1, 2, 3):  # a boolean as a container's element, a byte
        return _byte(buf, pos)[1]
    if kind in (4, 5, 6):
        return _varint(buf, pos)[1]
    if kind == 7:  # double
        return _end(buf, pos, 8)
    if kind == 8:  # binary: its length, then its bytes
        size, pos = _varint(buf, pos)
        return _end(buf, pos, size)
    if kind == 12:
        return parse_struct(buf, pos, depth + 1)[1]
    if kind in (9, 10):  # list, set: size and element type in a byte (size 15: a varint follows)
        byte, pos = _byte(buf, pos)
        size, element = byte >> 4, byte & 0x0F
        if size == 15:
            size, pos = _varint(buf, pos)
        return _skip_values(buf, pos, [element] * min(size, len(buf)), size, depth)
    if kind == 11:  # map: its size as a varint, then (if any) the key and value types in a byte
        size, pos = _varint(buf, pos)
        if not size:
            return pos
        byte, pos = _byte(buf, pos)
        return _skip_values(buf, pos, [byte >> 4, byte & 0x0F] * min(size, len(buf)), 2 * size, depth)
    raise MalformedHeader(f"no compact type {kind}")


def _skip_values(buf: bytes, pos: int, kinds: list[int], count: int, depth: int) -> int:
    if count > len(buf) - pos:  # each value takes a byte at least
        raise MalformedHeader("a container longer than its header")
    if depth >= _MAX_DEPTH:
        raise MalformedHeader("containers nested too deep")
    for kind in kinds:
        pos = _skip(buf, pos, kind, depth + 1)
    return pos


def _byte(buf: bytes, pos: int) -> tuple[int, int]:
    if pos >= len(buf):
        raise MalformedHeader("cut short")
    return buf[pos], pos + 1


def _end(buf: bytes, pos: int, size: int) -> int:
    if size > len(buf) - pos:
        raise MalformedHeader("cut short")
    return pos + size


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    for end in range(pos, min(pos + 10, len(buf))):
        value |= (buf[end] & 0x7F) << shift
        if buf[end] < 0x80:
            return value, end + 1
        shift += 7
    raise MalformedHeader("a varint cut short or longer than 10 bytes")


def _unzigzag(value: int) -> int:
    return (value >> 1) ^ -(value & 1)


def chunk_fault(
    read: Callable[[int, int], bytes],
    start: int,
    length: int,
    values: int,
    value_bytes: int | None,
    unpacked: int,
    max_pages: int = MAX_PART_PAGES,
) -> tuple[str | None, int]:
    """What is wrong with the page headers of the column chunk of `length` bytes at `start` (None: nothing),
    which the footer says holds `values` values (`value_bytes` each; None: unbounded) in `unpacked` bytes
    uncompressed, headers included; and the pages walked. `read(offset, size)` reads the file; it is never
    asked for a byte outside the chunk, nor for more than `max_pages` headers."""
    pos, end = start, start + length
    seen_values = seen_unpacked = pages = 0
    while pos < end:
        if pages == max_pages:
            return f"more than {MAX_PART_PAGES} pages in a part", pages
        pages += 1
        try:
            header, size = parse_struct(read(pos, min(MAX_HEADER_BYTES, end - pos)))
        except MalformedHeader as exc:
            return f"the page header at byte {pos} is not one ({exc})", pages
        kind, unpacked_page, packed = header.get(1), header.get(2), header.get(3)
        # Any field may hold a struct where an integer belongs (a byte of its type changed): not a page type.
        page = header.get(_PAGE_TYPE_HEADER.get(kind, -1)) if isinstance(kind, int) else None
        page_values = page.get(1) if isinstance(page, dict) else None
        if not (isinstance(unpacked_page, int) and isinstance(packed, int) and isinstance(page_values, int)):
            return f"the page header at byte {pos} lacks its type, sizes or values", pages
        # A dictionary may list more values than the chunk holds (an import's names are an Enum: every name, in a
        # chunk of one row); no page unpacks to more than the whole chunk.
        most_values = page_values if kind == _DICTIONARY_PAGE else values
        if not (0 <= packed <= end - pos - size and 0 <= page_values <= most_values):
            return (
                f"the page at byte {pos} claims {packed} bytes and {page_values} values, past its column chunk",
                pages,
            )
        bound = unpacked if value_bytes is None else min(unpacked, page_values * (value_bytes + _LEVEL_BYTES_PER_VALUE))
        if not 0 <= unpacked_page <= bound + _PAGE_SLACK_BYTES:
            return (
                f"the page at byte {pos} claims {unpacked_page} bytes uncompressed for {page_values} values "
                "(a decompression bomb)",
                pages,
            )
        if kind != _DICTIONARY_PAGE:
            seen_values += page_values
        seen_unpacked += size + unpacked_page
        pos += size + packed
    if (seen_values, seen_unpacked) != (values, unpacked):
        return (
            f"the pages of the column chunk at byte {start} hold {seen_values} values in {seen_unpacked} bytes "
            f"uncompressed; its footer says {values} in {unpacked}",
            pages,
        )
    return None, pages


def page_header_fault(read: Callable[[int, int], bytes], metadata: Any, file_size: int) -> str | None:
    """What is wrong with the page headers of a Parquet file (None: nothing) whose footer, a pyarrow
    ``FileMetaData``, is parsed: each column chunk must lie between the file's header and footer and its pages
    agree with it (`chunk_fault`). Reads a few kilobytes a page, MAX_PART_PAGES pages at most."""
    data_end = file_size - 8 - metadata.serialized_size
    pages_left = MAX_PART_PAGES
    for g in range(metadata.num_row_groups):
        group = metadata.row_group(g)
        for c in range(group.num_columns):
            chunk = group.column(c)
            start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
            length = chunk.total_compressed_size
            if not (0 <= length <= data_end - start and (4 <= start or length == 0)):  # (an empty chunk: at 0)
                return f"the column chunk of {chunk.path_in_schema} at byte {start} lies outside the file's data"
            if chunk.num_values != group.num_rows:  # the shim's columns are flat: a value a row
                return (
                    f"the column chunk of {chunk.path_in_schema} holds {chunk.num_values} values in "
                    f"{group.num_rows} rows"
                )
            fault, pages = chunk_fault(
                read,
                start,
                length,
                chunk.num_values,
                _VALUE_BYTES.get(chunk.physical_type),
                chunk.total_uncompressed_size,
                pages_left,
            )
            if fault:
                return f"{chunk.path_in_schema}: {fault}"
            pages_left -= pages
    return None
