"""The tokenizer identity's fast writer (orjson) hashes exactly the bytes every earlier version hashed
(`json.dumps(value, sort_keys=True, separators=(",", ":"))`), so fingerprints recorded in run folders stay
comparable: on random JSON-like values and on every real tokenizer the tests build."""

from __future__ import annotations

import enum
import gc
import hashlib
import json
from collections import OrderedDict

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sftaudit.core.tokenizer import (
    IDENTITY_PARTS,
    _canonical_json,
    _collector_paused,
    _orjson_writes_alike,
    _special_tokens,
    tokenizer_identity,
)

from .corpus import real_tokenizer_folder, tokenizer_cache


def reference_json(value) -> bytes:
    """What the identity hashed before orjson wrote it."""
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def spec_parts(spec: dict) -> dict:
    """A fast tokenizer's spec split into the identity's parts, as earlier versions split it."""
    parts = dict.fromkeys(IDENTITY_PARTS)
    model = dict(spec.get("model") or {})
    parts["vocabulary"], parts["merges"], parts["model"] = model.pop("vocab", None), model.pop("merges", None), model
    for key in ("added_tokens", "normalizer", "pre_tokenizer", "post_processor", "decoder"):
        parts[key] = spec.get(key)
    return parts


def reference_identity(tokenizer) -> dict[str, str]:
    """`tokenizer_identity` as earlier versions computed it: json.loads of the whole spec, json.dumps of each part."""
    parts = spec_parts(json.loads(tokenizer.backend_tokenizer.to_str()))
    parts["special_tokens"] = _special_tokens(tokenizer)
    parts["chat_template"] = getattr(tokenizer, "chat_template", None)
    return {name: hashlib.sha256(reference_json(value)).hexdigest()[:16] for name, value in parts.items()}


def written(value) -> bytes | type:
    """The bytes written, or the kind of error raised (both writers must refuse the same values)."""
    try:
        return _canonical_json(value)
    except (TypeError, ValueError, RecursionError) as exc:
        return type(exc)


def reference_written(value) -> bytes | type:
    try:
        return reference_json(value)
    except (TypeError, ValueError, RecursionError) as exc:
        return type(exc)


# Characters where the two writers part: control characters, DEL, quotes and backslashes (escapes of their
# own), Latin-1, the BMP's edges, astral ones (a surrogate pair in json.dumps), lone surrogates (orjson refuses).
TRICKY = st.sampled_from(
    ["\x00", "\x08", "\x1f", "\x7f", "\x80", "\xff", '"', "\\", "/", "\u0120", "\u2028", "\ud800", "\udfff"]
    + ["\ue000", "\uffff", "\U00010000", "\U0001f600", "\U0010ffff", "e", "1", "u"]
)
TEXT = st.lists(st.one_of(TRICKY, st.characters(exclude_categories=())), max_size=8)
STRINGS = TEXT.map("".join)
BASE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),  # beyond 64 bits too (orjson refuses them)
    st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1]),
    STRINGS,
)


def nestings(scalars):
    return st.recursive(
        scalars,
        lambda children: st.one_of(
            st.lists(children, max_size=5),
            st.lists(children, max_size=5).map(tuple),
            st.dictionaries(STRINGS, children, max_size=5),
            st.dictionaries(st.integers(), children, max_size=3),  # keys json.dumps writes as strings, orjson refuses
        ),
        max_leaves=30,
    )


# Values without a float (orjson writes them) and with floats (nan, inf, -0.0, subnormal, huge: json.dumps does).
VALUES = st.one_of(nestings(BASE), nestings(st.one_of(BASE, st.floats())))


class Role(enum.IntEnum):
    BOS = 1


class Token(str):
    pass


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def cyclic() -> list:
    value: list = [1]
    value.append(value)
    return value


@settings(max_examples=100, deadline=None)
@given(VALUES)
@example({"\uffff": 1, "\U00010000": 2, "\ue000": 3, "": 4})  # code point order, not UTF-16's
@example(["\\\u00e9", '\\"', "\\\\u0041", "\\\U0001f600", "\x7f\\\x7f"])  # escapes beside escapes
@example([1e-05, 1e16, 1e-7, float("nan"), float("inf"), -float("inf"), -0.0, 5e-324])
@example({"a": [{"b": 2**64}], "c": "\ud800"})
@example({1: "a", 2: "b"})
@example({1: "a", "b": 2})  # keys json.dumps cannot sort: both refuse
@example(nested(253))  # 254 levels: the deepest orjson writes
@example(nested(254))
@example(nested(300))
@example(cyclic())  # both refuse
@example([Role.BOS, Token("<s>"), {Token("k"): 1}, OrderedDict([("b", 1), ("a", 2)])])  # subclasses
def test_the_fast_writer_writes_what_json_dumps_writes(value):
    assert written(value) == reference_written(value)


def test_every_control_and_latin1_character_is_escaped_alike():
    every = "".join(map(chr, range(0x180)))
    assert _canonical_json([every, {every: every}]) == reference_json([every, {every: every}])


def test_a_float_anywhere_is_written_by_json_dumps():
    value = {"vocab": [["\u2581a", -1e-05], ["b", 1e16]], "dropout": None}
    assert (
        _canonical_json(value) == reference_json(value) == b'{"dropout":null,"vocab":[["\\u2581a",-1e-05],["b",1e+16]]}'
    )


def test_the_collector_is_as_it_was_after_a_parse():
    assert gc.isenabled()
    with pytest.raises(ValueError), _collector_paused():
        assert not gc.isenabled()
        json.loads("{")
    assert gc.isenabled()
    gc.disable()
    try:
        with _collector_paused():
            pass
        assert not gc.isenabled()  # a caller's own choice is kept
    finally:
        gc.enable()


def unigram_tokenizer():
    """A small Unigram tokenizer (T5's and XLM-R's kind): its vocabulary holds float scores, tiny ones too."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = [("<unk>", 0.0), ("</s>", 0.0), ("\u2581", -2.5), ("\u2581a", -1e-05), ("b", -3.25e-7), ("\u00e9", -17.0)]
    pieces += [("\u2581" + chr(0x4E00 + i), -float(i) / 7) for i in range(40)] + [("\U0001f600", -1e16)]
    backend = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=False))
    backend.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(" ", "\u2581")])
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")


def test_a_unigram_and_the_fixture_tokenizer_keep_their_identity():
    from sftaudit.fixtures import build_tokenizer

    fixture = build_tokenizer()
    fixture.chat_template = "{% for m in messages %}<|{{ m.role }}|>\u00e9\U0001f600{{ m.content }}{% endfor %}"
    for tokenizer in (unigram_tokenizer(), fixture):
        assert tokenizer_identity(tokenizer) == reference_identity(tokenizer)


def test_a_tokenizer_changed_in_place_is_hashed_anew():
    from sftaudit.fixtures import build_tokenizer

    tokenizer = build_tokenizer()
    before = tokenizer_identity(tokenizer)
    tokenizer.add_tokens(["<|new|>"])
    after = tokenizer_identity(tokenizer)
    assert after == reference_identity(tokenizer) and after["added_tokens"] != before["added_tokens"]


@pytest.mark.parametrize("family", ["llama3", "mistral", "phi3"])
def test_released_tokenizers_parts_are_written_alike(family):
    """Released vocabularies (128k byte-level BPE, SentencePiece BPE), read from their saved tokenizer.json
    (loading them whole takes seconds): `benchmarks/tokenizer_identity.py` compares their whole identities, and
    Qwen2's (151k, the same shape as Llama 3's)."""
    with _collector_paused():
        spec = json.loads((real_tokenizer_folder(family, tokenizer_cache()) / "tokenizer.json").read_text("utf-8"))
    parts = spec_parts(spec)
    vocabulary, merges = parts["vocabulary"], parts["merges"]
    assert (
        len(vocabulary) > 30_000 and _orjson_writes_alike(vocabulary) and _orjson_writes_alike(merges)
    )  # the fast way
    assert all(_canonical_json(part) == reference_json(part) for part in parts.values())
