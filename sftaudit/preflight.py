"""`sftaudit preflight`: checks LOOP-01..04 on a dataset + tokenizer + chat template, before training.

Every sample is rendered (by transformers, as apply_chat_template renders it), tokenized and
collated (by the given collator, or a standard completion-only one), and the result is
written into the same DuckDB tables a recorded run is ingested into, with each batch as a
"step". The same checks then run on it, so findings, verdict and exit codes are those of
`audit`. No torch: tokenization is the tokenizer's Rust backend, masks are numpy.
"""

from __future__ import annotations

import importlib
import itertools
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa

from .artifacts import DATABASE_FILE, SCHEMA_VERSION, TOKENIZER_DIR, artifact_root, template_fingerprint
from .chat_template import (IGNORE_INDEX, TRAINED, Renderer, TemplateBudget, expected_labels, remember_tokenizer, run_layout,
                            tokenizer_specials)
from .config import AuditConfig
from .dataset_preview import dataset_preview
from .errors import InputError, one_line
from .tokenizer_info import TokenizerRefused, describe_tokenizer, load_saved_tokenizer

PREFLIGHT_CHECKS = ("LOOP-01", "LOOP-02", "LOOP-03", "LOOP-04")
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


def preflight(data: str | Path, tokenizer_dir: str | Path, out: str | Path, *, template: str | Path | None = None,
              collator: str | None = None, batch_size: int = 8, max_length: int | None = None,
              config: AuditConfig | None = None, progress: bool = True) -> dict[str, Any]:
    """Render, tokenize, collate and check every sample; returns the verdict (stored under `out`)."""
    from .audit import judge
    from .checks import registered_checks
    from .ingest import connect, create_tables

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
    ids, rendered, failures, batches, max_length = dataset_batches(tokenizer, rows, collator=collator, batch_size=batch_size,
                                                                   max_length=max_length, progress=progress)

    out = Path(out)
    root = artifact_root(out)
    root.mkdir(parents=True, exist_ok=True)
    (root / DATABASE_FILE).unlink(missing_ok=True)
    tokenizer.save_pretrained(str(root / TOKENIZER_DIR))
    remember_tokenizer(root / TOKENIZER_DIR, tokenizer)
    manifest = {
        "schema_version": SCHEMA_VERSION, "run_id": f"preflight-{Path(data).stem}", "seg": 0, "rank": 0,
        "world_size": 1, "profile": "preflight", "started": time.time(), "params": [],
        "model": {"class": "none (preflight: no model)", "config": None, "tie_word_embeddings": None, "dropout": {}},
        "tokenizer": describe_tokenizer(tokenizer), "dataset": _describe_rows(rows),
        "preflight": {"data": str(data), "tokenizer": str(tokenizer_dir), "template": str(template) if template else None,
                      "collator": collator or "standard completion-only", "batch_size": batch_size,
                      "max_length": max_length},
        "preview": dataset_preview(tokenizer, source, _layout_or_none(tokenizer), rendered, ids, batches),
    }
    config = config or AuditConfig()
    config.disabled = sorted(set(config.disabled) | {c.code for c in registered_checks()
                                                      if c.code not in PREFLIGHT_CHECKS})
    con = connect(out)
    try:
        create_tables(con)
        _store(con, manifest, batches, failures, len(tokenizer), template_fingerprint(source))
        return judge(con, out, config)
    finally:
        con.close()


def dataset_batches(tokenizer, rows: list[dict], *, collator: str | None = None, batch_size: int = 8,
                    max_length: int | None = None, progress: bool = True):
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
        layout = None if renderer.tracks_generation else _layout_or_none(tokenizer)
        batches = _standard_batches(tokenizer, rendered, encodings, ids, keep, batch_size, max_length, layout)
    bar.close()
    return ids, rendered, failures, batches, max_length


def _layout_or_none(tokenizer):
    """The template's turn markers, for the report's expected labels (LOOP-04 reports a template without them)."""
    try:
        return run_layout(tokenizer)
    except Exception:  # noqa: BLE001 - the preview then shows labels without expectations; LOOP-04 says why
        return None


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="sample", desc="preflight", file=sys.stderr,
                disable=not enabled or total < PROGRESS_FROM, mininterval=0.5)


def _render(rows, ids, renderer: Renderer, bar, encode=None) -> tuple[dict[int, tuple[str, list]],
                                                                      list[tuple[str, str, str]], list]:
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
                    failures.append((ids[i], "content_dropped",
                                     f"the {m.get('role')} message's content is missing from the render"))
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
    flat_ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), dtype=np.int64,
                           count=int(lengths.sum()))
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
        batches.append({"sample_ids": [ids[keep[r]] for r in rows], "input_ids": input_ids, "labels": labels,
                        "attention_mask": inside.astype(np.int64)})
    return batches


def _custom_batches(collate, tokenizer, rows, ids, keep, batch_size, max_length, bar) -> list[dict]:
    batches = []
    for b in range(0, len(keep), batch_size):
        chunk = keep[b:b + batch_size]
        try:
            out = collate(tokenizer, [rows[i] for i in chunk], **({"max_length": max_length} if max_length else {}))
            batch = {k: np.asarray(out[k]) for k in ("input_ids", "labels")}
            batch["attention_mask"] = np.asarray(out["attention_mask"]) if out.get("attention_mask") is not None \
                else np.ones_like(batch["input_ids"])
        except Exception as exc:  # noqa: BLE001 - the user's collator failing is bad input
            raise InputError(f"--collator failed on rows from {ids[chunk[0]]}: {type(exc).__name__}: {one_line(exc)}") from None
        batch["sample_ids"] = [ids[i] for i in chunk]
        batches.append(batch)
        bar.update(len(chunk))
    return batches


def _describe_rows(rows: list[dict]) -> dict[str, Any]:
    fields, message_fields = set(), set()
    for row in rows:
        fields.update(row)
        messages = row.get("messages")
        if isinstance(messages, list):
            message_fields.update(k for m in messages if isinstance(m, dict) for k in m)
    return {"rows": len(rows), "fields": sorted(fields), "message_fields": sorted(message_fields)}


def _list_column(matrices: list[np.ndarray]) -> pa.Array:
    """Rows of [B, T] matrices as one Arrow list column (no per-value Python objects)."""
    if not matrices:
        return pa.array([], type=pa.list_(pa.int32()))
    values = np.concatenate([m.reshape(-1) for m in matrices]).astype(np.int32)
    widths = np.concatenate([np.full(m.shape[0], m.shape[1], dtype=np.int64) for m in matrices])
    offsets = np.concatenate([[0], np.cumsum(widths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


def _store(con, manifest: dict, batches: list[dict], failures: list[tuple[str, str, str]], tokenizer_length: int,
           fingerprint: str | None) -> None:
    con.execute("INSERT INTO manifest VALUES (0, 0, ?, ?, 'preflight', 1, ?, NULL, ?)",
                [manifest["run_id"], SCHEMA_VERSION, manifest["started"], json.dumps(manifest)])
    steps = np.arange(1, len(batches) + 1)
    sizes = np.array([len(b["sample_ids"]) for b in batches], dtype=np.int64)
    real = [b["attention_mask"] != 0 for b in batches]
    trained = [b["labels"] != IGNORE_INDEX for b in batches]
    batch_table = pa.table({
        "step": pa.array(steps, pa.int64()),
        "rows": pa.array(sizes, pa.int32()),
        "seq_len": pa.array([b["input_ids"].shape[1] for b in batches], pa.int32()),
        "sample_ids": pa.array([b["sample_ids"] for b in batches], pa.list_(pa.string())),
        "lengths": pa.array([r.sum(1).tolist() for r in real], pa.list_(pa.int32())),
        "label_tokens": pa.array([t.sum(1).tolist() for t in trained], pa.list_(pa.int32())),
        "padding_trained": pa.array([(t & ~r).sum(1).tolist() for t, r in zip(trained, real)], pa.list_(pa.int32())),
        "left_padded_rows": pa.array([int((~r[:, 0]).sum()) for r in real], pa.int32()),
    })
    con.register("new_batches", batch_table)
    con.execute("""INSERT INTO batches (rank, seg, step, micro, rows, seq_len, sample_ids, lengths, label_tokens,
                   padding_trained, left_padded_rows, tokenizer_length, template_fingerprint)
                   SELECT 0, 0, step, 0, rows, seq_len, sample_ids, lengths, label_tokens,
                   padding_trained, left_padded_rows, ?, ? FROM new_batches""", [tokenizer_length, fingerprint])
    con.unregister("new_batches")
    sample_table = pa.table({
        "step": pa.array(np.repeat(steps, sizes), pa.int64()),
        "row": pa.array(np.concatenate([np.arange(s) for s in sizes]) if len(sizes) else [], pa.int32()),
        "sample_id": pa.array([s for b in batches for s in b["sample_ids"]], pa.string()),
        "input_ids": _list_column([b["input_ids"] for b in batches]),
        "labels": _list_column([b["labels"] for b in batches]),
        "attention_mask": _list_column([b["attention_mask"] for b in batches]),
    })
    con.register("new_samples", sample_table)
    con.execute("""INSERT INTO samples SELECT 0, 0, step, 0, row, sample_id, input_ids, labels, attention_mask
                   FROM new_samples""")
    con.unregister("new_samples")
    if failures:
        con.executemany("INSERT INTO events (rank, seg, kind, time, error, sample_id) VALUES (0, 0, ?, ?, ?, ?)",
                        [(kind, float(i), error, sample) for i, (sample, kind, error) in enumerate(failures)])
