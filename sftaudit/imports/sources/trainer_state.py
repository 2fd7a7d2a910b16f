"""The Hugging Face Trainer's ``trainer_state.json``: its ``log_history`` (every log since the run began, as the
branch that saved it ran), its plan (``max_steps``, ``num_train_epochs``, ``logging_steps``, ``eval_steps``,
``save_steps``, ``train_batch_size``) and its other fields (``global_step``, ``best_metric``,
``stateful_callbacks``...). One is saved with every checkpoint and one at the top of the output when training ends:
the Trainer output importer reads them all and tells the runs and branches of the folder apart by what they hold.

A per-step log of a long run is large (10^6 entries: hundreds of MB to GBs, in every checkpoint), so a state is
read as a stream, a chunk of the file in memory after a size check: the log entries wholly in the chunk decoded
together by orjson (`decoded_entries`), any other value (a field, an entry cut by the chunk's end) one at a time by
the standard library's decoder (ijson cannot read the ``NaN`` and ``Infinity`` the Trainer writes for a non-finite
loss, and DuckDB's JSON reader holds the whole object, several times its size: 3 s and 1.2 GB for 10^6 entries). The states of one
output mostly repeat each other: an older checkpoint's log is the newer one's beginning, byte for byte, as the
Trainer writes them. So the largest state is read whole and each other one is compared with it byte by byte, its
log taken as the largest one's first entries where it is their exact copy (read in full only where it is not).
"""

from __future__ import annotations

import bisect
import codecs
import contextlib
import json
import re
from array import array
from collections import deque
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from ...core.safe_io import head, open_regular
from ...errors import InputError
from ..logs import MAX_LOG_BYTES, all_normalised, is_step, normalised
from ..source import LogSource, SourceLog, numbers_only

TRAINER_STATE = "trainer_state.json"
# The state's fields that are its plan, in the Trainer's names.
PLAN_FIELDS = ("max_steps", "num_train_epochs", "logging_steps", "eval_steps", "save_steps", "train_batch_size")
# How far into the file the detection looks for the state's own keys (the Trainer sorts them: a few scalars first).
DETECT_BYTES = 1 << 16
# Read this much of a state at a time; one value (a log entry, a field) larger than MAX_VALUE_BYTES is refused.
CHUNK_BYTES = 1 << 23
MAX_VALUE_BYTES = 1 << 26
_SPACE = re.compile(r"[ \t\n\r]*")
_SPACE_BYTES = b" \t\n\r"
_ENTRY_MEET = re.compile(r"\}[ \t\n\r]*,[ \t\n\r]*(?=\{)")  # the end of an object, the next one's start


_NON_FINITE = re.compile(r"-?Infinity|NaN")


def decoded_entries(text: str, decoder: json.JSONDecoder) -> list[Any]:
    """The JSON values of `text`, a comma-separated run of them, as the standard library's decoder gives them,
    decoded by orjson (three times faster) where it can: the ``NaN`` and ``Infinity`` the Trainer writes, which
    strict JSON lacks, read as text spelling them (which `normalised` reads as the number); a bare one inside a
    string breaks the text and sends it to the standard decoder, as does anything else orjson refuses."""
    try:
        return orjson.loads("[" + text + "]")
    except orjson.JSONDecodeError:
        pass
    if "NaN" in text or "Infinity" in text:  # searched only where orjson refused: most logs hold neither
        with contextlib.suppress(orjson.JSONDecodeError):
            return orjson.loads("[" + _NON_FINITE.sub(lambda m: '"' + m.group() + '"', text) + "]")
    return decoder.decode("[" + text + "]")


class TrainerState(LogSource):
    name = "trainer_state"
    provenance = "imported logs: trainer_state.json"
    patterns = (TRAINER_STATE, f"*/{TRAINER_STATE}")
    what = TRAINER_STATE
    rank = None  # one per checkpoint: the Trainer output importer reads every one and compares them

    def detect(self, path: Path) -> bool:
        """A JSON object whose first keys include the Trainer state's ``log_history`` or ``global_step``."""
        text = head(path, DETECT_BYTES).lstrip()
        return text[:1] == b"{" and (b'"log_history"' in text or b'"global_step"' in text)

    def read(self, files: list[Path], run_dir: Path) -> SourceLog:
        """One state file: its history as the one segment, its plan and its other fields. Raises `InputError` when
        it is not a readable state (a save cut short, a file that is not JSON, one nested too deeply)."""
        return self._log(files[0], run_dir, _read(files[0], run_dir))

    def read_all(self, files: list[Path], run_dir: Path) -> list[SourceLog | InputError]:
        """Every state of an output, each as `read` gives it (or the error refusing it): the largest read in full,
        each other one compared with it byte by byte and read in full only where its log is not the largest one's
        beginning."""
        sizes = {}
        for path in files:
            try:
                sizes[path] = regular_size(path, run_dir)
            except InputError:
                sizes[path] = -1
        order = sorted(files, key=lambda p: -sizes[p])
        out: dict[Path, SourceLog | InputError] = {}
        reference: _Read | None = None
        for path in order:
            try:
                read = _read(path, run_dir, reference)
            except InputError as exc:
                out[path] = exc
                continue
            reference = reference or read
            out[path] = self._log(path, run_dir, read)
        return [out[p] for p in files]

    def _log(self, path: Path, run_dir: Path, read: _Read) -> SourceLog:
        plan, ignored = numbers_only(read.fields, (*PLAN_FIELDS, "global_step"))
        return self.log(
            [path],
            run_dir,
            segments=[read.history],
            plan={k: v for k, v in plan.items() if k != "global_step"},
            fields={k: v for k, v in read.fields.items() if k not in ignored},
            records=read.records,
            ignored=ignored,
        )


def regular_size(path: Path, run_dir: Path) -> int:
    with open_regular(path.absolute(), run_dir, MAX_LOG_BYTES) as f:
        return f.seek(0, 2)


class _Read:
    """A state as read: its fields but the log, the log's entries (normalised; those whose step is no integer left
    out), how many entries the log held, and where the log lies in the file (bytes, while the file is ASCII, as
    the Trainer writes it): the offset of its ``[``, and the entries' ends relative to it a span at a time (a batch
    decoded together, or one entry): where the span's text begins and ends, and how many entries and history entries
    the spans through it gave. A batch's own entry ends are found only where another state shares part of it."""

    def __init__(self) -> None:
        self.fields: dict[str, Any] = {}
        self.history: list[dict[str, Any]] = []
        self.records = 0
        self.path: Path | None = None
        self.start: int | None = None
        self.span_starts = array("q")
        self.span_ends = array("q")
        self.span_records = array("q")
        self.span_kept = array("q")

    def spanned(self, start: int, end: int) -> None:
        """The entries read since the last span, their text from `start` to `end` (relative to the log's ``[``)."""
        self.span_starts.append(start)
        self.span_ends.append(end)
        self.span_records.append(self.records)
        self.span_kept.append(len(self.history))

    def entries_within(self, size: int) -> tuple[int, int, int] | None:
        """Of the log's first `size` bytes: (the entries wholly within them, the history entries those gave, the
        offset of the last one's end; 1, past the ``[``, for none). A batch cut by `size` is read again from the file
        for its entries' ends (a batch's entries are each kept: `_Stream.batch`); None when its text is not that
        batch's entries as decoded."""
        b = bisect.bisect_right(self.span_ends, size)
        records, kept = (self.span_records[b - 1], self.span_kept[b - 1]) if b else (0, 0)
        end = self.span_ends[b - 1] if b else 1
        if b == len(self.span_ends) or self.span_records[b] - records < 2 or self.span_starts[b] >= size:
            return records, kept, end
        with open_regular(self.path.absolute()) as f:
            f.seek(self.start + self.span_starts[b])
            text = f.read(self.span_ends[b] - self.span_starts[b]).decode("ascii", "replace")
        meets = [self.span_starts[b] + m.start() + 1 for m in _ENTRY_MEET.finditer(text)]
        if len(meets) != self.span_records[b] - records - 1:  # a string holding where entries meet: not its ends
            return None
        inside = bisect.bisect_right(meets, size)
        return (records + inside, kept + inside, meets[inside - 1]) if inside else (records, kept, end)


def _read(path: Path, run_dir: Path, reference: _Read | None = None) -> _Read:
    try:
        with open_regular(path.absolute(), run_dir, MAX_LOG_BYTES) as f:
            return _Stream(f, path, reference).state()
    except RecursionError:
        raise InputError(f"{path}: not a readable trainer state (nested too deeply)") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not a readable trainer state (not UTF-8: {exc.reason})") from None


class _Stream:
    """A state file read a value at a time with the standard library's decoder, a chunk of the file in memory."""

    def __init__(self, f: BinaryIO, path: Path, reference: _Read | None):
        self.f, self.path, self.reference = f, path, reference
        self.decoder = json.JSONDecoder()
        self.utf8 = codecs.getincrementaldecoder("utf-8")()
        self.buf, self.pos, self.base, self.eof, self.ascii = "", 0, 0, False, True
        self.batched = False  # whether `batch` was tried on this chunk

    def state(self) -> _Read:
        read = _Read()
        read.path = self.path
        self.expect("{")
        if self.peek() == "}":
            self.pos += 1
        else:
            while True:
                key = self.value()
                if not isinstance(key, str):
                    self.fail("a key that is not text")
                self.expect(":")
                if key == "log_history" and self.peek() == "[":
                    self.log(read)
                else:
                    read.fields[key] = self.value()
                separator = self.next_char()
                if separator == "}":
                    break
                if separator != ",":
                    self.fail("no comma between fields" if separator else "the file is cut short")
        if self.peek() != "":
            self.fail("more after the state's end")
        if read.start is None:
            raise InputError(f"{self.path}: not a trainer state (no log_history list)")
        return read

    def log(self, read: _Read) -> None:
        """The log's entries: copied from the reference where the file repeats its beginning, else decoded."""
        read.start = self.offset()
        self.pos += 1  # the "["
        if self.reference is not None and read.start is not None and self.reference.start is not None:
            if self.copied(read):
                return
        raw = self.decoder.raw_decode
        if self.peek() == "]":
            self.pos += 1
            return
        while True:
            if self.peek() == "{" and self.batch(read):
                separator = self.next_char()
                if separator == "]":
                    return
                if separator != ",":
                    self.fail("no comma between log entries" if separator else "the file is cut short")
                continue
            while True:  # one entry, the chunk refilled while it is cut short
                try:
                    entry, end = raw(self.buf, self.pos)
                    break
                except json.JSONDecodeError:
                    if not self.fill():
                        self.fail("a log entry cut short")
            self.pos = end
            self.took(read, entry, end)
            separator = self.next_char()
            if separator == "]":
                return
            if separator != ",":
                self.fail("no comma between log entries" if separator else "the file is cut short")

    def took(self, read: _Read, entry: Any, end: int) -> None:
        """One log entry decoded, ending at `end` in the buffer."""
        read.records += 1
        if type(entry) is dict and is_step(entry.get("step")):
            read.history.append(normalised(entry))
        if read.start is not None and self.ascii:
            read.spanned(self.base + end - read.start, self.base + end - read.start)

    def batch(self, read: _Read) -> bool:
        """The log entries wholly in the buffer decoded in one call, when they are all objects: up to the last place
        where ``}`` meets ``,`` and ``{``, a place in a string or within an entry leaving text that does not decode
        (a string or a bracket left open). Their ends are found one by one only where one is not kept as it is.
        False (nothing taken) otherwise: each of them is then decoded alone."""
        if self.batched:  # once a chunk: text that fails it is read an entry at a time, not scanned again
            return False
        self.batched = True
        cut = _last_meet(self.buf, self.pos)
        if cut is None:
            return False
        text = self.buf[self.pos : cut]
        try:
            entries = decoded_entries(text, self.decoder)
        except (json.JSONDecodeError, RecursionError):  # one level deeper than the entries alone
            return False
        if not entries or set(map(type, entries)) != {dict}:
            return False
        offset = self.base - read.start if read.start is not None and self.ascii else None
        history = read.history
        if all_normalised(entries):  # a per-step log's: each kept as it is, one span
            history.extend(entries)
            read.records += len(entries)
            if offset is not None:
                read.spanned(offset + self.pos, offset + cut)
        else:
            meets = [self.pos + m.start() + 1 for m in _ENTRY_MEET.finditer(text)] + [cut]
            if len(meets) != len(entries):  # a string holding where entries meet: each entry decoded alone
                return False
            for entry, end in zip(entries, meets):
                read.records += 1
                if is_step(entry.get("step")):
                    history.append(normalised(entry))
                if offset is not None:
                    read.spanned(offset + end, offset + end)
        self.pos = cut
        return True

    def copied(self, read: _Read) -> bool:
        """Whether this file's log is the reference's first entries, byte for byte: then they are taken from it and
        the stream goes on past the log's ``]``; else the file is left where the stream had read it."""
        ref = self.reference
        same = _common_prefix(self.f, read.start, ref.path, ref.start)  # from the log's "[" on
        within = ref.entries_within(same)  # the reference's entries wholly within the bytes they share
        if within is None:
            self.f.seek(self.base + len(self.buf))
            return False
        count, kept, end = within
        edge = read.start + end
        self.f.seek(edge)
        after = self.f.read(4096)
        rest = after.lstrip(_SPACE_BYTES)
        if rest[:1] != b"]":  # it goes on otherwise (another branch of the run): read in full
            self.f.seek(self.base + len(self.buf))  # (ASCII so far: a character is a byte)
            return False
        self.base = edge + len(after) - len(rest) + 1
        self.f.seek(self.base)
        self.buf, self.pos = "", 0
        read.history = ref.history[:kept]
        read.records = count
        return True

    # -- the stream

    def fill(self) -> bool:
        """More of the file into the buffer (what was consumed dropped); False at its end."""
        if self.eof:
            return False
        data = self.f.read(CHUNK_BYTES)
        self.eof = not data
        text = self.utf8.decode(data, final=self.eof)
        self.ascii = self.ascii and text.isascii()
        self.base += self.pos
        self.buf, self.pos, self.batched = self.buf[self.pos :] + text, 0, False
        if len(self.buf) > MAX_VALUE_BYTES + CHUNK_BYTES:
            raise InputError(f"{self.path}: a value of more than {MAX_VALUE_BYTES >> 20} MB; not a trainer state")
        return True

    def peek(self) -> str:
        """The next character that is not white space ("" at the end of the file)."""
        while True:
            self.pos = _SPACE.match(self.buf, self.pos).end()
            if self.pos < len(self.buf) or not self.fill():
                return self.buf[self.pos : self.pos + 1]

    def next_char(self) -> str:
        char = self.peek()
        self.pos += 1
        return char

    def expect(self, char: str) -> None:
        if self.next_char() != char:
            self.fail(f"no {char!r} where the state needs one")

    def value(self) -> Any:
        """The next JSON value (a number at the buffer's end is read again with more: it may go on)."""
        self.peek()
        while True:
            try:
                value, end = self.decoder.raw_decode(self.buf, self.pos)
                if end < len(self.buf) or self.eof:
                    self.pos = end
                    return value
            except json.JSONDecodeError:
                if self.eof:
                    self.fail("not JSON")
            self.fill()

    def offset(self) -> int | None:
        """The byte offset of the stream's position (None once the file held anything but ASCII)."""
        return self.base + self.pos if self.ascii else None

    def fail(self, what: str) -> None:
        where = f" at byte {self.base + self.pos:,}" if self.ascii else ""
        raise InputError(f"{self.path}: not a readable trainer state ({what}{where})")


def _last_meet(text: str, pos: int) -> int | None:
    """The end of the last object in `text` from `pos` on that a ``,`` and another ``{`` follow (searched from the
    end, a window widened until one is found)."""
    window = 1 << 16
    while True:
        start = max(pos, len(text) - window)
        if last := deque(_ENTRY_MEET.finditer(text, start), maxlen=1):
            return last[0].start() + 1
        if start == pos:
            return None
        window *= 8


def _common_prefix(f: BinaryIO, start: int, other: Path, other_start: int) -> int:
    """How many bytes from `start` in `f` equal those from `other_start` in the file `other` (a block at a time,
    compared in C)."""
    block = 1 << 20
    f.seek(start)
    with open_regular(other.absolute()) as g:
        g.seek(other_start)
        same = 0
        while True:
            a, b = f.read(block), g.read(block)
            if a == b and a:
                same += len(a)
                continue
            low, high = 0, min(len(a), len(b))  # the first differing byte of the two blocks, by bisection
            while low < high:
                mid = (low + high + 1) // 2
                if a[:mid] == b[:mid]:
                    low = mid
                else:
                    high = mid - 1
            return same + low
