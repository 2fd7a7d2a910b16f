"""Run text in the HTML report: every string a template prints is shown as the CLI shows it (controls, bidi
and format characters as their escapes, line breaks kept for <pre> blocks) before Jinja's autoescape turns
``& < > " '`` into entities. What a template marks safe itself (the inlined plotly.js, ``tojson``) is ours; run
text inside a figure (plotly renders a subset of HTML in labels and hover text) passes through `text`."""

from __future__ import annotations

import html
from typing import Any

from markupsafe import Markup

from ...core.terminal import shown


def finalize(value: Any) -> Any:
    """Jinja's `finalize`: applied to every ``{{ ... }}`` before autoescape."""
    if isinstance(value, str) and not isinstance(value, Markup):
        return shown(value, keep_newlines=True)
    return value


def text(value: Any) -> str:
    """`value` as HTML text content: shown as the CLI shows it, ``& < >`` as entities."""
    return html.escape(shown(value), quote=False)
