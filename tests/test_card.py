"""`sftaudit card`: the audit as a model card's "Training audit" section, printed or written between markers
into a Hugging Face README.md whose every other byte stays as it was."""

from __future__ import annotations

import shutil

import pytest

from sftaudit.commands.card import END, START
from tests.github_runs import cli, failed_run

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
    root = tmp_path_factory.mktemp("card")
    run = failed_run(root)
    config = root / "audit.toml"
    config.write_text('[audit]\ndisable = ["LOOP-10"]\n')
    assert cli("audit", run, "--config", config, "--no-report", "--out", root / "out", cwd=root).returncode == 1
    return run


def test_card_prints_the_stored_verdict_with_the_manifests_versions(audited, tmp_path):
    result = cli("card", audited, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("## Training audit\n\n**Verdict: ❌ FAIL** for run run.\n")
    assert "- **Roll back to:** checkpoint-80, the last intact checkpoint saved before it" in result.stdout
    assert "- **LOOP-10 loss pathologies and drift disabled** by the audit configuration" in result.stdout
    assert "| transformers | 4.45.2 |" in result.stdout and "*Audited by sftaudit " in result.stdout


def test_card_into_a_model_card_leaves_every_other_byte(audited, tmp_path):
    card = tmp_path / "README.md"
    card.write_bytes(CARD)
    assert cli("card", audited, "--into", card, cwd=tmp_path).returncode == 0
    written = card.read_bytes()
    assert written.startswith(CARD + b"\r\n\r\n" + START.encode() + b"\r\n## Training audit\r\n")  # the card's CRLF
    assert written.endswith(END.encode() + b"\r\n") and written.count(START.encode()) == 2  # one in the YAML
    # Again: the same bytes. A stale section is replaced and what follows it kept.
    assert cli("card", audited, "--into", card, cwd=tmp_path).returncode == 0
    assert card.read_bytes() == written
    after = b"\n\n## Citation\n\nkeep me\n"
    stale = written.replace(b"## Training audit", b"## Stale section")
    card.write_bytes(stale + after[2:])
    assert cli("card", audited, "--into", card, cwd=tmp_path).returncode == 0
    assert card.read_bytes() == written + after[2:]


def test_card_into_a_missing_card_creates_it(audited, tmp_path):
    card = tmp_path / "model" / "README.md"
    card.parent.mkdir()
    assert cli("card", audited, "--into", card, cwd=tmp_path).returncode == 0
    text = card.read_text(encoding="utf-8")
    assert text.startswith(START + "\n## Training audit\n") and text.endswith(END + "\n")


@pytest.mark.parametrize(
    "content, reason",
    [
        (f"# m\n{END}\n{START}\n".encode(), "the markers must appear once each"),
        (f"# m\n{START}\nx\n{END}\n{START}\n".encode(), "the markers must appear once each"),
        (b"# caf\xe9\n", "not UTF-8 text"),
    ],
)
def test_a_card_that_cannot_be_edited_is_one_line_and_exit_2(audited, tmp_path, content, reason):
    card = tmp_path / "README.md"
    card.write_bytes(content)
    result = cli("card", audited, "--into", card, cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and reason in result.stderr, result.stderr
    assert card.read_bytes() == content  # untouched


def test_a_run_not_audited_yet_is_audited_first(tmp_path):
    run = failed_run(tmp_path)
    result = cli("card", run, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (
        "**Verdict: ❌ FAIL**" in result.stdout and "LOOP-10 loss pathologies and drift disabled" not in result.stdout
    )
    assert (run / "sftaudit" / "audit.duckdb").is_file()


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    for args in (["card", tmp_path / "nowhere"], ["card"]):
        result = cli(*args, cwd=tmp_path)
        assert result.returncode == 2 and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    result = cli("card", empty, "--into", tmp_path / "README.md", cwd=tmp_path)
    assert result.returncode == 2 and "no sftaudit artifacts" in result.stderr
    assert not (tmp_path / "README.md").exists()
    shutil.rmtree(empty)
