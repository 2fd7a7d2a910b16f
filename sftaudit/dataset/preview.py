"""What the dataset report shows that only preflight can see: a few samples as rendered (with
the template's markers) and token by token (labels as collated against what the template
expects), and each marker's tokenization and training share. Computed once in preflight,
where the tokenizer and the renders are at hand, and stored in the manifest: the report
only draws it.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from .fields import template_fields
from .layout import CATEGORY_NAMES, EITHER, IGNORE_INDEX, TemplateLayout, actual_labels, expected_labels, matches

PREVIEW_SAMPLES = 3
PREVIEW_TOKENS = 400  # per sample in the label view
PREVIEW_CHARS = 4000  # per sample in the render preview


def dataset_preview(
    tokenizer: Any,
    source: str,
    layout: TemplateLayout | None,
    rendered: dict[int, tuple[str, list]],
    ids: list[str],
    batches: list[dict],
) -> dict[str, Any]:
    markers = _marker_strings(tokenizer, source, layout)
    pattern = re.compile("|".join(map(re.escape, sorted(markers, key=len, reverse=True)))) if markers else None
    samples = []
    for batch in batches:
        for row, sample_id in enumerate(batch["sample_ids"]):
            if len(samples) == PREVIEW_SAMPLES:
                break
            index = ids.index(sample_id)
            text = rendered[index][0] if index in rendered else ""
            samples.append(
                {
                    "sample_id": sample_id,
                    "render": _segments(text[:PREVIEW_CHARS], pattern),
                    "render_cut": max(0, len(text) - PREVIEW_CHARS),
                    **_label_view(tokenizer, layout, batch, row),
                }
            )
        if len(samples) == PREVIEW_SAMPLES:
            break
    return {"samples": samples, "markers": _marker_table(tokenizer, markers, layout, batches)}


def _marker_strings(tokenizer: Any, source: str, layout: TemplateLayout | None) -> dict[str, str | None]:
    """Marker -> the template role it plays (None for a plain special token): the tokenizer's
    special and added tokens the template writes, its bos/eos/pad, and the layout's turn markers
    (a header such as `<|start_header_id|>assistant<|end_header_id|>` is several tokens by design)."""
    literal_text = "\0".join(template_fields(source).literals)
    known = {str(t) for t in tokenizer.all_special_tokens}
    known |= {t.content for t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values()}
    found: dict[str, str | None] = {t: None for t in sorted(known) if t and t in literal_text}
    for role in ("bos", "eos", "pad"):
        token = getattr(tokenizer, f"{role}_token", None)
        if token:
            found[str(token)] = role
    if layout is not None:
        found.update({text.strip(): role for role, text in layout.texts.items() if text.strip()})
    return found


def _segments(text: str, pattern: re.Pattern | None) -> list[dict[str, Any]]:
    if pattern is None:
        return [{"text": text, "marker": False}]
    out, at = [], 0
    for m in pattern.finditer(text):
        if m.start() > at:
            out.append({"text": text[at : m.start()], "marker": False})
        out.append({"text": m.group(), "marker": True})
        at = m.end()
    if at < len(text):
        out.append({"text": text[at:], "marker": False})
    return out


def _label_view(tokenizer: Any, layout: TemplateLayout | None, batch: dict, row: int) -> dict[str, Any]:
    """The row as collated, in LOOP-04's token-evidence shape (actual and template-expected class)."""
    ids = np.asarray(batch["input_ids"])[row : row + 1]
    labels = np.asarray(batch["labels"])[row : row + 1]
    attention = np.asarray(batch["attention_mask"])[row : row + 1]
    actual = actual_labels(labels, attention)[0]
    expected = expected_labels(ids, attention, layout, tokenizer.pad_token_id)[0][0] if layout is not None else actual
    expected = np.where(expected == EITHER, actual, expected)  # collators differ there, all fine
    real = int(np.flatnonzero(attention[0]).max(initial=-1)) + 1
    shown = [int(i) for i in ids[0, : min(PREVIEW_TOKENS, real + 2)]]  # trailing padding: its first two
    tokens = _readable(tokenizer, shown)
    return {
        "tokens": [
            {
                "pos": j,
                "token": str(tokens[j]),
                "input_id": shown[j],
                "label": int(labels[0, j]),
                "actual": CATEGORY_NAMES[actual[j]],
                "expected": CATEGORY_NAMES[expected[j]],
            }
            for j in range(len(shown))
        ],
        "tokens_cut": max(0, real - len(shown)),
        "padding_cut": max(0, ids.shape[1] - max(real, len(shown))),
        "expected_known": layout is not None,
    }


def _readable(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each token as the text it decodes to; its raw piece where that is part of a character."""
    raw = tokenizer.convert_ids_to_tokens(ids)
    return [
        text if "\ufffd" not in text else str(piece)
        for text, piece in zip(tokenizer.batch_decode([[i] for i in ids]), raw)
    ]


def _marker_table(
    tokenizer: Any, markers: dict[str, str | None], layout: TemplateLayout | None, batches: list[dict]
) -> list[dict[str, Any]]:
    """Per marker: its ids (one = atomic), and in how many attended occurrences it is trained
    (a marker of several ids: where they follow one another, trained when every one is)."""
    pieces = {m: list(tokenizer(m, add_special_tokens=False)["input_ids"]) for m in markers}
    atomic = np.array(sorted({p[0] for p in pieces.values() if len(p) == 1}), dtype=np.int64)
    atomic_counts = np.zeros((2, len(atomic)), dtype=np.int64)  # occurrences, trained
    counts = {m: [0, 0] for m, p in pieces.items() if len(p) > 1}
    for batch in batches:  # batch by batch: the whole dataset's ids at once would double preflight's memory
        ids = np.asarray(batch["input_ids"])
        attended = np.asarray(batch["attention_mask"]) != 0
        trained = np.asarray(batch["labels"]) != IGNORE_INDEX
        hit = attended & np.isin(ids, atomic)
        column = np.searchsorted(atomic, ids[hit])
        atomic_counts[0] += np.bincount(column, minlength=len(atomic))
        atomic_counts[1] += np.bincount(column[trained[hit]], minlength=len(atomic))
        for marker in counts:
            seq = pieces[marker]
            at = matches(ids, seq) & attended
            every = at.copy()
            for j in range(len(seq)):
                every[:, : every.shape[1] - j] &= trained[:, j:]
            counts[marker][0] += int(at.sum())
            counts[marker][1] += int(every.sum())
    for i, token in enumerate(atomic.tolist()):
        for marker in (m for m, p in pieces.items() if p == [token]):
            counts[marker] = atomic_counts[:, i].tolist()
    turn_roles = set(layout.texts) if layout is not None else set()
    return [
        {
            "marker": marker,
            "ids": pieces[marker],
            "atomic": len(pieces[marker]) == 1,
            "sequence": role in turn_roles and role != "turn_end" and len(pieces[marker]) > 1,
            "pieces": tokenizer.convert_ids_to_tokens(pieces[marker]),
            "role": role,
            "occurrences": counts.get(marker, [0, 0])[0],
            "trained": counts.get(marker, [0, 0])[1],
        }
        for marker, role in sorted(markers.items(), key=lambda m: (m[1] in turn_roles, m[0]))
    ]
