"""What the commands share: exit codes, printing text built from the run's own strings, writing an output file,
the default output folder, importing a folder trained without the shim, the verdict's terminal summary."""

from __future__ import annotations

import sys
from pathlib import Path

from ..core.terminal import safe_name, shown
from ..errors import InputError, one_line

EXIT_PASS, EXIT_FAIL, EXIT_CANNOT_JUDGE = 0, 1, 2
DEFAULT_REPORTS = Path("reports")


def error(message: str) -> None:
    """The one line a user sees when the input cannot be judged (escaped: it may quote the input)."""
    print(f"sftaudit: error: {shown(message)}", file=sys.stderr)


def say(text: str = "", end: str = "\n") -> None:
    """Print text built from the run's own strings: controls and bidi characters escaped."""
    print(shown(text, keep_newlines=True), end=end)


def write(path: Path, text: str, what: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise InputError(
            f"{what} {path}: cannot write ({exc.strerror or one_line(exc)}); give a writable file path"
        ) from None


def read(path: Path) -> str:
    from ..verdict.config import read_small_text

    return read_small_text(path, "file", limit=256 * 2**20)


def prepare(args) -> None:
    """A Trainer output trained without the shim is imported first (or re-imported: it may have grown)."""
    from ..imports import ensure_artifacts

    ensure_artifacts(args.run_dir, args.data, source=args.source, file=args.log_file)


def out_dir(args, run: str) -> Path:
    return args.out or DEFAULT_REPORTS / safe_name(run)


def exit_code(verdict: str, strict: bool) -> int:
    if verdict == "unjudged":
        return EXIT_CANNOT_JUDGE
    if verdict == "fail" or (strict and verdict == "warn"):
        return EXIT_FAIL
    return EXIT_PASS


def print_summary(verdict: dict, verdict_path: Path, report: Path | None) -> None:
    if verdict.get("cannot_judge"):
        from ..verdict.audit import unjudged_reason

        error(unjudged_reason(verdict))
    lines = [f"{shown(verdict['run'])}: {verdict['verdict'].upper()}"]
    window = (verdict.get("resolution") or {}).get("first_anomalous_window")
    if window:  # imported evidence: the step is only known to lie in a logging or checkpoint window
        lines[0] += f"; first anomalous {window['kind']}: steps {window['first_step']}-{window['last_step']}"
    elif verdict["first_anomalous_step"] is not None:
        lines[0] += f"; first anomalous step {verdict['first_anomalous_step']}"
    if verdict["rollback_checkpoint"]:
        lines[0] += f"; roll back to {shown(verdict['rollback_checkpoint'])}"
    for f in verdict["findings"]:
        where = f"step {f['step']}" if f["step"] is not None else "run"
        lines.append(f"  {f['code']} {f['severity']:<4} {where}: {shown(f['message'])}")
    lines += [f"  {e['code']} could not run: {shown(e['error'])}" for e in verdict["check_errors"]]
    evidence = verdict.get("evidence") or {}
    lines += [f"  partial evidence: {shown(note)}" for note in evidence.get("partial", [])]
    lines += [
        f"  unreadable lines: {b['lines']} of {b['of']} in {shown(b['file'])}" for b in evidence.get("bad_lines", [])
    ]
    lines += [f"  note: {shown(note)}" for note in (verdict.get("resolution") or {}).get("notes") or []]
    not_run = [c for c in verdict.get("checks", []) if c["status"] in ("not_run", "disabled")]
    if not_run:
        lines.append("  not run: " + "; ".join(f"{c['code']} ({shown(c['reason'])})" for c in not_run))
    lines.append(f"verdict: {shown(verdict_path)}")
    if report:
        lines.append(f"report:  {shown(report)}")
    say("\n".join(lines))
