"""Shared real runs: each is trained once per test session through the real shim."""

from __future__ import annotations

from pathlib import Path

import pytest

from sftaudit.fixtures.train import train_plain

NAN_STEP = 13


@pytest.fixture(scope="session")
def tokenizer_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tokenizer")


@pytest.fixture(scope="session")
def runs(tmp_path_factory, tokenizer_cache):
    """Train a named run once per session: runs(name, **train_plain options) -> run_dir."""
    made: dict[str, Path] = {}

    def make(name: str, **options) -> Path:
        if name not in made:
            made[name] = train_plain(tmp_path_factory.mktemp(name) / name, tokenizer_cache=tokenizer_cache, **options)
        return made[name]

    return make


@pytest.fixture(scope="session")
def clean_run(runs) -> Path:
    return runs("clean", steps=30)


@pytest.fixture(scope="session")
def nan_run(runs) -> Path:
    return runs("nan", steps=20, faults={"nan_at": NAN_STEP})
