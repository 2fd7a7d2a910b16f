"""Audit configuration: per-check threshold overrides and disabled checks, from a TOML file.

    [checks."LOOP-05"]          # override a check's defaults
    max_tensors_listed = 50

    [audit]
    disable = ["LOOP-06", "LOOP-05/periodic-spike"]   # skip checks, or single rules of a check
    strict = false              # warns block the gate too

    [verdict]
    rollback_margin = 100       # the rollback checkpoint is at least this many steps before the anomaly (default 1)
    max_missing_share = 0.01    # unreadable lines in an artifact file, or recorded steps without their batch or
                                # gradient records, beyond this share: the run is unjudged

    [ingest]
    max_record_bytes = 67108864     # one artifact line (record) larger than this is refused (64 MiB)
    max_file_bytes = 17179869184    # one artifact file larger than this is refused (16 GiB)

Config is kept apart from computation: checks read only their own `params`. Every value is checked
where it is read (names, types, ranges): a mistake is an InputError (exit 2), never a silent misreading.
"""

from __future__ import annotations

import math
import os
import stat
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InputError
from ..store.ingest import DEFAULT_MAX_FILE_BYTES, DEFAULT_MAX_RECORD_BYTES

if TYPE_CHECKING:
    from ..checks.base import Option

# Steps between the rollback checkpoint and the first anomalous step, at least: 1 is the last
# checkpoint before the anomaly; a cautious choice rolls back to `step_id - 3` (3); PaLM-style practice
# restarts about 100 steps before a loss spike (100).
DEFAULT_ROLLBACK_MARGIN = 1

DEFAULT_MAX_MISSING_SHARE = 0.01
MAX_CONFIG_BYTES = 2**20

_SECTIONS = {"checks", "audit", "verdict", "ingest"}


def read_small_text(path: str | Path, what: str, limit: int = MAX_CONFIG_BYTES) -> str:
    """A small UTF-8 text file given on the command line (config, policy, prompts): a regular file,
    at most `limit` bytes; an InputError naming it otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block the open
    except OSError as exc:
        raise InputError(f"{what} {path}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{what} {path}: not a regular file")
        if st.st_size > limit:
            raise InputError(f"{what} {path}: {st.st_size} bytes, more than the {limit} allowed")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{what} {path}: not UTF-8 text (byte {exc.start})") from None


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """A small TOML file given on the command line (config, policy); InputError in one line when it is not TOML,
    or nested deeper than the parser's recursion limit."""
    try:
        return tomllib.loads(read_small_text(path, what))
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{what} {path}: not TOML ({exc})") from None
    except RecursionError:
        raise InputError(f"{what} {path}: not TOML this sftaudit reads (nested too deeply)") from None


def _type_name(kind: type) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list"}[kind]


def _checked(where: str, value: Any, kind: type) -> Any:
    """`value` if it has the type `kind` (an integer is a number too; a bool is neither), else InputError."""
    ok = (
        isinstance(value, bool)
        if kind is bool
        else (
            isinstance(value, (int, float)) and not isinstance(value, bool)
            if kind is float
            else isinstance(value, int) and not isinstance(value, bool)
            if kind is int
            else isinstance(value, kind)
        )
    )
    if not ok:
        raise InputError(f"{where} must be {_type_name(kind)}, not {value!r}")
    if kind in (int, float) and not (math.isfinite(value) and value >= 0):
        raise InputError(f"{where} must be a finite number >= 0, not {value!r}")
    return float(value) if kind is float else value


def _check_options(path: Any, checks: Any, known: dict[str, dict[str, Option]]) -> dict[str, dict[str, Any]]:
    if not isinstance(checks, dict):
        raise InputError(f"config {path}: [checks] must be a table of check codes")
    out = {}
    for code, options in checks.items():
        if code not in known:
            raise InputError(f"config {path}: unknown check {code!r} in [checks]; known: {', '.join(known)}")
        if not isinstance(options, dict):
            raise InputError(f'config {path}: checks."{code}" must be a table of options, not {options!r}')
        declared = known[code]
        for name, value in options.items():
            if name not in declared:
                raise InputError(f"config {path}: {code}: unknown options [{name!r}]; known: {sorted(declared)}")
            option, where = declared[name], f'config {path}: checks."{code}".{name}'
            kind = option.value_type or str
            _checked(where, value, kind)
            if kind is list and not all(isinstance(v, str) for v in value):
                raise InputError(f"{where} must be a list of strings")
            if kind in (int, float) and not option.in_range(value):
                raise InputError(f"{where} must be {_type_name(kind)} {option.range_words()}, not {value!r}")
        out[code] = {k: float(v) if declared[k].value_type is float else v for k, v in options.items()}
    return out


def _table(path: Any, data: dict, name: str, keys: set[str]) -> dict:
    table = data.get(name, {})
    if not isinstance(table, dict):
        raise InputError(f"config {path}: [{name}] must be a table")
    unknown = sorted(set(table) - keys)
    if unknown:
        raise InputError(f"config {path}: unknown key {unknown[0]!r} in [{name}]; known: {', '.join(sorted(keys))}")
    return table


@dataclass
class AuditConfig:
    check_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    disabled: list[str] = field(default_factory=list)
    strict: bool = False
    rollback_margin: int = DEFAULT_ROLLBACK_MARGIN
    max_missing_share: float = DEFAULT_MAX_MISSING_SHARE
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES

    @classmethod
    def load(cls, path: str | Path | None) -> AuditConfig:
        if path is None:
            return cls()
        return cls.from_dict(read_toml(path, "config"), path)

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: Any = "<dict>") -> AuditConfig:
        from ..checks import registered_checks  # the known codes and their option types

        known = {c.code: c.options for c in registered_checks()}
        rule_ids = [f"{c.code}/{slug}" for c in registered_checks() for slug in c.rules]
        unknown = sorted(set(data) - _SECTIONS)
        if unknown:
            raise InputError(
                f"config {path}: unknown section [{unknown[0]}]; known: "
                + ", ".join(f"[{s}]" for s in sorted(_SECTIONS))
            )
        audit = _table(path, data, "audit", {"disable", "strict"})
        verdict = _table(path, data, "verdict", {"rollback_margin", "max_missing_share"})
        ingest = _table(path, data, "ingest", {"max_record_bytes", "max_file_bytes"})
        disabled = _checked(f"config {path}: audit.disable", audit.get("disable", []), list)
        for name in disabled:
            if not isinstance(name, str) or (name not in known and name not in rule_ids):
                code = str(name).partition("/")[0]
                raise InputError(
                    f"config {path}: audit.disable names unknown check {name!r}; known: {', '.join(known)}"
                    if code not in known
                    else f"config {path}: audit.disable names unknown rule {name!r}; {code}'s rules: "
                    + ", ".join(r for r in rule_ids if r.startswith(code + "/"))
                )
        margin = _checked(
            f"config {path}: verdict.rollback_margin", verdict.get("rollback_margin", DEFAULT_ROLLBACK_MARGIN), int
        )
        if margin < 1:
            raise InputError(f"config {path}: verdict.rollback_margin must be an integer >= 1")
        share = _checked(
            f"config {path}: verdict.max_missing_share",
            verdict.get("max_missing_share", DEFAULT_MAX_MISSING_SHARE),
            float,
        )
        if share > 1:
            raise InputError(f"config {path}: verdict.max_missing_share is a share between 0 and 1, not {share}")
        limits = {
            k: _checked(f"config {path}: ingest.{k}", ingest.get(k, default), int)
            for k, default in (
                ("max_record_bytes", DEFAULT_MAX_RECORD_BYTES),
                ("max_file_bytes", DEFAULT_MAX_FILE_BYTES),
            )
        }
        if min(limits.values()) < 1:
            raise InputError(f"config {path}: ingest limits must be at least 1 byte")
        return cls(
            check_options=_check_options(path, data.get("checks", {}), known),
            disabled=list(disabled),
            strict=_checked(f"config {path}: audit.strict", audit.get("strict", False), bool),
            rollback_margin=margin,
            max_missing_share=share,
            **limits,
        )
