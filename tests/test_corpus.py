"""Released chat templates and real vocabularies (tests/corpus.py): render parity with transformers,
clean multi-turn chats pass `preflight`, planted faults on real families fail with the right code.

Run alone: `.venv/bin/python -m pytest tests/test_corpus.py -q` (the real tokenizers are built
once from the packages' files and cached in the temp folder, keyed by the package versions).
"""

from __future__ import annotations

import copy
import json
import tempfile
from importlib.metadata import version
from pathlib import Path

import pytest

from sftaudit.chat_template import Renderer, TemplateLayout, tokenizer_specials
from sftaudit.preflight import preflight

from .corpus import CLEAN_CHATS, CORPUS, real_tokenizer, template

FAMILIES = ("llama3", "qwen2", "mistral")
# Templates with no marker that ends an assistant turn (the next turn's header stops generation):
# their assistant spans cannot be derived from the template alone, so preflight needs --collator.
NO_END_OF_TURN = {"zai-org-glm-4-9b-chat", "zai-org-GLM-4-9B-0414", "zai-org-GLM-4.5-Air",
                  "upstage-SOLAR-10.7B-Instruct-v1.0"}


@pytest.fixture(scope="module")
def tokenizers():
    cache = Path(tempfile.gettempdir()) / (
        f"sftaudit-real-tokenizers-{version('quicktok-v1')}-{version('mistral-common')}-{version('transformers')}")
    return {family: real_tokenizer(family, cache) for family in FAMILIES}


def test_the_corpus_is_wide_enough():
    assert len(CORPUS) >= 40 and len({family for _, family in CORPUS}) >= 12


def test_renders_are_byte_equal_with_apply_chat_template(tokenizers):
    compared = 0
    for name, _ in CORPUS:
        source = template(name)
        for tokenizer in tokenizers.values():
            renderer = Renderer(source, tokenizer_specials(tokenizer))
            for chat in CLEAN_CHATS:
                assert outcome(lambda: renderer.render(chat)[0]) == \
                    outcome(lambda: tokenizer.apply_chat_template(chat, tokenize=False, chat_template=source)), name
                compared += 1
    assert compared == len(CORPUS) * len(FAMILIES) * len(CLEAN_CHATS)


def outcome(render):
    """The render, or the error a template raises (a template reading `bos_token` with Qwen's tokenizer,
    which has none, fails in transformers too)."""
    try:
        return render()
    except Exception as exc:  # noqa: BLE001 - the same failure on both sides is parity too
        return type(exc).__name__, str(exc)


def test_layout_is_derived_for_every_template_with_an_end_of_turn_marker(tokenizers):
    derived = {}
    for name, family in CORPUS:
        tokenizer = tokenizers[{"qwen": "qwen2", "mistral": "mistral"}.get(family, "llama3")]
        if name in NO_END_OF_TURN:
            continue
        layout = TemplateLayout.derive(tokenizer, template(name))
        derived[name] = layout.texts
        assert layout.headers["assistant"] and layout.turn_end, name
    assert derived["Qwen-Qwen2.5-7B-Instruct"] == {"turn_end": "<|im_end|>", "assistant": "<|im_start|>assistant\n",
                                                   "user": "<|im_start|>user\n"}
    assert derived["microsoft-Phi-3.5-mini-instruct"]["turn_end"] == "<|end|>" or "<|end|>" not in \
        tokenizers["llama3"].get_vocab()  # split by the Llama vocabulary, so compared as its pieces
    assert derived["mistralai-Mistral-7B-Instruct-v0.3"]["turn_end"] == "</s>"


def write_rows(path: Path, chats: list[list[dict]]) -> Path:
    rows = [{"id": f"row-{i}", "messages": chat} for i, chat in enumerate(chats)]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def incremental_collator(tokenizer, rows, max_length=4096):
    """A correct user collator: each assistant turn trained from the end of the generation prompt that
    precedes it to the end of its own render (as TRL's prompt-completion split does, turn by turn)."""
    import numpy as np

    input_ids, labels = [], []
    for row in rows:
        messages = row["messages"]
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        label = [-100] * len(ids)
        for turn, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = len(tokenizer.apply_chat_template(messages[:turn], add_generation_prompt=True, return_dict=False))
            end = len(tokenizer.apply_chat_template(messages[:turn + 1], return_dict=False))
            label[start:end] = ids[start:end]
        input_ids.append(ids[:max_length])
        labels.append(label[:max_length])
    width = max(map(len, input_ids))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return {"input_ids": np.array([r + [pad] * (width - len(r)) for r in input_ids]),
            "labels": np.array([r + [-100] * (width - len(r)) for r in labels]),
            "attention_mask": np.array([[1] * len(r) + [0] * (width - len(r)) for r in input_ids])}


def run_preflight(tmp_path, tokenizers, family, template_name, chats, collator=None, **edits):
    tokenizer = copy.deepcopy(tokenizers[family])
    tokenizer.chat_template = template(template_name)
    for key, value in edits.items():
        setattr(tokenizer, key, value)
    folder = tmp_path / "tokenizer"
    tokenizer.save_pretrained(str(folder))
    data = write_rows(tmp_path / "data.jsonl", chats)
    verdict = preflight(data, folder, tmp_path / "out", collator=collator, progress=False)
    return verdict, [(f["code"], f["severity"], f["message"]) for f in verdict["findings"] if f["severity"] != "info"]


USER_COLLATOR = "tests.test_corpus:incremental_collator"
# Qwen3 renders the last turn with an empty thinking block and earlier turns without, so rendering
# turn by turn is not a correct collator for it: only the standard collator is run there.
CLEAN_CASES = [("llama3", "meta-llama-Llama-3.1-8B-Instruct", None), ("llama3", "meta-llama-Llama-3.1-8B-Instruct", USER_COLLATOR),
               ("qwen2", "Qwen-Qwen2.5-7B-Instruct", None), ("qwen2", "Qwen-Qwen2.5-7B-Instruct", USER_COLLATOR),
               ("qwen2", "Qwen-Qwen3-0.6B", None),
               ("mistral", "mistralai-Mistral-7B-Instruct-v0.3", None), ("mistral", "mistralai-Mistral-7B-Instruct-v0.3", USER_COLLATOR)]


@pytest.mark.parametrize("family,name,collator", CLEAN_CASES)
def test_clean_chats_pass_preflight_on_real_families(tmp_path, tokenizers, family, name, collator):
    verdict, problems = run_preflight(tmp_path, tokenizers, family, name, CLEAN_CHATS * 2, collator)
    assert problems == [] and verdict["check_errors"] == [], problems
    assert verdict["verdict"] == "pass"
