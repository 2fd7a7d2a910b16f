"""`sftaudit preflight`: checks LOOP-01..04 on a dataset + tokenizer + chat template, before training.

Every sample is rendered (by transformers, as apply_chat_template renders it), tokenized and
collated (by the given collator, or a standard completion-only one), and the result is
written into the same DuckDB tables a recorded run is ingested into, with each batch as a
"step". The same checks then run on it, so findings, verdict and exit codes are those of
`audit`. No torch: tokenization is the tokenizer's Rust backend, masks are numpy.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from ..core.artifacts import (
    SCHEMA_VERSION,
    TOKENIZER_DIR,
    artifact_root,
    template_fingerprint,
)
from ..core.tokenizer import TokenizerRefused, describe_tokenizer, load_saved_tokenizer, remember_tokenizer
from ..dataset.batches import (
    batch_record,
    dataset_batches,
    describe_rows,
    failure_records,
    layout_or_none,
    load_rows,
)
from ..dataset.preview import dataset_preview
from ..errors import InputError, one_line
from ..schema.records import DATASET, RECORDS
from ..verdict.config import AuditConfig

# Not run on a dataset, and not because a config switched them off: the verdict says why.
TRAINING_ONLY = "judges training: preflight runs the dataset checks (LOOP-01..04) before any training"


def preflight(
    data: str | Path,
    tokenizer_dir: str | Path,
    out: str | Path,
    *,
    template: str | Path | None = None,
    collator: str | None = None,
    batch_size: int = 8,
    max_length: int | None = None,
    config: AuditConfig | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Render, tokenize, collate and check every sample; returns the verdict (stored under `out`)."""
    from ..checks import DATASET_CHECKS, registered_checks
    from ..store.rundb import connect, create_tables, remove_database
    from ..verdict.audit import judge_database

    try:
        tokenizer = load_saved_tokenizer(tokenizer_dir)
    except TokenizerRefused as exc:
        raise InputError(f"{tokenizer_dir}: {exc}") from None
    except Exception as exc:  # noqa: BLE001
        raise InputError(f"{tokenizer_dir}: cannot load tokenizer: {type(exc).__name__}: {one_line(exc)}") from None
    if template is not None:
        try:
            tokenizer.chat_template = Path(template).read_text(encoding="utf-8")
        except OSError as exc:
            raise InputError(f"--template {template}: {exc.strerror}") from None
    source = tokenizer.chat_template
    if not isinstance(source, str) or not source:
        raise InputError(f"{tokenizer_dir}: the tokenizer has no chat template (pass --template FILE)")
    if batch_size < 1:
        raise InputError("--batch-size must be at least 1")
    rows = load_rows(data)
    ids, rendered, failures, batches, max_length = dataset_batches(
        tokenizer, rows, collator=collator, batch_size=batch_size, max_length=max_length, progress=progress
    )

    out = Path(out)
    root = artifact_root(out)
    root.mkdir(parents=True, exist_ok=True)
    remove_database(out)  # the output folder's database (in sftaudit's cache) holds this preflight alone
    tokenizer.save_pretrained(str(root / TOKENIZER_DIR))
    remember_tokenizer(root / TOKENIZER_DIR, tokenizer)
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "run_id": f"preflight-{Path(data).stem}",
        "seg": 0,
        "rank": 0,
        "world_size": 1,
        "profile": "preflight",
        "started": time.time(),
        "params": [],
        "model": {"class": "none (preflight: no model)", "config": None, "tie_word_embeddings": None, "dropout": {}},
        "tokenizer": describe_tokenizer(tokenizer),
        "dataset": describe_rows(rows),
        "preflight": {
            "data": str(data),
            "tokenizer": str(tokenizer_dir),
            "template": str(template) if template else None,
            "collator": collator or "standard completion-only",
            "batch_size": batch_size,
            "max_length": max_length,
        },
        "preview": dataset_preview(tokenizer, source, layout_or_none(tokenizer), rendered, ids, batches),
    }
    config = config or AuditConfig()
    training = {c.code for c in registered_checks() if c.code not in DATASET_CHECKS}
    config.disabled = sorted(set(config.disabled) | training)
    con = connect(out)
    try:
        create_tables(con)
        _store(con, manifest, batches, failures, len(tokenizer), template_fingerprint(source))
        verdict = judge_database(con, out, config)
        for check in verdict["checks"]:
            if check["code"] in training:
                check["reason"] = TRAINING_ONLY
        con.execute("UPDATE audit_verdict SET verdict = ?", [json.dumps(verdict)])
        return verdict
    finally:
        con.close()


def _numbers(values: np.ndarray) -> pa.Array:
    """A numeric (not bool: Arrow packs those in bits) numpy vector as an Arrow array over its buffer. Not
    `pa.array`: its first call imports pandas (to ask whether the input is a pandas object), half a second of
    preflight's fixed cost."""
    values = np.ascontiguousarray(values)
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)])


def _strings(values: list[str]) -> pa.Array:
    """Python strings as an Arrow string column (its UTF-8 bytes and offsets; not `pa.array`, as above)."""
    encoded = [v.encode() for v in values]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int32)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    return pa.Array.from_buffers(
        pa.string(), len(encoded), [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(encoded))]
    )


def _records(records: list[dict]) -> pl.DataFrame:
    """Dict records as a frame with a type per field inferred from every record (pyarrow's `from_pylist`
    would import pandas, as above; polars is loaded anyway, for the checks)."""
    return pl.from_dicts(records, infer_schema_length=None)


def _list_column(matrices: list[np.ndarray]) -> pa.Array:
    """Rows of [B, T] matrices as one Arrow list column (no per-value Python objects)."""
    if not matrices:
        return pa.ListArray.from_arrays(_numbers(np.zeros(1, dtype=np.int32)), _numbers(np.zeros(0, dtype=np.int32)))
    values = np.concatenate([m.reshape(-1) for m in matrices]).astype(np.int32)
    widths = np.concatenate([np.full(m.shape[0], m.shape[1], dtype=np.int64) for m in matrices])
    offsets = np.concatenate([[0], np.cumsum(widths)]).astype(np.int32)
    return pa.ListArray.from_arrays(_numbers(offsets), _numbers(values))


def _store(
    con,
    manifest: dict,
    batches: list[dict],
    failures: list[tuple[str, str, str]],
    tokenizer_length: int,
    fingerprint: str | None,
) -> None:
    con.execute(
        "INSERT INTO manifest VALUES (0, 0, ?, ?, 'preflight', 1, ?, NULL, ?)",
        [manifest["run_id"], SCHEMA_VERSION, manifest["started"], json.dumps(manifest)],
    )
    if batches:  # each batch is a step (1..N) of one micro-batch
        _insert(
            con,
            "batches",
            _records([batch_record(b, step, 0, tokenizer_length, fingerprint) for step, b in enumerate(batches, 1)]),
        )
    sizes = np.array([len(b["sample_ids"]) for b in batches], dtype=np.int64)
    zeros = _numbers(np.zeros(int(sizes.sum()), dtype=np.int32))
    rows = [np.arange(s, dtype=np.int32) for s in sizes] or [np.zeros(0, dtype=np.int32)]
    _insert(
        con,
        "samples",
        pa.table(
            {
                "seg": zeros,
                "step": _numbers(np.repeat(np.arange(1, len(batches) + 1, dtype=np.int64), sizes)),
                "micro": zeros,
                "row": _numbers(np.concatenate(rows)),
                "sample_id": _strings([s for b in batches for s in b["sample_ids"]]),
                "input_ids": _list_column([b["input_ids"] for b in batches]),
                "labels": _list_column([b["labels"] for b in batches]),
                "attention_mask": _list_column([b["attention_mask"] for b in batches]),
            }
        ),
    )
    if failures:
        _insert(con, "events", _records(failure_records(failures)))


def _insert(con, kind: str, table: pa.Table | pl.DataFrame) -> None:
    """Records of the dataset path into the kind's table: the fields declared as its (`sftaudit.schema.records`)."""
    names = ", ".join(f'"{name}"' for name in RECORDS[kind].names(DATASET))
    con.register("new_records", table)
    con.execute(f'INSERT INTO "{kind}" (rank, {names}) SELECT 0, {names} FROM new_records')
    con.unregister("new_records")


def run(args) -> int:
    """The CLI: preflight the dataset, write verdict.json and the dataset report, print the summary."""
    from .common import exit_code, out_dir, print_summary, write

    config = AuditConfig.load(args.config)
    out = out_dir(args, f"preflight-{args.data.stem}", args.data)
    verdict = preflight(
        args.data,
        args.tokenizer,
        out,
        template=args.template,
        collator=args.collator,
        batch_size=args.batch_size,
        max_length=args.max_length,
        config=config,
        progress=not args.quiet,
    )
    write(out / "verdict.json", json.dumps(verdict, indent=2, sort_keys=True) + "\n", "--out")
    report = None
    if not args.no_report:
        from ..outputs.report import write_report

        report = write_report(out, out)
    from ..checks import DATASET_CHECKS

    print_summary(
        verdict, out / "verdict.json", report, codes=DATASET_CHECKS
    )  # the training checks are not its business
    return exit_code(verdict["verdict"], args.strict or config.strict)
