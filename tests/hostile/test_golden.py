"""A golden file is untrusted input: refused in one line (exit 2) when it is not what `sftaudit golden` writes,
before any value of it is used; and `sftaudit golden` writes plain JSON (a value that is not finite is null, with
what it was), valid against its published schema."""

from __future__ import annotations

import importlib.resources
import json
import math
import os
import subprocess
import sys

import pytest
from jsonschema import Draft202012Validator

from .builders import AUDIT_BOUND_S, recorded_run

pytestmark = pytest.mark.slow  # each test launches sftaudit


def cli(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sftaudit.cli", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=AUDIT_BOUND_S,
        stdin=subprocess.DEVNULL,
    )


def strict_json(text: str):
    def refuse(word):
        raise ValueError(f"bare {word} in a golden file")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    """A run whose loss and gradient norms are NaN from step 12 on, and its golden file."""
    root = tmp_path_factory.mktemp("golden")
    run = recorded_run(root, nan_step=12)
    done = cli("golden", run, "--out", root / "golden.json", "--stride", 1, cwd=root)
    assert done.returncode == 0, done.stderr
    return run, root / "golden.json"


def test_golden_writes_plain_json_valid_against_its_schema_with_nulls_for_nan(golden):
    run, path = golden
    written = strict_json(path.read_text())  # no bare NaN
    schema = json.loads((importlib.resources.files("sftaudit.schema") / "golden.schema.json").read_text())
    Draft202012Validator.check_schema(schema)
    assert not list(Draft202012Validator(schema).iter_errors(written))
    assert written["steps"]["step"][:2] == [1, 2] and written["steps"]["loss"][11] is None
    said = {tuple(n["series"]): n["value"] for n in written["not_finite"] if n["index"] == 11}
    assert said[("steps", "loss")] == "nan" and said[("tensors", "layer0.weight", "norms")] == "nan"


def test_the_nulls_read_back_as_the_nan_they_were(golden):
    """Against its own golden file the run does not diverge; against a clean twin it diverges where the NaN starts."""
    run, path = golden
    same = cli("diff", path, run, cwd=run.parent)
    assert same.returncode == 0 and "no divergence" in same.stdout, same.stdout + same.stderr
    clean = recorded_run(run.parent / "clean")
    other = cli("diff", path, clean, cwd=run.parent)
    assert other.returncode == 1 and "diverged at step 12" in other.stdout, other.stdout + other.stderr


def _edited(golden_path, change):
    g = json.loads(golden_path.read_text())
    change(g)
    return g


BROKEN = {
    "steps missing": (lambda g: g.pop("steps"), "'steps' is a required property"),
    "steps a string": (lambda g: g.update(steps="abc"), "at steps: 'abc' is not of type 'object'"),
    "step past int64": (lambda g: g["steps"]["step"].__setitem__(0, 2**70), "at steps/step/0"),
    "negative step": (lambda g: g["steps"]["step"].__setitem__(0, -3), "at steps/step/0"),
    "a tensor step as text": (lambda g: g["tensors"]["layer1.weight"]["steps"].__setitem__(1, "a"), "not of type"),
    "a loss as text": (lambda g: g["steps"]["loss"].__setitem__(1, "1.0"), "at steps/loss/1"),
    "loss shorter than steps": (lambda g: g["steps"]["loss"].pop(), "steps/loss is not as long as its steps"),
    "norms shorter than steps": (
        lambda g: g["tensors"]["layer1.weight"]["norms"].pop(),
        "tensors/layer1.weight is not as long as its steps",
    ),
    "a data order key that is no step": (lambda g: g["data_order"].update({"1e5": "x"}), "at data_order"),
    "a finding that is no triple": (lambda g: g.update(findings=[["LOOP-05"]]), "at findings/0"),
    "not_finite naming nothing": (
        lambda g: g["not_finite"].append({"series": ["steps", "nope"], "index": 0, "value": "nan"}),
        "not_finite names no value",
    ),
    "not_finite out of range": (
        lambda g: g["not_finite"].append({"series": ["steps", "loss"], "index": 10**6, "value": "nan"}),
        "not_finite names no value",
    ),
    "a list": (lambda g: g.clear(), "not a golden file of version 1"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_malformed_golden_file_is_refused_in_one_line(golden, tmp_path, case):
    run, path = golden
    change, reason = BROKEN[case]
    bad = tmp_path / "golden.json"
    bad.write_text(json.dumps(_edited(path, change)))
    done = cli("diff", bad, run, cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert reason in done.stderr and "write it again with `sftaudit golden" in done.stderr, done.stderr
    assert "bug in sftaudit" not in done.stderr


@pytest.mark.parametrize(
    "text, reason",
    [
        ('{"sftaudit_golden": 1, "steps": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
        ('{"sftaudit_golden": 1, "steps": {', "not JSON"),
        ("\ufeff\udcff", "not JSON"),
    ],
)
def test_a_golden_file_that_is_not_json_is_refused_in_one_line(golden, tmp_path, text, reason):
    run, _ = golden
    bad = tmp_path / "golden.json"
    bad.write_bytes(text.encode("utf-8", "surrogateescape"))
    done = cli("diff", bad, run, cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and reason in done.stderr, done.stderr


@pytest.mark.parametrize("size", [2**30, 2**33])
def test_a_huge_golden_file_is_refused_by_its_size_before_it_is_read(golden, tmp_path, size):
    """A sparse file of 1 GB or 8 GB: refused from its size alone, in seconds, without reading it."""
    run, _ = golden
    bad = tmp_path / "golden.json"
    with open(bad, "wb") as f:
        f.truncate(size)
    assert os.stat(bad).st_blocks == 0  # sparse: nothing was written to disk
    done = cli("diff", run, bad, cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert f"{size} bytes, over the" in done.stderr and "bug in sftaudit" not in done.stderr


def test_a_golden_file_of_an_earlier_release_still_reads(golden, tmp_path):
    """Written before `not_finite`: bare NaN and float steps, which Python's json read and wrote."""
    run, path = golden
    old = _edited(path, lambda g: g.pop("not_finite"))
    old["steps"]["step"] = [float(s) for s in old["steps"]["step"]]
    old["steps"]["loss"] = [math.nan if v is None else v for v in old["steps"]["loss"]]
    (tmp_path / "old.json").write_text(json.dumps(old))
    done = cli("diff", tmp_path / "old.json", run, cwd=tmp_path)
    assert done.returncode == 0 and "no divergence" in done.stdout, done.stdout + done.stderr
