"""What identifies a tokenizer (its manifest description and fingerprint), and the one loader of a saved one.

Shared by the shim (recorded at start and at each checkpoint) and the analyzer (the checks, the importers,
`preflight`, which have no torch), so it imports neither torch nor the analyzer.
"""

from __future__ import annotations

import gc
import hashlib
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import chain
from json.encoder import encode_basestring_ascii
from pathlib import Path
from typing import Any

import orjson

from ..errors import InputError, one_line
from .safe_io import read_text

# What a tokenizer IS, part by part: the pieces of its tokenizer.json that map text to ids and back, its
# special-token roles and its chat template. Never its runtime truncation or padding state: TRL and the
# collators set those while tokenizing (truncation max_length 128 where the saved file says null), so a
# tokenizer saved mid-run would otherwise differ from the one the run started with.
IDENTITY_PARTS = (
    "vocabulary",
    "merges",
    "model",
    "added_tokens",
    "normalizer",
    "pre_tokenizer",
    "post_processor",
    "decoder",
    "special_tokens",
    "chat_template",
)
# Fingerprints of this kind start with it; those recorded before it (16 hex digits of the whole backend,
# its truncation and padding state included) have no prefix and are recomputed from the saved files.
FINGERPRINT_KIND = "v2:"


def tokenizer_identity(tokenizer: Any) -> dict[str, str]:
    """A short hash of each part of what the tokenizer is (IDENTITY_PARTS): two tokenizers that tokenize,
    decode and template alike have equal parts, whatever truncation or padding they were last called with."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digests = dict(_spec_digests(backend.to_str()))
    else:  # a slow tokenizer: its vocabulary is what it exposes
        digests = dict.fromkeys(IDENTITY_PARTS, _digest(None))
        digests["vocabulary"] = _digest(sorted(tokenizer.get_vocab().items()))
    digests["special_tokens"] = _digest(_special_tokens(tokenizer))
    digests["chat_template"] = _digest(getattr(tokenizer, "chat_template", None))
    return {name: digests[name] for name in IDENTITY_PARTS}


_SPEC_PARTS = ("added_tokens", "normalizer", "pre_tokenizer", "post_processor", "decoder")
# The last few specs' part digests, by the spec's own hash: the shim and an import fingerprint the same
# tokenizer at every checkpoint, where parsing and writing its parts again is most of the cost.
_SPEC_DIGESTS: dict[bytes, dict[str, str]] = {}


def _spec_digests(spec_text: str) -> dict[str, str]:
    """The digests of the parts of a fast tokenizer's spec (its backend's to_str): vocabulary, merges, the rest
    of the model's settings and _SPEC_PARTS."""
    key = hashlib.sha256(spec_text.encode()).digest()
    if key not in _SPEC_DIGESTS:
        with _collector_paused():  # the parsed spec is written and freed before the collector runs again
            digests = _part_digests(json.loads(spec_text))
        while len(_SPEC_DIGESTS) >= 4:
            _SPEC_DIGESTS.pop(next(iter(_SPEC_DIGESTS)))
        _SPEC_DIGESTS[key] = digests
    return _SPEC_DIGESTS[key]


def _part_digests(spec: dict[str, Any]) -> dict[str, str]:
    model = dict(spec.get("model") or {})
    parts = {"vocabulary": model.pop("vocab", None), "merges": model.pop("merges", None), "model": model}
    parts.update((name, spec.get(name)) for name in _SPEC_PARTS)
    return {name: _digest(value) for name, value in parts.items()}


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """One hash of the tokenizer's identity (`tokenizer_identity`), prefixed with FINGERPRINT_KIND."""
    return FINGERPRINT_KIND + _digest(tokenizer_identity(tokenizer))


def current_fingerprint(fingerprint: Any) -> bool:
    """Whether a recorded fingerprint is of this kind (comparable with `tokenizer_fingerprint`'s)."""
    return isinstance(fingerprint, str) and fingerprint.startswith(FINGERPRINT_KIND)


def _digest(value: Any) -> str:
    return hashlib.sha256(_canonical_json(value)).hexdigest()[:16]


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cycle collector off while a tokenizer's spec is parsed and written: its 300k new lists (the
    merges) would set off full collections over the whole heap, most of the parse's time in a process with
    transformers loaded, and once freed they need none. Nothing parsed can be cyclic; the collector's state
    before is restored."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _canonical_json(value: Any) -> bytes:
    """`json.dumps(value, sort_keys=True, separators=(",", ":")).encode()`, byte for byte: what every version
    hashed. orjson writes it (its sort_keys in Rust: several times faster on a 128k vocabulary) when it writes
    the value alike; json.dumps writes the rest."""
    if _orjson_writes_alike(value):
        try:
            written = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
        except TypeError:  # an int beyond 64 bits, a lone surrogate, a key that is not exactly a str, deep nesting
            pass
        else:
            return _ascii_escaped(written)
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


# The types orjson writes as json.dumps does once its text is ASCII-escaped. Never a float (orjson writes 1e-05
# as 0.00001 and NaN as null), nor a subclass (json.dumps may write one its own way).
_WRITTEN_ALIKE = frozenset({dict, list, tuple, str, int, bool, type(None)})
_CONTAINERS = frozenset({dict, list, tuple})
_SEQUENCES = frozenset({list, tuple})
_DEEPEST = 256  # levels walked: deeper (or cyclic) values are json.dumps's; orjson refuses past 254 levels


def _orjson_writes_alike(value: Any) -> bool:
    """Whether `value` holds only _WRITTEN_ALIKE types, walked level by level: passes in C over each level's
    members (a vocabulary's 128k ids, its merges' 560k strings), not a Python call per member."""
    if type(value) not in _WRITTEN_ALIKE:
        return False
    containers, kinds = [value], {type(value)}
    for _ in range(_DEEPEST):
        if kinds.isdisjoint(_CONTAINERS):
            return True
        if not kinds <= _CONTAINERS:
            containers = [v for v in containers if type(v) in _CONTAINERS]
            kinds &= _CONTAINERS
        member_kinds = set(map(type, _members(containers, kinds)))
        if not member_kinds <= _WRITTEN_ALIKE:
            return False
        if not member_kinds.isdisjoint(_CONTAINERS):  # a next level: its containers kept (scalars dropped above)
            containers = list(_members(containers, kinds))
        kinds = member_kinds
    return False


def _members(containers: list, kinds: set[type]) -> Iterator[Any]:
    """The members of each container (a dict's values), in one chain."""
    if kinds == {dict}:
        return chain.from_iterable(map(dict.values, containers))
    if dict not in kinds:
        return chain.from_iterable(containers)
    return chain.from_iterable(v.values() if type(v) is dict else v for v in containers)


def _ascii_escaped(written: bytes) -> bytes:
    """orjson's UTF-8 text with json.dumps's escapes: every non-ASCII character as \\uXXXX (astral ones as a
    surrogate pair) and DEL as \\u007f. json's own string escaper does it over the whole text; the quotes and
    backslashes it escapes on the way (all of them: every one in orjson's text is a delimiter or opens an escape)
    are put back, left to right as a JSON reader pairs them."""
    if written.isascii() and b"\x7f" not in written:
        return written
    escaped = encode_basestring_ascii(written.decode())[1:-1]  # its own enclosing quotes dropped
    return escaped.replace("\\\\", "\x00").replace('\\"', '"').replace("\x00", "\\").encode()


def _special_tokens(tokenizer: Any) -> dict[str, Any]:
    specials = {}
    for role in ("bos", "eos", "pad", "unk"):
        token = getattr(tokenizer, f"{role}_token", None)
        specials[role] = {"token": token, "id": getattr(tokenizer, f"{role}_token_id", None)}
    return specials


def describe_tokenizer(tokenizer: Any) -> dict[str, Any]:
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    identity = tokenizer_identity(tokenizer)
    return {
        "class": type(tokenizer).__name__,
        "fingerprint": FINGERPRINT_KIND + _digest(identity),
        "identity": identity,
        "length": len(tokenizer),
        "special_tokens": _special_tokens(tokenizer),
        "added_tokens": [
            {"id": int(i), "content": t.content, "special": bool(t.special)} for i, t in sorted(added.items())
        ],
        "padding_side": getattr(tokenizer, "padding_side", None),
        "truncation_side": getattr(tokenizer, "truncation_side", None),
        "chat_template": getattr(tokenizer, "chat_template", None),
    }


# How each identity part is named to a reader (the special tokens, added tokens and template are named
# token by token from the descriptions instead).
_PART_NAMES = {
    "vocabulary": "the vocabulary",
    "merges": "the merges",
    "model": "the tokenization model's settings",
    "normalizer": "the normaliser",
    "pre_tokenizer": "the pre-tokenizer",
    "post_processor": "the post-processor (the tokens it adds around a text)",
    "decoder": "the decoder",
    "added_tokens": "the added tokens' settings",
}
SHOWN_TOKENS = 5  # added or removed tokens named in a change; the rest are counted


def tokenizer_changes(before: dict[str, Any], after: dict[str, Any]) -> list[dict[str, Any]]:
    """What differs between two described tokenizers (`describe_tokenizer`, or an older description without
    `identity`), as changes a reader acts on: {part, text, and for a special token role/before/after, for added
    tokens the tokens}. Empty when nothing that is compared differs."""
    changes: list[dict[str, Any]] = []
    specials_a, specials_b = before.get("special_tokens") or {}, after.get("special_tokens") or {}
    for role in ("bos", "eos", "pad", "unk"):
        a, b = specials_a.get(role) or {}, specials_b.get(role) or {}
        if (a.get("token"), a.get("id")) != (b.get("token"), b.get("id")):
            verb = "added" if a.get("token") is None else "removed" if b.get("token") is None else "changed"
            changes.append(
                {
                    "part": "special_tokens",
                    "role": role,
                    "change": verb,
                    "before": a.get("token"),
                    "after": b.get("token"),
                    "text": f"{role} token {verb}: {_token(a)} -> {_token(b)}",
                }
            )
    added_a = {t.get("content"): t.get("id") for t in before.get("added_tokens") or [] if isinstance(t, dict)}
    added_b = {t.get("content"): t.get("id") for t in after.get("added_tokens") or [] if isinstance(t, dict)}
    for verb, tokens in (
        ("added", [t for t in added_b if t not in added_a]),
        ("removed", [t for t in added_a if t not in added_b]),
    ):
        if tokens:
            shown = ", ".join(repr(t) for t in tokens[:SHOWN_TOKENS]) + (
                f" and {len(tokens) - SHOWN_TOKENS} more" if len(tokens) > SHOWN_TOKENS else ""
            )
            changes.append(
                {
                    "part": "added_tokens",
                    "change": verb,
                    "tokens": tokens[:50],
                    "count": len(tokens),
                    "text": f"{len(tokens)} token(s) {verb}: {shown}",
                }
            )
    if (before.get("chat_template") or None) != (after.get("chat_template") or None):
        changes.append({"part": "chat_template", "change": "changed", "text": "the chat template changed"})
    length_a, length_b = before.get("length"), after.get("length")
    moved = sum(c.get("count", 0) * (1 if c["change"] == "added" else -1) for c in changes if "count" in c)
    if length_a is not None and length_b is not None and length_b - length_a != moved:
        changes.append(
            {"part": "vocabulary", "change": "resized", "text": f"the vocabulary: {length_a} -> {length_b} ids"}
        )
    parts_a, parts_b = before.get("identity") or {}, after.get("identity") or {}
    named = {c["part"] for c in changes}
    for part, name in _PART_NAMES.items():
        if part in parts_a and part in parts_b and parts_a[part] != parts_b[part] and part not in named:
            changes.append({"part": part, "change": "changed", "text": f"{name} changed"})
    return changes


def _token(special: dict[str, Any]) -> str:
    if special.get("token") is None:
        return "none"
    return f"{special['token']!r}" + (f" (id {special['id']})" if special.get("id") is not None else "")


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
    if not any((folder / name).exists() for name in ("tokenizer_config.json", "special_tokens_map.json")):
        return (
            f"the tokenizer's special tokens were not saved: {folder.name}/ has no tokenizer_config.json or "
            f"special_tokens_map.json, so its eos and pad tokens cannot be told; save the tokenizer with "
            f"tokenizer.save_pretrained to judge it"
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
    import transformers

    if not (folder / "tokenizer_config.json").exists():
        # tokenizer.json with its special tokens in special_tokens_map.json: only the generic class builds it;
        # transformers 4's AutoTokenizer refuses a folder with neither config.
        return transformers.PreTrainedTokenizerFast
    try:
        config = json.loads(read_text(folder / "tokenizer_config.json", max_bytes=_CONFIG_LIMIT))
    except (InputError, ValueError):
        return None
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    if name not in _GENERIC_FAST:
        return None
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
