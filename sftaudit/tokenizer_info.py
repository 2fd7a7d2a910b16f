"""What identifies a tokenizer: its manifest description and fingerprint.

Shared by the shim (recorded at start and at each checkpoint) and `preflight` (which has no
torch), so it imports neither torch nor the analyzer.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Hash of everything that changes token ids: vocabulary, merges, normalizer, specials, template."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(_special_tokens(tokenizer), sort_keys=True).encode())
    h.update((getattr(tokenizer, "chat_template", None) or "").encode())
    return h.hexdigest()[:16]


def _special_tokens(tokenizer: Any) -> dict[str, Any]:
    specials = {}
    for role in ("bos", "eos", "pad", "unk"):
        token = getattr(tokenizer, f"{role}_token", None)
        specials[role] = {"token": token, "id": getattr(tokenizer, f"{role}_token_id", None)}
    return specials


def describe_tokenizer(tokenizer: Any) -> dict[str, Any]:
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return {
        "class": type(tokenizer).__name__,
        "fingerprint": tokenizer_fingerprint(tokenizer),
        "length": len(tokenizer),
        "special_tokens": _special_tokens(tokenizer),
        "added_tokens": [
            {"id": int(i), "content": t.content, "special": bool(t.special)} for i, t in sorted(added.items())
        ],
        "padding_side": getattr(tokenizer, "padding_side", None),
        "truncation_side": getattr(tokenizer, "truncation_side", None),
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
