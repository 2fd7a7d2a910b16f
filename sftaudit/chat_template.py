"""Chat-template analysis for the data-layer checks (LOOP-01/02/04) and `preflight`. No torch.

Three things, all derived from the template itself, never from hard-coded marker strings:

* `template_fields`: what the template reads from a message and from its context, walking
  jinja2's own AST (message aliases followed through ``for``/``set``).
* `Renderer`: the template rendered the way transformers renders it, but with
  ``StrictUndefined`` (a missing field is an error, not an empty string) and the
  ``{% generation %}`` spans returned as character offsets.
* `TemplateLayout`: the token-id sequences that open each role's turn and end a turn,
  found by rendering sentinel conversations and diffing the text; `expected_labels`
  uses them to say, for every position of a token row, whether it should be trained.
"""

from __future__ import annotations

import functools
import json
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
import jinja2.nodes as nodes
import numpy as np
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import InputError, one_line

IGNORE_INDEX = -100
MASKED, TRAINED, PADDING = 0, 1, 2
CATEGORY_NAMES = ("masked", "trained", "padding")
# Tests that make a field read optional: `message.tool_calls is defined`, `... is none`.
_OPTIONAL_TESTS = {"defined", "undefined", "none", "string", "mapping", "sequence", "iterable"}
_SENTINEL = {"system": "SFTAUDITSYSTEMSENTINEL", "user": "SFTAUDITUSERSENTINEL",
             "assistant": "SFTAUDITASSISTANTSENTINEL"}


def template_source(chat_template: Any) -> str | None:
    """The default template text (tokenizers may carry a dict of named templates)."""
    if isinstance(chat_template, dict):
        return chat_template.get("default") or next(iter(chat_template.values()), None)
    if isinstance(chat_template, list):  # the serialised form: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in chat_template if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return chat_template or None


# --------------------------------------------------------------------------- AST


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}``: records the character span it rendered."""

    tags = {"generation"}
    spans: ContextVar[list | None] = ContextVar("sftaudit_generation_spans", default=None)

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_track"), [], [], body).set_lineno(lineno)

    def _track(self, caller):
        text = caller()
        tracking = self.spans.get()
        if tracking is not None:
            blocks, spans = tracking
            start = sum(map(len, blocks))
            spans.append((start, start + len(text)))
        return text


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined,
                                        extensions=[_Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda f: datetime.now().strftime(f),
                       namespace=jinja2.utils.Namespace)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise InputError(f"chat template does not parse: {one_line(exc)}") from None


@dataclass
class TemplateFields:
    message_required: set[str] = field(default_factory=set)
    message_optional: set[str] = field(default_factory=set)
    context: set[str] = field(default_factory=set)
    literals: set[str] = field(default_factory=set)


def template_fields(source: str) -> TemplateFields:
    """Every field the template reads from a message (required unless only tested/`.get`),
    the context variables it reads, and its literal strings (for LOOP-02's markers)."""
    ast = _compile(source).environment.parse(source)
    lists, messages = {"messages"}, set()
    assignments = [(n.target, n.iter, True) for n in ast.find_all(nodes.For)]
    assignments += [(n.target, n.node, False) for n in ast.find_all(nodes.Assign)]

    def is_list(e):
        if isinstance(e, nodes.Name):
            return e.name in lists
        if isinstance(e, nodes.Getitem):
            return isinstance(e.arg, nodes.Slice) and is_list(e.node)
        if isinstance(e, nodes.Filter):
            return e.node is not None and is_list(e.node)
        return False

    def is_message(e):
        if isinstance(e, nodes.Name):
            return e.name in messages
        if isinstance(e, nodes.Getitem):
            return not isinstance(e.arg, nodes.Slice) and is_list(e.node)
        return False

    for _ in range(3):  # aliases of aliases: a fixpoint in a few passes
        for target, value, loops in assignments:
            if isinstance(target, nodes.Name):
                if loops and is_list(value):
                    messages.add(target.name)
                elif not loops and is_list(value):
                    lists.add(target.name)
                elif not loops and is_message(value):
                    messages.add(target.name)

    assigned = {n.name for n in ast.find_all(nodes.Name) if n.ctx == "store"}
    out = TemplateFields(context=set(jinja2.meta.find_undeclared_variables(ast)) - assigned)
    out.literals = {n.data for n in ast.find_all(nodes.TemplateData)}
    out.literals |= {n.value for n in ast.find_all(nodes.Const) if isinstance(n.value, str)}

    def visit(node, parent):
        name = None
        if isinstance(node, nodes.Getitem) and is_message(node.node) and isinstance(node.arg, nodes.Const) \
                and isinstance(node.arg.value, str):
            name = node.arg.value
        elif isinstance(node, nodes.Getattr) and is_message(node.node) and node.attr not in ("get", "items", "keys", "values"):
            name = node.attr
        elif isinstance(node, nodes.Call) and isinstance(node.node, nodes.Getattr) and node.node.attr == "get" \
                and is_message(node.node.node) and node.args and isinstance(node.args[0], nodes.Const):
            out.message_optional.add(node.args[0].value)
        elif isinstance(node, nodes.Compare) and isinstance(node.expr, nodes.Const) and \
                any(op.op in ("in", "notin") and is_message(op.expr) for op in node.ops):
            out.message_optional.add(node.expr.value)
        if name is not None:
            optional = isinstance(parent, nodes.Test) and parent.name in _OPTIONAL_TESTS
            (out.message_optional if optional else out.message_required).add(name)
        for child in node.iter_child_nodes():
            visit(child, node)

    visit(ast, None)
    out.message_required -= out.message_optional
    return out


# --------------------------------------------------------------------------- rendering


class Renderer:
    """Render conversations with the template, strictly, with the generation spans."""

    def __init__(self, source: str, special_tokens: dict[str, str | None] | None = None):
        self.source = source
        self.template = _compile(source)
        self.context = {"tools": None, "documents": None, **(special_tokens or {})}

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        token = _Generation.spans.set((blocks, spans))
        try:
            for block in self.template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                **self.context):
                blocks.append(block)
        finally:
            _Generation.spans.reset(token)
        return "".join(blocks), spans


def tokenizer_specials(tokenizer: Any) -> dict[str, str | None]:
    """The special-token strings transformers passes to chat templates."""
    return {f"{role}_token": getattr(tokenizer, f"{role}_token", None) for role in ("bos", "eos", "pad", "unk")}


# --------------------------------------------------------------------------- layout


@dataclass
class TemplateLayout:
    """Token-id markers of the template: where each role's turn opens and where a turn ends.

    Derived by rendering sentinel conversations: the generation prompt is the assistant
    header; the part of the assistant's generation span after its content is the end of
    turn (without generation markers: the text after the last assistant message); the text
    between the end of one turn and the next sentinel is that role's header.
    """

    headers: dict[str, list[int]]
    turn_end: list[int]
    texts: dict[str, str]

    @classmethod
    def derive(cls, tokenizer: Any, source: str) -> "TemplateLayout":
        renderer = Renderer(source, tokenizer_specials(tokenizer))
        s = _SENTINEL

        def conv(*roles):
            return [{"role": r, "content": s[r]} for r in roles]

        text_ua, spans = renderer.render(conv("user", "assistant"))
        a_start = text_ua.index(s["assistant"])
        a_end = a_start + len(s["assistant"])
        span = next(((b, e) for b, e in spans if b <= a_start < e), None)
        turn_end = text_ua[a_end:span[1]] if span else text_ua[a_end:].rstrip()
        if not turn_end.strip():
            raise InputError("cannot find the template's end-of-turn marker after an assistant message")
        prompt_only, _ = renderer.render(conv("user"))
        with_prompt, _ = renderer.render(conv("user"), add_generation_prompt=True)
        if with_prompt.startswith(prompt_only) and with_prompt != prompt_only:
            assistant = with_prompt[len(prompt_only):]
        else:
            between = text_ua[text_ua.index(s["user"]) + len(s["user"]):a_start]
            assistant = between.split(turn_end, 1)[-1]
        texts = {"assistant": assistant.lstrip(), "turn_end": turn_end}
        text_uau, _ = renderer.render(conv("user", "assistant", "user"))
        between = text_uau[text_uau.index(s["assistant"]) + len(s["assistant"]):text_uau.rindex(s["user"])]
        texts["user"] = between.split(turn_end, 1)[-1].lstrip() if turn_end in between else None
        user_prefix = prompt_only[:prompt_only.index(s["user"])]
        try:
            text_sua, _ = renderer.render(conv("system", "user", "assistant"))
            if texts["user"] and user_prefix.endswith(texts["user"]):
                preamble = user_prefix[:-len(texts["user"])]
                system_prefix = text_sua[:text_sua.index(s["system"])]
                if system_prefix.startswith(preamble):
                    texts["system"] = system_prefix[len(preamble):]
        except (jinja2.TemplateError, ValueError):
            pass  # a template without system turns: only user/assistant headers
        texts = {k: v for k, v in texts.items() if v}

        def encode(text):
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])

        headers = {role: encode(texts[role]) for role in ("system", "user", "assistant") if role in texts}
        return cls(headers=headers, turn_end=encode(turn_end), texts=texts)


def _matches(ids: np.ndarray, seq: list[int]) -> np.ndarray:
    """[N, T] bool: the sequence `seq` starts at each position."""
    n, t = ids.shape
    out = np.zeros((n, t), dtype=bool)
    k = len(seq)
    if k == 0 or k > t:
        return out
    hit = np.ones((n, t - k + 1), dtype=bool)
    for j, token in enumerate(seq):
        hit &= ids[:, j:t - k + 1 + j] == token
    out[:, :t - k + 1] = hit
    return out


def _shift(mask: np.ndarray, by: int) -> np.ndarray:
    """Move True marks `by` positions to the right (marks past the end drop)."""
    out = np.zeros_like(mask)
    if by < mask.shape[1]:
        out[:, by:] = mask[:, :mask.shape[1] - by]
    return out


def expected_labels(ids: np.ndarray, attention: np.ndarray, layout: TemplateLayout,
                    pad_id: int | None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Expected category (MASKED / TRAINED / PADDING) of every position of right-aligned rows.

    Trained: from the end of each assistant header through the next end-of-turn marker
    (or the row's end when truncated). Padding: attention 0, and the runs of pad ids before
    the first / after the last real token that are not an open assistant turn's end marker
    (so pad == eos is handled). Also returns, per role, [N, T] marks of empty turns
    (a header immediately followed by the end-of-turn marker).
    Rows shorter than T are filled with -1 ids and attention 0.
    """
    n, t = ids.shape
    header = layout.headers["assistant"]
    opens = _shift(_matches(ids, header), len(header))
    end_at = _matches(ids, layout.turn_end)
    closes = _shift(end_at, len(layout.turn_end))
    events = np.full((n, t), -1, dtype=np.int8)
    events[closes] = MASKED
    events[opens] = TRAINED
    positions = np.where(events >= 0, np.arange(t), 0)
    np.maximum.accumulate(positions, axis=1, out=positions)
    state = np.take_along_axis(events, positions, axis=1)
    state = np.where(state == TRAINED, TRAINED, MASKED).astype(np.int8)

    padding = attention == 0
    if pad_id is not None:
        is_pad = ids == pad_id
        trailing = np.flip(np.cumprod(np.flip(is_pad | (ids < 0), axis=1), axis=1), axis=1).astype(bool)
        leading = np.cumprod(is_pad, axis=1).astype(bool)
        padding |= (trailing & is_pad & (state == MASKED)) | leading
    expected = np.where(padding, PADDING, state).astype(np.int8)

    empty = {}
    for role, seq in layout.headers.items():
        end_right_after = np.pad(end_at[:, len(seq):], ((0, 0), (0, len(seq))))
        empty[role] = _matches(ids, seq) & end_right_after
    return expected, empty


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
        yield (part, to_matrix(part["input_ids"], -1), to_matrix(part["labels"], IGNORE_INDEX),
               to_matrix(part["attention_mask"], 0))


# --------------------------------------------------------------------------- tokenizer


@functools.lru_cache(maxsize=4)
def _load(path: str, mtime: float) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load_tokenizer(path: str | Path) -> Any:
    """A saved tokenizer (transformers, without torch), cached while its files are unchanged."""
    path = Path(path)
    files = [p for p in path.glob("*") if p.is_file()] if path.is_dir() else []
    if not files:
        raise InputError(f"{path}: no saved tokenizer")
    try:
        return _load(str(path.resolve()), max(p.stat().st_mtime for p in files))
    except Exception as exc:  # noqa: BLE001 - any loader failure is bad input
        raise InputError(f"{path}: cannot load tokenizer: {type(exc).__name__}: {one_line(exc)}") from None


# --------------------------------------------------------------------------- what the checks share


def run_tokenizer(ctx: Any) -> Any | None:
    """The run's own tokenizer, as the shim saved it (None when the run recorded none)."""
    from .artifacts import TOKENIZER_DIR, artifact_root

    path = artifact_root(ctx.run_dir) / TOKENIZER_DIR
    return load_tokenizer(path) if path.is_dir() else None


def first_manifest(ctx: Any) -> dict:
    """The manifest of the run's first segment: the template and tokenizer it started with."""
    row = ctx.row("SELECT manifest FROM manifest WHERE rank = 0 ORDER BY seg LIMIT 1")
    return json.loads(row[0]) if row else ctx.manifest


@functools.lru_cache(maxsize=8)
def _layout(tokenizer: Any, source: str) -> TemplateLayout:
    return TemplateLayout.derive(tokenizer, source)


def run_layout(tokenizer: Any) -> TemplateLayout | None:
    source = template_source(getattr(tokenizer, "chat_template", None))
    return _layout(tokenizer, source) if source else None


def recorded_samples(ctx: Any, template: str | None) -> Any:
    """Recorded rows (step, sample_id, input_ids, labels, attention_mask) of batches rendered
    with `template` (rows of batches with another template are LOOP-01's)."""
    from .artifacts import template_fingerprint

    return ctx.frame(
        """
        SELECT s.step, s.sample_id, s.input_ids, s.labels, s.attention_mask
        FROM samples s JOIN batches b USING (rank, seg, step, micro)
        WHERE b.template_fingerprint IS NULL OR b.template_fingerprint = ? OR ? IS NULL
        ORDER BY s.step, s.micro, s.row
        """,
        [template_fingerprint(template), template_fingerprint(template)],
    )
