"""What the analyzer reads off a chat template's text without jinja2: which template of a tokenizer is the
default, whether it marks generation, and the error a template over its render budget is reported as. The checks
import these at module level; the template engine (`sandbox`, `render`, `fields`) is imported only where a
template is rendered or parsed, so a run with no template (a trainer log) never pays for jinja2."""

from __future__ import annotations

import re
from typing import Any

from ..errors import InputError

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class TemplateOverBudget(InputError):
    """TemplateBudget as the analyzer reports it: never taken for "a template without turns"."""


def template_source(chat_template: Any) -> str | None:
    """The default template text (tokenizers may carry a dict of named templates)."""
    if isinstance(chat_template, dict):
        return chat_template.get("default") or next(iter(chat_template.values()), None)
    if isinstance(chat_template, list):  # the serialised form: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in chat_template if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return chat_template or None


def has_generation_block(source: str | None) -> bool:
    """The template marks its assistant turns with `{% generation %}` (what transformers' assistant mask and
    TRL's assistant_only_loss read)."""
    return bool(source) and bool(GENERATION_TAG.search(source))
