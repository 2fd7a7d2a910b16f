"""Batch records whose sample ids hold text no reader can hold (a lone surrogate, as a sample id decoded with
surrogateescape has; bytes that are not UTF-8) are kept: only that text is escaped or replaced, the lines are
counted in the verdict's evidence, and the audit judges the run instead of leaving it unjudged for lack of
batches."""

from __future__ import annotations

import json

import pytest

from sftaudit.core.artifacts import rank_dir
from sftaudit.shim.writer import JsonlWriter

from .builders import audit, recorded_run

pytestmark = pytest.mark.slow  # each test launches sftaudit

BAD_STEPS = range(11, 23)  # twelve batch records


def verdict(run, done) -> dict:
    """The verdict the audit printed the path of (a recorded run's report folder is named by its run id)."""
    written = done.stdout.strip().splitlines()[-1].removeprefix("verdict: ")
    return json.loads((run.parent / written).read_text())


def _rewrite_batches(run, write) -> None:
    path = rank_dir(run, 0) / "batches.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    path.unlink()
    for r in records:
        if r["step"] in BAD_STEPS:
            r["sample_ids"][0] = f"row-\udc80\ud800-{r['step']}"
    write(path, records)


def _through_the_shim(path, records) -> None:
    writer = JsonlWriter(path.parent)
    for r in records:
        writer.write("batches", r)
    writer.close()


def _raw(path, records) -> None:
    """As a writer that does not escape them would leave them: surrogates encoded raw, not UTF-8."""
    path.write_bytes(
        b"".join(json.dumps(r, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n" for r in records)
    )


@pytest.mark.parametrize("write", [_through_the_shim, _raw], ids=["shim", "raw-bytes"])
def test_records_with_lone_surrogates_are_kept_and_counted_and_the_run_judged(tmp_path, write):
    run = recorded_run(tmp_path, steps=60)
    _rewrite_batches(run, write)
    lines = (rank_dir(run, 0) / "batches.jsonl").read_bytes().splitlines()
    assert len(lines) == 60  # the shim kept every record
    done = audit(run, "--no-report")
    assert done.returncode == 0, done.stdout + done.stderr
    judged = verdict(run, done)
    assert judged["verdict"] == "pass" and not judged["cannot_judge"]
    assert judged["evidence"]["mended_lines"] == [{"file": "rank-0/batches.jsonl", "lines": 12, "of": 60}]
    assert judged["evidence"]["bad_lines"] == [] and judged["evidence"]["missing"] == []
    assert "text mended: 12 of 60 lines in rank-0/batches.jsonl" in done.stdout


def test_a_nan_after_mended_records_still_fails_at_its_step(tmp_path):
    """The mended records are judged like any other: a run that goes NaN at step 40 fails there."""
    run = recorded_run(tmp_path, steps=60, nan_step=40)
    _rewrite_batches(run, _through_the_shim)
    done = audit(run, "--no-report")
    assert done.returncode == 1, done.stdout + done.stderr
    assert verdict(run, done)["first_anomalous_step"] == 40
