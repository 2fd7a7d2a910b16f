"""`sftaudit gate`: 0 on a passing checkpoint, 1 on a failing one, 2 when it cannot be judged;
JUnit with one testcase per check; the same bytes for the same input."""

import shutil
import xml.etree.ElementTree as ET

import pytest

from sftaudit.checks import registered_checks
from sftaudit.cli import main


def gate(run, checkpoint, *extra):
    return main(["gate", str(run), "--checkpoint", str(checkpoint), *map(str, extra)])


def test_clean_run_passes_every_checkpoint_with_stable_outputs(clean_run, tmp_path, capsys):
    for step in (10, 20, 30):
        junit, out = tmp_path / f"{step}.xml", tmp_path / f"{step}.json"
        assert gate(clean_run, f"checkpoint-{step}", "--junit", junit, "--json", out) == 0
        first = junit.read_bytes(), out.read_bytes()
        assert gate(clean_run, step, "--junit", junit, "--json", out) == 0
        assert (junit.read_bytes(), out.read_bytes()) == first
    suite = ET.parse(tmp_path / "30.xml").getroot()
    cases = [c.get("name") for c in suite.iter("testcase")]
    assert cases == [f"{c.code} {c.name}" for c in registered_checks()]
    assert suite.get("failures") == "0"
    assert "PASS" in capsys.readouterr().out


def test_bad_checkpoint_fails_and_a_good_one_of_the_same_run_passes(checkpoint_fault_run, tmp_path):
    junit = tmp_path / "gate.xml"
    assert gate(checkpoint_fault_run, "checkpoint-8", "--junit", junit) == 1
    failed = [c for c in ET.parse(junit).getroot().iter("testcase") if c.find("failure") is not None]
    assert [c.get("name").split()[0] for c in failed] == ["LOOP-09"]
    assert "non-finite" in failed[0].find("failure").get("message")
    assert gate(checkpoint_fault_run, "checkpoint-2") == 0
    assert gate(checkpoint_fault_run, checkpoint_fault_run / "checkpoint-10") == 1  # by path
    assert gate(checkpoint_fault_run, 14) == 1  # by step


def test_trainer_run(hf_checkpoint_fault_run, tmp_path):
    assert gate(hf_checkpoint_fault_run, "checkpoint-5") == 0
    assert gate(hf_checkpoint_fault_run, "checkpoint-10") == 1
    # checkpoint-15 lacks its RNG states: sound weights pass by default, fail when the policy
    # requires an exact-resume training state.
    assert gate(hf_checkpoint_fault_run, "checkpoint-15") == 0
    policy = tmp_path / "resume.toml"
    policy.write_text("[gate]\nrequire_resume_state = true\n")
    assert gate(hf_checkpoint_fault_run, "checkpoint-15", "--policy", policy) == 1
    assert gate(hf_checkpoint_fault_run, "checkpoint-20", "--policy", policy) == 0
    assert gate(hf_checkpoint_fault_run, "checkpoint-20") == 0


def test_policy_and_strict(checkpoint_fault_run, resumed_run, tmp_path):
    ignore = tmp_path / "ignore.toml"
    ignore.write_text('[gate]\nignore = ["LOOP-09"]\n')
    assert gate(checkpoint_fault_run, "checkpoint-8", "--policy", ignore) == 0
    # resumed_run: LOOP-11 fails at step 16 (in checkpoint-20's window) and 21 (weights not loaded,
    # checkpoint-25's); no warns: with nothing but warns blocking, --strict passes both.
    warns_only = tmp_path / "warns.toml"
    warns_only.write_text("[gate]\nblock = []\n")
    assert gate(resumed_run, "checkpoint-20", "--policy", warns_only, "--strict") == 0
    assert gate(resumed_run, "checkpoint-25", "--policy", warns_only, "--strict") == 0
    other_code = tmp_path / "codes.toml"
    other_code.write_text('[gate]\ncodes = ["LOOP-05"]\n')
    assert gate(resumed_run, "checkpoint-25", "--policy", other_code) == 0
    assert gate(resumed_run, "checkpoint-15") == 0 and gate(resumed_run, "checkpoint-25") == 1


@pytest.mark.parametrize("case", ["unknown checkpoint", "no run", "deleted checkpoint", "no artifacts", "bad policy"])
def test_cannot_judge_exits_2_with_one_line(clean_run, tmp_path, capsys, case):
    run, checkpoint, extra = clean_run, "checkpoint-20", []
    if case == "unknown checkpoint":
        checkpoint = "checkpoint-25"
    elif case == "no run":
        run = tmp_path / "nowhere"
    elif case == "deleted checkpoint":
        run = tmp_path / "copy"
        shutil.copytree(clean_run, run)
        shutil.rmtree(run / "checkpoint-20")
    elif case == "no artifacts":
        run = tmp_path / "copy"
        shutil.copytree(clean_run, run)
        shutil.rmtree(run / "sftaudit")
    else:
        (tmp_path / "p.toml").write_text('[gate]\nblock = ["fatal"]\n')
        extra = ["--policy", tmp_path / "p.toml"]
    assert gate(run, checkpoint, *extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("sftaudit: error: ") and err.count("\n") == 1


def test_junit_shows_a_check_on_partial_evidence_as_skipped_with_its_reason():
    """A check that judged only part of what was recorded is no plain pass in CI: skipped with the reason,
    or failed (the reason beside the failure) when what it judged blocks."""
    from sftaudit.commands.gate import GateResult, Policy

    finding = {"code": "LOOP-08", "severity": "fail", "step": 4, "checkpoint": "checkpoint-4", "message": "leaked"}
    checks = [
        ("LOOP-06", "logits distribution stability", "partial", "2 of 6 probe steps were not judged"),
        ("LOOP-07", "generation diversity", "ran", None),
        ("LOOP-08", "eval metric drift", "partial", "1 evaluation(s) recorded"),
    ]
    result = GateResult("run", {"name": "checkpoint-4", "step": 4}, Policy(), [finding], checks)
    cases = {c.get("name").split()[0]: c for c in ET.fromstring(result.to_junit().split("\n", 1)[1]).iter("testcase")}
    skipped = cases["LOOP-06"].find("skipped")
    assert skipped is not None and skipped.get("message").startswith("partial evidence: 2 of 6 probe steps")
    assert list(cases["LOOP-07"]) == []  # ran on its whole evidence, nothing found: the one plain pass
    assert cases["LOOP-08"].find("failure") is not None and cases["LOOP-08"].find("skipped") is None
    assert "partial evidence: 1 evaluation(s) recorded" in cases["LOOP-08"].find("system-out").text
