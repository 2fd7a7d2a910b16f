"""`sftaudit preflight` on real dataset files and the real fixture tokenizer, through the CLI."""

import json
import subprocess
import sys

import pytest
from sftaudit.fixtures import CHAT_TEMPLATE_PATH, build_tokenizer, load_dataset
from sftaudit.fixtures.faults.data import SPLIT_MARKER

from sftaudit.cli import main

from .torchless import PRELUDE

ROWS = 24


@pytest.fixture(scope="module")
def tokenizer_dir(tokenizer_cache):
    build_tokenizer(tokenizer_cache)
    return tokenizer_cache


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def run(tmp_path, data, tokenizer_dir, *extra):
    out = tmp_path / "out"
    code = main(
        ["preflight", "--data", str(data), "--tokenizer", str(tokenizer_dir), "--out", str(out), "--no-report", *extra]
    )
    verdict = json.loads((out / "verdict.json").read_text()) if (out / "verdict.json").exists() else None
    return code, verdict


def failing(verdict, code):
    return [f for f in verdict["findings"] if f["code"] == code and f["severity"] != "info"]


def test_clean_dataset_passes_with_the_standard_collator(tmp_path, tokenizer_dir):
    data = write_jsonl(tmp_path / "clean.jsonl", load_dataset()[:ROWS])
    code, verdict = run(tmp_path, data, tokenizer_dir, "--max-length", "128")
    assert code == 0 and verdict["verdict"] == "pass" and verdict["check_errors"] == []
    assert [f["code"] for f in verdict["findings"]] == ["LOOP-03"]  # the padding-waste info


def test_clean_dataset_passes_with_a_given_collator_and_as_a_datasets_folder(tmp_path, tokenizer_dir):
    from datasets import Dataset

    folder = tmp_path / "ds"
    Dataset.from_list(load_dataset()[:ROWS]).save_to_disk(str(folder))
    code, verdict = run(tmp_path, folder, tokenizer_dir, "--collator", "sftaudit.fixtures:collate")
    assert code == 0 and verdict["verdict"] == "pass"


def test_capitalised_fields_fail_naming_both_spellings_and_every_sample(tmp_path, tokenizer_dir):
    rows = [
        {**r, "messages": [{k.capitalize(): v for k, v in m.items()} for m in r["messages"]]}
        for r in load_dataset()[:ROWS]
    ]
    code, verdict = run(tmp_path, write_jsonl(tmp_path / "caps.jsonl", rows), tokenizer_dir)
    assert code == 1
    fields = [f for f in failing(verdict, "LOOP-01") if "template_field" in f["evidence"]]
    assert {(f["evidence"]["template_field"], tuple(f["evidence"]["spelled_as"])) for f in fields} == {
        ("role", ("Role",)),
        ("content", ("Content",)),
    }
    (render,) = [f for f in failing(verdict, "LOOP-01") if "error" in f["evidence"]]
    assert render["evidence"]["sample_ids"] == [r["id"] for r in rows]
    assert "role" in render["evidence"]["error"]


def test_empty_turns_reported_with_their_sample_ids(tmp_path, tokenizer_dir):
    rows = load_dataset()[:ROWS]
    rows[3]["messages"][-1]["content"] = "   "  # renders empty after the template's trim
    rows[7]["messages"][0 if rows[7]["messages"][0]["role"] == "user" else 1]["content"] = ""
    code, verdict = run(tmp_path, write_jsonl(tmp_path / "empty.jsonl", rows), tokenizer_dir)
    assert code == 1
    empty = {f["evidence"]["role"]: f for f in failing(verdict, "LOOP-01") if "role" in f["evidence"]}
    assert empty["assistant"]["evidence"]["sample_ids"] == [rows[3]["id"]]
    assert empty["user"]["evidence"]["sample_ids"] == [rows[7]["id"]]
    assert empty["assistant"]["severity"] == "fail"


def test_template_with_a_splitting_marker_fails(tmp_path, tokenizer_dir):
    template = tmp_path / "split.jinja"
    template.write_text(CHAT_TEMPLATE_PATH.read_text().replace("<|eot_id|>", SPLIT_MARKER))
    data = write_jsonl(tmp_path / "d.jsonl", load_dataset()[:ROWS])
    code, verdict = run(tmp_path, data, tokenizer_dir, "--template", str(template))
    assert code == 1
    (f,) = [f for f in failing(verdict, "LOOP-02") if "split_markers" in f["evidence"]]
    assert [m["marker"] for m in f["evidence"]["split_markers"]] == [SPLIT_MARKER]


def test_off_by_one_collator_fails_on_every_sample(tmp_path, tokenizer_dir, monkeypatch):
    (tmp_path / "my_collator.py").write_text(
        "from sftaudit.fixtures import collate\n"
        "def early(tokenizer, rows, **kw):\n"
        "    batch = collate(tokenizer, rows, **kw)\n"
        "    labels, ids = batch['labels'], batch['input_ids']\n"
        "    starts = (labels[:, 1:] != -100) & (labels[:, :-1] == -100)\n"
        "    labels[:, :-1][starts] = ids[:, :-1][starts]\n"
        "    return batch\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    data = write_jsonl(tmp_path / "d.jsonl", load_dataset()[:ROWS])
    code, verdict = run(tmp_path, data, tokenizer_dir, "--collator", "my_collator:early")
    assert code == 1
    (f,) = [f for f in failing(verdict, "LOOP-04") if f["evidence"].get("kind") == "off_by_one"]
    assert f["step"] == 1 and set(f["evidence"]["sample_ids"]) == {r["id"] for r in load_dataset()[:ROWS]}


def test_bad_input_is_one_line_and_exit_2(tmp_path, tokenizer_dir, capsys):
    assert main(["preflight", "--data", str(tmp_path / "missing.jsonl"), "--tokenizer", str(tokenizer_dir)]) == 2
    (tmp_path / "bad.jsonl").write_text('{"id": 1}\nnot json\n')
    assert main(["preflight", "--data", str(tmp_path / "bad.jsonl"), "--tokenizer", str(tokenizer_dir)]) == 2
    assert main(["preflight", "--data", str(tmp_path / "bad.jsonl"), "--tokenizer", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("sftaudit: error: ") for line in err)
    assert "bad.jsonl:2: not JSON" in err[1]


def test_preflight_runs_without_torch_and_shows_progress(tmp_path, tokenizer_dir):
    data = write_jsonl(tmp_path / "d.jsonl", load_dataset()[:ROWS])
    script = (
        PRELUDE + "import sftaudit.dataset.batches as d; d.PROGRESS_FROM = 1\n"
        "from sftaudit.cli import main\n"
        f"sys.exit(main(['preflight', '--data', {str(data)!r}, '--tokenizer', {str(tokenizer_dir)!r}, "
        f"'--out', {str(tmp_path / 'out')!r}]))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"{ROWS}/{ROWS}" in out.stderr  # the progress bar reached the end
    assert "PASS" in out.stdout and (tmp_path / "out" / "report.html").exists()


def test_full_sequence_loss_is_one_warn_unless_declared(tmp_path, tokenizer_dir, monkeypatch):
    (tmp_path / "full_collator.py").write_text(
        "from sftaudit.fixtures import collate\n"
        "def everything(tokenizer, rows, **kw):\n"
        "    batch = collate(tokenizer, rows, **kw)\n"
        "    batch['labels'] = batch['input_ids'].clone()\n"
        "    batch['labels'][batch['attention_mask'] == 0] = -100\n"
        "    return batch\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    data = write_jsonl(tmp_path / "d.jsonl", load_dataset()[:ROWS])
    code, verdict = run(tmp_path, data, tokenizer_dir, "--collator", "full_collator:everything")
    (warn,) = failing(verdict, "LOOP-04")
    assert code == 0 and warn["severity"] == "warn" and warn["evidence"]["kind"] == "full_sequence_loss"
    assert 'expect = "all_tokens"' in warn["message"] and "assistant_only_loss" in warn["message"]
    (tmp_path / "checks.toml").write_text('[checks."LOOP-04"]\nexpect = "all_tokens"\n')
    code, verdict = run(
        tmp_path,
        data,
        tokenizer_dir,
        "--collator",
        "full_collator:everything",
        "--config",
        str(tmp_path / "checks.toml"),
    )
    assert code == 0 and failing(verdict, "LOOP-04") == []


def test_preflight_says_nothing_of_the_training_checks_and_names_what_a_config_switched_off(
    tmp_path, tokenizer_dir, capsys
):
    """A user who gave no config reads no "switched off in the audit config" for the 21 training checks; the
    verdict says why they did not run; a dataset check the user's config switches off is still named."""
    data = write_jsonl(tmp_path / "clean.jsonl", load_dataset()[:ROWS])
    code, verdict = run(tmp_path, data, tokenizer_dir, "--quiet")
    out = capsys.readouterr().out
    assert code == 0 and "not run" not in out and "switched off" not in out and "LOOP-05" not in out, out
    training = [c for c in verdict["checks"] if c["code"] not in ("LOOP-01", "LOOP-02", "LOOP-03", "LOOP-04")]
    assert training and {(c["status"], c["reason"].split(":")[0]) for c in training} == {
        ("disabled", "judges training")
    }
    config = tmp_path / "checks.toml"
    config.write_text('[audit]\ndisable = ["LOOP-03"]\n')
    code, _ = run(tmp_path, data, tokenizer_dir, "--quiet", "--config", str(config))
    out = capsys.readouterr().out
    assert "not run: LOOP-03 (switched off in the audit config)\n" in out and "LOOP-05" not in out, out
