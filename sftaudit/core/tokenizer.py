"""What identifies a tokenizer (its manifest description and fingerprint), and the one loader of a saved one.

Shared by the shim (recorded at start and at each checkpoint) and the analyzer (the checks, the importers,
`preflight`, which have no torch), so it imports neither torch nor the analyzer.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from ..errors import InputError, one_line
from .safe_io import read_text


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


# ---------------------------------------------------------------------------- loading a saved tokenizer

# Files any one of which holds a whole vocabulary (fast tokenizer, SentencePiece, BPE/WordPiece vocab,
# tiktoken). Without one, transformers still builds a tokenizer, from the special tokens of
# tokenizer_config.json alone (a few dozen tokens): its ids are wrong, so it is not used.
VOCAB_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "sentencepiece.model",
    "spm.model",
    "vocab.json",
    "vocab.txt",
    "vocab.model",
    "tokenizer.tiktoken",
    "qwen.tiktoken",
)
_CONFIG_LIMIT = 64 * 1024 * 1024


class TokenizerRefused(ValueError):
    """A saved tokenizer that sftaudit will not load: it asks for code from its folder, or it cannot be
    built whole from the files there."""


def refusal(folder: str | Path) -> str | None:
    """Why the tokenizer saved in `folder` must not be loaded (None: it may be)."""
    folder = Path(folder)
    for name, keys in (("tokenizer_config.json", None), ("config.json", ("AutoTokenizer",))):
        try:
            config = json.loads(read_text(folder / name, max_bytes=_CONFIG_LIMIT)) if (folder / name).exists() else None
        except (InputError, ValueError):
            config = None
        auto_map = config.get("auto_map") if isinstance(config, dict) else None
        if isinstance(auto_map, dict) and auto_map:
            entries = {k: v for k, v in auto_map.items() if keys is None or k in keys}
            if entries:
                key, value = next(iter(entries.items()))
                shown = " ".join(str(v) for v in value) if isinstance(value, list) else str(value)
                return (
                    f"the tokenizer asks for code from its folder ({name} auto_map {key}: {shown}); sftaudit "
                    f"never runs code from a run folder (trust_remote_code=False), so it was not loaded"
                )
    if not any((folder / name).is_file() for name in VOCAB_FILES):
        present = sorted(p.name for p in folder.iterdir() if p.is_file())[:6] if folder.is_dir() else []
        return (
            f"the tokenizer cannot be built whole: {folder.name}/ has no tokenizer.json or vocabulary file "
            f"(tokenizer.model, vocab.json, vocab.txt, ...), only {', '.join(present) or 'nothing'}; save the "
            f"tokenizer with the checkpoint (tokenizer.save_pretrained) to judge it"
        )
    return None


def load_saved_tokenizer(folder: str | Path) -> Any:
    """A tokenizer from its saved files: never code from the folder, never a prompt, never a partial one.
    Raises TokenizerRefused with the reason, or what transformers raises."""
    reason = refusal(folder)
    if reason is not None:
        raise TokenizerRefused(reason)
    generic = _generic_fast_class(Path(folder))
    if generic is not None:
        added = _added_tokens_decoder(Path(folder))  # only added_tokens_decoder: no switch can come in through it
        return generic.from_pretrained(str(folder), trust_remote_code=False, local_files_only=True, **added)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False, local_files_only=True)


# The generic classes of a tokenizer.json-only tokenizer (transformers 4 saves the first, 5 the second).
_GENERIC_FAST = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _generic_fast_class(folder: Path) -> Any:
    """The class AutoTokenizer would load a bare tokenizer folder with, when that is plainly the generic
    class its tokenizer_config.json names (a tokenizer.json, no config.json whose model type could pick
    another one); else None. Loading it directly skips AutoTokenizer's import of every model
    configuration, and with them torch: seconds of preflight's fixed cost."""
    if not (folder / "tokenizer.json").is_file() or (folder / "config.json").exists():
        return None
    try:
        config = json.loads(read_text(folder / "tokenizer_config.json", max_bytes=_CONFIG_LIMIT))
    except (InputError, ValueError):
        return None
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    if name not in _GENERIC_FAST:
        return None
    import transformers

    return getattr(transformers, name, None)


def _added_tokens_decoder(folder: Path) -> dict[str, Any]:
    """`added_tokens_decoder` for from_pretrained, taken from the head of tokenizer.json, when
    tokenizer_config.json lacks it (as transformers 5 saves it) and no legacy special_tokens_map.json or
    added_tokens.json asks for transformers' own merge. Without it transformers json-loads the whole
    tokenizer.json in Python for that list alone (0.45 s CPU on Llama 3's 128k vocabulary), and builds the
    same tokens from it. Empty (transformers reads the file itself) in every other case."""
    if (folder / "special_tokens_map.json").exists() or (folder / "added_tokens.json").exists():
        return {}
    try:
        config = json.loads(read_text(folder / "tokenizer_config.json", max_bytes=_CONFIG_LIMIT))
        text = read_text(folder / "tokenizer.json")
    except (InputError, ValueError):
        return {}
    if not isinstance(config, dict) or "added_tokens_decoder" in config or text.count('"added_tokens"') != 1:
        return {}  # a repeated key: the last one counts, in the Rust parser and in json.load
    tokens = _leading_member(text, "added_tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, dict) and type(t.get("id")) is int for t in tokens):
        return {}
    return {"added_tokens_decoder": {t["id"]: {k: v for k, v in t.items() if k != "id"} for t in tokens}}


_SPACE = re.compile(r"[ \t\n\r]*")  # JSON's whitespace


def _leading_member(text: str, name: str) -> Any:
    """The value of the top-level member `name` of the JSON object `text`, parsing only the members up to it
    (the tokenizers library writes version, truncation, padding and added_tokens ahead of the vocabulary);
    None when the text is not such an object."""
    decoder, pos = json.JSONDecoder(), _SPACE.match(text).end()
    if not text.startswith("{", pos):
        return None
    try:
        while True:
            key, pos = decoder.raw_decode(text, _SPACE.match(text, pos + 1).end())
            pos = _SPACE.match(text, pos).end()
            if not isinstance(key, str) or not text.startswith(":", pos):
                return None
            value, pos = decoder.raw_decode(text, _SPACE.match(text, pos + 1).end())
            if key == name:
                return value
            pos = _SPACE.match(text, pos).end()
            if not text.startswith(",", pos):
                return None
    except ValueError:  # not JSON there
        return None


_LOADED: dict[tuple[str, float], Any] = {}  # (folder, newest file time) -> tokenizer, the last few


def _key(path: Path) -> tuple[str, float]:
    files = [p for p in path.glob("*") if p.is_file()] if path.is_dir() else []
    if not files:
        raise InputError(f"{path}: no saved tokenizer")
    return str(path.resolve()), max(p.stat().st_mtime for p in files)


class TokenizerUnusable(InputError):
    """A saved tokenizer sftaudit will not load (it asks for remote code, or cannot be built whole)."""


def load_tokenizer(path: str | Path) -> Any:
    """A saved tokenizer (transformers, without torch), cached while its files are unchanged. Never code
    from the folder (`trust_remote_code=False`, no prompt), never one rebuilt from part of its files:
    those raise TokenizerUnusable with the reason."""
    key = _key(Path(path))
    if key not in _LOADED:
        try:
            tokenizer = load_saved_tokenizer(key[0])
        except TokenizerRefused as exc:
            raise TokenizerUnusable(f"{path}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - any loader failure is bad input
            raise InputError(f"{path}: cannot load tokenizer: {type(exc).__name__}: {one_line(exc)}") from None
        remember_tokenizer(path, tokenizer)
    return _LOADED[key]


def remember_tokenizer(path: str | Path, tokenizer: Any) -> None:
    """`tokenizer` is what is saved in `path` (preflight just saved it): the checks reuse it, not a reload."""
    while len(_LOADED) >= 4:
        _LOADED.pop(next(iter(_LOADED)))
    _LOADED[_key(Path(path))] = tokenizer
