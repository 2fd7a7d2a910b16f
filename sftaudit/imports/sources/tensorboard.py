"""TensorBoard event files of a Trainer run (the optional extra ``sftaudit[tensorboard]``).

The Trainer's ``TensorBoardCallback`` writes, at every log, ``add_scalar(tag, value, global_step)``
with the log's keys renamed by ``rewrite_logs``: ``eval_x`` -> ``eval/x``, everything else ->
``train/x`` (``train/loss``, ``train/grad_norm``, ``train/learning_rate``, ``train/epoch``, and
at the end ``train/train_loss``, ``train/train_runtime``...). Every (re)start opens a new
``events.out.tfevents.*`` file (under ``output_dir/runs/<time>_<host>/`` by default), so a resumed
run's files overlap: the earlier file's steps from the restart on are the branch the resume
abandoned, which the resumed ``trainer_state.json`` no longer holds.

Every event is read (no sampling and no purging of "orphaned" steps, which ``EventAccumulator`` would drop by
default), one file per restart in the order they were started, as tensorboard's ``Event`` protos. The records are
framed here (length, its masked CRC-32C, data, its CRC; tensorboard's own CRC): a record whose CRC fails is skipped
and counted, and reading goes on at the next record (after a damaged length, at the next place a length's CRC holds),
where tensorboard's loader would stop and drop the rest of the file. Values are float32, as the callback stored them.
A Git LFS pointer in place of an event file (a clone without git-lfs) holds no events: it is left out, and the
import names it.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ...core.safe_io import is_lfs_pointer, open_regular
from ..logs import MAX_LOG_BYTES, normalised
from ..source import PLAN_KEYS, LogSource, SourceLog, numbers_only

EVENTS_GLOB = "events.out.tfevents.*"
# A record's frame: its length (8 bytes) and that length's masked CRC (4), then the data and the data's CRC (4).
HEADER, FOOTER = 12, 4
# The first record of every event file: the Event holding `file_version`.
FILE_VERSION = b"brain.Event:"
# The end-of-training log's keys (`Trainer._finalize_training` + `speed_metrics`): a summary, not a step.
SUMMARY = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss"}
# The callback's tag group for `trainer.predict`'s metrics (`test_*` keys).
PREDICTION_GROUPS = {"test"}


class TensorBoardLog(LogSource):
    name = "tensorboard"
    provenance = "imported logs: TensorBoard event files"
    patterns = (f"**/{EVENTS_GLOB}",)
    what = "the TensorBoard event files"
    rank = 20
    needs = ("tensorboard", "sftaudit[tensorboard]")

    def detect(self, path: Path) -> bool:
        """A TFRecord whose length's CRC holds and whose first event names its file version."""
        crc = _crc()
        with open_regular(path) as f:
            head = f.read(HEADER + 64)
        return (
            crc is not None
            and len(head) >= HEADER
            and crc(head[:8]) == struct.unpack("<I", head[8:HEADER])[0]
            and FILE_VERSION in head[HEADER:]
        )

    def read(self, files: list[Path], run_dir: Path) -> SourceLog:
        segments, texts, skipped, records = event_segments(files, run_dir)
        args = texts.get("args", {})
        # The callback's args text is TrainingArguments: the per-device batch size is the state's train_batch_size.
        plan, ignored = numbers_only({**args, "train_batch_size": args.get("per_device_train_batch_size")}, PLAN_KEYS)
        return self.log(
            files,
            run_dir,
            segments=segments,
            plan=plan,
            identity={"config": args, "model_config": texts.get("model_config")},
            skipped=skipped,
            records=records,
            ignored=ignored,
        )


def event_files(run_dir: Path) -> list[Path]:
    """Every file named as an event file in the run folder (a Git LFS pointer too; the import names those)."""
    return sorted(
        p for p in run_dir.rglob(EVENTS_GLOB) if p.is_file() and "sftaudit" not in p.relative_to(run_dir).parts
    )


def records(path: Path, run_dir: Path) -> tuple[Iterator[bytes], list[int]]:
    """The file's records, and (filled as they are read) the count of those skipped: a record whose data fails
    its CRC, or a stretch whose length fails its own (read on from the next place a length's CRC holds and the
    record fits in the file). A last record cut short (a write in progress, a crash) is the end, not a skip."""
    crc = _crc()
    skipped = [0]

    def read() -> Iterator[bytes]:
        with open_regular(path.absolute(), run_dir, MAX_LOG_BYTES) as f:
            size = f.seek(0, 2)
            if size == 0:
                return
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                pos, lost = 0, False
                while pos + HEADER <= size:
                    (length,) = struct.unpack_from("<Q", m, pos)
                    (length_crc,) = struct.unpack_from("<I", m, pos + 8)
                    if crc(m[pos : pos + 8]) != length_crc:
                        skipped[0] += not lost  # one damaged stretch, one skipped record
                        lost, pos = True, pos + 1
                        continue
                    end = pos + HEADER + length + FOOTER
                    if end > size:
                        if lost or pos + HEADER + length > size and _frame_after(m, pos + 1, size, crc):
                            skipped[0] += not lost  # a length beyond the file, with records after it
                            lost, pos = True, pos + 1
                            continue
                        return  # the last record, cut short
                    data = m[pos + HEADER : end - FOOTER]
                    if crc(data) != struct.unpack_from("<I", m, end - FOOTER)[0]:
                        skipped[0] += 1
                    else:
                        yield data
                    pos, lost = end, False

    return read(), skipped


def _frame_after(m: mmap.mmap, start: int, size: int, crc) -> bool:
    """Whether a record frame (a length whose CRC holds, fitting in the file) starts anywhere after `start`."""
    for pos in range(start, size - HEADER + 1):
        (length,) = struct.unpack_from("<Q", m, pos)
        if pos + HEADER + length + FOOTER <= size and crc(m[pos : pos + 8]) == struct.unpack_from("<I", m, pos + 8)[0]:
            return True
    return False


def _crc():
    """tensorboard's masked CRC-32C (None without the extra)."""
    try:
        from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
    except ImportError:
        return None
    return masked_crc32c


def event_segments(
    files: list[Path], run_dir: Path
) -> tuple[list[list[dict[str, Any]]], dict[str, Any], list[dict[str, Any]], int]:
    """One list of log-history entries per start of the run, in start order; the callback's text summaries by name
    (``args``: ``max_steps``, ``num_train_epochs``, ``logging_steps``...; ``model_config``); the records skipped per
    file (``{"file", "lines", "of"}``); the records read. Nothing when tensorboard is not installed. A file whose
    steps do not go back from the files before it continues their start (a final evaluation, the hparams plugin,
    open writers of their own); one that goes back is a restart (a new process, or
    ``trainer.train(resume_from_checkpoint=...)`` again in the same notebook)."""
    files = [p for p in files if not is_lfs_pointer(p)]
    try:
        from tensorboard import data_compat, dataclass_compat
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.util import tensor_util
    except ImportError:
        return [], {}, [], 0
    from google.protobuf.message import DecodeError

    def events(data: bytes, metadata: dict) -> list:
        """The record's event through tensorboard's read-time compat layers (as its `EventFileLoader` does: a
        legacy ``simple_value`` becomes a scalars-plugin tensor)."""
        return dataclass_compat.migrate_event(data_compat.migrate_event(Event.FromString(data)), metadata)

    per_file = []
    texts: dict[str, dict[str, Any]] = {}
    skipped_per_file, total = [], 0
    for path in files:
        entries: dict[tuple[int, str], dict[str, Any]] = {}
        first_time = None
        stream, skipped = records(path, run_dir)
        read = 0
        metadata: dict = {}
        for data in stream:
            read += 1
            try:
                migrated = events(data, metadata)
            except DecodeError:
                skipped[0] += 1
                continue
            for event in migrated:
                first_time = event.wall_time if first_time is None else first_time
                _add_values(event, entries, texts, tensor_util)
        total += read + skipped[0]
        if skipped[0]:
            skipped_per_file.append(
                {"file": str(path.relative_to(run_dir)), "lines": skipped[0], "of": read + skipped[0]}
            )
        if entries:
            per_file.append((first_time, entries))
    starts: list[dict[tuple[int, str], dict[str, Any]]] = []
    for _, entries in sorted(per_file, key=lambda f: f[0]):
        if starts and min(k[0] for k in entries) >= max(k[0] for k in starts[-1]):
            for key, entry in entries.items():
                starts[-1].setdefault(key, {}).update(entry)
        else:
            starts.append(dict(entries))
    segments = [sorted((normalised(e) for e in s.values()), key=lambda e: e["step"]) for s in starts]
    return segments, texts, skipped_per_file, total


def _add_values(event, entries: dict[tuple[int, str], dict[str, Any]], texts: dict[str, Any], tensor_util) -> None:
    """An event's scalars into the step's entry of their kind (train, eval, summary); the callback's texts."""
    for value in event.summary.value:
        plugin = value.metadata.plugin_data.plugin_name
        if plugin == "text" and value.tag.partition("/")[0] in ("args", "model_config"):
            texts[value.tag.partition("/")[0]] = _json_text(tensor_util.make_ndarray(value.tensor)) or {}
        if plugin != "scalars":
            continue  # text (the run's args) and anything else that is not a logged number
        # An untagged scalar ("loss", "lr": a SummaryWriter of one's own) is a training log's, and so is
        # one in a group of its own ("rewards/chosen" written directly), under its whole tag.
        group, _, key = value.tag.partition("/") if "/" in value.tag else ("train", "", value.tag)
        if group == "eval":
            kind, key = "eval", f"eval_{key}"
        elif group == "train":
            kind = "summary" if key in SUMMARY else "train"
        elif group in PREDICTION_GROUPS:
            continue  # `trainer.predict` after training: no training step
        else:
            kind, key = "train", value.tag
        entry = entries.setdefault((event.step, kind), {"step": event.step})
        entry[key] = float(tensor_util.make_ndarray(value.tensor).item())


def _json_text(array: Any) -> dict[str, Any] | None:
    try:
        text = array.reshape(-1)[0]
        value = json.loads(text.decode("utf-8") if isinstance(text, bytes) else str(text))
    except (ValueError, IndexError, UnicodeDecodeError, AttributeError):
        return None
    return value if isinstance(value, dict) else None
