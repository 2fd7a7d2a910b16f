"""Text from a run folder (tensor names, sample ids, paths, messages quoting them) made harmless to show.

A terminal obeys escape sequences (window title, screen clear) and bidi controls reorder what a reader
sees (U+202E). Every CLI print path and the JSON outputs pass their text through here, and each output's
own escaping (`sftaudit.outputs.escape`) starts from it: such characters are shown as their
escapes (``\\x1b``, ``\\u202e``), so the text stays readable and nothing acts on it.
"""

from __future__ import annotations

import re
import unicodedata

# Controls (C0 but newline, DEL, C1), format characters (bidi, zero-width, tags), line/paragraph
# separators and lone surrogates (which cannot even be encoded).
_UNSAFE_CATEGORIES = {"Cc", "Cf", "Cs", "Zl", "Zp"}


def _unsafe(ch: str) -> bool:
    return unicodedata.category(ch) in _UNSAFE_CATEGORIES


def escaped_char(ch: str) -> str:
    """One character as the escape a reader sees: ``\\x1b``, ``\\u202e``, ``\\U000e0041``."""
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


_CANDIDATES = re.compile(r"[^\x20-\x7e]")  # only non-printable-ASCII characters need a closer look


def shown(text: object, keep_newlines: bool = False) -> str:
    """`text` with every control, bidi/format character and lone surrogate written as its escape.
    With `keep_newlines`, line breaks stay (for output the CLI itself laid out in lines)."""
    text = str(text)

    def sub(m: re.Match) -> str:
        ch = m.group()
        if keep_newlines and ch == "\n":
            return ch
        return escaped_char(ch) if _unsafe(ch) else ch

    return _CANDIDATES.sub(sub, text)


def json_safe(text: str) -> str:
    """A JSON document with the characters `shown` escapes written as JSON ``\\uXXXX`` escapes: the
    same document, safe to print or write as UTF-8 (json.dumps with ensure_ascii=False leaves
    bidi controls, C1 controls and lone surrogates raw)."""

    def sub(m: re.Match) -> str:
        ch = m.group()
        if ch == "\n" or not _unsafe(ch):  # json.dumps escapes C0 controls inside strings itself
            return ch
        code = ord(ch)
        if code < 0x10000:
            return f"\\u{code:04x}"
        code -= 0x10000
        return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"

    return _CANDIDATES.sub(sub, text)


def safe_name(name: str) -> str:
    """A run id as a single safe path component (run ids come from untrusted artifacts). Here, not in
    the report: the CLI names the output folder without importing the report (and plotly)."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "run"
    return cleaned[:100]
