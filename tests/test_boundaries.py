"""Data flows one way: the shim needs torch only; the analyzer never needs torch."""

import ast
import subprocess
import sys
from pathlib import Path

import sftaudit

from .torchless import PRELUDE

PACKAGE = Path(sftaudit.__file__).parent
ANALYZER_ONLY = ("duckdb", "scipy", "plotly", "polars", "pandas", "jinja2")
ANALYZER_MODULES = (
    "sftaudit.store.ingest",
    "sftaudit.checks",
    "sftaudit.verdict.audit",
    "sftaudit.verdict.attribution",
    "sftaudit.outputs.report",
    "sftaudit.verdict.config",
    "sftaudit.cli",
)


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the module's package
                parts = path.relative_to(PACKAGE.parent).with_suffix("").parts[: -node.level]
                base = ".".join(parts + ((base,) if base else ()))
            names.add(base)
    return names


# Modules both halves import: they must need neither torch nor the analyzer's libraries.
SHARED = ("core", "schema", "errors", "_version")


def test_shim_never_imports_the_analyzer():
    for path in [*(PACKAGE / "shim").rglob("*.py"), PACKAGE / "hf.py"]:
        for name in imports_of(path):
            top = name.split(".")[0]
            assert top not in ANALYZER_ONLY, f"{path.name} imports {name}"
            if name.startswith("sftaudit."):
                assert name.split(".")[1] in ("shim", *SHARED), f"{path.name} imports {name}"


def test_shared_modules_need_neither_torch_nor_the_analyzer():
    for module in SHARED:
        package = PACKAGE / module  # a shared package (schema/): every module in it
        for path in sorted(package.glob("*.py")) if package.is_dir() else [PACKAGE / f"{module}.py"]:
            names = imports_of(path)
            assert not {n for n in names if n.split(".")[0] in (*ANALYZER_ONLY, "torch")}, path
            assert not {n for n in names if n.startswith("sftaudit.") and n.split(".")[1] not in SHARED}, path


def test_checks_never_render_and_the_report_only_presents():
    for path in (PACKAGE / "checks").rglob("*.py"):
        assert not {n for n in imports_of(path) if n.split(".")[0] in ("plotly", "jinja2")}, path.name
        assert not {n for n in imports_of(path) if n.startswith("sftaudit.outputs.report")}, path.name
    for path in (PACKAGE / "outputs").rglob("*.py"):
        source = path.read_text(encoding="utf-8")
        assert "run_checks" not in source and "audit(" not in source, path.name  # reads stored results only
        assert "connect(" not in source and "stored_verdict" not in source, path.name  # given, never opened
        assert not {n for n in imports_of(path) if n.split(".")[0] in ("scipy", "torch")}, path.name


def test_analyzer_runs_a_full_audit_with_torch_blocked(nan_run, tmp_path):
    """A CI box that only gates checkpoints must not need torch: import and audit with torch unimportable."""
    code = (
        PRELUDE
        + f"""
import importlib
for module in {ANALYZER_MODULES!r}:
    importlib.import_module(module)
from sftaudit.cli import main
sys.exit(main(["audit", {str(nan_run)!r}, "--out", {str(tmp_path)!r}]))
"""
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr  # the planted NaN fails the run
    assert "could not run" not in result.stdout, result.stdout  # no check crashed for want of torch
    assert "LOOP-05" in result.stdout and (tmp_path / "verdict.json").exists() and (tmp_path / "report.html").exists()
