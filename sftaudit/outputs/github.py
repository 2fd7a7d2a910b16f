"""The verdict in GitHub Actions: workflow-command annotations and a Markdown step summary.

`annotations` writes one `::error` (blocking finding) or `::warning` (any other warn or fail finding) line per
finding, titled with its check, severity, step and checkpoint, within GitHub's caps: at most
`ANNOTATIONS_PER_LEVEL` errors and as many warnings per step (GitHub drops the rest), the overflow of each level
rolled up into its last line. A finding about a checkpoint is located at the checkpoint's folder; others have no
file (the run, not a line of code). Text is escaped as the runner decodes it (`data`, `prop`): ``%``, CR and LF
everywhere, and ``:`` and ``,`` in properties; control and bidi characters are first written as their visible
escapes. `commands_off` stops the runner from obeying workflow commands in the run's own text while the CLI
prints it. `summary` is the Markdown of `outputs.markdown` cut to what GitHub accepts for a step (1 MiB).
"""

from __future__ import annotations

import secrets
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from ..core.terminal import shown

ANNOTATIONS_PER_LEVEL = 10  # GitHub shows at most 10 error and 10 warning annotations per step
SUMMARY_LIMIT = 1024 * 1024  # bytes: GitHub refuses a larger step summary
TRUNCATED = "\n\n*The summary was cut here: GitHub takes at most 1 MiB per step. `sftaudit audit` writes every finding to verdict.json.*\n"


def data(value: Any) -> str:
    """A workflow command's message: ``%``, CR and LF escaped as the runner unescapes them."""
    return shown(value).replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def prop(value: Any) -> str:
    """A workflow command's property value: as `data`, and ``:`` and ``,`` too (they end a property)."""
    return data(value).replace(":", "%3A").replace(",", "%2C")


def command(level: str, message: Any, **properties: Any) -> str:
    """One workflow command. The runner trims the properties and drops an empty one: so do we."""
    values = {key: prop(value).strip() for key, value in properties.items() if value is not None}
    props = ",".join(f"{key}={value}" for key, value in values.items() if value)
    return f"::{level}{' ' + props if props else ''}::{data(message)}"


def annotations(
    verdict: dict[str, Any], run_dir: str | Path, *, strict: bool = False, gate: dict[str, Any] | None = None
) -> str:
    """The annotation lines of an audit (fail blocks; warn too when `strict`) or of a gate (`gate`: the
    document `sftaudit gate --json` writes; its blocking findings are errors, its other findings warnings)."""

    def blocks(f: dict[str, Any]) -> bool:
        if gate is not None:
            return f in gate["blocking"]
        return f["severity"] == "fail" or (strict and f["severity"] == "warn")

    paths = {c["name"]: c["path"] for c in verdict.get("checkpoints") or []}
    levels: dict[str, list[tuple[str | None, str]]] = {"error": [], "warning": []}  # (check code, line)
    if verdict.get("cannot_judge"):
        title = f"sftaudit could not judge {verdict['run']}"
        levels["error"].append((None, command("error", verdict["cannot_judge"], title=title)))
    for e in verdict.get("check_errors") or []:
        levels["error"].append((e["code"], command("error", e["error"], title=f"{e['code']} could not run")))
    for f in gate["findings"] if gate is not None else verdict["findings"]:
        if f["severity"] not in ("warn", "fail"):
            continue
        level = "error" if blocks(f) else "warning"
        where = "the run" if f["step"] is None else f"step {f['step']}"
        title = f"{f['code']} {f['severity']} at {where}" + (f" ({f['checkpoint']})" if f["checkpoint"] else "")
        about = f["checkpoint"] if f.get("scope") == "checkpoint" else None
        file = f"{Path(run_dir).as_posix()}/{paths[about]}" if about in paths else None
        levels[level].append((f["code"], command(level, f["message"], file=file, title=title)))
    return "".join(line + "\n" for level, items in levels.items() for line in _capped(level, items))


def _capped(level: str, items: list[tuple[str | None, str]]) -> list[str]:
    """At most ANNOTATIONS_PER_LEVEL lines: past it, the last one says what else there is."""
    if len(items) <= ANNOTATIONS_PER_LEVEL:
        return [line for _, line in items]
    rest = items[ANNOTATIONS_PER_LEVEL - 1 :]
    codes = sorted({code for code, _ in rest if code})
    message = (
        f"{len(rest)} more {level}s not annotated (GitHub shows {ANNOTATIONS_PER_LEVEL} per step)"
        + (f": {', '.join(codes)}" if codes else "")
        + "; sftaudit audit writes every finding to verdict.json"
    )
    return [line for _, line in items[: ANNOTATIONS_PER_LEVEL - 1]] + [
        command(level, message, title=f"sftaudit: {len(rest)} more {level}s")
    ]


def summary(markdown: str, limit: int = SUMMARY_LIMIT) -> str:
    """`markdown` cut at a line so that it takes at most `limit` bytes in UTF-8, saying so when cut."""
    encoded = markdown.encode("utf-8")
    if len(encoded) <= limit:
        return markdown
    room = max(limit - len(TRUNCATED.encode("utf-8")), 0)
    kept = encoded[:room].decode("utf-8", errors="ignore")
    kept = kept[: kept.rfind("\n") + 1] if "\n" in kept else ""
    return kept + TRUNCATED if len(TRUNCATED.encode("utf-8")) <= limit else ""


def publish(annotation_lines: str, markdown: str, summary_path: str | None, out: TextIO | None = None) -> None:
    """Print the annotations; append the summary to the step's summary file (`$GITHUB_STEP_SUMMARY`) when
    there is one, keeping that file within GitHub's limit."""
    out = out or sys.stdout
    out.write(annotation_lines)
    out.flush()
    if not summary_path:
        return
    path = Path(summary_path)
    used = path.stat().st_size if path.exists() else 0
    with path.open("a", encoding="utf-8") as f:
        f.write(summary(markdown, SUMMARY_LIMIT - used))


@contextmanager
def commands_off(out: TextIO | None = None) -> Iterator[None]:
    """While the CLI prints the run's own text, the runner obeys no workflow command in it (a run named
    ``::error::...`` or ``::stop-commands::...``): GitHub's stop-commands, with a token nobody can guess."""
    out = out or sys.stdout
    token = secrets.token_hex(16)
    out.write(f"::stop-commands::{token}\n")
    out.flush()
    try:
        yield
    finally:
        sys.stdout.flush()
        out.write(f"::{token}::\n")
        out.flush()
