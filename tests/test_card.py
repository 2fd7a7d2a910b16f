"""`sftaudit card`: the audit as a model card's "Training audit" section, printed or written between markers
into a Hugging Face README.md whose every other byte stays as it was."""

from __future__ import annotations

import pytest

from sftaudit.cli import main
from sftaudit.commands.card import END, START
from sftaudit.store.rundb import database_path
from tests.github_runs import cli, failed_run, shared_failed_run

CARD = b"""---
license: apache-2.0
tags:
- sft
# <!-- sftaudit:start --> in a YAML comment is not a marker
---

# tiny-sft

A model fine-tuned on a tiny set.\r
Trailing text without a final newline"""


@pytest.fixture(scope="module")
def audited(tmp_path_factory):
    """A failed run audited with LOOP-10 turned off: a card that re-audited with the defaults would show it on."""
    run = shared_failed_run(tmp_path_factory)
    config = run.parent / "audit.toml"
    config.write_text('[audit]\ndisable = ["LOOP-10"]\n')
    assert main(["audit", str(run), "--config", str(config), "--no-report", "--out", str(run.parent / "out")]) == 1
    return run


def card(capsys, *args) -> tuple[int, str, str]:
    """`sftaudit card ...` in this process: exit code, stdout, stderr."""
    capsys.readouterr()
    code = main(["card", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_card_prints_the_stored_verdict_with_the_manifests_versions(audited, tmp_path):
    result = cli("card", audited, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("## Training audit\n\n**Verdict: ❌ FAIL** for run run.\n")
    assert "- **Roll back to:** checkpoint-80, the last intact checkpoint saved before it" in result.stdout
    assert "- **LOOP-10 loss pathologies and drift disabled** by the audit configuration" in result.stdout
    assert "| transformers | 4.45.2 |" in result.stdout and "*Audited by sftaudit " in result.stdout


def test_card_into_a_model_card_leaves_every_other_byte(audited, tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_bytes(CARD)
    assert card(capsys, audited, "--into", readme) == (0, "", "")
    written = readme.read_bytes()
    assert written.startswith(CARD + b"\r\n\r\n" + START.encode() + b"\r\n## Training audit\r\n")  # the card's CRLF
    assert written.endswith(END.encode() + b"\r\n") and written.count(START.encode()) == 2  # one in the YAML
    # Again: the same bytes. A stale section is replaced and what follows it kept.
    assert card(capsys, audited, "--into", readme)[0] == 0
    assert readme.read_bytes() == written
    after = b"## Citation\n\nkeep me\n"
    readme.write_bytes(written.replace(b"## Training audit", b"## Stale section") + after)
    assert card(capsys, audited, "--into", readme)[0] == 0
    assert readme.read_bytes() == written + after


def test_card_into_a_missing_card_creates_it(audited, tmp_path, capsys):
    readme = tmp_path / "model" / "README.md"
    readme.parent.mkdir()
    assert card(capsys, audited, "--into", readme)[0] == 0
    text = readme.read_text(encoding="utf-8")
    assert text.startswith(START + "\n## Training audit\n") and text.endswith(END + "\n")


@pytest.mark.parametrize(
    "content, reason",
    [
        (f"# m\n{END}\n{START}\n".encode(), "the markers must appear once each"),
        (f"# m\n{START}\nx\n{END}\n{START}\n".encode(), "the markers must appear once each"),
        (b"# caf\xe9\n", "not UTF-8 text"),
    ],
)
def test_a_card_that_cannot_be_edited_is_one_line_and_exit_2(audited, tmp_path, capsys, content, reason):
    readme = tmp_path / "README.md"
    readme.write_bytes(content)
    code, _, err = card(capsys, audited, "--into", readme)
    assert code == 2 and err.count("\n") == 1 and reason in err, err
    assert readme.read_bytes() == content  # untouched


def test_a_run_not_audited_yet_is_audited_first(tmp_path, capsys):
    run = failed_run(tmp_path)
    code, out, err = card(capsys, run)
    assert code == 0, err
    assert "**Verdict: ❌ FAIL**" in out and "LOOP-10 loss pathologies and drift disabled" not in out
    assert database_path(run).is_file()


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    result = cli("card", cwd=tmp_path)  # argparse's own error, in a real process
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    code, _, err = card(capsys, tmp_path / "nowhere")
    assert code == 2 and err == f"sftaudit: error: {tmp_path / 'nowhere'}: no such run directory\n"
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = card(capsys, empty, "--into", tmp_path / "README.md")
    assert code == 2 and "no sftaudit artifacts" in err and err.count("\n") == 1
    assert not (tmp_path / "README.md").exists()
