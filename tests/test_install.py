"""The wheel `scripts/build-wheel` builds installs into a fresh virtual environment and works there: the CLI, the
shim, and the files the package reads at run time (templates, the verdict schema, the plotly bundle, the
fixtures' data)."""

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds a wheel (pip fetches setuptools into its isolated build) and a venv

ROOT = Path(__file__).resolve().parents[1]

CHECK = """
import importlib.resources as r, sys
import sftaudit
assert sftaudit.__file__.startswith(sys.prefix), sftaudit.__file__
assert r.files("sftaudit.schema").joinpath("verdict.schema.json").is_file()
assert r.files("sftaudit.outputs.templates").joinpath("report.html.j2").is_file()
assert r.files("sftaudit.outputs.report.vendor").joinpath("plotly-cartesian.min.js").is_file()
from sftaudit.fixtures import build_tokenizer, load_dataset
from sftaudit.shim import Recorder
from sftaudit.hf import SFTAuditCallback
assert len(load_dataset()) > 100 and build_tokenizer().chat_template
print("installed", sftaudit.__version__)
"""


def test_the_built_wheel_installs_into_a_fresh_venv_and_runs(tmp_path):
    built = subprocess.run(
        [str(ROOT / "scripts" / "build-wheel"), str(tmp_path / "dist")], capture_output=True, text=True, check=True
    )
    wheel = Path(built.stdout.strip().splitlines()[-1])
    assert wheel.is_file() and wheel.name.startswith("sftaudit-")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check", str(wheel)],
        check=True,
        capture_output=True,
    )
    # Its dependencies from this environment (already installed: the test stays offline and fast), after its own.
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    here = [p for p in sys.path if p.endswith("site-packages")] or [sysconfig.get_paths()["purelib"]]
    (Path(purelib) / "zz_dependencies.pth").write_text("\n".join(here) + "\n")
    checked = subprocess.run(
        [str(python), "-c", CHECK], capture_output=True, text=True, cwd=tmp_path, check=False, timeout=300
    )
    assert checked.returncode == 0, checked.stderr[-2000:]
    assert checked.stdout.startswith("installed ")
    cli = subprocess.run(
        [str(venv / "bin" / "sftaudit"), "--help"], capture_output=True, text=True, cwd=tmp_path, check=False
    )
    assert cli.returncode == 0 and "audit" in cli.stdout


def test_every_package_folder_is_in_the_wheel_list():
    """pyproject.toml lists the packages a wheel holds: a new folder of modules missing there installs nothing."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "sftaudit").rglob("__init__.py")}
    folders |= {
        ".".join(("sftaudit", *p.parent.relative_to(ROOT).parts)) for p in (ROOT / "fixtures").rglob("__init__.py")
    }
    assert folders - listed == set()
