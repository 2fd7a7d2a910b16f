"""`sftaudit card RUN_DIR [--into README.md]`: the run's audit as a "Training audit" section of a model card.

The section (`outputs.markdown`) holds the verdict, the checkpoints to keep and to roll back to, the findings
that matter, what could not be judged and the library versions the run's manifest records. It is printed, or
`--into` writes it into a Hugging Face model card between `START` and `END`: the section between the markers
is replaced, or appended when the card has none (a missing card is created); every other byte of the file,
front matter included, stays as it was (markers inside the front matter are not ours). The run's stored verdict is used (as `report` does); a run not audited
yet is audited first.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from ..errors import InputError, one_line

START = "<!-- sftaudit:start -->"
END = "<!-- sftaudit:end -->"
CARD_LIMIT = 16 * 2**20  # bytes: a model card is a few KiB


def run(args) -> int:
    from .._version import __version__
    from ..outputs.markdown import render
    from .common import EXIT_PASS, manifest_versions, say

    verdict = audited_verdict(args.run_dir)
    section = render(verdict, versions=manifest_versions(args.run_dir), audited_with=__version__)
    if args.into is None:
        say(section, end="")
    else:
        insert(args.into, section)
    return EXIT_PASS


def audited_verdict(run_dir: Path) -> dict[str, Any]:
    """The run's stored verdict, as `report` reads it; a run with none (not audited yet) is audited first."""
    from ..imports import ensure_artifacts
    from ..verdict.audit import audit, stored_verdict

    try:
        return stored_verdict(run_dir)
    except InputError:  # not ingested or not audited yet: audit it as `sftaudit audit` would
        ensure_artifacts(run_dir)
        return audit(run_dir)


def insert(card: Path, section: str) -> None:
    """Write `section` between the markers of the model card `card`, every other byte left as it was."""
    original = _read(card)
    try:
        text = original.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"--into {card}: not UTF-8 text; give the model card (README.md)") from None
    newline = "\r\n" if "\r\n" in text else "\n"
    block = START + newline + section.replace("\n", newline) + END
    head, body = _split_front_matter(text)  # the front matter is never read for markers nor touched
    start, end = body.find(START), body.find(END)
    if start < 0 and end < 0:
        separator = "" if not text or text.endswith("\n") else newline
        updated = text + separator + (newline if text else "") + block + newline
    elif start < 0 or end < start or body.count(START) > 1 or body.count(END) > 1:
        raise InputError(
            f"--into {card}: the markers must appear once each, {START} before {END}; fix them or remove both"
        )
    else:
        updated = head + body[:start] + block + body[end + len(END) :]
    _replace(card, updated.encode("utf-8"))


def _read(card: Path) -> bytes:
    if not card.exists():
        return b""
    if not card.is_file():
        raise InputError(f"--into {card}: not a regular file")
    if card.stat().st_size > CARD_LIMIT:
        raise InputError(f"--into {card}: larger than {CARD_LIMIT} bytes: not a model card")
    try:
        return card.read_bytes()
    except OSError as exc:
        raise InputError(f"--into {card}: cannot read ({exc.strerror or one_line(exc)})") from None


def _split_front_matter(text: str) -> tuple[str, str]:
    """The YAML front matter (a Hugging Face card's metadata, between two `---` lines at the top) and the rest."""
    lines = text.splitlines(keepends=True)
    if not lines or lines[0].rstrip("\r\n") != "---":
        return "", text
    offset = len(lines[0])
    for line in lines[1:]:
        offset += len(line)
        if line.rstrip("\r\n") == "---":
            return text[:offset], text[offset:]
    return "", text


def _replace(card: Path, data: bytes) -> None:
    """Write the card whole or not at all (a temporary file beside it, renamed over it), keeping its mode."""
    try:
        card = card.resolve()  # a card that is a link is edited where it lies
        fd, tmp = tempfile.mkstemp(prefix=f".{card.name}.", dir=card.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            if card.exists():
                os.chmod(tmp, card.stat().st_mode & 0o7777)
            os.replace(tmp, card)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise InputError(
            f"--into {card}: cannot write ({exc.strerror or one_line(exc)}); give a writable file"
        ) from None
