"""Files that are not what they say: FIFOs, devices, symlinks out of the run, Git LFS pointers."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from sftaudit.core.safe_io import UnsafeFile, read_bytes

from .builders import audit, findings, trainer_run

LFS = b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"0" * 64 + b"\nsize 52231312\n"


def _one_line_fail(run, text):
    fails = [f for f in findings(run, "LOOP-09") if f["severity"] == "fail" and text in f["message"]]
    assert fails and all("\n" not in f["message"] for f in fails), findings(run, "LOOP-09")
    return fails


def test_a_fifo_as_weights_or_state_is_refused_without_opening_it(tmp_path):
    run = trainer_run(tmp_path)
    os.mkfifo(run / "checkpoint-20" / "model.safetensors")
    done = audit(run)
    if done.returncode == 2:  # refused while importing the folder: one line naming the file
        assert done.stderr.strip().endswith("model.safetensors: a FIFO, not a regular file; not read")
        assert len(done.stderr.strip().splitlines()) == 1
    else:
        assert done.returncode == 1, done.stdout + done.stderr
        _one_line_fail(run, "a FIFO, not a regular file")


def test_symlinks_out_of_the_run_are_never_read_or_walked(tmp_path):
    run = trainer_run(tmp_path, checkpoints=(10, 20))
    os.symlink("/etc/passwd", run / "checkpoint-10" / "model.safetensors")
    os.symlink("/", run / "checkpoint-30")
    done = audit(run)
    assert done.returncode == 1, done.stdout + done.stderr
    _one_line_fail(run, "symlink to /etc/passwd, outside the run folder")
    _one_line_fail(run, "checkpoint-30 was saved outside the run directory")
    assert "header claims" not in done.stdout


def test_devices_and_oversized_files_are_not_read_whole(tmp_path):
    with pytest.raises(UnsafeFile, match="character device"):
        read_bytes("/dev/zero")
    sparse = tmp_path / "sparse.json"
    with open(sparse, "wb") as f:
        f.truncate(2 << 30)
    with pytest.raises(UnsafeFile, match="over the"):
        read_bytes(sparse, max_bytes=1 << 20)


def test_git_lfs_pointers_are_named_once_per_checkpoint(tmp_path):
    run = trainer_run(tmp_path, checkpoints=(10, 20))
    for step in (10, 20):
        for name in ("adapter_model.safetensors", "optimizer.pt", "rng_state.pth", "scheduler.pt"):
            (run / f"checkpoint-{step}" / name).write_bytes(LFS)
        (run / f"checkpoint-{step}" / "adapter_config.json").write_text('{"r": 8, "target_modules": ["q_proj"]}')
    done = audit(run)
    assert done.returncode in (0, 1), done.stdout + done.stderr
    loop09 = findings(run, "LOOP-09")
    pointers = [f for f in loop09 if "Git LFS pointer" in f["message"]]
    assert sorted(f["checkpoint"] for f in pointers) == ["checkpoint-10", "checkpoint-20"]
    assert all("git lfs pull" in f["message"] and f["severity"] == "warn" for f in pointers)
    assert not any("hostile header" in f["message"] or "opcode" in f["message"] for f in loop09)


REALRUNS = next(
    (p for p in (Path(__file__).resolve().parents[i] / "shared" / "realruns" for i in (3, 4)) if p.is_dir()),
    Path("absent"),
)


@pytest.mark.skipif(not (REALRUNS / "gemma3-kaggle-lfs-clone").is_dir(), reason="the real runs are not here")
@pytest.mark.slow  # a real run
def test_the_real_lfs_clone_gets_one_pointer_finding_per_checkpoint(tmp_path):
    run = tmp_path / "gemma3-kaggle-lfs-clone"
    shutil.copytree(REALRUNS / run.name, run)
    for p in [run, *run.rglob("*")]:
        p.chmod(p.stat().st_mode | 0o200)
    done = audit(run)
    assert done.returncode in (0, 1), done.stdout + done.stderr
    loop09 = findings(run, "LOOP-09")
    checkpoints = sorted(p.name for p in run.glob("checkpoint-*"))
    assert sorted(f["checkpoint"] for f in loop09 if "Git LFS pointer" in f["message"]) == checkpoints
    assert not any("hostile header" in f["message"] or "opcode" in f["message"] for f in loop09)
