"""Conversations rendered by transformers' own machinery (byte-equal with ``apply_chat_template(..., tokenize=False)``), with the ``{% generation %}`` spans as character offsets when the template has them."""

from __future__ import annotations

import functools
from typing import Any

from ..errors import UnsupportedVersion
from .sandbox import TemplateBudget, compiled_template, render_budgeted
from .template_text import GENERATION_TAG


class Renderer:
    """Render conversations exactly as `tokenizer.apply_chat_template(..., tokenize=False)` does, with
    the `{% generation %}` spans when the template has them. A template that refuses a row
    (`raise_exception`) raises TemplateError.

    transformers normalises every conversation before rendering (objects to dicts, keys whose value is
    None dropped, everything rebuilt from plain JSON types, reasoning fields aliased). For a plain JSON
    row (what a JSONL file or a `datasets` row holds) without reasoning fields all of that but the None
    drop is the identity, so such rows go straight to the compiled template; any other row is normalised
    by transformers' own helpers first. Either way the template renders in the budgeted sandbox
    (`_BudgetEnvironment`); only a transformers without those private helpers falls back to
    `render_jinja_template` itself (constant bombs are still refused before it compiles the template).
    """

    def __init__(self, source: str, template_kwargs: dict[str, Any] | None = None):
        self.source = source
        self.kwargs = dict(template_kwargs or {})
        self.tracks_generation = bool(GENERATION_TAG.search(source))
        self.compiled = compiled_template(source)  # a syntax error is bad input, reported once
        # Values that are not plain JSON must go through transformers' normalisation.
        self.template = self.compiled if _is_json(self.kwargs) else None
        self.context = {"tools": None, "documents": None, **self.kwargs}
        self.over_budget: TemplateBudget | None = None

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
        # A template over its budget once is refused from then on: each row would spend the whole budget.
        if self.over_budget is not None:
            raise self.over_budget
        try:
            return self._render(messages, add_generation_prompt)
        except TemplateBudget as exc:
            self.over_budget = exc
            raise

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> tuple[str, list[tuple[int, int]]]:
        chat = _plain_chat(messages) if self.template is not None else None
        context = self.context
        if chat is None and self.compiled is not None and _normalisers() is not None:
            plain, alias = _normalisers()  # what render_jinja_template does before it renders
            chat = plain(_without_none(messages))
            for message in chat:
                if not isinstance(message, dict):
                    raise TypeError(f"Chat messages should be dicts, but got {type(message).__name__}")
            chat, context = alias(chat), {"tools": None, "documents": None, **plain(self.kwargs)}
        if chat is None:
            render_jinja_template = _public_renderer()

            (text,), spans = render_jinja_template(
                [_without_none(messages)],
                chat_template=self.source,
                add_generation_prompt=add_generation_prompt,
                return_assistant_tokens_mask=self.tracks_generation,
                **self.kwargs,
            )
            return text, [tuple(s) for s in spans[0]] if spans else []
        if self.tracks_generation:  # as transformers' _render_with_assistant_indices, within the budget
            blocks, spans = [], []
            with self.compiled.environment.activate_tracker(blocks, spans):
                text = render_budgeted(
                    self.compiled, blocks, messages=chat, add_generation_prompt=add_generation_prompt, **context
                )
            return text, [tuple(s) for s in spans]
        return render_budgeted(self.compiled, messages=chat, add_generation_prompt=add_generation_prompt, **context), []


def _public_renderer() -> Any:
    """transformers' `render_jinja_template` (4.45 has it, or the private helpers above); older releases
    render chat templates inside the tokenizer only."""
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError:
        import transformers

        raise UnsupportedVersion(
            f"transformers {transformers.__version__} is older than 4.45, the oldest sftaudit supports: it cannot "
            f"render the chat template as the tokenizer does; upgrade it (pip install 'transformers>=4.45') to "
            f"judge the chat template, its special tokens and the loss mask"
        ) from None
    return render_jinja_template


@functools.cache
def _normalisers() -> tuple[Any, Any] | None:
    """transformers' conversation normalisation (private: None in a version without it)."""
    try:
        from transformers.utils.chat_template_utils import _alias_reasoning_fields, _plain_template_data
    except ImportError:
        return None
    return _plain_template_data, _alias_reasoning_fields


# Message fields transformers copies into one another before rendering (reasoning_content <-> thinking).
_REASONING_FIELDS = frozenset({"reasoning_content", "thinking", "reasoning"})
_JSON_SCALARS = frozenset({str, int, float, bool, type(None)})


def _is_json(value: Any) -> bool:
    """Built from JSON types only (exact types: a str subclass is not plain)."""
    kind = type(value)
    if kind in _JSON_SCALARS:
        return True
    if kind is list:
        return all(map(_is_json, value))
    if kind is dict:
        return all(type(k) is str for k in value) and all(map(_is_json, value.values()))
    return False


def _plain_chat(messages: Any) -> list[dict] | None:
    """The messages as transformers hands a plain JSON row to the template (keys whose value is None
    dropped), or None when the row needs transformers' own normalisation."""
    if type(messages) is not list:
        return None
    chat = []
    for message in messages:
        if type(message) is not dict or not _REASONING_FIELDS.isdisjoint(message):
            return None
        plain = {}
        for key, value in message.items():
            if type(key) is not str or (type(value) is not str and not _is_json(value)):
                return None
            if value is not None:
                plain[key] = value
        chat.append(plain)
    return chat


def _without_none(messages: Any) -> Any:
    """apply_chat_template's first normalisation: message keys whose value is None dropped."""
    if not isinstance(messages, (list, tuple)):
        return messages
    return [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in messages]


def tokenizer_specials(tokenizer: Any) -> dict[str, Any]:
    """What transformers passes to chat templates besides the messages: the special-tokens map."""
    return dict(getattr(tokenizer, "special_tokens_map", {}) or {})
