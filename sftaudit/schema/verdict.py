"""verdict.json, declared once: the run's verdict and its parts as typed records.

`attribution.build_verdict` builds a `Verdict`; the audit stores `Verdict.to_dict()` and every reader loads it back
with `Verdict.from_dict`. ``verdict.schema.json`` is generated from these types (`scripts/gen_verdict_schema.py`;
a test fails when it drifts): never edit it by hand. Within one `schema_version` fields may be added (at the end of
their record, so the bytes of what was there stay the same), none removed or retyped.

A field's `description` (dataclass field metadata) is what the schema says about it. A field whose metadata has
`omit_none` is left out of the JSON while it is None (it was added to the verdict after others read it).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from .findings import Finding, described

VerdictValue = Literal["pass", "warn", "fail", "unjudged"]
CheckpointValue = Literal["pass", "warn", "fail"]
CoverageStatus = Literal["ran", "partial", "not_run", "disabled", "error"]


class Record:
    """Dataclass records that read and write their JSON shape: fields in declaration order, nested records and
    findings by their own `to_dict`/`from_dict`, everything else as it is."""

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is None and f.metadata.get("omit_none"):
                continue
            out[f.name] = _to_json(value)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Any:
        hints = _hints(cls)
        values = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name in data:
                values[f.name] = _from_json(hints[f.name], data[f.name])
        return cls(**values)


def _to_json(value: Any) -> Any:
    if isinstance(value, (Record, Finding)):
        return value.to_dict()
    if isinstance(value, list):
        return [_to_json(v) for v in value]
    return value


def _from_json(hint: Any, value: Any) -> Any:
    """`value` read as `hint` says: records and findings built, lists of them too, the rest as stored."""
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(hint) if a is not type(None)]
        return _from_json(kinds[0], value) if len(kinds) == 1 else value
    if origin is list:
        (item,) = typing.get_args(hint)
        return [_from_json(item, v) for v in value]
    if isinstance(hint, type) and issubclass(hint, (Record, Finding)):
        return hint.from_dict(value)
    return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@dataclass(frozen=True)
class ChainLink(Record):
    """A finding that fired near the first anomalous step."""

    code: str = described("The check's code.")
    severity: str = described("info | warn | fail.")
    step: int | None = described("The finding's step.")
    message: str = described("The finding's message.")


@dataclass(frozen=True)
class CheckpointVerdict(Record):
    """One saved checkpoint: its verdict (everything up to it) and the findings about it."""

    name: str = described("The checkpoint's folder name (checkpoint-200).")
    step: int = described("The step it was saved at.")
    path: str = described("Its path, relative to the run folder.")
    saves: list[int] = described("Every step saved to this path (the last one's save is on disk).")
    on_disk: bool = described("False: rotated out or deleted since it was saved.")
    verdict: CheckpointValue = described("The worst severity of what happened up to it (pass | warn | fail).")
    intact: bool = described("On disk and sound: can be rolled back to or kept.")
    sound: bool = described("No warn/fail finding about the checkpoint itself.")
    findings: list[Finding] = described("The findings in its window or about it (each with its scope).")


@dataclass(frozen=True)
class CheckError(Record):
    """A check that raised: it judged nothing (the verdict is then unjudged)."""

    code: str = described("The check's code.")
    error: str = described("The exception, in one line.")


@dataclass(frozen=True)
class CheckCoverage(Record):
    """Whether one registered check judged the run, on what, and why not."""

    code: str = described("The check's code.")
    name: str = described("The check's name.")
    status: CoverageStatus = described(
        "ran | partial (on part of its evidence) | not_run (its evidence is missing) | disabled | error."
    )
    reason: str | None = described("Why it did not run, or ran on part of its evidence.")
    evidence: list[str] = described("The kinds of evidence it ran on, as a reader names them.")
    sources: list[str] = described("Where that evidence came from (shim, imported logs...).")


@dataclass(frozen=True)
class RankCoverage(Record):
    """What one rank recorded."""

    rank: int = described("The rank.")
    steps: int = described("How many steps it recorded.")
    first_step: int | None = described("Its first recorded step.")
    last_step: int | None = described("Its last recorded step.")


@dataclass(frozen=True)
class ComponentOff(Record):
    """A recording component the shim switched off after it failed: what it records stops there."""

    rank: int = described("The rank.")
    component: str = described("The component (gradients, batches, probes...).")
    from_step: int | None = described("The step it stopped at.")
    error: str | None = described("Why.")


@dataclass(frozen=True)
class LinesSkipped(Record):
    """Lines of an artifact or log file that could not be read."""

    file: str | None = described("The file.")
    lines: int | None = described("How many lines were skipped.")
    of: int | None = described("Of how many.")


@dataclass(frozen=True)
class MissingEvidence(Record):
    """Recorded steps without the records of one kind of evidence."""

    rank: int = described("The rank.")
    evidence: str = described("The kind of evidence, as a reader names it.")
    steps: int = described("How many steps lack it.")
    of: int = described("Of how many recorded steps.")
    first_step: int | None = described("The first step that lacks it.")


@dataclass(frozen=True)
class DatasetCoverage(Record):
    """A preflight's dataset: how many rows rendered."""

    rows: int = described("Rows in the dataset.")
    rendered: int = described("Rows the chat template rendered.")
    render_failed: str | None = described("The first render error.")


@dataclass(frozen=True)
class EvidenceCoverage(Record):
    """What the evidence covers: the verdict is only as good as it."""

    ranks: list[RankCoverage] = described("What each rank recorded.", default_factory=list)
    components_off: list[ComponentOff] = described("Recording components switched off mid-run.", default_factory=list)
    bad_lines: list[LinesSkipped] = described("Lines that could not be read.", default_factory=list)
    mended_lines: list[LinesSkipped] = described(
        "Lines kept with text no reader can hold mended (a lone surrogate escaped, bytes not UTF-8 replaced).",
        default_factory=list,
    )
    missing: list[MissingEvidence] = described("Recorded steps without some of their evidence.", default_factory=list)
    dataset: DatasetCoverage | None = described("A preflight's dataset.", default=None, omit_none=True)
    checks_not_run: list[str] = described("Checks that raised or could not judge.", default_factory=list)
    partial: list[str] = described("What was recorded for only part of the run.", default_factory=list)
    too_little: str | None = described(
        "Set when too few steps logged a loss to judge the training: a run with nothing found on it is then unjudged.",
        default=None,
    )
    cannot_judge: str | None = described("Why the evidence cannot support a verdict.", default=None)


@dataclass(frozen=True)
class Best(Record):
    step: int = described("The step of the run's best evaluation.")
    value: float = described("Its value.")


@dataclass(frozen=True)
class AfterBest(Record):
    steps: int = described("Steps trained after the best evaluation.")
    share: float = described("That as a share of the run.")


@dataclass(frozen=True)
class Keep(Record):
    """Why the kept checkpoint (what to ship) was chosen, or why none was."""

    metric: str | None = described("The selection metric (best_metric's, else eval_loss).")
    direction: str | None = described("min | max.")
    selected_by: str | None = described("Where the metric was chosen: the run's own state, or eval_loss.")
    step: int | None = described("The kept checkpoint's step.")
    value: float | None = described("Its value on the metric.")
    band: float | None = described("The eval's noise band (None: too few evaluations to tell).")
    best: Best | None = described("The run's best evaluation.")
    best_not_saved: int | None = described("The best evaluation's step when no checkpoint was saved there.")
    after_best: AfterBest | None = described("How much of the run came after the best evaluation.")
    why: str = described("Why this checkpoint, or why none, in words.")


@dataclass(frozen=True)
class Window(Record):
    kind: str = described("logging window | checkpoint window.")
    first_step: int = described("The window's first step.")
    last_step: int = described("The window's last step.")


@dataclass(frozen=True)
class RunResolution(Record):
    """An imported run: how finely its evidence places a step, and what its logs cannot show."""

    kind: str = described("logging window | exact step.")
    logging_steps: int | None = described("The Trainer's logging interval.")
    source: str | None = described("The log source the run was imported from.")
    notes: list[str] | None = described(
        "What the import could not read and what the logs cannot show, in words, once per run.",
        default=None,
        omit_none=True,
    )
    first_anomalous_window: Window | None = described(
        "The narrowest window known to hold the first anomalous step (None: no anomaly, or its step is exact).",
        default=None,
    )


@dataclass(frozen=True)
class Verdict(Record):
    """verdict.json, the file CI gates on: the run's verdict, its first anomalous step, the checkpoint to roll
    back to, the checkpoint to keep (ship), per-checkpoint verdicts, every finding, and what the evidence
    covered."""

    schema_version: int = described("The verdict's format version.")
    run: str = described("The run's id (its folder name unless the manifest names it).")
    verdict: VerdictValue = described(
        "unjudged: the evidence cannot support a verdict (cannot_judge says why); never a pass."
    )
    cannot_judge: str | None = described("Why the run could not be judged.")
    evidence: EvidenceCoverage = described("What the evidence covers.")
    first_anomalous_step: int | None = described(
        "The earliest step of a warn/fail anomaly (configurations and risks do not date the run)."
    )
    first_anomaly_chain: list[ChainLink] = described("The findings within 50 steps of the first anomalous step.")
    rollback_checkpoint: str | None = described("The last intact checkpoint saved before the first anomalous step.")
    rollback_deleted: str | None = described("The checkpoint that would be the rollback had it not been rotated out.")
    rollback_margin: int = described("The rollback is at least this many steps before the first anomalous step.")
    keep_checkpoint: str | None = described(
        "The checkpoint to ship: best on the selection metric, intact, anomaly-free."
    )
    keep: Keep = described("Why that checkpoint, or why none.")
    checkpoints: list[CheckpointVerdict] = described("Every saved checkpoint, by step.")
    findings: list[Finding] = described("Every finding, by step.")
    check_errors: list[CheckError] = described("Checks that raised.")
    checks: list[CheckCoverage] = described(
        "Per registered check: ran, partial, not_run, disabled or error.", default_factory=list
    )
    resolution: RunResolution | None = described(
        "An imported run's resolution (absent for a recorded run).", default=None, omit_none=True
    )
