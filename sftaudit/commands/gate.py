"""`sftaudit gate RUN_DIR --checkpoint CKPT`: may this checkpoint ship? For CI.

The run is audited (ingest + checks + verdict); the checkpoint's verdict rests on the run
findings up to its step and the findings about the checkpoint itself (LOOP-09). A policy
says which of them block. Outputs are deterministic: same input, same bytes.
``--checkpoint best`` judges the checkpoint the verdict keeps (`keep_checkpoint`: best on the run's selection
metric); when it keeps none, exit 2 with the reason.

Policy file (TOML)::

    [gate]
    block = ["fail"]        # severities that block (--strict adds "warn")
    codes = []              # only these check codes block (empty: every code)
    ignore = ["LOOP-07"]    # these codes never block
    require_resume_state = false  # true: a checkpoint without optimizer, scheduler, RNG states
                                  # or data position fails (default: one warn for the run)
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..checks import registered_checks
from ..checks.base import SEVERITIES, AuditContext
from ..checks.resume_state import (
    cannot_resume,
    inspected,
    inspection_options,
    missing_state,
    saved_checkpoints,
)
from ..core.terminal import json_safe, shown, xml_text
from ..errors import InputError
from ..readers.checkpoints import CheckpointError, inside_run
from ..store.rundb import connect, load_manifest
from ..verdict.attribution import findings_up_to
from ..verdict.audit import audited, unjudged_reason
from ..verdict.config import AuditConfig, read_toml


@dataclass(frozen=True)
class Policy:
    block: tuple[str, ...] = ("fail",)
    codes: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    require_resume_state: bool = False

    @classmethod
    def load(cls, path: str | Path | None, strict: bool = False) -> Policy:
        data: dict[str, Any] = {}
        if path is not None:
            doc = read_toml(path, "policy")
            if set(doc) - {"gate"}:
                raise InputError(f"policy {path}: unknown section [{sorted(set(doc) - {'gate'})[0]}]; known: [gate]")
            data = doc.get("gate", {})
            if not isinstance(data, dict):
                raise InputError(f"policy {path}: [gate] must be a table")
            keys = {"block", "codes", "ignore", "require_resume_state"}
            if set(data) - keys:
                raise InputError(
                    f"policy {path}: unknown key {sorted(set(data) - keys)[0]!r} in [gate]; "
                    f"known: {', '.join(sorted(keys))}"
                )
        lists = {}
        for key, default in (("block", ["fail"]), ("codes", []), ("ignore", [])):
            value = data.get(key, default)
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise InputError(f"policy {path}: gate.{key} must be a list of strings, not {value!r}")
            lists[key] = value
        known = [c.code for c in registered_checks()]
        for key in ("codes", "ignore"):
            for code in lists[key]:
                if code not in known:
                    raise InputError(
                        f"policy {path}: gate.{key} names unknown check {code!r}; known: {', '.join(known)}"
                    )
        resume = data.get("require_resume_state", False)
        if not isinstance(resume, bool):
            raise InputError(f"policy {path}: gate.require_resume_state must be true or false, not {resume!r}")
        block = set(lists["block"]) | ({"warn"} if strict else set())
        unknown = block - set(SEVERITIES)
        if unknown:
            raise InputError(f"policy {path}: unknown severities {sorted(unknown)}; use {list(SEVERITIES)}")
        return cls(
            tuple(s for s in SEVERITIES if s in block),
            tuple(sorted(lists["codes"])),
            tuple(sorted(lists["ignore"])),
            resume,
        )

    def blocks(self, finding: dict[str, Any]) -> bool:
        return (
            finding["severity"] in self.block
            and finding["code"] not in self.ignore
            and (not self.codes or finding["code"] in self.codes)
        )


@dataclass
class GateResult:
    run: str
    checkpoint: dict[str, Any]
    policy: Policy
    findings: list[dict[str, Any]]
    checks: list[tuple[str, str, str, str | None]]  # (code, name, status, reason), as the verdict's `checks`
    blocking: list[dict[str, Any]] = field(init=False)

    def __post_init__(self) -> None:
        self.blocking = [f for f in self.findings if self.policy.blocks(f)]

    @property
    def passed(self) -> bool:
        return not self.blocking

    def to_json(self) -> str:
        doc = {
            "run": self.run,
            "checkpoint": self.checkpoint,
            "result": "pass" if self.passed else "fail",
            "policy": {
                "block": list(self.policy.block),
                "codes": list(self.policy.codes),
                "ignore": list(self.policy.ignore),
            },
            "blocking": self.blocking,
            "findings": self.findings,
        }
        return json_safe(json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False)) + "\n"

    def to_junit(self) -> str:
        """One testcase per check: a blocking finding is a failure; a check turned off, one that had
        too little evidence to judge (`not_run`), or one that judged only part of the run's evidence
        (`partial`) and found nothing blocking, is skipped with the reason: never a plain pass for what
        was not seen. All text goes through `xml_text`: XML cannot hold control characters, and CI
        pages should not show bidi controls raw."""
        name = self.checkpoint["name"]
        suite = ET.Element("testsuite", {"name": xml_text(f"sftaudit gate {self.run} {name}")})
        counts = {"tests": 0, "failures": 0, "skipped": 0}
        for code, title, status, reason in self.checks:
            case = ET.SubElement(
                suite, "testcase", {"classname": xml_text(f"sftaudit.{name}"), "name": xml_text(f"{code} {title}")}
            )
            counts["tests"] += 1
            mine = [f for f in self.findings if f["code"] == code]
            if status in ("disabled", "not_run"):
                why = "disabled by configuration" if status == "disabled" else f"not run: {reason}"
                ET.SubElement(case, "skipped", {"message": xml_text(why)})
                counts["skipped"] += 1
                continue
            blocking = [f for f in mine if self.policy.blocks(f)]
            partial = f"partial evidence: {reason}" if status == "partial" else None
            if blocking:
                counts["failures"] += 1
                failure = ET.SubElement(
                    case, "failure", {"type": blocking[0]["severity"], "message": xml_text(blocking[0]["message"])}
                )
                failure.text = xml_text("\n".join(_line(f) for f in blocking))
            elif partial:
                ET.SubElement(case, "skipped", {"message": xml_text(f"{partial}; nothing blocking in what was judged")})
                counts["skipped"] += 1
            others = [_line(f) for f in mine if not self.policy.blocks(f)] + ([partial] if partial and blocking else [])
            if others:
                ET.SubElement(case, "system-out").text = xml_text("\n".join(others))
        for key in ("tests", "failures", "skipped"):
            suite.set(key, str(counts[key]))
        suite.set("errors", "0")
        ET.indent(suite)
        return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suite, encoding="unicode") + "\n"

    def summary(self) -> str:
        c = self.checkpoint
        lines = [shown(f"{self.run} {c['name']} (step {c['step']}): {'PASS' if self.passed else 'FAIL'}")]
        lines += [f"  blocks: {shown(_line(f))}" for f in self.blocking]
        return "\n".join(lines)


def _line(f: dict[str, Any]) -> str:
    where = f"step {f['step']}" if f["step"] is not None else "run"
    return f"{f['code']} {f['severity']} {where}: {f['message']}"


def gate(
    run_dir: str | Path,
    checkpoint: str,
    policy: Policy,
    config: AuditConfig | None = None,
    data: str | Path | None = None,
    source: str | None = None,
    log_file: str | Path | None = None,
) -> GateResult:
    """Audit the run and judge one checkpoint; InputError when it cannot be judged."""
    config = config or AuditConfig()
    run_dir = Path(run_dir)
    with audited(
        run_dir, config, data=data, source=source, log_file=log_file
    ) as done:  # the audit and the inspection of its checkpoints: one state
        verdict = done.verdict
        lacking = resume_state_lacking(run_dir, config) if policy.require_resume_state else {}
    if verdict.get("cannot_judge"):  # a check that raised is among the reasons (build_verdict)
        raise InputError(unjudged_reason(verdict))
    wanted = kept_checkpoint_name(verdict) if checkpoint == BEST else checkpoint
    target = resolve_checkpoint(run_dir, verdict["checkpoints"], wanted)
    try:
        on_disk = inside_run(run_dir, target["path"]).exists()
    except CheckpointError as exc:
        raise InputError(f"cannot judge {target['name']}: {exc}") from None
    if not on_disk:
        raise InputError(
            f"cannot judge {target['name']}: it is no longer on disk at {run_dir / target['path']} "
            f"(rotated out or deleted)"
        )
    checks = [(c["code"], c["name"], c["status"], c["reason"]) for c in verdict["checks"]]
    considered = findings_up_to(verdict["findings"], target["name"], target["step"])
    if target["name"] in lacking and not any(
        f["code"] == "LOOP-09" and f["scope"] == "checkpoint" and "missing_state" in f["evidence"] for f in considered
    ):
        # The policy's rule is LOOP-09's `require_resume_state` for this checkpoint: its failure, as LOOP-09 words it.
        considered.append(
            {
                "code": "LOOP-09",
                "severity": "fail",
                "step": target["step"],
                "checkpoint": target["name"],
                "message": cannot_resume(target["name"], lacking[target["name"]]),
                "evidence": {"missing_state": lacking[target["name"]]},
                "category": "risk",
                "scope": "checkpoint",
            }
        )
    return GateResult(verdict["run"], {k: target[k] for k in ("name", "step", "path")}, policy, considered, checks)


def resume_state_lacking(run_dir: Path, config: AuditConfig) -> dict[str, list[str]]:
    """Checkpoint name -> the training-state parts it lacks of those an exact resume of the run needs,
    inspected with the audit config's LOOP-09 options (the audit just cached those inspections)."""
    con = connect(run_dir, read_only=True)
    try:
        ctx = AuditContext(con, run_dir, load_manifest(con))
        options = inspection_options(config.check_options.get("LOOP-09", {}))
        return missing_state(ctx, inspected(ctx, saved_checkpoints(ctx), **options))
    finally:
        con.close()


# `--checkpoint best`: the checkpoint the verdict keeps (a folder named `best` is given by its path, `./best`).
BEST = "best"


def kept_checkpoint_name(verdict: dict[str, Any]) -> str:
    """The verdict's kept checkpoint; an InputError (exit 2, one line) saying why when it names none."""
    if verdict.get("keep_checkpoint"):
        return verdict["keep_checkpoint"]
    why = (verdict.get("keep") or {}).get("why") or "the verdict names none"
    raise InputError(f"{verdict['run']}: no checkpoint to keep for --checkpoint best: {why}")


def resolve_checkpoint(run_dir: Path, checkpoints: list[dict[str, Any]], wanted: str) -> dict[str, Any]:
    """A checkpoint by name (step-20), step (20) or path (inside the run directory). A step whose
    save a later save to the same path overwrote cannot be judged: its files are gone."""
    by_name = [c for c in checkpoints if c["name"] == wanted]
    by_step = [c for c in checkpoints if wanted.isdigit() and c["step"] == int(wanted)]
    root = run_dir.resolve()
    for base in (Path.cwd(), root):
        path = (base / wanted).resolve()
        by_path = [c for c in checkpoints if (root / c["path"]).resolve() == path]
        if by_path:
            break
    found = by_name or by_step or by_path
    if not found and wanted.isdigit():
        later = [c for c in checkpoints if int(wanted) in c.get("saves", ())]
        if later:
            c = later[-1]
            raise InputError(
                f"cannot judge step {wanted}'s checkpoint: {c['path']} was overwritten at step "
                f"{c['step']}; only that save is on disk (judge it with --checkpoint {c['name']})"
            )
    if not found:
        saved = ", ".join(c["name"] for c in checkpoints) or "none"
        raise InputError(f"checkpoint {wanted!r} is not among the run's saved checkpoints ({saved})")
    return found[-1]


def run(args) -> int:
    """The CLI: gate the checkpoint, write JUnit, JSON and SARIF where asked, print the summary."""
    from .common import EXIT_FAIL, EXIT_PASS, say, write

    config = AuditConfig.load(args.config)
    policy = Policy.load(args.policy, args.strict or config.strict)
    result = gate(
        args.run_dir, args.checkpoint, policy, config, data=args.data, source=args.source, log_file=args.log_file
    )
    for path, text in ((args.junit, result.to_junit), (args.json, result.to_json)):
        if path:
            write(path, text(), "--junit" if text == result.to_junit else "--json")
    if args.sarif:
        from ..outputs.sarif import to_sarif
        from ..verdict.audit import stored_verdict

        considered = {**stored_verdict(args.run_dir), "findings": result.findings}
        write(args.sarif, json.dumps(to_sarif(considered, args.run_dir), indent=1) + "\n", "--sarif")
    if args.github:
        from ..verdict.audit import stored_verdict
        from .common import with_github

        gated = json.loads(result.to_json())
        with_github(lambda: say(result.summary()), stored_verdict(args.run_dir), args.run_dir, gate=gated)
    else:
        say(result.summary())
    return EXIT_PASS if result.passed else EXIT_FAIL
