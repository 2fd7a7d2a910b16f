"""LOOP-04: masks that disagree with the template fire with their samples and tokens; clean is silent."""

import subprocess
import sys

import pytest
from sftaudit.fixtures import build_tokenizer, collate, load_dataset
from sftaudit.fixtures.faults.data import SPLIT_MARKER

from sftaudit.store.rundb import connect

from ..torchless import PRELUDE
from .data_runs import audited, batch_ids, clean_data_findings, findings


def by_kind(verdict):
    return {f["evidence"].get("kind"): f for f in findings(verdict, "LOOP-04") if f["evidence"].get("kind")}


def test_assistant_span_masked_at_its_step_with_its_sample(runs):
    run_dir, verdict = audited(runs, "data_mask")
    f = by_kind(verdict)["assistant_masked"]
    assert (f["severity"], f["step"]) == ("fail", 2)
    assert f["evidence"]["sample_ids"] == [batch_ids(run_dir, 2)[0]]
    tokens = f["evidence"]["tokens"]
    assert any(t["expected"] == "trained" and t["actual"] == "masked" for t in tokens)


def test_off_by_one_prompt_token_trained_from_its_step(runs):
    run_dir, verdict = audited(runs, "data_mask")
    f = by_kind(verdict)["off_by_one"]
    assert (f["severity"], f["step"]) == ("fail", 3)
    assert "prompt_trained" not in by_kind(verdict)  # every trained prompt token touches the answer
    assert set(f["evidence"]["sample_ids"]) == {s for step in (3, 4, 5) for s in batch_ids(run_dir, step)}
    # The side-by-side shows the header's last token trained right before the answer.
    tokens = f["evidence"]["tokens"]
    bad = [t for t in tokens if t["actual"] != t["expected"]]
    assert len(bad) == 1 and bad[0]["expected"] == "masked" and bad[0]["actual"] == "trained"
    after = next(t for t in tokens if t["pos"] == bad[0]["pos"] + 1)
    assert after["expected"] == "trained"


def test_padding_trained_counted_on_every_batch_row(runs):
    run_dir, verdict = audited(runs, "data_mask")
    f = by_kind(verdict)["padding_trained"]
    assert (f["severity"], f["step"]) == ("fail", 4)
    con = connect(run_dir, read_only=True)
    padded = {
        s
        for (ids, lengths, width) in con.execute(
            "SELECT sample_ids, lengths, seq_len FROM batches WHERE step = 4"
        ).fetchall()
        for s, n in zip(ids, lengths)
        if n < width
    }
    con.close()
    assert set(f["evidence"]["sample_ids"]) == padded
    assert any(t["expected"] == "padding" and t["actual"] == "trained" for t in f["evidence"]["tokens"])
    aggregate = [g for g in findings(verdict, "LOOP-04", "warn") if "expected_trained" in g["evidence"]]
    assert aggregate and aggregate[0]["evidence"]["actual_trained"] > aggregate[0]["evidence"]["expected_trained"]


def test_attended_padding_is_confused_with_prompt(runs):
    run_dir, verdict = audited(runs, "data_mask")
    f = by_kind(verdict)["padding_confused"]
    assert (f["severity"], f["step"]) == ("warn", 5)
    con = connect(run_dir, read_only=True)
    pad = build_tokenizer().pad_token_id
    padded = {
        s
        for (s,) in con.execute("SELECT sample_id FROM samples WHERE step = 5 AND input_ids[-1] = ?", [pad]).fetchall()
    }
    con.close()
    assert set(f["evidence"]["sample_ids"]) == padded
    assert any(t["expected"] == "padding" and t["actual"] == "masked" for t in f["evidence"]["tokens"])


def test_pad_equal_to_eos_masks_every_end_of_turn(runs):
    run_dir, verdict = audited(runs, "data_tokens")
    f = by_kind(verdict)["end_of_turn_untrained"]
    assert (f["severity"], f["step"], f["category"]) == ("fail", 1, "configuration")  # the setup: no batch to skip
    assert f["evidence"]["markers_trained"] == 0 < f["evidence"]["markers_total"]
    assert "the pad token is '<|eot_id|>'" in f["message"]
    # Oracle: the rows in which the correct collator (HF's generation mask) trains an end-of-turn token.
    tok = build_tokenizer()
    tok.chat_template = tok.chat_template.replace("<|start_header_id|>", SPLIT_MARKER)
    rows = {r["id"]: r for r in load_dataset()}
    ids = [s for step in (1, 2, 3) for s in batch_ids(run_dir, step)]
    labels = collate(tok, [rows[i] for i in ids], max_length=128)["labels"]
    ends_trained = (labels == tok.eos_token_id).any(1).tolist()
    assert set(f["evidence"]["sample_ids"]) == {i for i, trained in zip(ids, ends_trained) if trained}
    assert "assistant_masked" not in by_kind(verdict)  # the markers are this finding's, not also a masked answer's


def test_clean_run_masks_exactly_the_template_spans(clean_run):
    from ..shared import cached_audit

    verdict = cached_audit(clean_run)
    assert clean_data_findings(verdict) == []
    assert verdict["check_errors"] == []


def test_analyzer_loads_the_run_tokenizer_without_torch(runs):
    run_dir, _ = audited(runs, "data_mask")
    script = (
        PRELUDE + "from sftaudit.verdict.audit import audit\n"
        f"v = audit({str(run_dir)!r})\n"
        "assert v['check_errors'] == [], v['check_errors']\n"
        "print(sorted({f['evidence'].get('kind') for f in v['findings'] if f['code'] == 'LOOP-04'} - {None}))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "['assistant_masked', 'off_by_one', 'padding_confused', 'padding_trained']"


def test_markers_come_from_the_template_not_from_fixed_strings(tokenizer_cache):
    from sftaudit.dataset.layout import TemplateLayout

    chatml = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
        "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    layout = TemplateLayout.derive(build_tokenizer(tokenizer_cache), chatml)
    assert layout.texts == {
        "assistant": "<|im_start|>assistant\n",
        "turn_end": "<|im_end|>",
        "user": "<|im_start|>user\n",
        "system": "<|im_start|>system\n",
    }


def test_trl_packing_trains_every_token_a_configuration_named_once(trl_packing_run):
    """TRL trains every token of a packed `messages` dataset but each sample's first (nothing before it in
    the sample predicts it; its padding-free collator masks it): one configuration warn, none once declared."""
    from sftaudit.verdict.audit import audit
    from sftaudit.verdict.config import AuditConfig

    verdict = audit(trl_packing_run)
    assert [(f["severity"], f["evidence"]["kind"]) for f in verdict["findings"] if f["code"] == "LOOP-04"] == [
        ("warn", "full_sequence_loss")
    ]
    declared = audit(trl_packing_run, AuditConfig(check_options={"LOOP-04": {"expect": "all_tokens"}}))
    assert [f for f in declared["findings"] if f["severity"] in ("warn", "fail")] == []


def trl_assistant_only_run(run_dir, tokenizer_cache, template):
    """TRL's SFTTrainer as a user runs it (the installed TRL): a `messages` dataset, assistant_only_loss=True,
    the fixture tokenizer with `template`; TRL tokenizes and masks by the template's `{% generation %}` block."""
    from datasets import Dataset
    from sftaudit.fixtures import build_model, build_tokenizer, load_dataset
    from trl import SFTConfig, SFTTrainer

    from sftaudit.hf import SFTAuditCallback

    tok = build_tokenizer(tokenizer_cache)
    tok.chat_template = template
    dataset = Dataset.from_list([{"messages": r["messages"]} for r in load_dataset()[:16]])
    args = SFTConfig(
        output_dir=str(run_dir),
        max_steps=2,
        per_device_train_batch_size=8,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        max_length=128,
        assistant_only_loss=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    SFTTrainer(
        model=build_model(tok),
        args=args,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[SFTAuditCallback(run_dir, profile="dev")],
    ).train()
    return run_dir


@pytest.mark.slow
def test_trl_assistant_only_loss_with_the_end_of_turn_outside_the_generation_block(tmp_path, tokenizer_cache):
    """The fixture template with `{% endgeneration %}` moved before `<|eot_id|>`: TRL trains no end-of-turn marker
    (the model never learns to stop) and LOOP-04 fails at step 1; the template as shipped is clean."""
    from sftaudit.fixtures import CHAT_TEMPLATE_PATH

    from sftaudit.verdict.audit import audit

    shipped = CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")
    inside = "{{- message['content'] | trim + '<|eot_id|>' }}\n        {%- endgeneration %}"
    assert inside in shipped
    short = shipped.replace(inside, "{{- message['content'] | trim }}\n        {%- endgeneration %}{{- '<|eot_id|>' }}")
    verdict = audit(trl_assistant_only_run(tmp_path / "short", tokenizer_cache, short))
    [f] = findings(verdict, "LOOP-04", "fail")  # beside it, the aggregate count's warn
    assert (f["severity"], f["step"], f["evidence"]["kind"]) == ("fail", 1, "end_of_turn_untrained")
    assert f["evidence"]["markers_trained"] == 0 < f["evidence"]["markers_total"]
    assert "{% generation %} block" in f["message"]
    clean = audit(trl_assistant_only_run(tmp_path / "shipped", tokenizer_cache, shipped))
    assert [f for f in findings(clean, "LOOP-04") if f["severity"] != "info"] == []
