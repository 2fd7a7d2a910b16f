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

from .chat_template import (CATEGORY_NAMES, EITHER, IGNORE_INDEX, TemplateLayout, actual_labels, expected_labels,
                            matches, template_fields)

PREVIEW_SAMPLES = 3
PREVIEW_TOKENS = 400   # per sample in the label view
PREVIEW_CHARS = 4000   # per sample in the render preview


def dataset_preview(tokenizer: Any, source: str, layout: TemplateLayout | None, rendered: dict[int, tuple[str, list]],
                    ids: list[str], batches: list[dict]) -> dict[str, Any]:
    markers = _marker_strings(tokenizer, source, layout)
    pattern = re.compile("|".join(map(re.escape, sorted(markers, key=len, reverse=True)))) if markers else None
    samples = []
    for batch in batches:
        for row, sample_id in enumerate(batch["sample_ids"]):
            if len(samples) == PREVIEW_SAMPLES:
                break
            index = ids.index(sample_id)
            text = rendered[index][0] if index in rendered else ""
            samples.append({"sample_id": sample_id, "render": _segments(text[:PREVIEW_CHARS], pattern),
                            "render_cut": max(0, len(text) - PREVIEW_CHARS),
                            **_label_view(tokenizer, layout, batch, row)})
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
            out.append({"text": text[at:m.start()], "marker": False})
        out.append({"text": m.group(), "marker": True})
        at = m.end()
    if at < len(text):
        out.append({"text": text[at:], "marker": False})
    return out


def _label_view(tokenizer: Any, layout: TemplateLayout | None, batch: dict, row: int) -> dict[str, Any]:
    """The row as collated, in LOOP-04's token-evidence shape (actual and template-expected class)."""
    ids = np.asarray(batch["input_ids"])[row:row + 1]
    labels = np.asarray(batch["labels"])[row:row + 1]
    attention = np.asarray(batch["attention_mask"])[row:row + 1]
    actual = actual_labels(labels, attention)[0]
    expected = expected_labels(ids, attention, layout, tokenizer.pad_token_id)[0][0] if layout is not None else actual
    expected = np.where(expected == EITHER, actual, expected)  # collators differ there, all fine
    real = int(np.flatnonzero(attention[0]).max(initial=-1)) + 1
    shown = [int(i) for i in ids[0, :min(PREVIEW_TOKENS, real + 2)]]  # trailing padding: its first two
    tokens = _readable(tokenizer, shown)
    return {"tokens": [{"pos": j, "token": str(tokens[j]), "input_id": shown[j], "label": int(labels[0, j]),
                        "actual": CATEGORY_NAMES[actual[j]], "expected": CATEGORY_NAMES[expected[j]]}
                       for j in range(len(shown))],
            "tokens_cut": max(0, real - len(shown)), "padding_cut": max(0, ids.shape[1] - max(real, len(shown))),
            "expected_known": layout is not None}


def _readable(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each token as the text it decodes to; its raw piece where that is part of a character."""
    raw = tokenizer.convert_ids_to_tokens(ids)
    return [text if "\ufffd" not in text else str(piece)
            for text, piece in zip(tokenizer.batch_decode([[i] for i in ids]), raw)]


def _marker_table(tokenizer: Any, markers: dict[str, str | None], layout: TemplateLayout | None,
                  batches: list[dict]) -> list[dict[str, Any]]:
    """Per marker: its ids (one = atomic), and in how many attended occurrences it is trained."""
    ids = np.concatenate([np.asarray(b["input_ids"]).reshape(-1) for b in batches]) if batches else np.zeros(0, int)
    trained = np.concatenate([(np.asarray(b["labels"]) != IGNORE_INDEX).reshape(-1) for b in batches]) \
        if batches else np.zeros(0, bool)
    attended = np.concatenate([(np.asarray(b["attention_mask"]) != 0).reshape(-1) for b in batches]) \
        if batches else np.zeros(0, bool)
    width = int(ids.max(initial=0)) + 1
    seen = np.bincount(ids[attended & (ids >= 0)], minlength=width)
    seen_trained = np.bincount(ids[attended & trained & (ids >= 0)], minlength=width)
    turn_roles = set(layout.texts) if layout is not None else set()
    out = []
    for marker, role in sorted(markers.items(), key=lambda m: (m[1] in turn_roles, m[0])):
        pieces = list(tokenizer(marker, add_special_tokens=False)["input_ids"])
        if len(pieces) == 1:  # atomic: counted for every marker at once above
            occurrences = int(seen[pieces[0]]) if pieces[0] < width else 0
            trained_count = int(seen_trained[pieces[0]]) if pieces[0] < width else 0
        else:  # several tokens: where all follow one another, trained when every one is
            hit = np.flatnonzero(matches(ids[None, :], pieces)[0] & attended) if pieces else np.zeros(0, int)
            every = np.ones(len(hit), bool)
            for j in range(len(pieces)):
                every &= trained[hit + j]
            occurrences, trained_count = int(len(hit)), int(every.sum())
        out.append({"marker": marker, "ids": pieces, "atomic": len(pieces) == 1,
                    "sequence": role in turn_roles and role != "turn_end" and len(pieces) > 1,
                    "pieces": tokenizer.convert_ids_to_tokens(pieces), "role": role,
                    "occurrences": occurrences, "trained": trained_count})
    return out
