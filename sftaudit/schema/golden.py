"""The golden file (`sftaudit golden RUN --out golden.json`), declared once: what `diff` compares a run against.

`golden.schema.json` beside this file is generated from these types (`scripts/gen_golden_schema.py`, never edited
by hand) and every golden file is validated against it before `diff` reads a value. The golden file is plain JSON:
a value that is not a finite number is written as null, and `not_finite` says which it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

GOLDEN_VERSION = 1
# Every integer in a golden file (steps, ids) is a step or an index: it fits a signed 64-bit integer.
INT64_MAX = 2**63 - 1

Number = float | None  # null: not recorded, or not finite (see `not_finite`)


def _doc(text: str, **kw: Any) -> Any:
    return field(metadata={"description": text}, **kw)


@dataclass(frozen=True)
class StepSeries:
    step: list[int] = _doc("the recorded steps, ascending")
    loss: list[Number] = _doc("the training loss at each step")
    lr: list[Number] = _doc("the learning rate at each step")
    grad_norm: list[Number] = _doc("the global gradient norm at each step")


@dataclass(frozen=True)
class TensorSeries:
    steps: list[int] = _doc("the steps (every `stride`-th)")
    norms: list[Number] = _doc("the tensor's gradient norm at each of them")


@dataclass(frozen=True)
class Fingerprints:
    tokenizer: str | None = _doc("the tokenizer's fingerprint")
    chat_template: str | None = _doc("the chat template's fingerprint")
    templates_trained: list[str] = _doc("fingerprints of the templates the batches were rendered with")


@dataclass(frozen=True)
class NotFinite:
    series: list[str] = _doc('where the null stands: ["steps", "loss"], ["tensors", NAME, "norms"] or ["probes"]')
    index: int = _doc("its position in that list")
    value: Literal["nan", "inf", "-inf"] = _doc("what the run recorded there")


@dataclass(frozen=True)
class Golden:
    """A run's profile saved as JSON: per step the loss, learning rate and gradient norm, per tensor its gradient
    norm at a stride, the probe distributions, the data order, fingerprints, config, versions, checkpoint digests
    and the warn/fail findings. Versioned with sftaudit_golden."""

    sftaudit_golden: Literal[1] = _doc("the golden file's format version")
    run: str = _doc("the run's id")
    source: str = _doc("the run folder it was written from")
    stride: int = _doc("per-tensor gradient norms are kept every `stride` steps")
    steps: StepSeries = _doc("the per-step series")
    tensors: dict[str, TensorSeries] = _doc("per tensor (by parameter name) its gradient-norm series")
    probes: list[tuple[int, int, int, Number]] = _doc("[step, prompt index, top token id, its probability]")
    data_order: dict[str, str] = _doc("per step (a decimal string) a digest of the sample ids trained")
    fingerprints: Fingerprints = _doc("the tokenizer and chat template fingerprints")
    tokenizer: dict[str, Any] = _doc("what the tokenizer is (class, length, special and added tokens, template)")
    first_anomalous_step: int | None = _doc("the audit's first anomalous step")
    config: dict[str, Any] = _doc("the run's config, its own folder written as RUN_DIR")
    versions: dict[str, Any] = _doc("the library versions the run trained with")
    checkpoints: dict[str, Any] = _doc("per checkpoint path its digests")
    findings: list[tuple[str, str, int | None]] | None = _doc("the warn/fail findings as [code, severity, step]")
    not_finite: list[NotFinite] = _doc(
        "the nulls in the series that stand for a value that is not finite", default_factory=list
    )
