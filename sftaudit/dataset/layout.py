"""The template's layout: the token-id sequences that open each role's turn and end a turn, found by rendering sentinel conversations and diffing the text; `expected_labels` uses them to say, for every position of a token row, whether it should be trained."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InputError
from .template_text import TemplateOverBudget, template_source

IGNORE_INDEX = -100
MASKED, TRAINED, PADDING, EITHER = 0, 1, 2, 3
CATEGORY_NAMES = ("masked", "trained", "padding", "either")
_SENTINEL = {
    "system": "SFTAUDITSYSTEMSENTINEL",
    "user": "SFTAUDITUSERSENTINEL",
    "assistant": "SFTAUDITASSISTANTSENTINEL",
}


@dataclass
class TemplateLayout:
    """Token-id markers of the template: where each role's turn opens and where a turn ends.

    Derived by rendering sentinel conversations, whether or not the template has
    `{% generation %}` markers: the end of turn is what follows an assistant message both
    when the chat ends there and when a user turn follows (so a final eos the template adds
    after the last turn is not part of it); a role's header is what sits between the end of
    the previous turn and that role's sentinel. Text a template inserts between the
    assistant header and the content (an empty thinking block) is `assistant_prefix`.
    Markers are tokenized in context (the tokens lying wholly inside the marker's text), so
    a SentencePiece word-start merged into the content is not part of them.
    """

    headers: dict[str, list[int]]
    turn_end: list[int]
    texts: dict[str, str]
    assistant_prefix: list[int] = field(default_factory=list)
    blank_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    eos_id: int | None = None
    starts_with_bos: bool = False  # the render opens with the BOS string: inference sends BOS first

    @classmethod
    def derive(cls, tokenizer: Any, source: str) -> TemplateLayout:
        # The template engine here, not at module level: the checks import this module for its label
        # arithmetic, and a run with no template (a trainer log) never needs jinja2.
        import jinja2

        from .render import Renderer, tokenizer_specials
        from .sandbox import TemplateBudget

        renderer = Renderer(source, tokenizer_specials(tokenizer))
        s = _SENTINEL

        def render(*roles, prompt=False):
            try:
                return renderer.render([{"role": r, "content": s[r]} for r in roles], add_generation_prompt=prompt)
            except TemplateBudget as exc:
                raise TemplateOverBudget(str(exc)) from None
            except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError):
                return None, []  # the template refuses this shape of conversation

        def tokens(text, start, end):
            """(id, char start, char end) of `text`'s tokens lying wholly in [start, end): markers as
            tokenized in context."""
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            return [(i, b, e) for i, (b, e) in zip(enc["input_ids"], enc["offset_mapping"]) if start <= b < e <= end]

        blank = _blank_ids(tokenizer)

        def trimmed(run):
            """The run without whitespace tokens at either end."""
            while run and blank[run[0][0]]:
                run = run[1:]
            while run and blank[run[-1][0]]:
                run = run[:-1]
            return run

        text_ua, spans = render("user", "assistant")
        if text_ua is None or s["assistant"] not in text_ua:
            raise InputError("the chat template does not render a user/assistant conversation with its content")
        a_start = text_ua.index(s["assistant"])
        a_end = a_start + len(s["assistant"])
        span = next(((b, e) for b, e in spans if b <= a_start < e), None)
        text_uau, _ = render("user", "assistant", "user")
        if text_uau is not None and (s["assistant"] not in text_uau or text_uau.count(s["user"]) != 2):
            text_uau = None
        # The end of turn, in tokens: the generation span's tail, else what follows the assistant's content
        # both when the chat ends there and when a user turn follows (a final eos is not part of it).
        # A generation span that ends before the marker: the marker is still what generation must learn
        # to emit, so it is found as without a span.
        run = trimmed(tokens(text_ua, a_end, span[1])) if span else []
        run_from_span = bool(run)
        if not run:
            run = tokens(text_ua, a_end, len(text_ua))
        if not run_from_span and text_uau:
            after = text_uau.index(s["assistant"]) + len(s["assistant"])
            following = tokens(text_uau, after, len(text_uau))
            common = 0
            while common < min(len(run), len(following)) and run[common][0] == following[common][0]:
                common += 1
            # Nothing in common (the last turn ends with eos instead): the marker that closes earlier turns.
            run = trimmed(run[:common]) or trimmed(following)[:1]
        run = trimmed(run)
        if not run:
            raise InputError("cannot find the template's end-of-turn marker after an assistant message")
        turn_end = tokenizer.decode([i for i, _, _ in run])
        texts = {"turn_end": turn_end}
        markers = {"turn_end": [i for i, _, _ in run]}

        # A role's header: between the end of the previous turn and the role's sentinel, as it sits
        # inside a conversation (so not the last turn's extras), tokenized in context.
        def header(text, previous_end, sentinel_at, role):
            region = text[previous_end:sentinel_at]
            offset = previous_end + (region.index(turn_end) + len(turn_end) if turn_end in region else 0)
            stripped = text[offset:sentinel_at].lstrip()
            if stripped.strip():
                start = sentinel_at - len(stripped)
                texts[role] = stripped
                markers[role] = [i for i, _, _ in tokens(text, start, sentinel_at)]

        source_text = text_uau or text_ua
        user_at = source_text.index(s["user"])
        header(source_text, user_at + len(s["user"]), source_text.index(s["assistant"]), "assistant")
        if "assistant" not in markers:
            prompt_only, _ = render("user")
            with_prompt, _ = render("user", prompt=True)
            if prompt_only and with_prompt and with_prompt.startswith(prompt_only) and with_prompt != prompt_only:
                header(with_prompt, len(prompt_only), len(with_prompt), "assistant")
        if "assistant" not in markers or not markers["assistant"]:
            raise InputError("cannot find the template's assistant header")
        if text_uau:
            second_user = text_uau.rindex(s["user"])
            header(text_uau, text_uau.index(s["assistant"]) + len(s["assistant"]), second_user, "user")
        # What the template inserts before the last turn's content only (an empty thinking block).
        before = text_ua[:a_start]
        header_at = before.rfind(texts["assistant"])
        prefix = (header_at + len(texts["assistant"]), a_start) if header_at >= 0 else None
        assistant_prefix = (
            [i for i, _, _ in tokens(text_ua, *prefix)] if prefix and text_ua[prefix[0] : prefix[1]].strip() else []
        )
        text_sua, _ = render("system", "user", "assistant")
        if text_sua and s["system"] in text_sua and "user" in texts:
            system_at = text_sua.index(s["system"])
            user_header_at = text_ua.rfind(texts["user"], 0, text_ua.index(s["user"]))
            preamble = text_ua[:user_header_at] if user_header_at >= 0 else ""
            if text_sua.startswith(preamble) and text_sua[len(preamble) : system_at].strip():
                header(text_sua, len(preamble), system_at, "system")
        headers = {role: markers[role] for role in ("system", "user", "assistant") if markers.get(role)}
        bos = getattr(tokenizer, "bos_token", None)
        return cls(
            headers=headers,
            turn_end=markers["turn_end"],
            texts=texts,
            assistant_prefix=assistant_prefix,
            blank_ids=blank,
            eos_id=tokenizer.eos_token_id,
            starts_with_bos=bool(bos) and text_ua.startswith(str(bos)),
        )


BYTE_FALLBACK_BLANKS = {"<0x0A>", "<0x09>", "<0x20>"}


def _blank_ids(tokenizer: Any) -> np.ndarray:
    """[vocab] bool: tokens that decode to whitespace only (tolerated next to turn markers)."""
    vocab = tokenizer.get_vocab()
    blank = np.zeros(max(len(tokenizer), max(vocab.values(), default=0) + 1), dtype=bool)
    # Whitespace characters as byte-level (Ġ Ċ ĉ) and SentencePiece (▁) vocabularies spell them, and
    # SentencePiece's byte-fallback pieces for them: a strip() set of "<0x0A>" would also blank "A", "0", "x".
    pieces = [t for t in vocab if t in BYTE_FALLBACK_BLANKS or t.strip("\u0120\u010a\u0109\u2581\n\t\r ") == ""]
    for token in pieces:
        # A lone word-start piece decodes to nothing (a legacy SentencePiece `▁` after a special token).
        text = tokenizer.convert_tokens_to_string([token])
        if text.isspace() or not text:
            blank[vocab[token]] = True
    return blank


def matches(ids: np.ndarray, seq: list[int]) -> np.ndarray:
    """[N, T] bool: the sequence `seq` starts at each position."""
    n, t = ids.shape
    out = np.zeros((n, t), dtype=bool)
    k = len(seq)
    if k == 0 or k > t:
        return out
    hit = np.ones((n, t - k + 1), dtype=bool)
    for j, token in enumerate(seq):
        hit &= ids[:, j : t - k + 1 + j] == token
    out[:, : t - k + 1] = hit
    return out


def _shift(mask: np.ndarray, by: int) -> np.ndarray:
    """Move True marks `by` positions to the right (marks past the end drop)."""
    out = np.zeros_like(mask)
    if by < mask.shape[1]:
        out[:, by:] = mask[:, : mask.shape[1] - by]
    return out


def _covered(starts: np.ndarray, length: int) -> np.ndarray:
    """Every position of a `length`-token run starting at `starts`."""
    out = np.zeros_like(starts)
    for j in range(length):
        out |= _shift(starts, j)
    return out


def expected_labels(
    ids: np.ndarray, attention: np.ndarray, layout: TemplateLayout, pad_id: int | None, last_turn_only: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Expected category (MASKED / TRAINED / PADDING / EITHER) of every position of right-aligned rows.

    Trained: from the end of each assistant header through the next end-of-turn marker
    (or the row's end when truncated); with `last_turn_only`, the last assistant turn of each
    row only. Padding: attention 0, and the runs of pad ids before the first / after the
    last real token that are not an open assistant turn's end marker (so pad == eos is
    handled). EITHER (collators differ, all fine): whitespace tokens right after an
    end-of-turn marker, the template's eos after the last turn, and what the
    template inserts before the content (`assistant_prefix`, e.g. an empty thinking block).
    Also returns [N, T] marks of the assistant turns before each row's last one (trained unless
    `last_turn_only`). Rows shorter than T are filled with -1 ids and attention 0.
    """
    n, t = ids.shape
    header = layout.headers["assistant"]
    header_at = matches(ids, header)
    opens = _shift(header_at, len(header))
    end_at = matches(ids, layout.turn_end)
    closes = _shift(end_at, len(layout.turn_end))
    events = np.full((n, t), -1, dtype=np.int8)
    events[closes] = MASKED
    events[opens] = TRAINED
    positions = np.where(events >= 0, np.arange(t), 0)
    np.maximum.accumulate(positions, axis=1, out=positions)
    state = np.take_along_axis(events, positions, axis=1)
    state = np.where(state == TRAINED, TRAINED, MASKED).astype(np.int8)
    turn = np.cumsum(opens, axis=1)
    earlier = (turn < turn[:, -1:]) & (state == TRAINED)
    if last_turn_only:
        state[earlier] = MASKED

    either = np.zeros((n, t), dtype=bool)
    blank = layout.blank_ids[np.clip(ids, 0, len(layout.blank_ids) - 1)] & (ids >= 0) & (ids < len(layout.blank_ids))
    if layout.assistant_prefix:
        prefix_at = matches(ids, layout.assistant_prefix) & opens
        either |= _covered(prefix_at, len(layout.assistant_prefix))
    edge = closes | _shift(either, 1)
    for _ in range(3):  # a short run of whitespace tokens after the end-of-turn marker or the prefix
        edge_blank = edge & blank
        either |= edge_blank
        edge = _shift(edge_blank, 1)
    if layout.eos_id is not None and layout.eos_id not in layout.turn_end:
        last = np.maximum((attention != 0).sum(1) - 1, 0)
        at_last = np.zeros((n, t), dtype=bool)
        at_last[np.arange(n), last] = True
        either |= at_last & (ids == layout.eos_id) & (state == MASKED)

    padding = attention == 0
    if pad_id is not None:
        is_pad = ids == pad_id
        trailing = np.flip(np.cumprod(np.flip(is_pad | (ids < 0), axis=1), axis=1), axis=1).astype(bool)
        leading = np.cumprod(is_pad, axis=1).astype(bool)
        padding |= (trailing & is_pad & (state == MASKED)) | leading
    # The template's own final eos is attended text even when the pad id is the same token.
    expected = np.where(either & (attention != 0), EITHER, np.where(padding, PADDING, state)).astype(np.int8)
    return expected, earlier & (expected != PADDING) & (expected != EITHER)


def empty_turns(ids: np.ndarray, layout: TemplateLayout) -> dict[str, np.ndarray]:
    """Per role, [N, T] marks of empty turns: the role's header followed (whitespace aside) directly
    by the end-of-turn marker."""
    end_at = matches(ids, layout.turn_end)
    blank = layout.blank_ids[np.clip(ids, 0, len(layout.blank_ids) - 1)] & (ids >= 0) & (ids < len(layout.blank_ids))
    empty = {}
    for role, seq in layout.headers.items():
        reach = _shift(matches(ids, seq), len(seq))
        for _ in range(3):
            reach |= _shift(reach & blank, 1)
        empty[role] = reach & end_at
    return empty


def actual_labels(labels: np.ndarray, attention: np.ndarray) -> np.ndarray:
    trained = labels != IGNORE_INDEX
    return np.where(trained, TRAINED, np.where(attention == 0, PADDING, MASKED)).astype(np.int8)


def to_matrix(column: Any, fill: int) -> np.ndarray:
    """A polars list column (ragged rows) -> [N, T] int64, right-filled with `fill`."""
    lengths = column.list.len().fill_null(0).to_numpy().astype(np.int64)
    width = int(lengths.max()) if len(lengths) else 0
    out = np.full((len(lengths), width), fill, dtype=np.int64)
    if width:
        out[np.arange(width) < lengths[:, None]] = column.explode().drop_nulls().to_numpy()
    return out


def sample_blocks(frame: Any, rows: int = 8192):
    """(part, input_ids, labels, attention) per block of recorded rows, as [N, T] matrices."""
    for offset in range(0, frame.height, rows):
        part = frame.slice(offset, rows)
        yield (
            part,
            to_matrix(part["input_ids"], -1),
            to_matrix(part["labels"], IGNORE_INDEX),
            to_matrix(part["attention_mask"], 0),
        )


@functools.lru_cache(maxsize=8)
def _layout(tokenizer: Any, source: str) -> TemplateLayout:
    return TemplateLayout.derive(tokenizer, source)


def run_layout(tokenizer: Any) -> TemplateLayout | None:
    source = template_source(getattr(tokenizer, "chat_template", None))
    return _layout(tokenizer, source) if source else None
