"""Hostile pickles as checkpoint weights and training state: never run, never a hang, never a PASS."""

from __future__ import annotations

import io
import zipfile

import pytest

from .builders import audit, findings, trainer_run


def _payload(marker) -> bytes:
    """posix.system("touch MARKER") as a REDUCE (what torch.load(weights_only=False) would run)."""
    cmd = f"touch {marker}".encode()
    return b"cposix\nsystem\n" + b"X" + len(cmd).to_bytes(4, "little") + cmd + b"\x85R"


def _deep_key(marker) -> bytes:
    # {[[[...5000 deep...]]]: posix.system(...)}: repr of the key raised RecursionError before the walk
    # reached the call, and the checkpoint audited PASS.
    return b"\x80\x02}" + b"(" * 5000 + b"N" + b"l" * 5000 + _payload(marker) + b"s."


def _shared_lists(marker) -> bytes:
    # l = [l, l] sixty times over: 2**60 values to anything that walks it naively.
    body = b"\x80\x02]q\x00"
    for i in range(60):
        body += b"(h" + bytes([i]) + b"h" + bytes([i]) + b"lq" + bytes([i + 1])
    return body + b"."


def _many_marks(marker) -> bytes:
    return b"\x80\x02" + b"(" * 200_000 + b"N" + b"l" * 200_000 + b"."


@pytest.mark.parametrize(
    "name,build,file",
    [
        ("deep key, weights", _deep_key, "pytorch_model.bin"),
        ("deep key, optimizer", _deep_key, "optimizer.pt"),
        ("deep key, training state", _deep_key, "training_state.pt"),
        ("deep key, rng state", _deep_key, "rng_state.pth"),
        ("shared nested lists", _shared_lists, "optimizer.pt"),
        ("two hundred thousand marks", _many_marks, "rng_state.pth"),
    ],
)
def test_a_hostile_pickle_is_a_loop09_fail_and_never_runs(tmp_path, name, build, file):
    marker = tmp_path / "MARKER"
    run = trainer_run(tmp_path)
    (run / "checkpoint-20" / file).write_bytes(build(marker))
    done = audit(run)
    assert done.returncode == 1, done.stdout + done.stderr
    fails = [f for f in findings(run, "LOOP-09") if f["severity"] == "fail" and file in f["message"]]
    assert len(fails) == 1, fails
    message = fails[0]["message"]
    assert "\n" not in message
    if build is _deep_key:
        assert "posix.system" in message
    else:
        assert "unreadable pickle" in message and "refuse to load" in message
    assert not marker.exists()


def test_a_zip64_storage_that_claims_64_gb_is_refused_before_decompression(tmp_path):
    """A torch zip whose 5-float tensor's storage record is a zip64 entry claiming 64 GiB: refused from the
    sizes alone (streaming it would inflate 64 GiB)."""
    torch = pytest.importorskip("torch")
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(5)}, buf)
    run = trainer_run(tmp_path)
    target = run / "checkpoint-20" / "pytorch_model.bin"
    with zipfile.ZipFile(buf) as src, zipfile.ZipFile(target, "w") as dst:
        for info in src.infolist():
            if info.filename.endswith("data/0"):
                info.compress_type = zipfile.ZIP_DEFLATED
                with dst.open(info, "w") as out:
                    out.write(b"\0" * (1 << 20))
                # The central directory, written at close, then claims 64 GiB in a zip64 extra field.
                dst.getinfo(info.filename).file_size = 64 << 30
            else:
                dst.writestr(info, src.read(info))
    with zipfile.ZipFile(target) as z:
        assert z.getinfo("archive/data/0").file_size == 64 << 30
    done = audit(run)
    assert done.returncode == 1, done.stdout + done.stderr
    fails = [f["message"] for f in findings(run, "LOOP-09") if f["severity"] == "fail"]
    assert any(
        "storage record 0 holds 68719476736 bytes but the pickle declares 20" in m and "refusing to decompress" in m
        for m in fails
    ), fails
