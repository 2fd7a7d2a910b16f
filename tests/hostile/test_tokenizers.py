"""Tokenizer folders that ask for code, or cannot be built whole: never loaded, never a prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sftaudit.core.tokenizer import TokenizerRefused, load_saved_tokenizer

from .builders import audit, trainer_run, verdict


def _evil_folder(folder, marker):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenization_evil.py").write_text(f"import pathlib; pathlib.Path({str(marker)!r}).touch()\n")
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "EvilTokenizer",
                "auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]},
                "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
            }
        )
    )
    (folder / "tokenizer.json").write_text("{}")


def test_an_auto_map_tokenizer_is_refused_naming_the_entry(tmp_path):
    marker = tmp_path / "MARKER"
    _evil_folder(tmp_path / "tok", marker)
    with pytest.raises(TokenizerRefused, match="auto_map AutoTokenizer: tokenization_evil.EvilTokenizer"):
        load_saved_tokenizer(tmp_path / "tok")
    assert not marker.exists()


def test_an_auto_map_tokenizer_in_a_checkpoint_is_not_a_question(tmp_path):
    marker = tmp_path / "MARKER"
    run = trainer_run(tmp_path)
    _evil_folder(run / "checkpoint-20", marker)
    done = audit(run)  # stdin is closed: a [y/N] prompt would fail the run, not wait
    assert done.returncode in (0, 1, 2) and "Traceback" not in done.stderr, done.stderr
    checks = {c["code"]: c for c in verdict(run)["checks"]}
    assert checks["LOOP-02"]["status"] == "not_run"
    assert not marker.exists()


def test_a_tokenizer_config_alone_is_not_used(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "GemmaTokenizer", "eos_token": "<eos>"})
    )
    with pytest.raises(TokenizerRefused, match="cannot be built whole"):
        load_saved_tokenizer(folder)
    run = trainer_run(tmp_path / "r")
    (run / "checkpoint-20" / "tokenizer_config.json").write_text((folder / "tokenizer_config.json").read_text())
    done = audit(run)
    assert done.returncode in (0, 1), done.stdout + done.stderr
    checks = {c["code"]: c for c in verdict(run)["checks"]}
    assert checks["LOOP-01"]["status"] == checks["LOOP-02"]["status"] == "not_run"
    manifest_reason = "cannot be built whole"
    assert "(id 2)" not in done.stdout
    from sftaudit.imports.trainer import imported_manifest

    assert manifest_reason in imported_manifest(run)["lacks"]["tokenizer"]


def test_a_tokenizer_json_without_its_special_tokens_is_not_used(tmp_path):
    """tokenizer.json alone does not say which token is eos or pad: judging it would claim 'no eos token'."""
    from fixtures import build_tokenizer

    folder = tmp_path / "tok"
    build_tokenizer().save_pretrained(str(folder))
    (folder / "tokenizer_config.json").unlink()
    (folder / "special_tokens_map.json").unlink(missing_ok=True)
    with pytest.raises(TokenizerRefused, match="special tokens were not saved"):
        load_saved_tokenizer(folder)
    run = trainer_run(tmp_path / "r")
    (run / "tokenizer.json").write_text((folder / "tokenizer.json").read_text())
    done = audit(run)
    assert done.returncode in (0, 1), done.stdout + done.stderr
    assert {c["code"]: c for c in verdict(run)["checks"]}["LOOP-02"]["status"] == "not_run"
    assert "no eos token" not in done.stdout


# <repo>/../shared/realruns (a worktree under <repo>/../wt/NAME has it one level further up).
REALRUNS = next(
    (p for p in (Path(__file__).resolve().parents[i] / "shared" / "realruns" for i in (3, 4)) if p.is_dir()),
    Path("absent"),
)


@pytest.mark.skipif(not (REALRUNS / "gemma3-kaggle-lfs-clone").is_dir(), reason="the real runs are not here")
@pytest.mark.slow  # a real run
def test_gemma3s_real_template_gives_a_layout_with_a_whole_tokenizer(tmp_path):
    """The template is not what broke LOOP-01/02 on the Gemma 3 run: the 22-token tokenizer rebuilt from its
    tokenizer_config.json alone was. With a whole vocabulary the template's markers are found."""
    from sftaudit.fixtures import build_tokenizer

    from sftaudit.dataset.layout import TemplateLayout

    source = (REALRUNS / "gemma3-kaggle-lfs-clone" / "checkpoint-200" / "chat_template.jinja").read_text()
    tokenizer = build_tokenizer(tmp_path / "tok")
    layout = TemplateLayout.derive(tokenizer, source)
    assert layout.texts["turn_end"] == "<end_of_turn>" and layout.texts["assistant"] == "<start_of_turn>model\n"


def test_preflight_refuses_an_auto_map_tokenizer_in_one_line(tmp_path):
    from sftaudit.fixtures import build_tokenizer

    from .builders import preflight

    marker = tmp_path / "MARKER"
    folder = tmp_path / "tok"
    build_tokenizer(tmp_path / "cache").save_pretrained(str(folder))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "tokenization_evil.py").write_text(f"import pathlib; pathlib.Path({str(marker)!r}).touch()\n")
    done = preflight(tmp_path, folder)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "auto_map AutoTokenizer: tokenization_evil.EvilTokenizer" in lines[0]
    assert not marker.exists()
