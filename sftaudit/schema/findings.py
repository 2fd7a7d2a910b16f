"""A finding and its evidence, declared once: what a check returns and what every later layer reads.

`Finding` is what a check returns (`checks.base.Check.finding` builds it) and what verdict.json lists. Its
`evidence` is small structured data whose keys are mostly the check's own; the keys another layer reads (the
resolution, attribution, gate, the report) are declared in `Evidence`, each with its meaning and type.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, Literal

from typing_extensions import TypedDict  # the schema generator (pydantic) reads it on Python 3.11

SEVERITIES = ("info", "warn", "fail")
SEVERITY_RANK = {s: i for i, s in enumerate(SEVERITIES)}
# What a finding is about (its category). Only an anomaly (something went wrong at a step) sets the first anomalous
# step, the rollback checkpoint and replay's advice; a configuration is a deliberate choice stated at
# run scope; a risk is something that may bite later (a checkpoint that cannot resume exactly).
CATEGORIES = ("anomaly", "configuration", "risk")
# What a finding's verdict weighs on: the run up to its step ("run"), or one checkpoint alone ("checkpoint").
SCOPES = ("run", "checkpoint")

Severity = Literal["info", "warn", "fail"]
Category = Literal["anomaly", "configuration", "risk"]
Scope = Literal["run", "checkpoint"]


def described(description: str, *, omit_none: bool = False, **kwargs: Any) -> Any:
    """A dataclass field with its description (the generated schema's) and whether JSON leaves it out while None."""
    return field(metadata={"description": description, "omit_none": omit_none}, **kwargs)


class Resolution(TypedDict, total=False):
    """Which steps a finding on imported logs can stand for (`verdict.resolution`)."""

    kind: Annotated[
        str,
        "'logging window': the step is the last of a logging window; 'dataset': a finding on the data given "
        "with --data (no step); 'checkpoint window': between two saves",
    ]
    first_step: Annotated[int, "The window's first step (the finding is dated there)."]
    last_step: Annotated[int, "The window's last step: the logged step the check saw."]
    logging_steps: Annotated[int | None, "The Trainer's logging interval, when known."]
    source: Annotated[str, "Where the dataset came from (kind 'dataset')."]


class Evidence(TypedDict, total=False):
    """The evidence keys another layer reads, each with its meaning. A check adds its own keys beside these
    (the report draws them as they are); these keep one meaning and one type across every check."""

    resolution: Annotated[Resolution, "Which steps the finding can stand for on imported logs."]
    applies_to: Annotated[
        list[str], "The checkpoints a run-scope finding counts for (one finding for several checkpoints)."
    ]
    missing_state: Annotated[
        dict[str, list[str]],
        "Training-state part (optimizer, scheduler, rng, data_position...) -> checkpoints lacking it.",
    ]
    value: Annotated[float | int | str | None, "The measured statistic at the finding's step."]
    threshold: Annotated[float | int | str | None, "The limit the statistic was judged against."]
    p_value: Annotated[float | str | None, "The test's p-value, when the check ran one."]
    effect_size: Annotated[float | str | None, "How far the statistic stood from its baseline (e.g. x running median)."]
    tensor: Annotated[str, "The parameter tensor the finding is about."]
    tensors: Annotated[list[Any], "The tensors concerned (names, or objects with a `tensor` name and their values)."]
    sample_ids: Annotated[list[Any], "The recorded samples concerned (first ones)."]
    samples_affected: Annotated[int, "How many samples are concerned in all."]
    first_step: Annotated[int, "The first step the condition held."]
    spike_steps: Annotated[list[int], "The steps the condition was flagged at (the first 50)."]
    last_step: Annotated[int, "The last step the condition held."]
    not_intact: Annotated[
        bool,
        "The checkpoints it applies to (`applies_to`) cannot be resumed, shipped or rolled back to, whatever the "
        "finding's severity: never named rollback or keep; gate fails on them.",
    ]
    kind: Annotated[str, "A check's own sub-kind of the finding (older than the rule id; kept for readers)."]
    file: Annotated[str, "The file in the run folder the finding is about."]
    also_flagged_by: Annotated[
        list[dict[str, str]],
        "Findings of other rules at the same step that told the same event, folded into this one: each one's "
        "`rule` and `message`.",
    ]


@dataclass(frozen=True)
class Finding:
    """One thing a human must act on: which step, which tensor/samples, what to change.

    `checkpoint` is the checkpoint window the step falls in (set by attribution), or the checkpoint a
    checkpoint-level finding is about (set by the check itself). `rule` is the stable rule id
    ("LOOP-05/own-history-spike"): one check's code covers several rules.
    The field order is verdict.json's key order (fields are only ever added at the end).
    """

    code: str = described("The check's stable code (LOOP-01 ...).")
    severity: Severity = described("info | warn | fail.")
    message: str = described("One sentence a human can act on.")
    step: int | None = described("The first step it concerns, or none.", default=None)
    checkpoint: str | None = described(
        "The checkpoint window its step falls in, or the checkpoint it is about.", default=None
    )
    evidence: Evidence = described(
        "Small structured data: ids, values, thresholds (rendered by the report); the keys other layers read are "
        "declared, a check adds its own.",
        default_factory=dict,
    )
    category: Category = described("anomaly | configuration | risk: only anomalies date the run.", default="anomaly")
    scope: Scope | None = described(
        "run: weighs on every checkpoint from its step; checkpoint: on that checkpoint alone (set by attribution).",
        default=None,
    )
    rule: str | None = described("The stable rule id, CODE/slug (e.g. LOOP-05/periodic-spike).", default=None)

    def __post_init__(self) -> None:
        if self.severity not in SEVERITY_RANK:
            raise ValueError(f"severity must be one of {SEVERITIES}, not {self.severity!r}")
        if self.category not in CATEGORIES:
            raise ValueError(f"category must be one of {CATEGORIES}, not {self.category!r}")
        if self.scope is not None and self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, not {self.scope!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Finding:
        """A finding as verdict.json stores it; keys of a newer sftaudit are ignored, missing new ones default."""
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**{**known, "evidence": dict(known.get("evidence") or {})})
