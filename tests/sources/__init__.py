"""Tests of the log sources (`sftaudit.imports.sources`): each module ``test_<source module>.py`` here tests one source
and defines ``write_example(folder) -> list[Path]``, the source's files of the contract run every source must read
alike (`tests/test_imports_sources.py`): training logs at steps 1..10 with ``example_loss(step)`` and a learning rate
of 1e-4."""

import gzip
import json
import shutil
from pathlib import Path

EXAMPLE_STEPS = range(1, 11)


def example_loss(step: int) -> float:
    return 2.0 - 0.125 * step  # exact in float32 (TensorBoard stores float32)


# Real runs the trackers' own libraries wrote (fixtures/trackers/generate_all.py, 60 steps; packed by
# fixtures/trackers/pack_data.py): clean, nan_loss (non-finite from step 40), lr_x100 (the loss diverging).
TRACKER_DATA = Path(__file__).resolve().parents[2] / "fixtures" / "trackers" / "data"
FIRST_NAN_STEP = 40


def tracker_run(target: str, variant: str, folder: Path) -> Path:
    """A copy of a committed tracker run in `folder` (its SQLite databases unzipped), to read or audit."""
    run = folder / f"{target}-{variant}"
    shutil.copytree(TRACKER_DATA / target / variant, run)
    for packed in run.rglob("*.db.gz"):
        with gzip.open(packed) as src, packed.with_suffix("").open("wb") as dst:
            shutil.copyfileobj(src, dst)
        packed.unlink()
    return run


def audited(run: Path, *options: str) -> dict:
    """The verdict of ``sftaudit audit RUN`` (no report)."""
    from sftaudit.cli import main

    out = run.parent / f"{run.name}-audit"
    main(["audit", str(run), "--no-report", "--out", str(out), *options])
    return json.loads((out / "verdict.json").read_text(encoding="utf-8"))


def assert_variants_judged(verdicts: dict[str, dict]) -> None:
    """The clean run passes, the NaN run fails at its first NaN, the 100x learning rate is found."""
    assert verdicts["clean"]["verdict"] == "pass", verdicts["clean"]["findings"]
    nan = verdicts["nan_loss"]
    assert nan["verdict"] == "fail" and nan["first_anomalous_step"] == FIRST_NAN_STEP, nan["findings"]
    assert any(f["code"] == "LOOP-25" and f["step"] == FIRST_NAN_STEP for f in nan["findings"])
    lr = verdicts["lr_x100"]
    assert lr["verdict"] == "fail" and any(f["code"] == "LOOP-19" for f in lr["findings"]), lr["findings"]
