"""Names from the run folder reach the terminal, the shell and CI's XML only as inert text."""

import json
import shlex
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

from sftaudit.commands.replay import fill_template
from sftaudit.core.artifacts import rank_dir
from sftaudit.core.terminal import json_safe, shown
from sftaudit.outputs.escape.xml import text as xml_text

HOSTILE = "\x1b]0;pwned\x07\x1b[2J\u202e\x85"  # window title, screen clear, right-to-left override, C1 NEL
RAW = ("\x1b", "\x07", "\u202e", "\x85")
FOLDER = "checkpoint-10'$(touch marker)'"


def run_cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "sftaudit.cli", *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=300
    )


def test_escapes():
    assert shown("a\x1b[2Jb\u202ec\nd") == "a\\x1b[2Jb\\u202ec\\x0ad"
    assert shown("a\x1bb\nc", keep_newlines=True) == "a\\x1bb\nc"
    assert shown("\ud800 \U000e0041 日本語 ü") == "\\ud800 \\U000e0041 日本語 ü"  # lone surrogate, tag; text kept
    assert json.loads(json_safe(json.dumps({"k": HOSTILE + "\ud800"}, ensure_ascii=False))) == {"k": HOSTILE + "\ud800"}
    assert not any(c in json_safe(json.dumps(HOSTILE, ensure_ascii=False)) for c in RAW)
    assert xml_text("a\x00b\x1bc\ufffed") == "a\\x00b\\x1bc\\ufffed"


def test_a_hostile_checkpoint_folder_stays_one_word_in_the_printed_command(tmp_path):
    template = "echo resuming {checkpoint} skipping {skip_steps}"
    command = fill_template(template, f"run/{FOLDER}", [11, 12])
    result = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert result.stdout == f"resuming run/{FOLDER} skipping [11, 12]\n"
    assert not (tmp_path / "marker").exists()
    # Inside a word of another language (a Python string) such a path cannot be quoted: not filled in.
    assert fill_template("python -c 'train(resume_from=\"{checkpoint}\")'", f"run/{FOLDER}", []) is None
    assert fill_template("python -c 'train(resume_from=\"{checkpoint}\")'", "run/checkpoint-10", []) == shlex.join(
        ["python", "-c", 'train(resume_from="run/checkpoint-10")']
    )


def hostile_run(nan_run, run, names: bool):
    """The NaN run with hostile sample ids and a resume template; with `names`, hostile tensor names
    (its checkpoints then no longer match: LOOP-09), else a hostile checkpoint folder."""
    shutil.copytree(nan_run, run, ignore=shutil.ignore_patterns("audit.duckdb*"))
    folder = rank_dir(run, 0)
    manifest = json.loads((folder / "manifest.jsonl").read_text())
    for p in manifest["params"] if names else []:
        p["name"] = p["name"].replace("embed_tokens", f"embed{HOSTILE}tokens")
    manifest["config"]["resume_command"] = "echo resuming {checkpoint}"
    (folder / "manifest.jsonl").write_text(json.dumps(manifest) + "\n")
    batches = (folder / "batches.jsonl").read_text()
    (folder / "batches.jsonl").write_text(batches.replace('"s0', '"' + json.dumps(HOSTILE)[1:-1] + "s0"))
    if not names:
        (run / "checkpoint-10").rename(run / FOLDER)
        checkpoints = (folder / "checkpoints.jsonl").read_text()
        (folder / "checkpoints.jsonl").write_text(checkpoints.replace('"checkpoint-10', json.dumps(FOLDER)[:-1]))
    return run


def test_hostile_names_reach_the_terminal_junit_and_shell_inert(nan_run, tmp_path):
    run = hostile_run(nan_run, tmp_path / "names", names=True)
    audit = run_cli("audit", run, "--no-report", "--out", tmp_path / "out")
    assert audit.returncode == 1, audit.stderr
    assert "embed\\x1b]0;pwned\\x07\\x1b[2J\\u202e\\x85tokens" in audit.stdout
    run = hostile_run(nan_run, tmp_path / "folder", names=False)
    replay = run_cli("replay", run)
    assert replay.returncode == 1, replay.stderr
    assert "\\x1b]0;pwned\\x07\\x1b[2J\\u202e\\x85s0" in replay.stdout
    replay_json = run_cli("replay", run, "--json")
    assert json.loads(replay_json.stdout)["batches"][0]["sample_ids"][0].startswith(HOSTILE)
    for out in (audit.stdout, audit.stderr, replay.stdout, replay.stderr, replay_json.stdout):
        assert not any(c in out for c in RAW), out
    # The printed resume command, pasted into a shell, echoes the folder and runs nothing.
    [command] = [line.strip() for line in replay.stdout.splitlines() if line.strip().startswith("echo resuming")]
    pasted = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert pasted.stdout.strip() == f"resuming {run / FOLDER}" and not (tmp_path / "marker").exists()

    junit = tmp_path / "gate.xml"
    gate = run_cli(
        "gate", tmp_path / "names", "--checkpoint", "checkpoint-20", "--junit", junit, "--json", tmp_path / "gate.json"
    )
    assert gate.returncode == 1 and not any(c in gate.stdout + gate.stderr for c in RAW)
    suite = ET.parse(junit).getroot()  # well-formed XML despite the control characters
    text = ET.tostring(suite, encoding="unicode")
    assert "\\x1b]0;pwned" in text and not any(c in text for c in RAW)
    cases = {c.get("name").split()[0]: c for c in suite.iter("testcase")}
    skipped = cases["LOOP-07"].find("skipped")  # not run (no generations recorded): skipped with the reason
    assert skipped is not None and skipped.get("message").startswith("not run: not recorded")
    assert int(suite.get("skipped")) == sum(1 for c in cases.values() if c.find("skipped") is not None)
    assert cases["LOOP-05"].find("failure") is not None
    assert not any(c in (tmp_path / "gate.json").read_text() for c in RAW)
