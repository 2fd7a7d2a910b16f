"""Malformed input that sftaudit itself did not foresee once: nesting past the parser's recursion limit (JSON and
TOML), a manifest's schema_version or plan that is no number, a gradient-norm part that decompresses to far more
than the shim writes. Each gets one line naming the file and what is wrong (exit 2), or the right finding, in
bounded time; never "a bug in sftaudit"."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from .builders import AUDIT_BOUND_S, audit, findings, recorded_run, trainer_run

pytestmark = pytest.mark.slow  # each test launches sftaudit

DEEP = "[" * 100_000 + "]" * 100_000


def _one_line(done: subprocess.CompletedProcess, *said: str) -> str:
    assert done.returncode == 2, done.stdout + done.stderr
    line = done.stderr.strip()
    assert "\n" not in line and all(s in line for s in said), done.stderr
    assert "bug in sftaudit" not in line and "Traceback" not in line
    return line


@pytest.mark.parametrize(
    "text",
    [f"[audit]\ndisable = {DEEP}\n", "[audit]\nx = " + "{a=" * 50_000 + "1" + "}" * 50_000 + "\n"],
    ids=["array", "inline-table"],
)
@pytest.mark.parametrize("option", ["--config", "--policy"])
def test_toml_nested_too_deeply_is_refused_in_one_line(tmp_path, text, option):
    run = trainer_run(tmp_path)
    (tmp_path / "deep.toml").write_text(text)
    command = "gate" if option == "--policy" else "audit"
    extra = ["--checkpoint", "20"] if command == "gate" else []
    done = subprocess.run(
        [sys.executable, "-m", "sftaudit.cli", command, str(run), *extra, option, str(tmp_path / "deep.toml")],
        capture_output=True,
        text=True,
        timeout=AUDIT_BOUND_S,
        cwd=tmp_path,
    )
    _one_line(done, "deep.toml", "nested too deeply")


def test_a_safetensors_header_nested_too_deeply_fails_that_checkpoint(tmp_path):
    run = trainer_run(tmp_path)
    header = ('{"__metadata__": ' + DEEP + "}").encode()
    (run / "checkpoint-20" / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    done = audit(run, "--no-report")
    assert done.returncode == 1, done.stderr
    assert any("nested too deeply" in f["message"] and f["severity"] == "fail" for f in findings(run, "LOOP-09"))


@pytest.mark.parametrize("name", ["model.safetensors.index.json", "config.json"])
def test_checkpoint_json_nested_too_deeply_is_judged_not_raised(tmp_path, name):
    """A shard index or a model config of brackets: the index fails its checkpoint, the config is left unread;
    no check raises."""
    run = trainer_run(tmp_path)
    (run / "checkpoint-20" / "model.safetensors").write_bytes(b"")
    (run / "checkpoint-20" / name).write_text('{"weight_map": ' + DEEP + "}")
    done = audit(run, "--no-report")
    assert done.returncode in (0, 1), done.stderr
    verdict = json.loads((tmp_path / "reports" / "run" / "verdict.json").read_text())
    assert not verdict["check_errors"], verdict["check_errors"]


def _manifest(run: Path, change) -> None:
    path = next(run.rglob("manifest.jsonl"))
    first, *rest = path.read_text().splitlines()
    manifest = json.loads(first)
    change(manifest)
    path.write_text("\n".join([json.dumps(manifest), *rest]) + "\n")


@pytest.mark.parametrize(
    "change, said",
    [
        (lambda m: m.update(schema_version=None), "schema_version must be an integer (32-bit) >= 1, not null"),
        (lambda m: m.update(schema_version="3"), 'schema_version must be an integer (32-bit) >= 1, not "3"'),
        (lambda m: m.update(schema_version=-1), "schema_version must be an integer (32-bit) >= 1, not -1"),
        (
            lambda m: m["config"].update(max_steps=math.nan),
            "config.max_steps must be a finite number of steps, not NaN",
        ),
        (lambda m: m["config"].update(max_steps=math.inf), "config.max_steps must be a finite number of steps"),
        (lambda m: m["config"].update(max_steps=10**30), "config.max_steps must be a finite number of steps"),
        (lambda m: m["config"].update(logging_steps=-math.inf), "config.logging_steps must be a finite number"),
        (lambda m: m["config"].update(max_steps="40"), 'config.max_steps must be a finite number of steps, not "40"'),
    ],
    ids=[
        "null-version",
        "text-version",
        "negative-version",
        "nan-plan",
        "inf-plan",
        "huge-plan",
        "inf-logging",
        "text-plan",
    ],
)
def test_a_manifest_whose_version_or_plan_is_no_number_is_refused_in_one_line(tmp_path, change, said):
    """Recorded runs; the importers' side (trainer_state.json) ignores such values with a note instead."""
    run = recorded_run(tmp_path)
    _manifest(run, change)
    _one_line(audit(run, "--no-report"), "manifest.jsonl, line 1", said)


def test_the_trainers_minus_one_max_steps_is_a_plan_value_still_read(tmp_path):
    run = recorded_run(tmp_path)
    _manifest(run, lambda m: m["config"].update(max_steps=-1, logging_steps=0.1, num_train_epochs=3.0))
    assert audit(run, "--no-report").returncode == 0


def test_a_planted_columnar_metrics_file_claiming_more_rows_than_it_holds_is_refused_unread(tmp_path):
    """An import's metrics.parquet planted beside a recorded run's artifacts: four million identical rows in a few
    dozen KB, more than its bytes hold as an import writes them, refused from its footer in one line."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sftaudit.core.artifacts import rank_dir

    run = recorded_run(tmp_path)
    n = 1 << 22
    table = pa.table(
        {
            "seg": pa.array(np.zeros(n, np.int32)),
            "step": pa.array(np.ones(n, np.int64)),
            "name": pa.array(["loss"] * n, pa.string()),
            "value": pa.array(np.ones(n)),
        }
    )
    pq.write_table(table, rank_dir(run, 0) / "metrics.parquet", compression="zstd")
    _one_line(audit(run, "--no-report"), "metrics.parquet", f"claims {n} rows", "decompression bomb")


def test_a_planted_columnar_metrics_file_whose_page_header_lies_is_refused_unread(tmp_path):
    """An import's metrics.parquet whose footer is honest (20,000 rows in 170 KB) and whose first page of values
    claims 1 GiB uncompressed, its payload a zstd frame of that many zeros (tests/page_bombs.py): refused from its
    page headers in one line naming it, as a gradient part is; its honest twin is ingested."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sftaudit.core.artifacts import rank_dir
    from sftaudit.store.rundb import connect

    from ..page_bombs import lie_in_page_header

    n = 20_000
    table = pa.table(
        {
            "seg": pa.array(np.zeros(n, np.int32)),
            "step": pa.array(np.arange(1, n + 1, dtype=np.int64)),
            "name": pa.array(["eval_accuracy"] * n, pa.string()),
            "value": pa.array(np.random.default_rng(0).random(n)),
        }
    )
    honest, lying = recorded_run(tmp_path / "honest"), recorded_run(tmp_path / "lying")
    for run in (honest, lying):
        pq.write_table(table, rank_dir(run, 0) / "metrics.parquet", compression="zstd")
    lie_in_page_header(rank_dir(lying, 0) / "metrics.parquet", 1 << 30, column="value", bomb=True)
    _one_line(audit(lying, "--no-report"), "metrics.parquet", "claims 1073741824 bytes", "bomb")
    done = audit(honest, "--no-report")
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    con = connect(honest, read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM metrics WHERE name = 'eval_accuracy'").fetchone()[0] == n
    finally:
        con.close()


def test_a_gradient_part_that_decompresses_to_far_more_than_the_shim_writes_is_refused_unread(tmp_path):
    """Four million identical rows, a few hundred KB compressed: far more rows than a part of four tensors holds
    (the shim rolls a part every million norms), so it is refused from its footer, never decompressed."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sftaudit.core.artifacts import series_dir

    run = recorded_run(tmp_path)
    part = sorted(series_dir(run, 0, 0).glob("*.parquet"))[1]
    schema = pq.read_schema(part)
    n = 1 << 20
    block = pa.table({c: np.full(n, 15, dtype=schema.field(c).type.to_pandas_dtype()) for c in schema.names}, schema)
    with pq.ParquetWriter(part, schema, compression="zstd") as writer:
        for _ in range(4):
            writer.write_table(block)
    assert part.stat().st_size < 2**20
    _one_line(audit(run, "--no-report"), part.name, "claims 4194304 rows", "decompression bomb")


def test_a_gradient_part_whose_page_header_lies_is_refused_unread_in_bounded_memory(tmp_path):
    """A part of the shim's whose footer is honest and whose first page of norms claims 1 GiB uncompressed, its
    payload a zstd frame of that many zeros (tests/page_bombs.py): pyarrow and DuckDB would decompress all of it
    (1.1 GB; benchmarks/page_header_bomb.py). Refused from its page headers in one line naming it, the audit
    taking less than half what the page claims (about 200 MB; its clean twin is judged in 300 MB)."""
    from sftaudit.fixtures.live_run import write_live_run

    from sftaudit.core.artifacts import series_dir

    from ..page_bombs import lie_in_page_header, peak_rss

    run = tmp_path / "run"
    write_live_run(run, steps=1300, roll_steps=1300)  # 20,800 norms: a first page of 20,000, 60 KB compressed
    part = series_dir(run, 0, 0) / "part-000000001.parquet"
    lie_in_page_header(part, 1 << 30, bomb=True)
    command = [sys.executable, "-m", "sftaudit.cli", "audit", str(run), "--no-report"]
    status, rss, _, said = peak_rss(command, timeout=AUDIT_BOUND_S)
    _one_line(subprocess.CompletedProcess([], status, "", said), part.name, "claims 1073741824 bytes", "bomb")
    assert rss < 512, rss


@pytest.mark.parametrize(
    "eval_text, said",
    [
        (None, "no saved tokenizer to render the probe prompts with"),
        ('{"messages": ' + DEEP + "}\n", "nested too deeply"),
    ],
    ids=["no-tokenizer", "deep-eval-set"],
)
def test_probe_refuses_what_it_cannot_use_in_one_line(tmp_path, eval_text, said):
    run = trainer_run(tmp_path)
    (tmp_path / "prompts.txt").write_text("hello\n")
    extra = []
    if eval_text is not None:
        (tmp_path / "eval.jsonl").write_text(eval_text)
        extra = ["--eval", str(tmp_path / "eval.jsonl")]
    done = subprocess.run(
        [sys.executable, "-m", "sftaudit.cli", "probe", str(run), "--prompts", str(tmp_path / "prompts.txt"), *extra],
        capture_output=True,
        text=True,
        timeout=AUDIT_BOUND_S,
        cwd=tmp_path,
    )
    _one_line(done, said)


def test_steps_recorded_twice_in_one_segment_are_refused_in_one_line(tmp_path):
    """Artifacts copied into themselves: LOOP-05 and LOOP-10 raised on the repeated steps before."""
    run = recorded_run(tmp_path)
    path = next(run.rglob("steps.jsonl"))
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines + lines[:10]) + "\n")
    _one_line(audit(run, "--no-report"), "steps.jsonl records 10 step(s) more than once in segment 0 (first step 1)")


def test_steps_repeated_by_lines_appended_after_an_audit_are_refused_in_one_line(tmp_path):
    """The repeats checked at a re-audit are the new steps against every step, old and new."""
    run = recorded_run(tmp_path)
    assert audit(run, "--no-report").returncode in (0, 1)
    path = next(run.rglob("steps.jsonl"))
    lines = path.read_text().splitlines()
    with path.open("a") as out:
        out.write("\n".join(lines[2:5] + lines[3:4]) + "\n")
    _one_line(audit(run, "--no-report"), "steps.jsonl records 3 step(s) more than once in segment 0 (first step 3)")


def test_a_manifest_whose_special_tokens_are_no_table_is_refused_in_one_line(tmp_path):
    run = recorded_run(tmp_path)
    _manifest(run, lambda m: m.update(tokenizer={"special_tokens": 5}))
    _one_line(audit(run, "--no-report"), "tokenizer.special_tokens must map each role")


def test_a_chat_template_nested_past_the_parser_fails_loop01(tmp_path):
    run = recorded_run(tmp_path)
    _manifest(run, lambda m: m.update(tokenizer={"chat_template": "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}"}))
    done = audit(run, "--no-report")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "LOOP-01 fail run: chat template does not parse: nested too deeply" in done.stdout
    assert "could not run" not in done.stdout
