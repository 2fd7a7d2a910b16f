"""Run text for an XML 1.0 document (JUnit): what XML cannot hold (control characters, lone surrogates,
U+FFFE/U+FFFF) and what a reader of it should not see raw (bidi controls) written as escapes; line breaks kept.
``&``, ``<``, ``>`` and quotes are the XML writer's to escape (`xml.etree` does)."""

from __future__ import annotations

import re

from ...core.terminal import escaped_char, shown

_XML_INVALID = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def text(value: object) -> str:
    return _XML_INVALID.sub(lambda m: escaped_char(m.group()), shown(value, keep_newlines=True))
