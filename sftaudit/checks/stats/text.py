"""One tokenization for every text statistic (LOOP-07 diversity, LOOP-08 ROUGE/BLEU and contamination).

CJK characters are one token each (Chinese has no spaces to split on), runs of other letters and
digits are one lower-cased token each, punctuation and spaces are dropped. Using the same tokens
for ROUGE-L and BLEU-4 is the point: a common bug is the two metrics computed on different tokenizers.
"""

from __future__ import annotations

import re

_CJK = "\u2e80-\u9fff\uac00-\ud7af\uf900-\ufaff"
_TOKEN = re.compile(f"[{_CJK}]|[^\\W_{_CJK}]+")
_CJK_CHAR = re.compile(f"[{_CJK}]")


def tokenize(text: str) -> list[str]:
    return _TOKEN.findall((text or "").lower())


def join_ngram(tokens: tuple[str, ...]) -> str:
    """An n-gram for display: CJK characters joined directly, words with spaces."""
    out = tokens[0]
    for prev, tok in zip(tokens, tokens[1:]):
        out += tok if _CJK_CHAR.fullmatch(prev) and _CJK_CHAR.fullmatch(tok) else " " + tok
    return out


class SharedTokenizer:
    """The `tokenize(text)` object rouge-score accepts (its default drops non-Latin characters)."""

    def tokenize(self, text: str) -> list[str]:
        return tokenize(text)
