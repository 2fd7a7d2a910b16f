"""The record schema is declared once (sftaudit/schema/records.py). Real runs are recorded by every
writer (the shim under a plain loop and under the Trainer, `sftaudit import` with `--data`, `sftaudit
preflight`); every key each writes is declared for it, every key declared required is in each of its
records, every declared field is written by its writers, and docs/artifacts.md is generated from it."""

from __future__ import annotations

import inspect
import json
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from sftaudit.fixtures import load_dataset
from sftaudit.fixtures.train import build_tokenizer, train_hf

from sftaudit.commands.preflight import preflight
from sftaudit.core.artifacts import COLUMNAR_IMPORT_KINDS, artifact_root
from sftaudit.imports import import_run
from sftaudit.schema.records import DATASET, IMPORT, PARAM_FIELDS, RECORDS, SERIES, SHIM
from sftaudit.store.ingest import _PARAM_FIELDS, _PARAM_OPTIONAL, _manifest_problem
from sftaudit.store.rundb import connect

ROOT = Path(__file__).resolve().parents[1]
DATASET_EVENTS = ("render_failed", "content_dropped")  # the events the dataset path writes in an imported run
# Declared fields the runs below never write, each on a path a clean run does not take.
RARE = {
    ("steps", "grad_norm_source", SHIM),  # a Trainer step whose norms could only be read after the clip
    ("batches", "position_resets", SHIM),  # batches that give position_ids (TRL packing)
    ("events", "probe", SHIM),  # shim_error / probe_disabled
    ("events", "error", SHIM),  # shim_error, a close by an exception, grad_hists_not_recorded
    ("events", "traceback", SHIM),  # shim_error
    ("events", "halted", SHIM),  # the guard stopped the run
    ("checkpoints", "kept_path", SHIM),  # the guard kept the last good checkpoint out of the rotation
}


def _files(run: Path) -> dict[str, list[dict]]:
    """Every record of every rank folder, by kind (a file of an undeclared kind fails here): JSONL, and the typed
    Parquet an import writes for its columnar kinds (a row's null fields are keys it did not write)."""
    records: dict[str, list[dict]] = defaultdict(list)
    for folder in sorted(artifact_root(run).glob("rank-*")):
        for path in sorted(folder.glob("*.jsonl")):
            assert path.stem in RECORDS, f"{path}: a record kind not declared in sftaudit/schema/records.py"
            records[path.stem] += [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        for path in sorted(folder.glob("*.parquet")):
            assert path.stem in COLUMNAR_IMPORT_KINDS, f"{path}: not a kind an import writes as Parquet"
            rows = pq.read_table(path).to_pylist()
            records[path.stem] += [{k: v for k, v in row.items() if v is not None} for row in rows]
    return records


def _tables(out: Path) -> dict[str, list[dict]]:
    """What preflight stored (it writes the database directly): each row's non-null fields, by kind."""
    con = connect(out, read_only=True)
    try:
        records = {"manifest": [json.loads(m) for (m,) in con.execute("SELECT manifest FROM manifest").fetchall()]}
        for kind in ("batches", "samples", "events"):
            cursor = con.execute(f'SELECT * EXCLUDE (rank) FROM "{kind}"')
            names = [d[0] for d in cursor.description]
            records[kind] = [{k: v for k, v in zip(names, row) if v is not None} for row in cursor.fetchall()]
    finally:
        con.close()
    return records


@pytest.fixture(scope="module")
def recorded(runs, tmp_path_factory, tokenizer_cache) -> tuple[Path, Path]:
    """A plain-loop run with every kind on (probes, generations, evals, histograms, checkpoints, metrics)
    and a Trainer run, both through the shim."""
    plain = runs(
        "record-schema",
        steps=4,
        checkpoint_every=2,
        eval_loss_every=2,
        probe_every=2,
        generate_every=2,
        eval_every=2,
        grad_hist_every=2,
        generations_per_prompt=1,
        max_new_tokens=4,
    )
    trainer = train_hf(
        tmp_path_factory.mktemp("record-schema") / "trainer",
        steps=3,
        save_steps=2,
        batch_size=4,
        max_length=64,
        probe_every=0,
        generate_every=0,
        eval_every=0,
        tokenizer_cache=tokenizer_cache,
    )
    return plain, trainer


@pytest.fixture(scope="module")
def written(recorded, tmp_path_factory, tokenizer_cache) -> dict[tuple[str, str], list[dict]]:
    """(writer, kind) -> the records that writer wrote, from one short run of each."""
    out: dict[tuple[str, str], list[dict]] = defaultdict(list)
    plain, trainer = recorded
    root = tmp_path_factory.mktemp("record-schema-import")
    for run in (plain, trainer):
        for kind, records in _files(run).items():
            out[SHIM, kind] += records
    # The same Trainer output without the shim's folder, imported with its data (one row the template refuses).
    bare = Path(shutil.copytree(trainer, root / "bare", ignore=shutil.ignore_patterns("sftaudit")))
    data = root / "train.jsonl"
    rows = load_dataset()[:12] + [{"id": "broken", "messages": "not a list"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    import_run(bare, data)
    for kind, records in _files(bare).items():
        for r in records:
            by_dataset = kind in ("batches", "samples") or (kind == "events" and r["kind"] in DATASET_EVENTS)
            out[DATASET if by_dataset else IMPORT, kind].append(r)
    build_tokenizer(tokenizer_cache)
    preflight(data, tokenizer_cache, root / "preflight", batch_size=4, progress=False)
    for kind, records in _tables(root / "preflight").items():
        out[DATASET, kind] += records
    return dict(out)


def undeclared(writer: str, kind: str, records: list[dict]) -> set[str]:
    return {k for r in records for k in r} - set(RECORDS[kind].names(writer))


def missing(writer: str, kind: str, records: list[dict]) -> set[str]:
    return {k for r in records for k in RECORDS[kind].names(writer, required=True) if k not in r}


def test_every_writer_writes_every_kind_it_is_declared_for(written):
    declared = {(w, k.name) for k in RECORDS.values() for f in k.fields for w in f.writers}
    assert set(written) == declared
    assert all(written.values())


def test_every_key_a_writer_emits_is_declared_for_it(written):
    stray = {(w, k): sorted(keys) for (w, k), records in written.items() if (keys := undeclared(w, k, records))}
    assert not stray, f"keys written but not declared in sftaudit/schema/records.py: {stray}"


def test_every_required_key_is_in_every_record_of_its_writers(written):
    absent = {(w, k): sorted(keys) for (w, k), records in written.items() if (keys := missing(w, k, records))}
    assert not absent, f"required keys left out: {absent}"


def test_every_declared_field_is_written_by_its_writers(written):
    seen = {(k, name, w) for (w, k), records in written.items() for r in records for name in r}
    declared = {(k.name, f.name, w) for k in RECORDS.values() for f in k.fields for w in f.writers}
    assert declared - seen == RARE, "declared fields no writer wrote (or RARE is stale)"


def test_every_series_part_has_the_declared_columns(recorded):
    import pyarrow.parquet as pq

    arrow = {"BIGINT": "int64", "INTEGER": "int32", "FLOAT": "float"}
    for run in recorded:
        for name, series in SERIES.items():
            parts = sorted((artifact_root(run) / "series" / name).glob("rank=*/seg=*/part-*.parquet"))
            assert parts, f"{run}: no {name} part"
            for part in parts:
                columns = {f.name: str(f.type) for f in pq.read_schema(part)}
                assert columns == {f.name: arrow[f.type] for f in series.fields}, part


def test_manifest_parameter_entries_are_declared(written):
    names = {f.name for f in PARAM_FIELDS}
    required = {f.name for f in PARAM_FIELDS if f.required}
    for writer in (SHIM, IMPORT):
        entries = [p for m in written[writer, "manifest"] for p in m["params"]]
        assert entries and not {k for p in entries for k in p} - names
        assert all(required <= set(p) for p in entries)
    # Ingest's validator checks the declared entries: the required ones always, the layout when given.
    assert (set(_PARAM_FIELDS), set(_PARAM_OPTIONAL)) == (required, names - required)


def test_a_stray_key_or_a_missing_required_one_is_caught(written):
    steps = [dict(r) for r in written[SHIM, "steps"]]
    steps[0]["grad_norm_typo"] = 1.0
    del steps[-1]["loss"]
    assert undeclared(SHIM, "steps", steps) == {"grad_norm_typo"}
    assert missing(SHIM, "steps", steps) == {"loss"}
    # A field the shim writes is not the import's to write.
    assert undeclared(IMPORT, "steps", written[SHIM, "steps"]) >= {"dt", "tokens"}


VALUES = {"int": 1, "float": 1.5, "str": "x", "bool": True, "object": {}, "list": []}


def _sample(duckdb_type: str):
    if duckdb_type.endswith("[]"):
        return []
    return {"INTEGER": 1, "BIGINT": 1, "DOUBLE": 1.5, "VARCHAR": "x", "BOOLEAN": True}.get(duckdb_type, {})


def test_manifest_validator_agrees_with_the_declaration():
    """Ingest refuses a manifest whose field has the wrong type: each field it checks is declared, and a
    value of the declared type passes."""
    fields = {f.name: f for f in RECORDS["manifest"].fields}
    named = set(re.findall(r'"(\w+)"', inspect.getsource(_manifest_problem)))
    checked = {
        name for name in named | set(fields) if any(_manifest_problem({name: v}) is not None for v in VALUES.values())
    }
    assert checked and checked <= set(fields), f"validated but not declared: {sorted(checked - set(fields))}"
    for name in checked:
        assert _manifest_problem({name: _sample(fields[name].type)}) is None, (name, fields[name].type)


def test_artifacts_page_is_generated_from_the_declaration():
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_artifact_docs.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    page = (ROOT / "docs" / "artifacts.md").read_text(encoding="utf-8")
    assert "`tokenizer_length`" in page and "`template_fingerprint`" in page
