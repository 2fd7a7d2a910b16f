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

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..checks import registered_checks
from ..checks.base import SEVERITIES, AuditContext
from ..checks.loop09_checkpoint_integrity import CheckpointIntegrity
from ..checks.resume_state import (
    inspected,
    inspection_options,
    missing_state,
    saved_checkpoints,
)
from ..errors import InputError
from ..outputs import Rendering, rendered
from ..readers.checkpoints import CheckpointError, inside_run
from ..schema.findings import Finding
from ..store.rundb import connect, load_manifest
from ..verdict.attribution import findings_up_to, unusable
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
    verdict: dict[str, Any]  # the run's, whose `checks` say what each check judged
    blocking: list[dict[str, Any]] = field(init=False)

    def __post_init__(self) -> None:
        self.blocking = [f for f in self.findings if self.policy.blocks(f)]

    @property
    def passed(self) -> bool:
        return not self.blocking

    def document(self) -> dict[str, Any]:
        """The gate's result as `--json` writes it, and as every output format renders it."""
        return {
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

    def rendering(self, run_dir: Path) -> Rendering:
        return Rendering(self.verdict, Path(run_dir), gate=self.document())


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
    considered = findings_up_to([Finding.from_dict(f) for f in verdict["findings"]], target["name"], target["step"])
    if target["name"] in lacking and not any(
        f.code == CheckpointIntegrity.code and f.scope == "checkpoint" and "missing_state" in f.evidence
        for f in considered
    ):
        # The policy's rule is LOOP-09's `require_resume_state` for this checkpoint: its failure, as LOOP-09 makes it.
        made = CheckpointIntegrity(**config.check_options.get(CheckpointIntegrity.code, {})).resume_state_finding(
            target["name"], target["step"], lacking[target["name"]]
        )
        considered.append(replace(made, scope="checkpoint"))
    # A checkpoint a finding says cannot be used at all (a logs-only copy's: no weights) fails whatever the severity.
    considered = [replace(f, severity="fail") if target["name"] in unusable(f) else f for f in considered]
    return GateResult(
        verdict["run"],
        {k: target[k] for k in ("name", "step", "path")},
        policy,
        [f.to_dict() for f in considered],
        verdict,
    )


def resume_state_lacking(run_dir: Path, config: AuditConfig) -> dict[str, list[str]]:
    """Checkpoint name -> the training-state parts it lacks of those an exact resume of the run needs,
    inspected with the audit config's LOOP-09 options (the audit just cached those inspections)."""
    con = connect(run_dir, read_only=True)
    try:
        ctx = AuditContext(con, run_dir, load_manifest(con))
        options = inspection_options(config.check_options.get(CheckpointIntegrity.code, {}))
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
    from .common import EXIT_FAIL, EXIT_PASS, say, with_github, write

    config = AuditConfig.load(args.config)
    policy = Policy.load(args.policy, args.strict or config.strict)
    result = gate(
        args.run_dir, args.checkpoint, policy, config, data=args.data, source=args.source, log_file=args.log_file
    )
    r = result.rendering(args.run_dir)
    for option, name in (("junit", "junit"), ("json", "json"), ("sarif", "sarif")):
        if getattr(args, option):
            write(getattr(args, option), rendered(name, r), f"--{option}")
    if args.github:
        with_github(lambda: say(rendered("terminal", r), end=""), result.verdict, args.run_dir, gate=r.gate)
    else:
        say(rendered("terminal", r), end="")
    return EXIT_PASS if result.passed else EXIT_FAIL
