"""The dataset path: rows loaded, rendered with the chat template, tokenized and collated into the
batch records the data-layer checks read. `sftaudit preflight` runs it on a dataset before training;
`sftaudit import --data` runs it on the training data of a run nobody instrumented."""

from __future__ import annotations

import importlib
import itertools
import json
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError, one_line
from .layout import IGNORE_INDEX, TRAINED, expected_labels, run_layout
from .render import Renderer, tokenizer_specials
from .sandbox import TemplateBudget

PROGRESS_FROM = 2000  # rows: smaller datasets finish before a bar would help
ENCODE_CHUNK = 2048  # rendered texts per tokenizer call: large enough to batch, small enough to overlap


def load_rows(path: str | Path) -> list[dict]:
    """Rows of a JSONL file or of a Hugging Face `datasets` folder (`save_to_disk`)."""
    path = Path(path)
    if path.is_dir():
        try:
            from datasets import DatasetDict, load_from_disk

            data = load_from_disk(str(path))
        except Exception as exc:  # noqa: BLE001 - whatever the folder holds, it is bad input
            raise InputError(f"{path}: not a datasets folder: {type(exc).__name__}: {one_line(exc)}") from None
        if isinstance(data, DatasetDict):
            data = data["train"] if "train" in data else next(iter(data.values()))
        return data.to_list()
    if not path.is_file():
        raise InputError(f"{path}: no such dataset file or folder")
    rows = []
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise InputError(f"{path}:{number}: not JSON ({exc.msg})") from None
                except (UnicodeDecodeError, RecursionError) as exc:
                    why = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else "nested too deeply"
                    raise InputError(f"{path}:{number}: {why}; each line must be one JSON row") from None
                if not isinstance(row, dict):
                    raise InputError(f"{path}:{number}: a row must be a JSON object")
                rows.append(row)
    if not rows:
        raise InputError(f"{path}: no rows")
    return rows


def load_collator(spec: str) -> Callable[..., dict]:
    """`module:function`, called as function(tokenizer, rows) -> {input_ids, attention_mask, labels}."""
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise InputError(f"--collator {spec}: {one_line(exc)}") from None


def dataset_batches(
    tokenizer,
    rows: list[dict],
    *,
    collator: str | None = None,
    batch_size: int = 8,
    max_length: int | None = None,
    progress: bool = True,
):
    """Every row rendered with the tokenizer's chat template, tokenized and collated (by `collator`, or the
    standard completion-only one): (sample ids, renders, render failures, batches, max_length used).
    Also the dataset path of an imported run (`sftaudit import --data`)."""
    max_length = max_length or (tokenizer.model_max_length if tokenizer.model_max_length < 1_000_000 else None)
    ids = [str(row.get("id", f"row-{i}")) for i, row in enumerate(rows)]
    bar = _progress(len(rows) * (2 if collator else 1), progress)  # rendering, then the given collator

    renderer = Renderer(tokenizer.chat_template, tokenizer_specials(tokenizer))
    # The standard collator's tokenization runs on a worker thread, a chunk of renders at a time, while
    # the next chunk renders (the tokenizer's Rust backend releases the GIL): both cores work.
    with ThreadPoolExecutor(max_workers=1) as pool:

        def encode(texts):
            return pool.submit(tokenizer.backend_tokenizer.encode_batch, texts, add_special_tokens=False)

        rendered, failures, encoding_chunks = _render(rows, ids, renderer, bar, None if collator else encode)
        encodings = [e for chunk in encoding_chunks for e in chunk.result()]
    keep = [i for i in range(len(rows)) if i in rendered]
    if collator:
        batches = _custom_batches(load_collator(collator), tokenizer, rows, ids, keep, batch_size, max_length, bar)
    else:
        # Without `{% generation %}` markers the assistant spans come from the template's layout; a template
        # without turns (Nemotron-Parse renders the contents only) marks none, and LOOP-04 says it cannot judge.
        layout = None if renderer.tracks_generation else layout_or_none(tokenizer)
        batches = _standard_batches(tokenizer, rendered, encodings, ids, keep, batch_size, max_length, layout)
    bar.close()
    return ids, rendered, failures, batches, max_length


def layout_or_none(tokenizer):
    """The template's turn markers, for the report's expected labels (LOOP-04 reports a template without them)."""
    try:
        return run_layout(tokenizer)
    except Exception:  # noqa: BLE001 - the preview then shows labels without expectations; LOOP-04 says why
        return None


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit="sample",
        desc="preflight",
        file=sys.stderr,
        disable=not enabled or total < PROGRESS_FROM,
        mininterval=0.5,
    )


def _render(
    rows, ids, renderer: Renderer, bar, encode=None
) -> tuple[dict[int, tuple[str, list]], list[tuple[str, str, str]], list]:
    """Every row rendered; the failures as (sample id, kind, message): the template refusing the row
    (`render_failed`) or a message's content missing from its render (`content_dropped`). With
    `encode`, each chunk of rendered texts (in row order) is handed to it as soon as it is complete;
    returns what it returned, per chunk."""
    rendered, failures, pending, chunks = {}, [], [], []
    for i, row in enumerate(rows):
        messages = row.get("messages")
        try:
            if not isinstance(messages, list):
                raise ValueError("the row has no 'messages' list")
            rendered[i] = renderer.render(messages)
        except Exception as exc:  # noqa: BLE001 - every render failure is a finding, not a crash
            # The template's own error class tells the user something (TemplateError: its raise_exception).
            why = one_line(exc) if isinstance(exc, TemplateBudget) else f"{type(exc).__name__}: {one_line(exc)}"
            failures.append((ids[i], "render_failed", why))
        else:
            text = rendered[i][0]
            for m in messages:
                content = m.get("content") if isinstance(m, dict) else None
                if isinstance(content, str) and content.strip() and content.strip() not in text:
                    failures.append(
                        (ids[i], "content_dropped", f"the {m.get('role')} message's content is missing from the render")
                    )
                    break
            if encode is not None:
                pending.append(text)
                if len(pending) == ENCODE_CHUNK:
                    chunks.append(encode(pending))
                    pending = []
        bar.update(1)
    if encode is not None and pending:
        chunks.append(encode(pending))
    return rendered, failures, chunks


def _standard_batches(tokenizer, rendered, encodings, ids, keep, batch_size, max_length, layout) -> list[dict]:
    """Completion-only: labels on the template's generation spans (assistant content + end of turn),
    mapped to tokens the way transformers' `return_assistant_tokens_mask` does (char_to_token);
    without generation spans, on each assistant turn of the template's `layout` (content through
    the end-of-turn marker)."""
    lengths = np.array([len(e.ids) for e in encodings], dtype=np.int64)
    flat_ids = np.fromiter(
        itertools.chain.from_iterable(e.ids for e in encodings), dtype=np.int64, count=int(lengths.sum())
    )
    row_start = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    # +1 where an assistant span starts, -1 after it ends; the running sum marks the span tokens.
    edges = np.zeros(len(flat_ids) + 1, dtype=np.int64)
    for k, i in enumerate(keep):
        encoding = encodings[k]
        for begin, end in rendered[i][1]:
            first, last = encoding.char_to_token(begin), encoding.char_to_token(end - 1)
            if first is None:
                break
            last = lengths[k] - 1 if last is None else last
            edges[row_start[k] + first] += 1
            edges[row_start[k] + last + 1] -= 1
    assistant = np.cumsum(edges[:-1]) > 0
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise InputError("the tokenizer has neither a pad nor an eos token to pad batches with")
    batches = []
    for b in range(0, len(keep), batch_size):
        rows = range(b, min(b + batch_size, len(keep)))
        size = np.minimum(lengths[list(rows)], max_length or np.iinfo(np.int64).max)
        width = int(size.max())
        position = np.arange(width)
        inside = position < size[:, None]
        index = row_start[list(rows)][:, None] + np.minimum(position, np.maximum(size[:, None] - 1, 0))
        input_ids = np.where(inside, flat_ids[index], pad)
        if layout is None:
            labels = np.where(inside & assistant[index], input_ids, IGNORE_INDEX)
        else:
            expected, _ = expected_labels(np.where(inside, input_ids, -1), inside, layout, tokenizer.pad_token_id)
            labels = np.where(expected == TRAINED, input_ids, IGNORE_INDEX)
        batches.append(
            {
                "sample_ids": [ids[keep[r]] for r in rows],
                "input_ids": input_ids,
                "labels": labels,
                "attention_mask": inside.astype(np.int64),
            }
        )
    return batches


def _custom_batches(collate, tokenizer, rows, ids, keep, batch_size, max_length, bar) -> list[dict]:
    batches = []
    for b in range(0, len(keep), batch_size):
        chunk = keep[b : b + batch_size]
        try:
            out = collate(tokenizer, [rows[i] for i in chunk], **({"max_length": max_length} if max_length else {}))
            batch = {k: np.asarray(out[k]) for k in ("input_ids", "labels")}
            batch["attention_mask"] = (
                np.asarray(out["attention_mask"])
                if out.get("attention_mask") is not None
                else np.ones_like(batch["input_ids"])
            )
        except Exception as exc:  # noqa: BLE001 - the user's collator failing is bad input
            raise InputError(
                f"--collator failed on rows from {ids[chunk[0]]}: {type(exc).__name__}: {one_line(exc)}"
            ) from None
        batch["sample_ids"] = [ids[i] for i in chunk]
        batches.append(batch)
        bar.update(len(chunk))
    return batches


def batch_record(batch: dict, step: int, micro: int, tokenizer_length: int, fingerprint: str | None) -> dict[str, Any]:
    """The ``batches`` record of one collated batch: the fields the dataset path writes
    (`sftaudit.schema.records`; the rest need the run's forward and backward)."""
    real, trained = batch["attention_mask"] != 0, batch["labels"] != IGNORE_INDEX
    return {
        "seg": 0,
        "step": step,
        "micro": micro,
        "rows": len(batch["sample_ids"]),
        "seq_len": int(batch["input_ids"].shape[1]),
        "sample_ids": batch["sample_ids"],
        "lengths": real.sum(1).tolist(),
        "label_tokens": trained.sum(1).tolist(),
        "padding_trained": (trained & ~real).sum(1).tolist(),
        "left_padded_rows": int((~real[:, 0]).sum()),
        "tokenizer_length": tokenizer_length,
        "template_fingerprint": fingerprint,
    }


def failure_records(failures: list[tuple[str, str, str]]) -> list[dict[str, Any]]:
    """The rows the template refused or dropped content from, as ``events`` records (LOOP-01)."""
    return [
        {"seg": 0, "kind": kind, "time": float(i), "error": error, "sample_id": sample}
        for i, (sample, kind, error) in enumerate(failures)
    ]


def describe_rows(rows: list[dict]) -> dict[str, Any]:
    fields, message_fields = set(), set()
    for row in rows:
        fields.update(row)
        messages = row.get("messages")
        if isinstance(messages, list):
            message_fields.update(k for m in messages if isinstance(m, dict) for k in m)
    return {"rows": len(rows), "fields": sorted(fields), "message_fields": sorted(message_fields)}
