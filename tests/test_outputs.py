"""The output formats are units of extension: every module of `sftaudit.outputs` (but the shared escaping) is a
registered format with its own tests, commands pick them by name, and a new format is one module."""

from __future__ import annotations

import pkgutil
from pathlib import Path

import pytest

import sftaudit.outputs as outputs
from sftaudit.outputs import NOT_FORMATS, Format, Rendering, registered_formats, rendered
from tests.outputs_data import small_verdict

TESTS = Path(__file__).parent


def test_every_module_is_a_registered_format_with_its_own_tests():
    modules = {m.name for m in pkgutil.iter_modules(outputs.__path__)} - NOT_FORMATS
    formats = registered_formats()
    assert set(formats) == modules == {"github", "json", "junit", "markdown", "report", "sarif", "terminal"}
    for name, declared in formats.items():
        assert isinstance(declared, Format) and declared.what and callable(declared.render)
        assert (TESTS / f"test_{name}.py").is_file(), f"format {name} has no tests/test_{name}.py"


def test_an_unknown_format_is_refused():
    r = Rendering(small_verdict(), Path("run"))
    for name in ("csv", "escape", "../json", "report.figures"):
        with pytest.raises(KeyError):
            rendered(name, r)


def test_a_new_format_is_one_module(tmp_path, monkeypatch):
    (tmp_path / "csv.py").write_text(
        "from sftaudit.outputs import Format\n"
        "FORMAT = Format('findings as CSV', lambda r: ''.join(f\"{f['code']},{f['step']}\\n\" for f in r.verdict['findings']))\n"
    )
    monkeypatch.setattr(outputs, "__path__", [*outputs.__path__, str(tmp_path)])
    assert "csv" in registered_formats()
    assert rendered("csv", Rendering(small_verdict(), Path("run"))) == "LOOP-05,12\nLOOP-03,None\n"
