"""Released chat templates and real vocabularies (tests/corpus.py): render parity with transformers,
clean multi-turn chats pass `preflight`, planted faults on real families fail with the right code.

Run alone: `.venv/bin/python -m pytest tests/test_corpus.py -q` (the real tokenizers are built
once from the packages' files and cached in the temp folder, keyed by the package versions).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from sftaudit.commands.preflight import preflight
from sftaudit.dataset.layout import TemplateLayout
from sftaudit.dataset.render import Renderer, tokenizer_specials

from .corpus import CLEAN_CHATS, CORPUS, TOOL_CHATS, real_tokenizer, template, tokenizer_cache

pytestmark = pytest.mark.slow  # the released tokenizers and templates of the corpus

FAMILIES = ("llama3", "qwen2", "mistral")
# Templates with no marker that ends an assistant turn (the next turn's header stops generation):
# their assistant spans cannot be derived from the template alone, so preflight needs --collator.
NO_END_OF_TURN = {
    "zai-org-glm-4-9b-chat",
    "zai-org-GLM-4-9B-0414",
    "zai-org-GLM-4.5-Air",
    "upstage-SOLAR-10.7B-Instruct-v1.0",
}


@pytest.fixture(scope="module")
def tokenizers():
    return {family: real_tokenizer(family, tokenizer_cache()) for family in FAMILIES}


def test_the_corpus_is_wide_enough():
    assert len(CORPUS) >= 40 and len({family for _, family in CORPUS}) >= 12


def test_renders_are_byte_equal_with_apply_chat_template(tokenizers):
    compared = 0
    for name, _ in CORPUS:
        source = template(name)
        for tokenizer in tokenizers.values():
            renderer = Renderer(source, tokenizer_specials(tokenizer))
            for chat in CLEAN_CHATS:
                assert outcome(lambda: renderer.render(chat)[0]) == outcome(
                    lambda: tokenizer.apply_chat_template(chat, tokenize=False, chat_template=source)
                ), name
                compared += 1
    assert compared == len(CORPUS) * len(FAMILIES) * len(CLEAN_CHATS)


def test_rows_needing_transformers_normalisation_and_the_fallback_without_its_private_helpers(tokenizers, monkeypatch):
    """Rows with a None-valued key or a reasoning field (which transformers aliases) render as
    apply_chat_template renders them; so does every row when transformers lacks the private helpers
    the fast path uses (a version-guarded import: the public render_jinja_template takes over)."""
    from sftaudit.fixtures import CHAT_TEMPLATE_PATH

    from sftaudit.dataset import sandbox
    from sftaudit.dataset.fields import template_fields

    assert sandbox._internals() != (None, None), "the installed transformers lost the fast path's helpers"
    thinking = [
        {"role": "user", "content": "2+2?", "tool_calls": None},
        {"role": "assistant", "content": "4", "reasoning_content": "Two and two."},
    ]
    cases = [
        (CHAT_TEMPLATE_PATH.read_text(encoding="utf-8"), "llama3"),
        (template("Qwen-Qwen3-0.6B"), "qwen2"),
        (template("meta-llama-Llama-3.1-8B-Instruct"), "llama3"),
        (template("mistralai-Mistral-7B-Instruct-v0.3"), "mistral"),
    ]

    def renders():
        out = []
        for source, family in cases:
            renderer = Renderer(source, tokenizer_specials(tokenizers[family]))
            for chat in [*NO_SYSTEM, thinking]:
                out.append((renderer.render(chat), template_fields(source)))
                assert out[-1][0][0] == tokenizers[family].apply_chat_template(
                    chat, tokenize=False, chat_template=source
                )
        return out

    fast = renders()
    assert all(spans for (_, spans), _ in fast[: len(NO_SYSTEM) + 1])  # the fixture template's generation spans
    assert "Two and two." in fast[2 * (len(NO_SYSTEM) + 1) - 1][0][0]  # Qwen3 renders the aliased reasoning
    monkeypatch.setattr(sandbox, "_internals", lambda: (None, None))
    assert renders() == fast


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
    assert derived["Qwen-Qwen2.5-7B-Instruct"] == {
        "turn_end": "<|im_end|>",
        "assistant": "<|im_start|>assistant\n",
        "user": "<|im_start|>user\n",
    }
    assert (
        derived["microsoft-Phi-3.5-mini-instruct"]["turn_end"] == "<|end|>"
        or "<|end|>" not in tokenizers["llama3"].get_vocab()
    )  # split by the Llama vocabulary, so compared as its pieces
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
            end = len(tokenizer.apply_chat_template(messages[: turn + 1], return_dict=False))
            label[start:end] = ids[start:end]
        input_ids.append(ids[:max_length])
        labels.append(label[:max_length])
    width = max(map(len, input_ids))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return {
        "input_ids": np.array([r + [pad] * (width - len(r)) for r in input_ids]),
        "labels": np.array([r + [-100] * (width - len(r)) for r in labels]),
        "attention_mask": np.array([[1] * len(r) + [0] * (width - len(r)) for r in input_ids]),
    }


@pytest.fixture(scope="module", autouse=True)
def saved_tokenizers_root(tmp_path_factory):
    SAVED_TOKENIZERS["root"] = tmp_path_factory.mktemp("saved-tokenizers")
    yield
    SAVED_TOKENIZERS.clear()


SAVED_TOKENIZERS: dict[str, Path] = {}


def saved_tokenizer(tokenizers, family, template_name, **edits) -> Path:
    """The family's tokenizer with the template and edits, saved once for this module (preflight only reads
    it): a save takes a second with a released vocabulary."""
    name = "-".join([family, template_name, *map(str, sorted(edits.items()))])
    folder = SAVED_TOKENIZERS["root"] / name
    if not folder.is_dir():
        tokenizer = copy.deepcopy(tokenizers[family])
        tokenizer.chat_template = template(template_name)
        for key, value in edits.items():
            setattr(tokenizer, key, value)
        tokenizer.save_pretrained(str(folder))
    return folder


def run_preflight(tmp_path, tokenizers, family, template_name, chats, collator=None, config=None, **edits):
    folder = saved_tokenizer(tokenizers, family, template_name, **edits)
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = write_rows(tmp_path / "data.jsonl", chats)
    verdict = preflight(data, folder, tmp_path / "out", collator=collator, config=config, progress=False)
    return verdict, [(f["code"], f["severity"], f["message"]) for f in verdict["findings"] if f["severity"] != "info"]


USER_COLLATOR = "tests.test_corpus:incremental_collator"
NO_SYSTEM = [chat for chat in CLEAN_CHATS if chat[0]["role"] != "system"]
# Mistral v0.3 renders the system prompt only into a conversation's last message when that is a user turn, so
# a training chat (ending with the assistant) loses it: a real finding (test_dropped_system_prompt_fails),
# so its clean chats here have no system prompt. Qwen3 renders the last turn with an empty thinking block and earlier turns without, so rendering
# turn by turn is not a correct collator for it: only the standard collator is run there.
CLEAN_CASES = [
    ("llama3", "meta-llama-Llama-3.1-8B-Instruct", None),
    ("qwen2", "Qwen-Qwen2.5-7B-Instruct", USER_COLLATOR),
    ("qwen2", "Qwen-Qwen3-0.6B", None),
    ("mistral", "mistralai-Mistral-7B-Instruct-v0.3", USER_COLLATOR),
]


@pytest.mark.parametrize("family,name,collator", CLEAN_CASES)
def test_clean_chats_pass_preflight_on_real_families(tmp_path, tokenizers, family, name, collator):
    chats = NO_SYSTEM if family == "mistral" else CLEAN_CHATS
    verdict, problems = run_preflight(tmp_path, tokenizers, family, name, chats * 2, collator)
    assert problems == [] and verdict["check_errors"] == [], problems
    assert verdict["verdict"] == "pass"


def test_no_released_template_requires_a_field_beyond_role_and_content():
    """Reads of optional fields are guarded (`message.tool_calls is defined and message.tool_calls | length`),
    so plain chats without `tool_calls` or `reasoning_content` are no LOOP-01 finding on any template."""
    from sftaudit.dataset.fields import template_fields

    required = {name: template_fields(template(name)).message_required - {"role", "content"} for name, _ in CORPUS}
    assert {name: fields for name, fields in required.items() if fields} == {}
    assert "tool_calls" in template_fields(template("Qwen-Qwen3-Coder-30B-A3B-Instruct")).message_optional


def test_clean_tool_call_chats_pass_preflight_on_qwen3_coder(tmp_path, tokenizers):
    verdict, problems = run_preflight(
        tmp_path, tokenizers, "qwen2", "Qwen-Qwen3-Coder-30B-A3B-Instruct", TOOL_CHATS + CLEAN_CHATS, USER_COLLATOR
    )
    assert problems == [] and verdict["check_errors"] == [] and verdict["verdict"] == "pass", problems


def shifted_collator(start_by=0, end_by=0, mask_pad=False, bos=False):
    """The correct collator with one planted fault: labels start `start_by` tokens early, end `end_by`
    tokens early, the pad id masked wherever it occurs, or the rendered text tokenized with its BOS added."""

    def collate(tokenizer, rows, max_length=4096):
        import numpy as np

        batch = incremental_collator(tokenizer, rows, max_length)
        labels, ids = batch["labels"], batch["input_ids"]
        trained = labels != -100
        starts = trained[:, 1:] & ~trained[:, :-1]
        ends = trained[:, :-1] & ~trained[:, 1:]
        if start_by:
            labels[:, :-1][starts] = ids[:, :-1][starts]
        if end_by:
            labels[:, :-1][ends] = -100
        if mask_pad:
            labels[ids == tokenizer.pad_token_id] = -100
        if bos:  # one more BOS in front of the template's own: every row and label moves right by one
            first = np.full((ids.shape[0], 1), tokenizer.bos_token_id)
            batch = {
                "input_ids": np.hstack([first, ids]),
                "labels": np.hstack([np.full_like(first, -100), labels]),
                "attention_mask": np.hstack([np.ones_like(first), batch["attention_mask"]]),
            }
        return batch

    return collate


off_by_one = shifted_collator(start_by=1)
end_of_turn_masked = shifted_collator(end_by=1)
pad_masked_by_id = shifted_collator(mask_pad=True)
double_bos = shifted_collator(bos=True)


def codes(problems, code):
    return [(c, severity) for c, severity, _ in problems if c == code]


def last_turn_only(tokenizer, rows, max_length=4096, only=None):
    """The correct collator with every assistant turn but the last masked (a prompt-completion split of
    multi-turn chats), in every row or in the rows whose id is in `only`."""
    import numpy as np

    batch = incremental_collator(tokenizer, rows, max_length)
    trained = batch["labels"] != -100
    turn = np.cumsum(trained & ~np.pad(trained, ((0, 0), (1, 0)))[:, :-1], axis=1)
    chosen = np.array([only is None or row["id"] in only for row in rows])[:, None]
    batch["labels"][trained & (turn < turn[:, -1:]) & chosen] = -100
    return batch


def one_earlier_answer_dropped(tokenizer, rows, max_length=4096):
    return last_turn_only(tokenizer, rows, max_length, only={"row-1"})


def test_last_turn_only_training_is_a_policy_to_declare(tmp_path, tokenizers):
    """Undeclared: one LOOP-04 warn naming the policy and the config that declares it; declared: a pass.
    A sample that drops an earlier answer while another sample trains all of its answers stays a fail."""
    from sftaudit.verdict.config import AuditConfig

    args = (tokenizers, "qwen2", "Qwen-Qwen2.5-7B-Instruct", CLEAN_CHATS)
    verdict, problems = run_preflight(tmp_path / "undeclared", *args, "tests.test_corpus:last_turn_only")
    (warn,) = [f for f in verdict["findings"] if f["severity"] != "info"]
    assert verdict["verdict"] == "warn" and warn["code"] == "LOOP-04" and warn["severity"] == "warn"
    assert warn["evidence"]["kind"] == "last_turn_only" and warn["evidence"]["sample_ids"] == ["row-1", "row-2"]
    # A policy, stated at run scope: it dates nothing (no first anomalous step, no rollback).
    assert (warn["category"], warn["step"]) == ("configuration", None) and verdict["first_anomalous_step"] is None
    assert '[checks."LOOP-04"] assistant_turns = "last"' in warn["message"]
    declared = AuditConfig(check_options={"LOOP-04": {"assistant_turns": "last"}})
    verdict, problems = run_preflight(tmp_path / "declared", *args, "tests.test_corpus:last_turn_only", declared)
    assert problems == [] and verdict["verdict"] == "pass", problems
    verdict, problems = run_preflight(tmp_path / "dropped", *args, "tests.test_corpus:one_earlier_answer_dropped")
    (fail,) = [f for f in verdict["findings"] if f["code"] == "LOOP-04" and f["severity"] == "fail"]
    assert fail["evidence"]["kind"] == "assistant_masked" and fail["evidence"]["sample_ids"] == ["row-1"]


def test_rows_keyed_role_fail_loop01_on_llama3(tmp_path, tokenizers):
    chats = [[{"Role": m["role"], "content": m["content"]} for m in chat] for chat in CLEAN_CHATS]
    verdict, problems = run_preflight(tmp_path, tokenizers, "llama3", "meta-llama-Llama-3.1-8B-Instruct", chats)
    assert verdict["verdict"] == "fail" and ("LOOP-01", "fail") in codes(problems, "LOOP-01")
    field = next(f for f in verdict["findings"] if f["evidence"].get("template_field") == "role")
    assert field["evidence"]["spelled_as"] == ["Role"]


@pytest.mark.parametrize("family,name", [("qwen2", "Qwen-Qwen2.5-7B-Instruct")])
def test_missing_content_fails_loop01_naming_the_row(tmp_path, tokenizers, family, name):
    """Qwen2.5's template refuses the row (undefined + text): a finding naming the row, not a crash."""
    chats = [list(chat) for chat in CLEAN_CHATS]
    chats[2] = chats[2][:-1] + [{"role": "assistant"}]
    verdict, problems = run_preflight(tmp_path, tokenizers, family, name, chats)
    (finding,) = [f for f in verdict["findings"] if f["code"] == "LOOP-01" and f["severity"] == "fail"]
    assert verdict["verdict"] == "fail" and finding["evidence"]["sample_ids"] == ["row-2"]


@pytest.mark.parametrize(
    "family,name,fault,kind",
    [
        ("mistral", "mistralai-Mistral-7B-Instruct-v0.3", "off_by_one", "off_by_one"),
        ("llama3", "meta-llama-Llama-3.1-8B-Instruct", "end_of_turn_masked", "assistant_masked"),
    ],
)
def test_collator_faults_fail_loop04(tmp_path, tokenizers, family, name, fault, kind):
    chats = NO_SYSTEM if family == "mistral" else CLEAN_CHATS
    verdict, problems = run_preflight(tmp_path, tokenizers, family, name, chats, f"tests.test_corpus:{fault}")
    assert verdict["verdict"] == "fail"
    found = [f for f in verdict["findings"] if f["code"] == "LOOP-04" and f["evidence"].get("kind") == kind]
    assert found and found[0]["severity"] == "fail" and len(found[0]["evidence"]["sample_ids"]) == len(chats)


def test_pad_set_to_the_stop_marker_and_masked_by_id_fails_loop02(tmp_path, tokenizers):
    verdict, problems = run_preflight(
        tmp_path,
        tokenizers,
        "qwen2",
        "Qwen-Qwen2.5-7B-Instruct",
        CLEAN_CHATS,
        "tests.test_corpus:pad_masked_by_id",
        pad_token="<|im_end|>",
    )
    stop = next(f for f in verdict["findings"] if f["code"] == "LOOP-02" and "eos_trained" in f["evidence"])
    assert (
        verdict["verdict"] == "fail" and stop["severity"] == "fail" and stop["evidence"]["stop_marker"] == "<|im_end|>"
    )
    # LOOP-04 names the same cause with the same count of the same markers (the assistant turns' ends).
    untrained = next(f for f in verdict["findings"] if f["evidence"].get("kind") == "end_of_turn_untrained")
    assert stop["evidence"]["eos_attended"] == untrained["evidence"]["markers_total"] > 0
    assert f"all {untrained['evidence']['markers_total']} that end an assistant turn" in stop["message"]
    # Its token strip counts the one masked marker: the newline after it may be trained either way.
    from sftaudit.outputs.report.evidence import token_block

    strip = token_block("tokens", untrained["evidence"]["tokens"])
    expected = [t["expected"] for t in untrained["evidence"]["tokens"]]
    assert "either" in expected and strip["mismatches"] == 1


def test_phi35_eos_after_the_last_turn_is_no_pad_finding(tmp_path, tokenizers):
    """Phi-3.5 appends its eos (also its pad) after the `<|end|>` that ends a turn: not pad == stop."""
    tokenizer = copy.deepcopy(tokenizers["llama3"])
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|end|>", "<|user|>", "<|assistant|>", "<|system|>", "<|endoftext|>"]}
    )
    tokenizer.eos_token = tokenizer.pad_token = "<|endoftext|>"
    tokenizers = {**tokenizers, "phi": tokenizer}
    verdict, problems = run_preflight(tmp_path, tokenizers, "phi", "microsoft-Phi-3.5-mini-instruct", CLEAN_CHATS)
    assert problems == [] and verdict["verdict"] == "pass", problems


def test_truncation_that_empties_samples_fails_loop04(tmp_path, tokenizers):
    tokenizer = tokenizers["qwen2"]
    tokenizer.chat_template = template("Qwen-Qwen2.5-7B-Instruct")
    folder = tmp_path / "tokenizer"
    tokenizer.save_pretrained(str(folder))
    data = write_rows(tmp_path / "data.jsonl", CLEAN_CHATS)
    prompt_lengths = [
        len(
            tokenizer.apply_chat_template(
                chat[: [m["role"] for m in chat].index("assistant")], add_generation_prompt=True, return_dict=False
            )
        )
        for chat in CLEAN_CHATS
    ]
    max_length = sorted(prompt_lengths)[1]  # cuts the rows whose first answer starts there or later
    verdict = preflight(data, folder, tmp_path / "out", max_length=max_length, progress=False)
    emptied = next(f for f in verdict["findings"] if f["evidence"].get("kind") == "emptied_by_truncation")
    assert verdict["verdict"] == "fail" and emptied["evidence"]["max_length"] == max_length
    assert emptied["evidence"]["sample_ids"] == [f"row-{i}" for i, n in enumerate(prompt_lengths) if n >= max_length]


def test_double_bos_fails_loop02(tmp_path, tokenizers):
    verdict, problems = run_preflight(
        tmp_path, tokenizers, "llama3", "meta-llama-Llama-3.1-8B-Instruct", CLEAN_CHATS, "tests.test_corpus:double_bos"
    )
    bos = next(f for f in verdict["findings"] if f["evidence"].get("kind") == "double_bos")
    assert verdict["verdict"] == "fail" and bos["code"] == "LOOP-02" and len(bos["evidence"]["sample_ids"]) == 4


def test_dropped_system_prompt_fails_loop01(tmp_path, tokenizers):
    verdict, problems = run_preflight(
        tmp_path, tokenizers, "mistral", "mistralai-Mistral-7B-Instruct-v0.3", CLEAN_CHATS
    )
    dropped = next(f for f in verdict["findings"] if f["evidence"].get("kind") == "content_dropped")
    assert verdict["verdict"] == "fail" and dropped["code"] == "LOOP-01"
    assert dropped["evidence"]["sample_ids"] == ["row-1", "row-3"] and "system" in dropped["evidence"]["error"]


# Templates whose generation prompt differs from the header inside a conversation (a thinking block
# opened by the prompt) or that close only the last message with eos: rendering them turn by turn
# is not a correct collator, so they are left out of the agreement below.
NOT_INCREMENTAL = {
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
    "Qwen-Qwen3-0.6B",
    "Qwen-Qwen3-4B-Thinking-2507",
    "Qwen-QwQ-32B",
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use",
    "microsoft-Phi-3-mini-4k-instruct",
    "microsoft-Phi-3.5-mini-instruct",
    "microsoft-Phi-4-mini-reasoning",
}


def test_layout_agrees_with_a_correct_collator_on_every_template(tokenizers):
    """Each template's layout (no generation markers) against the labels of a collator that renders turn
    by turn; families without a vocabulary here get the Llama 3 one with their markers added as specials."""
    import re

    from sftaudit.dataset.fields import template_fields
    from sftaudit.dataset.layout import EITHER, actual_labels, expected_labels

    marker = re.compile(
        r"<\|[^<>|\s]+\|>|</?[a-z_]+>|\[/?[A-Z_]{2,}\]|<\uff5c[^>]+\uff5c>|\[\|[a-z]+\|\]|<\|[a-z]+>|<[a-z]+\|>"
    )
    home = {"qwen": "qwen2", "mistral": "mistral"}
    others = copy.deepcopy(tokenizers["llama3"])
    literals = "\0".join(lit for name, _ in CORPUS for lit in template_fields(template(name)).literals)
    others.add_special_tokens(
        {
            "additional_special_tokens": sorted(
                m for m in set(marker.findall(literals)) if len(others(m, add_special_tokens=False)["input_ids"]) > 1
            )
        }
    )
    agreed = []
    for name, family in CORPUS:
        if name in NO_END_OF_TURN or name in NOT_INCREMENTAL:
            continue
        tokenizer = tokenizers[home[family]] if family in home else others
        tokenizer.chat_template = template(name)
        with_system = outcome(lambda: tokenizer.apply_chat_template(CLEAN_CHATS[1], tokenize=False))
        # Templates that refuse or drop a system prompt (Gemma 2, Mistral) are shown chats without one.
        chats = (
            CLEAN_CHATS if isinstance(with_system, str) and CLEAN_CHATS[1][0]["content"] in with_system else NO_SYSTEM
        )
        batch = incremental_collator(tokenizer, [{"messages": chat} for chat in chats])
        layout = TemplateLayout.derive(tokenizer, tokenizer.chat_template)
        expected, _ = expected_labels(batch["input_ids"], batch["attention_mask"], layout, tokenizer.pad_token_id)
        actual = actual_labels(batch["labels"], batch["attention_mask"])
        assert not ((expected != actual) & (expected != EITHER)).any(), name
        agreed.append(name)
    assert len(agreed) == len(CORPUS) - len(NO_END_OF_TURN) - len(NOT_INCREMENTAL)
    assert len({family for name, family in CORPUS if name in agreed}) >= 12


def test_macro_and_presence_guarded_fields_are_optional_on_released_templates():
    """Kimi K2 reads `tool_calls` in a macro it calls only under `if message.get('tool_calls')`; OLMo 3 reads
    `function_calls` after `message.get('function_calls', none) is not none`: plain chats need neither."""
    from sftaudit.dataset.fields import template_fields

    for name, field_name in [
        ("moonshotai-Kimi-K2-Thinking", "tool_calls"),
        ("moonshotai-Kimi-K2.6", "tool_calls"),
        ("Kimi-K2-Thinking", "tool_calls"),
        ("allenai-olmo-3-tokenizer-instruct-release", "function_calls"),
    ]:
        fields = template_fields(template(name))
        assert field_name not in fields.message_required and field_name in fields.message_optional, name
    # A read that every row takes stays required: a macro called outside any condition.
    source = (
        "{% macro turn(message) %}{{ message['role'] + message['title'] }}{% endmacro %}"
        "{% for message in messages %}{{ turn(message) }}{% if message.get('x') %}{{ message.x }}{% endif %}"
        "{% endfor %}"
    )
    assert template_fields(source).message_required == {"role", "title"}


def test_kimi_tool_call_template_passes_preflight_on_plain_chats(tmp_path, tokenizers):
    verdict, problems = run_preflight(tmp_path, tokenizers, "qwen2", "moonshotai-Kimi-K2.6", CLEAN_CHATS)
    assert [p for p in problems if p[0] == "LOOP-01"] == [], problems


def test_template_without_turns_is_judged_without_a_crash(tmp_path, tokenizers):
    """Nemotron-Parse v1.1 renders the messages' contents only (transformers renders it): preflight runs the
    checks it can and says why LOOP-04 cannot judge, instead of exiting 2."""
    verdict, problems = run_preflight(tmp_path, tokenizers, "llama3", "nvidia-NVIDIA-Nemotron-Parse-v1.1", CLEAN_CHATS)
    assert verdict["check_errors"] == [] and problems == [], (verdict["check_errors"], problems)
    loop04 = next(c for c in verdict["checks"] if c["code"] == "LOOP-04")
    assert loop04["status"] == "not_run" and "turns cannot be told apart" in loop04["reason"]


def bos_stripped(tokenizer, rows, max_length=4096):
    """The correct collator on a render stripped of its BOS (a user avoiding a double BOS), tokenized by a
    tokenizer that adds none: every row loses the BOS the template writes."""
    batch = incremental_collator(tokenizer, rows, max_length)
    assert (batch["input_ids"][:, 0] == tokenizer.bos_token_id).all()
    return {k: v[:, 1:] for k, v in batch.items()}


def test_bos_missing_where_the_template_sends_one_fails_loop02(tmp_path, tokenizers):
    verdict, problems = run_preflight(
        tmp_path,
        tokenizers,
        "llama3",
        "meta-llama-Llama-3.1-8B-Instruct",
        CLEAN_CHATS,
        "tests.test_corpus:bos_stripped",
    )
    [missing] = [f for f in verdict["findings"] if f["evidence"].get("kind") == "bos_missing"]
    assert (missing["code"], missing["severity"]) == ("LOOP-02", "fail") and len(missing["evidence"]["sample_ids"]) == 4
    assert missing["evidence"]["first_token"] == "<|start_header_id|>"
    # The clean twin: the render tokenized as it is keeps its BOS.
    verdict, problems = run_preflight(
        tmp_path / "clean", tokenizers, "llama3", "meta-llama-Llama-3.1-8B-Instruct", CLEAN_CHATS, USER_COLLATOR
    )
    assert problems == [], problems


# The Llama 3 template with TRL's `{% generation %}` block (trl/chat_templates/llama3_training.jinja), which a
# user closed before `<|eot_id|>`: TRL's assistant_only_loss then trains no end-of-turn marker.
LLAMA3_GENERATION = (
    "{%- for message in messages %}{%- if loop.index0 == 0 %}{{- bos_token }}{%- endif %}"
    "{%- if message['role'] == 'assistant' %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}"
    "{%- else %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
LLAMA3_GENERATION_SHORT = LLAMA3_GENERATION.replace(
    "{%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}",
    "{%- generation %}{{- message['content'] | trim }}{%- endgeneration %}{{- '<|eot_id|>' }}",
)


def test_end_of_turn_outside_the_generation_block_fails_loop04(tmp_path, tokenizers):
    """Labels exactly as transformers' assistant mask gives them (preflight's standard collator, what TRL's
    assistant_only_loss trains): with the block closed before `<|eot_id|>`, 0 of the markers are trained."""
    findings = {}
    tokenizers["llama3"].save_pretrained(str(tmp_path / "tokenizer"))
    for name, source in (("short", LLAMA3_GENERATION_SHORT), ("whole", LLAMA3_GENERATION)):
        (tmp_path / f"{name}.jinja").write_text(source)
        verdict = preflight(
            write_rows(tmp_path / "data.jsonl", CLEAN_CHATS),
            tmp_path / "tokenizer",
            tmp_path / f"out-{name}",
            template=tmp_path / f"{name}.jinja",
            progress=False,
        )
        findings[name] = [f for f in verdict["findings"] if f["severity"] != "info"]
    [untrained] = [f for f in findings["short"] if f["severity"] == "fail"]  # beside it, the aggregate count's warn
    assert (untrained["code"], untrained["severity"], untrained["evidence"]["kind"]) == (
        "LOOP-04",
        "fail",
        "end_of_turn_untrained",
    )
    assert (
        untrained["evidence"]["markers_trained"] == 0 and untrained["evidence"]["markers_total"] == 6
    )  # the chats' answers
    assert "{% generation %} block" in untrained["message"] and "'<|eot_id|>'" in untrained["message"]
    assert findings["whole"] == []


def phi_collator(tokenizer, rows, max_length=4096):
    """Phi-3.5 labels as a correct collator sets them: each answer from after `<|assistant|>\\n` through its
    `<|end|>` (by character offsets in the render), nothing after the marker."""
    import numpy as np

    input_ids, labels = [], []
    for row in rows:
        text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        spans, at = [], 0
        while (start := text.find("<|assistant|>\n", at)) >= 0:
            begin = start + len("<|assistant|>\n")
            end = text.index("<|end|>", begin) + len("<|end|>")
            spans.append((begin, end))
            at = end
        ids = enc["input_ids"]
        label = [
            i if any(b <= s and e <= end for b, end in spans) and e > s else -100
            for i, (s, e) in zip(ids, enc["offset_mapping"])
        ]
        input_ids.append(ids)
        labels.append(label)
    width = max(map(len, input_ids))
    pad = tokenizer.pad_token_id
    return {
        "input_ids": np.array([r + [pad] * (width - len(r)) for r in input_ids]),
        "labels": np.array([r + [-100] * (width - len(r)) for r in labels]),
        "attention_mask": np.array([[1] * len(r) + [0] * (width - len(r)) for r in input_ids]),
    }


def test_phi35_word_start_piece_after_the_end_marker_is_not_expected_trained(tmp_path, tokenizers):
    """Phi-3.5's legacy SentencePiece tokenizer writes `▁` between `<|end|>` and the newline; the model stops at
    `<|end|>` and never generates it, so a collator that stops its labels there is clean."""
    tokenizers = {**tokenizers, "phi3": real_tokenizer("phi3", tokenizer_cache())}
    tok = tokenizers["phi3"]
    pieces = tok.convert_ids_to_tokens(tok("<|end|>\n<|user|>", add_special_tokens=False)["input_ids"])
    assert pieces[:2] == ["<|end|>", "\u2581"]  # the shape of the released tokenizer
    verdict, problems = run_preflight(
        tmp_path, tokenizers, "phi3", "microsoft-Phi-3.5-mini-instruct", CLEAN_CHATS, "tests.test_corpus:phi_collator"
    )
    assert problems == [] and verdict["verdict"] == "pass", problems
    # Its fault twin: the marker itself masked is still found.
    verdict, problems = run_preflight(
        tmp_path / "masked",
        tokenizers,
        "phi3",
        "microsoft-Phi-3.5-mini-instruct",
        CLEAN_CHATS,
        "tests.test_corpus:phi_end_masked",
    )
    assert ("LOOP-04", "fail") in codes(problems, "LOOP-04")


def phi_end_masked(tokenizer, rows, max_length=4096):
    batch = phi_collator(tokenizer, rows, max_length)
    batch["labels"][batch["input_ids"] == tokenizer.convert_tokens_to_ids("<|end|>")] = -100
    return batch


def full_sequence(tokenizer, rows, max_length=4096, mask_pad=False):
    """Full-sequence loss (TRL's default on a `messages` dataset): every attended token trained; with
    `mask_pad`, the pad id masked wherever it occurs."""
    batch = incremental_collator(tokenizer, rows, max_length)
    batch["labels"] = batch["input_ids"].copy()
    batch["labels"][batch["attention_mask"] == 0] = -100
    if mask_pad:
        batch["labels"][batch["input_ids"] == tokenizer.pad_token_id] = -100
    return batch


def full_sequence_pad_masked(tokenizer, rows, max_length=4096):
    return full_sequence(tokenizer, rows, max_length, mask_pad=True)


def test_full_sequence_loss_is_a_configuration_and_pad_eos_is_judged_on_its_own(tmp_path, tokenizers):
    """Full-sequence loss is one configuration finding at run scope, pad = eos or not; with pad = eos masked
    by id, what goes wrong is the stop marker never trained (not "prompt tokens are trained")."""
    args = (tokenizers, "llama3", "meta-llama-Llama-3.1-8B-Instruct", CLEAN_CHATS)
    kinds = {}
    for name in ("full_sequence", "full_sequence_pad_masked"):
        verdict, _ = run_preflight(tmp_path / name, *args, f"tests.test_corpus:{name}", pad_token="<|eot_id|>")
        kinds[name] = {f["evidence"].get("kind"): f for f in verdict["findings"] if f["code"] == "LOOP-04"}
    [config] = kinds["full_sequence"].values()
    assert (config["evidence"]["kind"], config["category"], config["step"], config["severity"]) == (
        "full_sequence_loss",
        "configuration",
        None,
        "warn",
    )
    assert set(kinds["full_sequence_pad_masked"]) == {"full_sequence_loss", "end_of_turn_untrained"}
    untrained = kinds["full_sequence_pad_masked"]["end_of_turn_untrained"]
    assert (untrained["severity"], untrained["category"]) == ("fail", "configuration")
    assert "the pad token is '<|eot_id|>'" in untrained["message"]


def test_assistant_only_advice_holds_for_the_installed_trl_and_the_template():
    from importlib.metadata import version as installed

    from sftaudit.checks.loop04_loss_mask import assistant_only_advice, installed_trl

    trl = installed_trl()
    assert trl is not None and trl[0] == installed("trl")
    version = trl[0]
    assert "TRL 0.16.1 has no assistant_only_loss" in assistant_only_advice(LLAMA3_GENERATION, ("0.16.1", frozenset()))
    assert assistant_only_advice(LLAMA3_GENERATION, trl).startswith(f"set assistant_only_loss=True (TRL {version};")
    # Llama 3's released template has a training version in TRL; Llama 3.1's has none (TRL refuses it).
    assert "swaps in its training version" in assistant_only_advice(
        template("NousResearch-Meta-Llama-3-8B-Instruct"), trl
    )
    assert "needs {% generation %} markers" in assistant_only_advice(template("meta-llama-Llama-3.1-8B-Instruct"), trl)
    assert "axolotl" in assistant_only_advice(None, None)
