"""Every check option is declared once with the range a config may set it in: a value outside it (0 where a
window or a spread must be positive, a share above 1) is refused in one line naming the key, and every value
inside it, down to the edges, is one the checks judge with (no check raises)."""

from __future__ import annotations

import json

import pytest

from sftaudit.checks import registered_checks
from sftaudit.errors import InputError
from sftaudit.verdict.config import AuditConfig

from .builders import audit, recorded_run, trainer_run

NUMERIC = [
    (c.code, name, o) for c in registered_checks() for name, o in c.options.items() if o.value_type in (int, float)
]


def test_every_numeric_option_declares_its_range():
    assert NUMERIC and not [(code, name) for code, name, o in NUMERIC if o.low is None]


def _outside(option) -> list:
    """Values just outside the option's range (and 0 and -1 where they are outside)."""
    step = 1 if option.value_type is int else 1e-9
    out = [option.low if option.low_open else option.low - step]
    if option.high is not None:
        out.append(option.high if option.high_open else option.high + step)
    return sorted({v for v in [*out, 0, -1] if not option.in_range(v)})


def _edge(option):
    """The lowest value the option accepts."""
    if option.low_open:
        return option.low + (1 if option.value_type is int else 1e-6)
    return option.low


def _toml(code: str, options: dict) -> str:
    return f'[checks."{code}"]\n' + "".join(f"{k} = {json.dumps(v)}\n" for k, v in options.items())


@pytest.mark.parametrize("code, name, option", NUMERIC, ids=[f"{c}.{n}" for c, n, _ in NUMERIC])
def test_a_value_outside_an_options_range_is_refused_naming_the_key(tmp_path, code, name, option):
    config = tmp_path / "audit.toml"
    for value in _outside(option):
        config.write_text(_toml(code, {name: option.value_type(value)}))
        with pytest.raises(InputError) as err:
            AuditConfig.load(config)
        said = str(err.value)
        assert f'checks."{code}".{name} must be' in said and "\n" not in said, said
        if value >= 0:  # a negative number is refused as such first
            assert option.range_words() in said, said


@pytest.mark.slow
@pytest.mark.parametrize("edge", ["low", "high"])
def test_options_at_the_edges_of_their_ranges_judge_without_a_check_raising(tmp_path, edge):
    """Every numeric option at once at its lowest (or highest) accepted value: the audits of a clean imported run
    and of a recorded run with NaN gradients complete, and no check raises."""
    values = {}
    for code, name, option in NUMERIC:
        value = (
            _edge(option) if edge == "low" or option.high is None else option.high - (1e-6 if option.high_open else 0)
        )
        values.setdefault(code, {})[name] = option.value_type(value)
    config = tmp_path / "audit.toml"
    config.write_text("".join(_toml(code, options) for code, options in values.items()))
    AuditConfig.load(config)
    for run in (trainer_run(tmp_path / "imported"), recorded_run(tmp_path, "recorded", nan_step=20)):
        done = audit(run, "--no-report", "--config", config)
        assert done.returncode in (0, 1), done.stderr
        verdict = json.loads((run.parent / "reports" / run.name / "verdict.json").read_text())
        assert not verdict["check_errors"], verdict["check_errors"]


def test_sftaudit_open_reads_a_config_as_the_cli_does(tmp_path):
    """A path or a dict is validated as --config is (one line naming the key); anything else is refused."""
    import sftaudit

    run = trainer_run(tmp_path)
    with pytest.raises(InputError, match=r'checks."LOOP-10".window must be an integer >= 2, not 0'):
        sftaudit.open(run, config={"checks": {"LOOP-10": {"window": 0}}})
    (tmp_path / "deep.toml").write_text("[audit]\ndisable = " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(InputError, match="nested too deeply"):
        sftaudit.open(run, config=tmp_path / "deep.toml")
    with pytest.raises(InputError, match="not int"):
        sftaudit.open(run, config=5)
