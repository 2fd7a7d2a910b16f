"""`sftaudit diff`: where a run starts to differ from another, or from a golden file."""

from __future__ import annotations

import json

import pytest
from sftaudit.fixtures.faults.dynamics import DEFAULT_SCALED_TENSOR

from sftaudit.commands.diff import compare, load, profile, write_golden
from sftaudit.errors import InputError

SCALED_FROM = 30


@pytest.fixture(scope="module")
def twin(runs):
    """The clean run again, same seed: a CPU run is bit-identical."""
    return runs("clean-twin", steps=30)


@pytest.fixture(scope="module")
def scaled(runs):
    """The clean run with layer 1's down_proj gradient x100 from step SCALED_FROM."""
    return runs("clean-scaled", steps=30, faults={"grad_scale_from": SCALED_FROM})


@pytest.fixture(scope="module")
def clean_profile(clean_run):
    return profile(clean_run)


@pytest.fixture(scope="module")
def scaled_profile(scaled):
    return profile(scaled)


def test_two_same_seed_runs_are_identical(clean_profile, twin):
    result = compare(clean_profile, profile(twin), exact=True)
    assert result["first_divergent_step"] is None and result["tensors"] == []
    assert [d for d in result["differences"] if not d["what"].startswith("checkpoint digest")] == [], result[
        "differences"
    ]
    assert result["findings_only_in"] == {"a": [], "b": []}


def test_a_layer_scaled_from_step_30_diverges_there_and_is_named(clean_profile, scaled_profile):
    for mode in ({"exact": True}, {}, {"tolerance": 0.5}):
        result = compare(clean_profile, scaled_profile, **mode)
        assert result["first_divergent_step"] == SCALED_FROM, (mode, result["series"])
        assert result["tensors"][0] == DEFAULT_SCALED_TENSOR, (mode, result["tensors"])
        assert all(".layers.1." in t for t in result["tensors"]), result["tensors"]


def test_another_chat_template_differs_in_the_template_fingerprint(clean_profile, runs):
    other = runs("second-template", steps=6, faults={"second_template_at": 1})
    result = compare(clean_profile, profile(other))
    whats = {d["what"] for d in result["differences"]}
    assert "templates trained fingerprint" in whats and "steps recorded" in whats


def test_a_golden_file_round_trips(clean_run, clean_profile, scaled_profile, tmp_path):
    golden = write_golden(clean_run, tmp_path / "golden.json", stride=1)
    assert json.loads(golden.read_text())["sftaudit_golden"] == 1
    same = compare(load(golden), clean_profile, exact=True)
    assert same["first_divergent_step"] is None
    moved = compare(load(golden), scaled_profile)
    assert moved["first_divergent_step"] == SCALED_FROM and moved["tensors"][0] == DEFAULT_SCALED_TENSOR


def test_what_cannot_be_compared_is_said_in_one_line(clean_run, tmp_path):
    bad = tmp_path / "golden.json"
    bad.write_text('{"not": "a golden"}')
    with pytest.raises(InputError, match="not a golden file"):
        load(bad)
    with pytest.raises(InputError, match="neither a run folder nor a golden file"):
        load(tmp_path / "missing")


def test_the_diff_report_names_the_step_and_escapes_names(clean_profile, scaled_profile, tmp_path):
    from sftaudit.outputs.report import write_diff_report

    result = compare(clean_profile, scaled_profile)
    result["differences"].append({"what": "config note", "a": "<script>alert(1)</script>", "b": "x"})
    html = write_diff_report(result, tmp_path).read_text()
    assert f"<strong>{SCALED_FROM}</strong>" in html and DEFAULT_SCALED_TENSOR in html
    assert "<script>alert" not in html and "&lt;script&gt;" in html


def test_the_cli_exits_0_same_1_diverged_2_cannot_compare(clean_run, twin, scaled, tmp_path, capsys):
    from sftaudit.cli import main

    assert main(["diff", str(clean_run), str(twin), "--exact"]) == 0
    capsys.readouterr()
    assert main(["diff", str(clean_run), str(scaled), "--json", "--out", str(tmp_path / "html")]) == 1
    printed = json.loads(capsys.readouterr().out)
    assert printed["first_divergent_step"] == SCALED_FROM and printed["tensors"][0] == DEFAULT_SCALED_TENSOR
    assert {"differences", "findings_only_in"} <= printed.keys() and (tmp_path / "html" / "diff.html").is_file()
    golden = tmp_path / "golden.json"
    assert main(["golden", str(clean_run), "--out", str(golden), "--stride", "5"]) == 0
    assert main(["diff", str(golden), str(twin)]) == 0
    capsys.readouterr()
    assert main(["diff", str(golden), str(tmp_path / "nowhere")]) == 2
    assert main(["diff", str(golden), str(twin), "--exact", "--tolerance", "0.1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "neither a run folder nor a golden file" in err[0] and "exclude each other" in err[1]


@pytest.mark.slow  # trains two runs
def test_a_pad_eos_run_diverges_where_its_audit_finds_it_and_the_pad_token_is_named(tmp_path, tokenizer_cache, capsys):
    """The user's pair: a clean run and the same run with pad = eos (masked), in two folders both named `run`.
    The loss differs from step 1 but within run-to-run noise; the audit finds the pad token at step 1: diff
    says step 1 (as --exact does), names the pad token, and names each run by the path that tells them apart."""
    from sftaudit.fixtures.train import train_plain

    from sftaudit.cli import main

    options = dict(steps=4, checkpoint_every=0, probe_every=0, generate_every=0, eval_every=0)
    clean = train_plain(tmp_path / "clean" / "run", tokenizer_cache=tokenizer_cache, **options)
    pad = train_plain(
        tmp_path / "pad-eos" / "run", tokenizer_cache=tokenizer_cache, faults={"pad_is_eos": True}, **options
    )
    assert main(["diff", str(clean), str(pad), "--out", str(tmp_path / "html")]) == 1
    out = capsys.readouterr().out
    html = (tmp_path / "html" / "diff.html").read_text()
    assert "<td>loss</td><td>within run-to-run noise</td><td>1</td>" in html and "<td>same</td>" not in html
    assert out.startswith("pad-eos/run against clean/run: diverged at step 1 (LOOP-02 fail only in pad-eos/run"), out
    assert "loss: differs from step 1, within run-to-run noise throughout" in out
    assert "differs: tokenizer pad token: <|pad|> -> <|eot_id|>" in out and "fingerprint" not in out
    assert "only in run" not in out and "only in pad-eos/run: LOOP-02 fail @1" in out
    assert main(["diff", str(clean), str(pad), "--exact"]) == 1
    assert capsys.readouterr().out.startswith("pad-eos/run against clean/run: diverged at step 1 (loss")


def test_runs_of_one_name_are_told_apart_by_their_paths(tmp_path):
    from sftaudit.commands.diff import distinguishing_names

    assert distinguishing_names(tmp_path / "a" / "run", tmp_path / "b" / "run") == ("a/run", "b/run")
    assert distinguishing_names(tmp_path / "x" / "a" / "run", tmp_path / "y" / "a" / "run") == ("x/a/run", "y/a/run")
