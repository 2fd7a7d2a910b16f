"""What the commands share: exit codes, printing text built from the run's own strings, writing an output file,
the default output folder, the verdict's terminal summary, the manifest's library versions, the GitHub Actions
outputs of `--github`."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


# In a default output folder: the resolved path of the run (or dataset) its outputs were written for.
OWNER_FILE = ".sftaudit-source"


def out_dir(args, run: str, source: str | Path) -> Path:
    """`--out` as given; else reports/<run>/, which belongs to the first run (or dataset) written there: a
    second one whose folder has the same name (a/run and b/run) gets reports/<run>-<8 hex digits of its
    resolved path>/, so no audit overwrites another run's report."""
    if args.out:
        return args.out
    import hashlib

    resolved = str(Path(source).resolve())
    target = DEFAULT_REPORTS / safe_name(run)
    try:
        owner = (target / OWNER_FILE).read_text(encoding="utf-8").strip() if (target / OWNER_FILE).is_file() else None
    except (OSError, UnicodeDecodeError):
        owner = None
    if owner is not None and owner != resolved:
        target = DEFAULT_REPORTS / f"{safe_name(run)}-{hashlib.sha256(resolved.encode()).hexdigest()[:8]}"
    write(target / OWNER_FILE, resolved + "\n", "output folder")  # a folder from before, unmarked, is claimed
    return target


def exit_code(verdict: str, strict: bool) -> int:
    if verdict == "unjudged":
        return EXIT_CANNOT_JUDGE
    if verdict == "fail" or (strict and verdict == "warn"):
        return EXIT_FAIL
    return EXIT_PASS


def print_summary(verdict: dict, verdict_path: Path, report: Path | None, codes: tuple[str, ...] = ()) -> None:
    """The verdict in a few lines; the checks not run are listed among `codes` (default: every check)."""
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
    lines += [
        f"  text mended: {b['lines']} of {b['of']} lines in {shown(b['file'])} kept with characters no reader can hold "
        f"escaped (a lone surrogate) or replaced (bytes not UTF-8)"
        for b in evidence.get("mended_lines", [])
    ]
    lines += [f"  note: {shown(note)}" for note in (verdict.get("resolution") or {}).get("notes") or []]
    not_run = [
        c
        for c in verdict.get("checks", [])
        if c["status"] in ("not_run", "disabled") and (not codes or c["code"] in codes)
    ]
    if not_run:
        lines.append("  not run: " + "; ".join(f"{c['code']} ({shown(c['reason'])})" for c in not_run))
    lines.append(f"verdict: {shown(verdict_path)}")
    if report:
        lines.append(f"report:  {shown(report)}")
    say("\n".join(lines))


def manifest_versions(run_dir: Path) -> dict[str, Any]:
    """The library versions the run's manifest records (the verdict does not carry them)."""
    from ..store.rundb import connect, load_manifest

    con = connect(run_dir, read_only=True)
    try:
        versions = load_manifest(con).get("versions")
    finally:
        con.close()
    return versions if isinstance(versions, dict) else {}


def with_github(show: Callable[[], None], verdict: dict, run_dir: Path, *, strict: bool = False, gate=None) -> None:
    """`--github`: `show` (the terminal summary, which quotes the run's own text) printed with workflow commands
    off, then the annotations and the Markdown step summary of the audit, or of the gate (`gate`: its JSON)."""
    from ..outputs import github
    from ..outputs.markdown import render, render_gate

    with github.commands_off():
        show()
    versions = manifest_versions(run_dir)
    markdown = (
        render_gate(gate, verdict, versions=versions)
        if gate is not None
        else render(verdict, heading="sftaudit audit", versions=versions)
    )
    lines = github.annotations(verdict, run_dir, strict=strict, gate=gate)
    github.publish(lines, markdown, os.environ.get("GITHUB_STEP_SUMMARY"))
