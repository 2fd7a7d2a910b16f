"""The training data of an imported run (``--data FILE``), through the preflight path.

A Trainer output keeps no batches: which rows were trained, how they were rendered, padded and
masked is gone. Given the dataset, every row is rendered with the chat template of the tokenizer
the run saved, tokenized and collated by the standard completion-only collator, exactly as
`sftaudit preflight` does; the batches and samples become the run's ``batches``/``samples``
records, so LOOP-01..04 and LOOP-12 judge them, and LOOP-08 finds eval items among them.

The order the run drew the rows in is not on disk: every dataset batch is recorded at step 0
(micro-batch = batch number), and the audit restates findings there as dataset-level (no step,
resolution "dataset"). The description goes to ``sftaudit/dataset.json``, which later imports
put in the manifest, so the evidence stays until the next ``--data``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..core.artifacts import TOKENIZER_DIR, artifact_root, template_fingerprint
from ..errors import InputError
from .logs import read_json

DATASET_FILE = "dataset.json"
DATASET_SOURCE = "dataset (preflight path)"
DATASET_STEP = 0  # the dataset's batches: before any training step (the run's order is unknown)
DATASET_KINDS = ("batches", "samples")
# Checks that read the batches but judge what only the run's own batches carry.
DATASET_LACKS = {
    "micro_batch_loss": "the dataset given with --data has no loss per micro-batch: the run's own batches were not recorded",
    "collator": "the run's collator (packing or not) is not on disk: the dataset given with --data was collated "
    "by the standard completion-only collator",
}


def dataset_records(run_dir: Path, data: str | Path, batch_size: int | None, progress: bool = False) -> dict[str, list]:
    """``batches`` and ``samples`` records of the dataset, rendered and collated with the run's saved
    tokenizer; writes its description (and the rows that failed to render) to ``sftaudit/dataset.json``."""
    from ..core.tokenizer import load_tokenizer
    from ..dataset.batches import batch_record, dataset_batches, load_rows

    folder = artifact_root(run_dir) / TOKENIZER_DIR
    if not (folder / "tokenizer_config.json").is_file():
        raise InputError(f"{run_dir}: --data needs the tokenizer the run saved with its checkpoints, and there is none")
    tokenizer = load_tokenizer(folder)
    if not tokenizer.chat_template:
        raise InputError(f"{run_dir}: the run's saved tokenizer has no chat template to render --data {data} with")
    rows = load_rows(data)
    _, _, failures, batches, max_length = dataset_batches(
        tokenizer, rows, batch_size=batch_size or 8, progress=progress
    )
    fingerprint = template_fingerprint(tokenizer.chat_template)
    records: dict[str, list] = {"batches": [], "samples": []}
    for micro, b in enumerate(batches):
        records["batches"].append(batch_record(b, DATASET_STEP, micro, len(tokenizer), fingerprint))
        records["samples"] += [
            {
                "seg": 0,
                "step": DATASET_STEP,
                "micro": micro,
                "row": r,
                "sample_id": sample,
                "input_ids": b["input_ids"][r].tolist(),
                "labels": b["labels"][r].tolist(),
                "attention_mask": b["attention_mask"][r].tolist(),
            }
            for r, sample in enumerate(b["sample_ids"])
        ]
    description = {
        "data": str(data),
        "rows": len(rows),
        "batch_size": batch_size or 8,
        "max_length": max_length,
        "collator": "standard completion-only",
        "failures": failures,
    }
    (artifact_root(run_dir) / DATASET_FILE).write_text(json.dumps(description), encoding="utf-8")
    return records


def failure_events(description: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows the template refused or dropped content from, as the preflight records them (LOOP-01)."""
    failures = description.get("failures", [])
    if not failures:
        return []  # most runs: no dataset given, and the preflight path (jinja2 with it) stays unimported
    from ..dataset.batches import failure_records

    return failure_records(failures)


def dataset_description(run_dir: Path) -> dict[str, Any] | None:
    """What an earlier ``--data`` import rendered (None: no dataset was given)."""
    value = read_json(artifact_root(run_dir) / DATASET_FILE, run_dir)
    return value if isinstance(value, dict) else None
