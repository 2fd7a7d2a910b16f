"""What the commands share: exit codes, printing text built from the run's own strings, writing an output file,
the default output folder, the verdict's terminal summary, the HTML report, the manifest's library versions, the
GitHub Actions outputs of `--github`. Every output is a format of `sftaudit.outputs`, picked by name; what a
format shows beyond the verdict is read here and handed in."""

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


def print_summary(verdict: dict, written: dict[str, Path], codes: tuple[str, ...] = ()) -> None:
    """The verdict in a few lines (the `terminal` format); the checks not run are listed among `codes` (default:
    every check); `written`: output name (verdict, report) -> where it was written."""
    from ..outputs import Rendering, rendered

    if verdict.get("cannot_judge"):
        from ..verdict.audit import unjudged_reason

        error(unjudged_reason(verdict))
    rendering = Rendering(verdict, Path(), codes=codes, written={k: v for k, v in written.items() if v})
    print(rendered("terminal", rendering), end="")


def write_report(run_dir: str | Path, out: Path) -> Path:
    """OUT/report.html of the run's stored verdict and database (no check is re-run): read here, rendered by
    the `report` format."""
    from ..outputs import Rendering, rendered
    from ..outputs.report import read
    from ..store.rundb import connect
    from ..verdict.audit import stored_verdict

    verdict = stored_verdict(run_dir)
    con = connect(run_dir, read_only=True)
    try:
        report_data = read(con, verdict)
    finally:
        con.close()
    path = Path(out) / "report.html"
    write(path, rendered("report", Rendering(verdict, Path(run_dir), report=report_data)), "--out")
    return path


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
    off, then the `github` format: the annotations and the Markdown step summary of the audit, or of the gate
    (`gate`: its JSON)."""
    from ..outputs import Rendering, github, rendered

    with github.commands_off():
        show()
    r = Rendering(verdict, Path(run_dir), gate=gate, strict=strict, versions=manifest_versions(run_dir))
    github.publish(rendered("github", r), github.step_summary(r), os.environ.get("GITHUB_STEP_SUMMARY"))
