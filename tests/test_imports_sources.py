"""The log-source registry is complete: every module of `sftaudit.imports.sources` is a registered source with its
own tests (``tests/sources/test_<module>.py``, with ``write_example``), and every source reads the same contract run
alike: detected by its content (and by no other source), its training entries Trainer-shaped, imported through the
one writer, and named by its own path."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import pkgutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import sftaudit.imports.sources as sources_package
from sftaudit.cli import main
from sftaudit.imports import import_run
from sftaudit.imports.source import LogSource
from sftaudit.imports.sources import registered_sources
from sftaudit.schema.records import LACKS

from .sources import EXAMPLE_STEPS, example_loss

TESTS = Path(__file__).parent / "sources"
MODULES = sorted(info.name for info in pkgutil.iter_modules(sources_package.__path__))
SOURCES = {type(s).__module__.rsplit(".", 1)[1]: s for s in registered_sources()}


def _example(module: str):
    return importlib.import_module(f"tests.sources.test_{module}").write_example


def _needs(source: LogSource) -> None:
    if source.needs and importlib.util.find_spec(source.needs[0]) is None:
        pytest.skip(f"{source.needs[0]} is not installed")


def test_every_module_is_one_registered_source_with_its_own_tests():
    for module in MODULES:
        classes = [
            obj
            for obj in vars(importlib.import_module(f"sftaudit.imports.sources.{module}")).values()
            if isinstance(obj, type) and issubclass(obj, LogSource) and obj.__module__.endswith(f".{module}")
        ]
        assert len(classes) == 1, f"sftaudit/imports/sources/{module}.py holds {len(classes)} LogSource classes"
        assert module in SOURCES, module
        tests = TESTS / f"test_{module}.py"
        assert tests.is_file(), f"the source {module} has no tests: {tests}"
        defined = {n.name for n in ast.parse(tests.read_text(encoding="utf-8")).body if isinstance(n, ast.FunctionDef)}
        assert "write_example" in defined and len([n for n in defined if n.startswith("test_")]) >= 2, tests
    assert sorted(SOURCES) == MODULES


def test_every_source_says_what_it_is():
    names = [s.name for s in SOURCES.values()]
    assert len(set(names)) == len(names)
    for s in SOURCES.values():
        assert s.name and s.provenance.startswith("imported logs: ") and s.what and s.patterns
        assert s.rank is None or isinstance(s.rank, int)


@pytest.mark.parametrize("module", MODULES)
def test_every_source_reads_the_contract_run_alike(module, tmp_path):
    source = SOURCES[module]
    _needs(source)
    run = tmp_path / "run"
    files = _example(module)(run)
    for other_module, other in SOURCES.items():  # its content tells it from every other source's
        assert all(other.detect(f) == (other_module == module) for f in files), (other_module, files)
    log = source.read(files, run)
    assert (log.source, log.provenance, log.what) == (source.name, source.provenance, source.what)
    assert log.files == [str(f.relative_to(run)) for f in files]
    training = [e for seg in log.segments for e in seg if "loss" in e]
    assert [(e["step"], e["loss"], e["learning_rate"]) for e in training] == [
        (s, example_loss(s), pytest.approx(1e-4)) for s in EXAMPLE_STEPS
    ]
    assert all(type(e["step"]) is int and all(type(v) is float for k, v in e.items() if k != "step") for e in training)
    # What it lacks is said in the declared vocabulary, never by a check's code.
    assert set(log.lacks) <= set(LACKS) and all(isinstance(why, str) and why for why in log.lacks.values())


@pytest.mark.parametrize("module", MODULES)
def test_every_source_is_imported_through_the_one_writer(module, tmp_path):
    source = SOURCES[module]
    _needs(source)
    run = tmp_path / "run"
    (first, *_) = _example(module)(run)
    done = import_run(run)
    assert done["steps"] == 10 and done["logging_steps"] == 1
    rank = run / "sftaudit" / "rank-0"
    manifest = json.loads((rank / "manifest.jsonl").read_text(encoding="utf-8").splitlines()[-1])
    assert manifest["imported"] and manifest["source"] == source.provenance
    steps = pq.read_table(rank / "steps.parquet").to_pylist()
    assert [(s["step"], s["loss"]) for s in steps] == [(s, example_loss(s)) for s in EXAMPLE_STEPS]
    # The same run named by its log file's own path (the CLI takes its folder as the run).
    assert main(["import", str(first)]) == 0
    assert main(["import", str(run), "--source", source.name]) == 0


def test_an_unknown_source_is_refused_in_one_line(tmp_path, capsys):
    _example("llamafactory")(tmp_path / "run")
    assert main(["import", str(tmp_path / "run"), "--source", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "no such log source (one of: trainer_state, llamafactory" in err


@pytest.mark.parametrize(
    ("uri", "said"),
    [
        ("https://huggingface.co/org/run", "is a web address"),
        ("http://host/run.tar", "is a web address"),
        ("s3://bucket/runs/7", "aws s3 sync"),
        ("wandb://entity/project/abc123", "is a W&B run"),
        ("runs:/0123abcd/model", "is an MLflow run"),
        ("gs://bucket/run", "gcloud storage cp"),
    ],
)
@pytest.mark.parametrize("command", ["import", "audit"])
def test_a_remote_run_gets_one_line_saying_how_to_copy_it(uri, said, command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, uri])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.splitlines()) == 1 and said in err and "never fetches" in err
