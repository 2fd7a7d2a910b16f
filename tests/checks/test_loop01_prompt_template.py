"""LOOP-01: field mismatches, empty turns and a second template fire with their samples; clean is silent."""

from sftaudit.fixtures import CHAT_TEMPLATE_PATH

from sftaudit.dataset.fields import template_fields

from .data_runs import audited, batch_ids, clean_data_findings, findings


def test_template_fields_come_from_the_ast_with_aliases_and_optional_reads():
    fields = template_fields(CHAT_TEMPLATE_PATH.read_text())
    assert fields.message_required == {"role", "content"} and "messages" in fields.context
    aliased = template_fields(
        "{% set first = messages[0] %}{{ first.Role }}{% set rest = messages[1:] %}"
        "{% for m in rest %}{{ m['text'] }}{% if m.tool_calls is defined %}{{ m.tool_calls }}{% endif %}"
        "{% if 'name' in m %}{{ m['name'] }}{% endif %}{{ m.get('weight') }}{% endfor %}"
    )
    assert aliased.message_required == {"Role", "text"}
    assert aliased.message_optional == {"tool_calls", "name", "weight"}


def test_field_case_mismatch_names_both_spellings(runs):
    _, verdict = audited(runs, "data_tokens")
    fails = {
        f["evidence"]["template_field"]: f
        for f in findings(verdict, "LOOP-01", "fail")
        if "template_field" in f["evidence"]
    }
    assert set(fails) == {"role", "content"}
    assert fails["role"]["evidence"]["spelled_as"] == ["Role"]
    assert "'role'" in fails["role"]["message"] and "'Role'" in fails["role"]["message"]
    assert fails["role"]["step"] is None


def test_empty_assistant_turn_reported_with_its_sample(runs):
    run_dir, verdict = audited(runs, "data_template")
    empty = [f for f in findings(verdict, "LOOP-01") if f["evidence"].get("role")]
    assert len(empty) == 1
    assert (empty[0]["severity"], empty[0]["step"], empty[0]["evidence"]["role"]) == ("fail", 2, "assistant")
    assert empty[0]["evidence"]["sample_ids"] == [batch_ids(run_dir, 2)[0]]


def test_second_template_fails_at_the_step_it_appears(runs):
    run_dir, verdict = audited(runs, "data_template")
    f = next(f for f in findings(verdict, "LOOP-01") if "template_fingerprints" in f["evidence"])
    assert (f["severity"], f["step"]) == ("fail", 4)
    assert len(f["evidence"]["template_fingerprints"]) == 2
    assert f["evidence"]["sample_ids"] == batch_ids(run_dir, 4)
    assert f["checkpoint"] == "checkpoint-6"


def test_clean_run_raises_nothing(clean_run):
    from ..shared import cached_audit

    assert [f for f in clean_data_findings(cached_audit(clean_run)) if f["code"] == "LOOP-01"] == []
