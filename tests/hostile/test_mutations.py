"""Property: mutated artifact lines of a real recorded run end in exit 0, 1 or 2, with no traceback,
and never in PASS (or WARN) when the mutation removed evidence (with no share of lost records allowed).

What counts as removed evidence (the oracle) is what the format promises to notice: a line that is no
longer a record (not a JSON object, cut short, bytes that are not JSON), a record whose field of a
declared type now holds another kind of value (a string where a number was), and a dropped steps
record before the last one or a dropped batch record (the shim writes both at every step; the last
steps record may be lost by a crash, which the format allows). The manifest is only cut or dropped:
the checks read its free-form parts as the shim wrote them.
"""

import contextlib
import io
import json
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from sftaudit.cli import main
from sftaudit.core.artifacts import rank_dir
from sftaudit.store.rundb import RECORD_COLUMNS

FILES = ("steps", "batches", "samples", "grad_hists", "probes", "checkpoints", "events", "manifest")
OPS = ("truncate", "flip", "drop", "duplicate", "retype")


def kind(value):
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


def parsed(line: bytes):
    try:
        value = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def removes_evidence(name: str, original: bytes, mutated: list[bytes], last: bool, op: str) -> bool:
    if op == "drop":
        return name == "batches" or name == "manifest" or (name == "steps" and not last)
    if op == "duplicate":
        return False
    before, declared = parsed(original), RECORD_COLUMNS.get(name, {})
    for line in mutated:
        after = parsed(line)
        if after is None:
            return True
        changed = [k for k in before if k in after and after[k] is not None and kind(after[k]) != kind(before[k])]
        if name == "manifest" and changed or any(declared.get(k, "JSON") != "JSON" for k in changed):
            return True
    return False


def mutate(line: bytes, op: str, data) -> list[bytes]:
    if op == "truncate":
        return [line[: data.draw(st.integers(0, max(len(line) - 1, 0)), label="cut")]]
    if op == "flip":
        at = data.draw(st.integers(0, len(line) - 1), label="at")
        byte = data.draw(st.integers(0, 255), label="byte")
        return [line[:at] + bytes([byte]) + line[at + 1 :]]
    if op == "drop":
        return []
    if op == "duplicate":
        return [line, line]
    record = json.loads(line)
    key = data.draw(st.sampled_from(sorted(record)), label="key")
    record[key] = data.draw(st.sampled_from(["x", [1, "y"], {"a": 1}, True, 1.5]), label="value")
    return [json.dumps(record).encode()]


@pytest.fixture(scope="module")
def pristine(clean_run):
    return clean_run


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    phases=(Phase.explicit, Phase.generate),  # no shrinking: bounded
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_mutated_artifacts_never_pass_without_their_evidence(pristine, data):
    name = data.draw(
        st.sampled_from([f for f in FILES if (rank_dir(pristine, 0) / f"{f}.jsonl").exists()]), label="file"
    )
    ops = ("truncate", "drop") if name == "manifest" else OPS
    op = data.draw(st.sampled_from(ops), label="op")
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        shutil.copytree(pristine, run, ignore=shutil.ignore_patterns("audit.duckdb*"))
        path = rank_dir(run, 0) / f"{name}.jsonl"
        lines = path.read_bytes().splitlines()
        index = data.draw(st.integers(0, len(lines) - 1), label="line")
        mutated = mutate(lines[index], op, data)
        removed = removes_evidence(name, lines[index], mutated, index == len(lines) - 1, op)
        path.write_bytes(b"".join(line + b"\n" for line in lines[:index] + mutated + lines[index + 1 :]))
        # No share of lost records allowed (the default allows 1%: tested in test_evidence), so that
        # every removal must be noticed.
        config = Path(tmp) / "audit.toml"
        config.write_text("[verdict]\nmax_missing_share = 0\n")
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["audit", str(run), "--no-report", "--out", str(Path(tmp) / "out"), "--config", str(config)])
        verdict_file = Path(tmp) / "out" / "verdict.json"
        verdict = json.loads(verdict_file.read_text())["verdict"] if verdict_file.exists() else None
    assert code in (0, 1, 2)
    assert "Traceback" not in err.getvalue() and err.getvalue().count("\n") <= 1, err.getvalue()
    if code == 2:
        assert err.getvalue().startswith("sftaudit: error: "), err.getvalue()
    if removed:
        assert code != 0 and verdict in (None, "fail", "unjudged"), (name, op, index, out.getvalue(), err.getvalue())
