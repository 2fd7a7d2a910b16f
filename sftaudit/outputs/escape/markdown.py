"""Run text as Markdown inline text (GitHub-flavoured: a step summary, a model card, SARIF messages that
code-scanning views render as Markdown) that renders as exactly what it says, on one line, in a table cell too.

Control, bidi and format characters and line breaks are written as their visible escapes (``\\x1b``, ``\\u202e``,
``\\x0a``), as the CLI shows them; ``&``, ``<`` and ``>`` become entities (no raw HTML); the ASCII punctuation that
Markdown gives a meaning (``\\ ` * _ { } [ ] ( ) # + ! | ~ $``) is backslash-escaped (no link, image, emphasis,
code, table cell or math); ``@`` becomes the fullwidth ``＠`` (no mention, no e-mail autolink); ``://`` and
``www.`` are defanged to ``[:]//`` and ``www[.]`` (no URL autolink). Each string is cut to `limit` characters.
"""

from __future__ import annotations

import re
from typing import Any

from ...core.terminal import shown

TEXT_LIMIT = 500  # characters of one run string (a message, a name, a reason) shown

_DEFANG = re.compile(r"://|(?i:www)\.")
_SPECIAL = re.compile(r"[\\`*_{}\[\]()#+!|~$&<>@]")
_REPLACED = {"&": "&amp;", "<": "&lt;", ">": "&gt;", "@": "＠"}


def inline(value: Any, limit: int = TEXT_LIMIT) -> str:
    """`value` as Markdown inline text that renders as exactly what it says, on one line, in a table cell too."""
    s = shown(value)  # no control, bidi or format character and no line break is left raw
    if len(s) > limit:
        s = s[: limit - 1] + "…"
    s = _DEFANG.sub(lambda m: "[:]//" if m.group() == "://" else m.group()[:3] + "[.]", s)
    return _SPECIAL.sub(lambda m: _REPLACED.get(m.group()) or "\\" + m.group(), s)
