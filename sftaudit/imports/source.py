"""What a log source is: one kind of training log (a Trainer state, LLaMA-Factory's trainer_log.jsonl, TensorBoard
event files, ...) read into the shape the Trainer's own ``log_history`` has, so that one importer and one writer turn
every source into the same artifacts.

A source is a `LogSource` subclass in its own module of `sftaudit.imports.sources` (the registry finds it). It says
its ``name`` (what ``--source NAME`` calls it), its ``provenance`` (what the verdict says the evidence came from),
where its files lie in a run folder (``patterns``), how to tell one of its files by content (`LogSource.detect`), and
reads them (`LogSource.read`) into a `SourceLog`.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, ClassVar

# The plan a source may record, in the Trainer's names: what the run was asked to do.
PLAN_KEYS = (
    "max_steps",
    "num_train_epochs",
    "logging_steps",
    "eval_steps",
    "save_steps",
    "warmup_steps",
    "learning_rate",
    "train_batch_size",
)


@dataclasses.dataclass
class SourceLog:
    """What a source read from one run's files (`LogSource.log` fills in the source's own attributes).

    ``segments``: the run's logged series, one list per (re)start in start order, each entry shaped as a
    ``log_history`` entry (``step``, ``loss``, ``learning_rate``, ``grad_norm``, ``eval_*`` and every other logged
    number under its own name, as floats). ``plan``: the `PLAN_KEYS` the source recorded (absent: not recorded).
    ``identity``: the run's name or id and its configuration (``config``: the arguments; ``model_config``).
    ``fields``: a Trainer state's other fields (``best_metric``, ``stateful_callbacks``, ...). ``lacks``: evidence this
    source cannot hold, {kind: why, in words}, the kinds from `schema.records.LACKS` (never a check's code). ``skipped``: records that could not be read and were skipped,
    ``{"file", "lines", "of"}`` per file (the evidence coverage counts them). ``records``: how many records (lines,
    events) the files held, logged numbers or not. ``ignored``: values of the plan (or of the Trainer state's
    ``global_step``) that are no number where one belongs (NaN, Infinity, text, a list), {field: the value as
    written}: left out, and said in the notes."""

    source: str
    provenance: str
    what: str
    files: list[str]
    segments: list[list[dict[str, Any]]]
    plan: dict[str, Any] = dataclasses.field(default_factory=dict)
    identity: dict[str, Any] = dataclasses.field(default_factory=dict)
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)
    lacks: dict[str, str] = dataclasses.field(default_factory=dict)
    skipped: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    records: int = 0
    ignored: dict[str, str] = dataclasses.field(default_factory=dict)


def numbers_only(raw: dict[str, Any], keys: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, str]]:
    """The `keys` of `raw` whose value is a finite number (a 64-bit integer, or a float that is finite), and the others
    that hold something else ({key: the value as written, shortened}); a key absent or null is neither."""
    kept, ignored = {}, {}
    for key in keys:
        value = raw.get(key)
        if value is None:
            continue
        if (type(value) is int and -(2**63) <= value < 2**63) or (type(value) is float and math.isfinite(value)):
            kept[key] = value
        else:
            ignored[key] = repr(value)[:40]
    return kept, ignored


class LogSource:
    """One kind of training log. Subclasses set the class attributes and implement `detect` and `read`."""

    name: ClassVar[str]
    provenance: ClassVar[str]
    # Where its files lie in a run folder (globs relative to it), checked by content before they are read.
    patterns: ClassVar[tuple[str, ...]]
    # How the import's notes name its files ("trainer_log.jsonl", "the TensorBoard event files").
    what: ClassVar[str]
    # Of the logs kept per (re)start found in one folder, the one of the lowest rank is read (the most complete).
    # None: not a log kept per restart but a state saved with each checkpoint (the Trainer's), read by the Trainer
    # output importer itself.
    rank: ClassVar[int | None]
    # A module the source needs beyond sftaudit's own dependencies, and the extra that installs it.
    needs: ClassVar[tuple[str, str] | None] = None
    # Why a run read from this source may have logged no gradient norm: said (the `grad_norm` kind of `lacks`) when
    # it logged entries and none holds one. None: the source records whether the norm was logged some other way.
    no_grad_norm: ClassVar[str | None] = None

    def detect(self, path: Path) -> bool:
        """Whether `path` (a regular file inside the run folder) is one of this source's, by its content."""
        raise NotImplementedError

    def read(self, files: list[Path], run_dir: Path) -> SourceLog:
        """Read the source's `files` (regular files inside `run_dir`, in the order found). Raises
        `sftaudit.errors.InputError` with one line for a file it must refuse (too large, not its format)."""
        raise NotImplementedError

    def log(self, files: list[Path], run_dir: Path, segments: list[list[dict[str, Any]]], **read: Any) -> SourceLog:
        """What `read` returns: the source's name, provenance and files, with what it read (and, for a source that
        says why a run may log none, the gradient norm lacking when no entry holds one)."""
        if self.no_grad_norm and segments and not any("grad_norm" in e for seg in segments for e in seg):
            read["lacks"] = {**read.get("lacks", {}), "grad_norm": self.no_grad_norm}
        return SourceLog(
            source=self.name,
            provenance=self.provenance,
            what=self.what,
            files=[str(p.relative_to(run_dir)) for p in files],
            segments=segments,
            **read,
        )
