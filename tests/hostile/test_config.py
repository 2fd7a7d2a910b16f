"""Hostile and mistaken configs and policies: each refused with one line and exit 2, before any run is read."""

import subprocess
import sys

import pytest

from sftaudit.commands.gate import Policy
from sftaudit.errors import InputError
from sftaudit.verdict.config import AuditConfig

BAD_CONFIGS = [
    ('[audit]\ndisable = "LOOP-05"\n', "audit.disable must be a list"),
    ('[audit]\nstrict = "no"\n', "audit.strict must be true or false"),
    ("[audit]\nstrict = 1\n", "audit.strict must be true or false"),
    ("[audti]\nstrict = true\n", "unknown section [audti]; known: [audit], [checks], [ingest], [verdict]"),
    ('[audit]\ndisabel = ["LOOP-05"]\n', "unknown key 'disabel' in [audit]"),
    ('[audit]\ndisable = ["LOOP-99"]\n', "unknown check 'LOOP-99'"),
    ('[checks."LOOP-99"]\nx = 1\n', "unknown check 'LOOP-99' in [checks]; known: LOOP-01"),
    ('[checks]\n"LOOP-05" = 5\n', 'checks."LOOP-05" must be a table of options'),
    ('[checks."LOOP-05"]\nsigma_own = "six"\n', 'checks."LOOP-05".sigma_own must be a number'),
    ('[checks."LOOP-05"]\nsigma_own = nan\n', "must be a finite number >= 0"),
    ('[checks."LOOP-05"]\nmax_tensors_listed = 2.5\n', "max_tensors_listed must be an integer"),
    ('[checks."LOOP-05"]\nmax_tensors_listed = true\n', "max_tensors_listed must be an integer"),
    ('[checks."LOOP-05"]\nwindow = "12"\n', "window must be an integer"),
    ('[checks."LOOP-09"]\ntrusted_pickle_globals = "os.system"\n', "trusted_pickle_globals must be a list"),
    ('[checks."LOOP-09"]\ntrusted_pickle_globals = [1]\n', "must be a list of strings"),
    ('[checks."LOOP-04"]\nexpect = 3\n', "expect must be a string"),
    ('[checks."LOOP-05"]\nno_such_option = 1\n', "no_such_option"),
    ('[verdict]\nrollback_margin = "100"\n', "verdict.rollback_margin must be an integer"),
    ("[verdict]\nrollback_margin = 0\n", "rollback_margin must be an integer >= 1"),
    ("[verdict]\nmax_missing_share = 2\n", "a share between 0 and 1"),
    ("[ingest]\nmax_record_bytes = -5\n", "must be a finite number >= 0"),
    ("[audit\n", "not TOML"),
    (b"\xff\xfe[audit]\n", "not UTF-8 text"),
]


def run_cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "sftaudit.cli", *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=600
    )


@pytest.mark.parametrize("text, reason", BAD_CONFIGS)
def test_a_config_mistake_is_refused_in_one_line(tmp_path, text, reason):
    config = tmp_path / "audit.toml"
    config.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(InputError) as err:
        AuditConfig.load(config)
    assert reason in str(err.value) and str(config) in str(err.value) and "\n" not in str(err.value)


def test_the_cli_refuses_a_bad_config_before_reading_the_run(tmp_path):
    """Every command that takes --config exits 2 with the one line (the run folder is never opened)."""
    config = tmp_path / "audit.toml"
    config.write_text('[audit]\ndisable = "LOOP-05"\n')
    for command in (
        ["audit", tmp_path / "no-run"],
        ["replay", tmp_path / "no-run"],
        ["ingest", tmp_path / "no-run"],
        ["gate", tmp_path / "no-run", "--checkpoint", "1"],
    ):
        result = run_cli(*command, "--config", config)
        assert result.returncode == 2, result
        assert result.stderr.count("\n") == 1 and "audit.disable must be a list" in result.stderr
        assert "Traceback" not in result.stderr and "Error:" not in result.stderr


@pytest.mark.parametrize("path", ["/tmp", "/dev/zero", "/no/such/config.toml"])
def test_a_config_that_is_not_a_readable_file_is_refused(path):
    with pytest.raises(InputError, match="config"):
        AuditConfig.load(path)


def test_a_fifo_config_does_not_block(tmp_path):
    import os

    fifo = tmp_path / "audit.toml"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="not a regular file"):
        AuditConfig.load(fifo)


def test_a_sound_config_is_read_with_its_types(tmp_path):
    config = tmp_path / "audit.toml"
    config.write_text(
        '[audit]\ndisable = ["LOOP-06"]\nstrict = true\n[checks."LOOP-05"]\nsigma_own = 7\nwindow = 12\n'
        "[verdict]\nrollback_margin = 3\nmax_missing_share = 0.05\n[ingest]\nmax_record_bytes = 1000000\n"
    )
    c = AuditConfig.load(config)
    assert (c.disabled, c.strict, c.rollback_margin, c.max_missing_share, c.max_record_bytes) == (
        ["LOOP-06"],
        True,
        3,
        0.05,
        1000000,
    )
    assert c.check_options == {"LOOP-05": {"sigma_own": 7.0, "window": 12}}
    assert isinstance(c.check_options["LOOP-05"]["sigma_own"], float)


@pytest.mark.parametrize(
    "text, reason",
    [
        ('[gate]\nblock = "fail"\n', "gate.block must be a list of strings"),
        ('[gate]\nblock = ["fatal"]\n', "unknown severities"),
        ('[gate]\nignore = ["LOOP-99"]\n', "unknown check 'LOOP-99'"),
        ('[gate]\nrequire_resume_state = "yes"\n', "require_resume_state must be true or false"),
        ('[gaet]\nblock = ["fail"]\n', "unknown section [gaet]"),
        ('[gate]\nblocks = ["fail"]\n', "unknown key 'blocks'"),
    ],
)
def test_a_policy_mistake_is_refused(tmp_path, text, reason):
    policy = tmp_path / "policy.toml"
    policy.write_text(text)
    with pytest.raises(InputError) as err:
        Policy.load(policy)
    assert reason in str(err.value)


@pytest.mark.parametrize(
    "args, reason",
    [
        (["preflight", "--data", "d", "--tokenizer", "t", "--max-length", "-5"], "--max-length: -5 is less than 1"),
        (["preflight", "--data", "d", "--tokenizer", "t", "--batch-size", "0"], "--batch-size: 0 is less than 1"),
        (["preflight", "--data", "d", "--tokenizer", "t", "--max-length", "x"], "'x' is not an integer"),
        (["probe", "r", "--prompts", "p", "--samples", "-1"], "--samples: -1 is less than 1"),
        (["demo", "--steps", "0"], "--steps: 0 is less than 1"),
    ],
)
def test_bad_numbers_on_the_command_line_exit_2_in_one_line(args, reason):
    result = run_cli(*args)
    assert result.returncode == 2 and reason in result.stderr and result.stderr.count("\n") == 1
    assert "Traceback" not in result.stderr
