"""Stable rule ids: every finding a check can make names one rule the check declares, and every declared rule is
made somewhere; the config can disable one rule alone, and names an unknown one in one line. What a check needs of
an imported run's source is named in the declared vocabulary, never by the source naming the check."""

from __future__ import annotations

import ast
import importlib
import inspect
import re

import pytest

from sftaudit.checks import registered_checks
from sftaudit.checks.base import Check
from sftaudit.errors import InputError
from sftaudit.verdict.config import AuditConfig

SLUG = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


def _finding_calls(tree: ast.AST) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "finding"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
    ]


def _constants(module) -> set[str]:
    """The strings the check's module (and the sftaudit modules it imports names from) spell, `_` read as `-`."""
    sources = [inspect.getsource(module)]
    for node in ast.walk(ast.parse(sources[0])):
        if isinstance(node, ast.ImportFrom) and node.level:
            name = importlib.util.resolve_name("." * node.level + (node.module or ""), module.__package__)
            sources.append(inspect.getsource(importlib.import_module(name)))
    return {
        n.value.replace("_", "-")
        for src in sources
        for n in ast.walk(ast.parse(src))
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


@pytest.mark.parametrize("check", registered_checks(), ids=lambda c: c.code)
def test_every_finding_names_a_declared_rule_and_every_rule_is_made(check):
    assert check.rules, f"{check.code} declares no rules"
    assert all(SLUG.match(slug) and text.strip() for slug, text in check.rules.items()), check.rules
    module = inspect.getmodule(check)
    calls = _finding_calls(ast.parse(inspect.getsource(module)))
    assert calls, f"{check.code} makes no finding"
    for call in calls:
        assert call.args, f"{check.code} line {call.lineno}: self.finding( without a rule"
        rule = call.args[0]
        if isinstance(rule, ast.Constant):
            assert rule.value in check.rules, f"{check.code} line {call.lineno}: undeclared rule {rule.value!r}"
        else:  # a rule chosen at run time: Check.finding refuses an undeclared one (test below)
            assert not isinstance(rule, ast.JoinedStr), f"{check.code} line {call.lineno}: a rule built from text"
    spelled = _constants(module)
    unused = [slug for slug in check.rules if slug not in spelled]
    assert not unused, f"{check.code} declares rules no finding makes: {unused}"


def test_a_finding_must_name_a_declared_rule(tmp_path):
    class Probe(Check):
        code, name, needs, rules = "LOOP-99", "probe", (), {"declared": "what it fires on"}

    made = Probe().finding("declared", "warn", "a message", 3, value=1.0)
    assert (made.code, made.rule, made.step, made.evidence) == ("LOOP-99", "LOOP-99/declared", 3, {"value": 1.0})
    # `rule` given by keyword is evidence (LOOP-06 keeps its own `rule` key): the rule is the first argument
    assert Probe().finding("declared", "info", "m", rule="kl").evidence == {"rule": "kl"}
    with pytest.raises(ValueError, match="undeclared rule 'other'"):
        Probe().finding("other", "warn", "a message")


def test_rule_ids_are_unique_across_checks():
    ids = [f"{c.code}/{slug}" for c in registered_checks() for slug in c.rules]
    assert len(ids) == len(set(ids))


def test_the_config_disables_one_rule_and_names_an_unknown_one(tmp_path):
    config = AuditConfig.from_dict({"audit": {"disable": ["LOOP-05/periodic-spike", "LOOP-06"]}})
    assert config.disabled == ["LOOP-05/periodic-spike", "LOOP-06"]
    with pytest.raises(InputError) as unknown_rule:
        AuditConfig.from_dict({"audit": {"disable": ["LOOP-05/no-such-rule"]}}, "c.toml")
    message = str(unknown_rule.value)
    assert (
        "\n" not in message and "unknown rule 'LOOP-05/no-such-rule'" in message and "LOOP-05/periodic-spike" in message
    )
    with pytest.raises(InputError, match="unknown check 'LOOP-77/x'"):
        AuditConfig.from_dict({"audit": {"disable": ["LOOP-77/x"]}}, "c.toml")


def test_a_disabled_rule_is_dropped_and_the_check_still_runs(tmp_path):
    from sftaudit.verdict.audit import audit

    from .checks.logged_runs import audited, trainer_run

    run = trainer_run(tmp_path / "zero", [0.0328] + [0.0] * 99, every=10, decimals=4)
    [made] = [f for f in audited(run)["findings"] if f["code"] == "LOOP-21"]
    assert made["rule"] == "LOOP-21/zero-loss"
    config = AuditConfig(disabled=["LOOP-21/zero-loss"])
    verdict = audit(run, config=config)
    assert [f for f in verdict["findings"] if f["code"] == "LOOP-21"] == []
    assert next(c for c in verdict["checks"] if c["code"] == "LOOP-21")["status"] == "ran"


def test_what_a_check_needs_of_a_source_is_in_the_declared_vocabulary():
    from sftaudit.schema.records import LACKS

    assert all(set(c.source_needs) <= set(LACKS) for c in registered_checks())
    needed = {kind for c in registered_checks() for kind in c.source_needs}
    assert needed == set(LACKS), "a kind of lack no check needs, or one a check needs that is not declared"


@pytest.mark.parametrize("check", [c for c in registered_checks() if c.restated_by], ids=lambda c: c.code)
def test_a_rule_restated_by_another_names_declared_rules_of_another_check(check):
    by_code = {c.code: c for c in registered_checks()}
    for rule, other in check.restated_by.items():
        assert rule in check.rules, f"{check.code}: restated_by names its undeclared rule {rule!r}"
        code, _, slug = other.partition("/")
        assert code != check.code and slug in by_code[code].rules, f"{check.code}: {other!r} is no other check's rule"
