"""Audit configuration: per-check threshold overrides and disabled checks, from a TOML file.

    [checks."LOOP-05"]          # override a check's defaults
    max_tensors_listed = 50

    [audit]
    disable = ["LOOP-06"]       # skip checks
    strict = false              # warns block the gate too

    [verdict]
    rollback_margin = 100       # the rollback checkpoint is at least this many steps before the anomaly (default 1)

Config is kept apart from computation: checks read only their own `params`.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import InputError
from .verdict import DEFAULT_ROLLBACK_MARGIN


@dataclass
class AuditConfig:
    check_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    disabled: list[str] = field(default_factory=list)
    strict: bool = False
    rollback_margin: int = DEFAULT_ROLLBACK_MARGIN

    @classmethod
    def load(cls, path: str | Path | None) -> "AuditConfig":
        if path is None:
            return cls()
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise InputError(f"config {path}: {exc}") from None
        audit = data.get("audit", {})
        margin = data.get("verdict", {}).get("rollback_margin", DEFAULT_ROLLBACK_MARGIN)
        if not isinstance(margin, int) or margin < 1:
            raise InputError(f"config {path}: verdict.rollback_margin must be an integer >= 1")
        return cls(check_options=data.get("checks", {}), disabled=list(audit.get("disable", [])),
                   strict=bool(audit.get("strict", False)), rollback_margin=margin)
