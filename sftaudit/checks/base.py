"""What a check is and what it returns. Checks query DuckDB and return findings; they never render."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import duckdb
import polars as pl

from ..schema.findings import CATEGORIES, SEVERITIES, SEVERITY_RANK, Finding  # noqa: F401 - the checks import them here
from ..store.rundb import first_row, has_rows

DOC_SECTIONS = ("What it detects", "Why it matters", "Statistic", "Threshold", "Evidence")

# The evidence a check may need, by table, as a reader would name it. A check whose `needs` are
# not all recorded did not run: the verdict and the report say so, never "passed".
EVIDENCE = {
    "steps": "training steps (loss, learning rate)",
    "grad_norms": "per-tensor gradient norms",
    "batches": "batch records (labels, padding, loss per micro-batch)",
    "samples": "rendered samples",
    "probes": "next-token distributions on the probe prompts",
    "generations": "generations on the probe prompts",
    "evals": "eval-set predictions",
    "checkpoints": "checkpoints",
    "metrics": "logged metrics",
    # Not tables: what the run's manifest describes.
    "tokenizer": "the run's tokenizer",
    "chat_template": "the tokenizer's chat template",
    "final_model": "the model saved into the output folder at the end",
}


@dataclass
class AuditContext:
    """What a check may read: the run's DuckDB tables, its manifest, its folder (for checkpoints).

    A check that computes a per-step statistic (a spread, a distinct-n, a correlation) hands
    it to `add_series` with its threshold: the audit stores it in the `series` table, so the
    report can draw it without computing anything.
    """

    con: duckdb.DuckDBPyConnection
    run_dir: Path
    manifest: dict[str, Any]
    series: list[dict[str, Any]] = field(default_factory=list)
    not_judged: dict[str, str] = field(default_factory=dict)  # check code -> why it could not judge
    # check code -> what of its evidence it could not judge (it judged the rest: the check ran on partial evidence)
    partly_judged: dict[str, str] = field(default_factory=dict)
    resources: list[Any] = field(default_factory=list)  # what checks share and `close` releases (temporary files)
    # table -> whether it holds a row, as far as the audit has asked (`has_rows`)
    known_rows: dict[str, bool] = field(default_factory=dict)
    # what one check computed for the others that ask, once an audit (`shared`)
    computed: dict[str, Any] = field(default_factory=dict)

    def add_series(
        self,
        code: str,
        name: str,
        steps: Any,
        values: Any,
        threshold: float | None = None,
        sole_condition: bool = False,
    ) -> None:
        """A named statistic over steps (sequences or numpy/polars columns of equal length), kept as typed
        columns (a million steps as Python lists took 40 MB a column). `sole_condition`: crossing `threshold`
        alone fires the check (else the report labels the line as one condition of several)."""
        steps, values = pl.Series(steps, dtype=pl.Int64), pl.Series(values, dtype=pl.Float64, strict=False)
        if len(steps) != len(values):
            raise ValueError(f"{code} series {name!r}: {len(steps)} steps but {len(values)} values")
        self.series.append(
            {
                "code": code,
                "name": name,
                "steps": steps,
                "values": values,
                "threshold": threshold,
                "sole_condition": sole_condition,
            }
        )

    def close(self) -> None:
        """Release what the checks shared (the audit's temporary files); the context's results stay."""
        while self.resources:
            self.resources.pop().close()

    def frame(self, sql: str, params: list[Any] | None = None) -> pl.DataFrame:
        return self.con.sql(sql, params=params or None).pl()

    def scalar(self, sql: str, params: list[Any] | None = None) -> Any:
        row = first_row(self.con, sql, params)
        return row[0] if row else None

    def row(self, sql: str, params: list[Any] | None = None) -> tuple | None:
        return first_row(self.con, sql, params)

    def shared(self, key: str, make: Callable[[], Any]) -> Any:
        """`make()`, computed once an audit under `key` for every check that asks (a million steps' reads and
        statistics cost each time)."""
        if key not in self.computed:
            self.computed[key] = make()
        return self.computed[key]

    def has_rows(self, table: str) -> bool:
        """Whether `table` exists and holds a row: asked once an audit (checks only read; a view over the gradient
        parts is a bind of every part each time it is asked)."""
        if table not in self.known_rows:
            self.known_rows[table] = has_rows(self.con, table)
        return self.known_rows[table]


def alternatives(check: type[Check] | Check) -> list[tuple[str, ...]]:
    """The check's `needs`, each as the kinds of evidence any one of which will do."""
    return [(need,) if isinstance(need, str) else need for need in check.needs]


def needed(check: type[Check] | Check) -> list[str]:
    """Every kind of evidence in the check's `needs`, alternatives spelled out."""
    return [t for need in alternatives(check) for t in need]


class CannotJudge(Exception):
    """Raised by a check's `run` when the run's evidence is too little to judge (one logged point, no
    learning rate logged): the check is `not_run` with this reason, never "ran"."""


@dataclass(frozen=True)
class Option:
    """A check option: its default and the range a config may set it in, declared once where the check declares
    it (`defaults = {"window": Option(None, low=2, kind=int)}`). `low`/`high` bound a number (included, or
    excluded when `*_open`); `kind` is the type a value must have (the default's own when there is one)."""

    default: Any
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    kind: type | None = None

    @property
    def value_type(self) -> type | None:
        return self.kind or (None if self.default is None else type(self.default))

    def range_words(self) -> str:
        """The range in words: ">= 1", "> 0", "between 0 and 1"."""
        if self.low is not None and self.high is not None:
            ends = "" if not (self.low_open or self.high_open) else " (ends excluded)"
            return f"between {self.low:g} and {self.high:g}{ends}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return f"{'<' if self.high_open else '<='} {self.high:g}" if self.high is not None else ""

    def in_range(self, value: float) -> bool:
        low_ok = self.low is None or (value > self.low if self.low_open else value >= self.low)
        return low_ok and (self.high is None or (value < self.high if self.high_open else value <= self.high))


def count(default: int | None, low: int = 1) -> Option:
    """A whole number of steps, items or evaluations, at least `low`."""
    return Option(default, low=low, kind=int)


def positive(default: float | None) -> Option:
    """A number above 0 (a multiple of a spread, a limit)."""
    return Option(default, low=0, low_open=True, kind=float)


def at_least(default: float, low: float) -> Option:
    return Option(default, low=low, kind=float if isinstance(default, float) else int)


def share(default: float) -> Option:
    """A fraction between 0 and 1, ends included."""
    return Option(default, low=0, high=1, kind=float)


def probability(default: float) -> Option:
    """A significance level or rate strictly between 0 and 1."""
    return Option(default, low=0, high=1, low_open=True, high_open=True, kind=float)


class Check:
    """Base class: subclasses set `code`, `name`, `defaults` and implement `run`.

    The class docstring documents the check in the fixed sections of DOC_SECTIONS
    (the report and the generated docs pages quote it). `defaults` are the default thresholds, each
    a plain value or an `Option` with the range a config may set it in; a config overrides them per
    check code. `needs` names the EVIDENCE tables without
    which the check cannot judge anything (a tuple among them: any one of those will do);
    `uses`, the evidence it judges more finely with (without it the check runs on partial
    evidence). `rules` declares what its findings fire on, one slug each.
    """

    code: ClassVar[str]
    name: ClassVar[str]
    needs: ClassVar[tuple[str | tuple[str, ...], ...]]
    uses: ClassVar[tuple[str, ...]] = ()
    # What an imported run's source may lack (`schema.records.LACKS`) that the check cannot judge without: when
    # the manifest's `lacks` names one, the check is not_run with the source's words.
    source_needs: ClassVar[tuple[str, ...]] = ()
    defaults: ClassVar[dict[str, Any]] = {}
    # The check's rules, declared once: slug -> one line on what it fires on. Each finding names one; its rule
    # id ("LOOP-05/periodic-spike") is what SARIF and the config's `disable` address.
    rules: ClassVar[dict[str, str]]
    # Each option's declaration (its range), from `defaults`; `defaults` itself keeps the plain default values.
    options: ClassVar[dict[str, Option]] = {}
    # One of its rules -> another check's rule id that tells the same event with more to act on: a finding of the
    # rule at a step where that rule found something at least as severe is folded into that finding (one event
    # told once; the verdict names the folded rule in the other's `also_flagged_by`).
    restated_by: ClassVar[dict[str, str]] = {}

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        declared = cls.__dict__.get("defaults")
        if declared is not None:
            cls.options = {k: v if isinstance(v, Option) else Option(v) for k, v in declared.items()}
            cls.defaults = {k: o.default for k, o in cls.options.items()}

    def __init__(self, **overrides: Any):
        unknown = set(overrides) - set(self.defaults)
        if unknown:
            raise ValueError(f"{self.code}: unknown options {sorted(unknown)}; known: {sorted(self.defaults)}")
        self.params = {**self.defaults, **overrides}

    def run(self, ctx: AuditContext) -> list[Finding]:
        raise NotImplementedError

    def finding(
        self,
        rule: str,
        severity: str,
        message: str,
        /,
        step: int | None = None,
        *,
        category: str = "anomaly",
        **evidence: Any,
    ) -> Finding:
        """A finding of this check under one of its declared `rules` (the slug; the finding's rule id is
        "CODE/slug"); `category` is one of CATEGORIES (anomaly by default)."""
        if rule not in self.rules:
            raise ValueError(f"{self.code}: undeclared rule {rule!r}; declared: {sorted(self.rules)}")
        return Finding(
            self.code,
            severity,
            message,
            step=None if step is None else int(step),
            evidence=_finite(json.loads(json.dumps(evidence, default=_json_default))),
            category=category,
            rule=f"{self.code}/{rule}",
        )


def _finite(value: Any) -> Any:
    """Evidence must be strict JSON: NaN and infinities become the strings "nan", "inf", "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON-serialisable: {type(value).__name__}")
