"""The shim's guard: a run stopped at the step it goes wrong (or when `sftaudit watch` asks), no checkpoint saved
over the good ones, the last good one kept out of rotation, an end that never reads as complete; and the stop
request both halves share."""

from __future__ import annotations

import ast
import json
import os
import shlex
import shutil
import time

import pytest
import torch
from torch.overrides import TorchFunctionMode

from sftaudit.commands.replay import replay, resume_command, to_text
from sftaudit.core.artifacts import (
    StopRequest,
    rank_dir,
    read_stop_request,
    stop_request_path,
    write_stop_request,
)
from sftaudit.core.safe_io import UnsafeFile
from sftaudit.shim import Recorder, TrainingHalted
from sftaudit.shim.guard import keep_copy
from sftaudit.verdict.audit import audit


class Tiny(torch.nn.Module):
    """A model whose whole step is microseconds: what the guard does is all there is to see."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.lin(x).pow(2).mean()


def tiny_recorder(run_dir, guard="stop", stop_check_seconds=0, **options):
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder(
        run_dir, model, optimizer=opt, profile="prod", guard=guard, stop_check_seconds=stop_check_seconds, **options
    )
    return rec, model, opt


def train_step(rec, model, opt, step, nan=False, scaler=None):
    loss = model(torch.ones(2, 4)) * (float("nan") if nan else 1.0)
    (scaler.scale(loss) if scaler is not None else loss).backward()
    rec.on_backward(step, loss)
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    rec.on_step_end(step)
    opt.zero_grad()


def events(run_dir, kind=None):
    lines = (rank_dir(run_dir, 0) / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if kind is None or e["kind"] == kind]


def save(run_dir, rec, model, step):
    path = run_dir / f"checkpoint-{step}"
    path.mkdir()
    torch.save(model.state_dict(), path / "model.pt")
    rec.on_checkpoint(step, path)
    return path


# ---------------------------------------------------------------- the stop request, one format for both halves


def test_a_stop_request_round_trips_and_is_validated(tmp_path):
    assert read_stop_request(tmp_path) is None
    write_stop_request(tmp_path, "LOOP-05 fail\x1b[2J at step 30", step=30, code="LOOP-05", requested_at=5.0)
    assert read_stop_request(tmp_path) == StopRequest("LOOP-05 fail\\x1b[2J at step 30", 30, "LOOP-05", 5.0)
    assert not list(stop_request_path(tmp_path).parent.glob(".stop-request-*"))  # written whole, then renamed
    stop_request_path(tmp_path).write_text("")  # `touch`: a plain request, dated by the file
    request = read_stop_request(tmp_path)
    assert (request.reason, request.step) == ("stop requested", None)
    assert abs(request.requested_at - os.stat(stop_request_path(tmp_path)).st_mtime) < 1e-6
    for text in (
        "not json",
        "[]",
        '{"reason": "", "requested_at": 1}',
        '{"reason": "x", "step": true, "requested_at": 1}',
    ):
        stop_request_path(tmp_path).write_text(text)
        with pytest.raises(ValueError):
            read_stop_request(tmp_path)
    stop_request_path(tmp_path).write_text(json.dumps({"reason": "x" * 100_000, "requested_at": 1}))
    with pytest.raises(UnsafeFile, match="limit"):
        read_stop_request(tmp_path)
    stop_request_path(tmp_path).unlink()
    os.mkfifo(stop_request_path(tmp_path))  # would block a plain open()
    with pytest.raises(UnsafeFile, match="FIFO"):
        read_stop_request(tmp_path)


# ---------------------------------------------------------------- what the guard acts on


def test_off_by_default_the_shim_records_a_nan_run_to_its_end(tmp_path):
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(tmp_path, model, optimizer=opt, profile="prod") as rec:
        for step in range(1, 5):
            train_step(rec, model, opt, step, nan=step >= 2)
            assert not rec.should_stop
    assert "halted" not in events(tmp_path, "close")[0] and not events(tmp_path, "halted")


def test_a_nan_loss_stops_the_run_at_its_step_and_keeps_the_last_checkpoint_before_it(tmp_path, capsys):
    rec, model, opt = tiny_recorder(tmp_path)
    with rec:
        for step in range(1, 10):
            train_step(rec, model, opt, step, nan=step == 5)
            if rec.should_stop:
                break
            if step % 2 == 0:
                save(tmp_path, rec, model, step)
    assert step == 5 and rec.poisoned(5) and not rec.poisoned(4)
    [close] = events(tmp_path, "close")
    assert close["step"] == 5
    assert close["halted"] == {
        "source": "nonfinite_loss",
        "reason": "the loss is nan",
        "step": 5,
        "anomaly_step": 5,
        "code": None,
        "kept": "sftaudit/kept/checkpoint-4",
        "kept_from": "checkpoint-4",
    }
    kept = tmp_path / "sftaudit/kept/checkpoint-4/model.pt"
    assert os.stat(kept).st_ino == os.stat(tmp_path / "checkpoint-4/model.pt").st_ino  # hard links: no extra disk
    records = [json.loads(x) for x in (rank_dir(tmp_path, 0) / "checkpoints.jsonl").read_text().splitlines()]
    assert [r for r in records if r["event"] == "kept"][0]["kept_path"] == "sftaudit/kept/checkpoint-4"
    err = capsys.readouterr().err
    assert err.count("sftaudit: guard: training halted at step 5: the loss is nan; checkpoint-4 kept as") == 1


def test_a_non_finite_gradient_with_a_finite_loss_stops_the_run_too(tmp_path):
    rec, model, opt = tiny_recorder(tmp_path)
    loss = model(torch.ones(2, 4))
    loss.backward()
    model.lin.weight.grad[0, 0] = float("inf")
    rec.on_backward(1, loss)
    opt.step()
    rec.on_step_end(1)
    assert rec.halted.source == "nonfinite_grad" and rec.halted.reason == "the gradient norm is inf"
    rec.close()


def test_guard_raise_ends_the_run_with_training_halted_after_the_close_record(tmp_path):
    rec, model, opt = tiny_recorder(tmp_path, guard="raise")
    with pytest.raises(TrainingHalted, match="training halted at step 2: the loss is nan"), rec:
        for step in range(1, 5):
            train_step(rec, model, opt, step, nan=step == 2)
            if rec.should_stop:
                break
    assert events(tmp_path, "close")[0]["halted"]["step"] == 2


def test_under_a_loss_scaler_skipped_steps_stop_the_run_once_its_scale_falls_below_1(tmp_path):
    """A GradScaler skips a step with non-finite gradients and halves its scale: one such step is a benign skip;
    a streak that drove the scale below 1 overflowed at every scale it tried."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**3)
    rec, model, opt = tiny_recorder(tmp_path, grad_scaler=scaler)
    train_step(rec, model, opt, 1, scaler=scaler)
    train_step(rec, model, opt, 2, nan=True, scaler=scaler)  # skipped: scale 8 -> 4
    train_step(rec, model, opt, 3, scaler=scaler)
    assert not rec.should_stop
    for step in range(4, 20):  # NaN from step 4 on: the scale 4 halves to 2, 1, then 0.5 after step 6
        train_step(rec, model, opt, step, nan=True, scaler=scaler)
        if rec.should_stop:
            break
    assert (step, rec.halted.source, rec.halted.anomaly_step) == (6, "skipped_steps", 4)
    assert rec.halted.reason.startswith(
        "3 steps in a row skipped by the loss scaler for non-finite values since step 4"
    )
    assert "its scale fell to 0.5, below 1" in rec.halted.reason
    rec.close()


def test_a_stop_request_is_acted_on_at_the_next_step_and_a_stale_one_is_ignored(tmp_path, capsys):
    write_stop_request(tmp_path, "left from an earlier segment", requested_at=time.time() - 3600)
    rec, model, opt = tiny_recorder(tmp_path)
    with rec:
        for step in range(1, 10):
            train_step(rec, model, opt, step)
            if rec.should_stop:
                break
            if step == 2:
                save(tmp_path, rec, model, step)
            if step == 4:  # what `sftaudit watch --stop-on fail` writes, between two steps
                write_stop_request(tmp_path, "LOOP-10 fail at step 3: loss spike", step=3, code="LOOP-10")
    assert step == 5
    ignored = events(tmp_path, "stop_request_ignored")
    assert len(ignored) == 1 and "requested before this segment started" in ignored[0]["error"]
    halted = events(tmp_path, "close")[0]["halted"]
    assert halted["source"] == "stop_request" and halted["reason"].startswith("stop requested: LOOP-10 fail")
    assert (halted["anomaly_step"], halted["code"], halted["kept_from"]) == (3, "LOOP-10", "checkpoint-2")
    assert rec.poisoned(3) and not rec.poisoned(2)
    assert capsys.readouterr().err.count("was ignored") == 1


def test_a_file_that_is_no_request_is_said_once_and_training_goes_on(tmp_path, capsys):
    rec, model, opt = tiny_recorder(tmp_path)
    stop_request_path(tmp_path).write_text("{not json")
    with rec:
        for step in range(1, 4):
            train_step(rec, model, opt, step)
    assert not rec.should_stop
    [ignored] = events(tmp_path, "stop_request_ignored")
    assert "not JSON" in ignored["error"]
    assert capsys.readouterr().err.count("ignored") == 1


def test_the_request_is_looked_for_at_most_every_check_seconds(tmp_path, monkeypatch):
    rec, model, opt = tiny_recorder(tmp_path, stop_check_seconds=3600)
    looked = []
    real_stat = os.stat
    monkeypatch.setattr("sftaudit.shim.guard.os.stat", lambda p, *a, **k: looked.append(p) or real_stat(p, *a, **k))
    for step in range(1, 6):
        train_step(rec, model, opt, step)
    assert [p.name for p in looked].count("stop-request.json") == 1  # the first step's look; the next: in an hour
    rec.close()


def test_the_guard_adds_no_torch_call_and_no_host_transfer_to_an_ordinary_step(tmp_path):
    """Every torch function and tensor method `on_step_end` calls (a host sync is one of them: .cpu(), .item(),
    .tolist(), bool()), with the guard off and on: the same calls, so no sync and no device work is added."""

    class Calls(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    calls = {}
    for guard in ("off", "stop"):
        rec, model, opt = tiny_recorder(tmp_path / guard, guard=guard, stop_check_seconds=1.0)  # the default
        for step in range(1, 4):
            loss = model(torch.ones(2, 4))
            loss.backward()
            rec.on_backward(step, loss)
            opt.step()
            with Calls() as mode:
                rec.on_step_end(step)
            opt.zero_grad()
        calls[guard] = mode.names
        rec.close()
    assert calls["stop"] == calls["off"]
    assert calls["off"].count("cpu") == 1  # the step's one transfer


def test_a_kept_copy_survives_the_rotation_that_deletes_its_original(tmp_path):
    original = tmp_path / "checkpoint-20"
    original.mkdir()
    (original / "model.safetensors").write_bytes(b"weights")
    (original / "sub").mkdir()
    (original / "sub" / "state.json").write_text("{}")
    kept = keep_copy(tmp_path, original)
    again = keep_copy(tmp_path, original)  # a name already taken: a second copy beside it
    assert (kept.name, again.name) == ("checkpoint-20", "checkpoint-20.2")
    shutil.rmtree(original)  # what save_total_limit does
    assert (kept / "model.safetensors").read_bytes() == b"weights" and (kept / "sub" / "state.json").exists()


# ---------------------------------------------------------------- replay's resume command


def test_the_resume_command_is_the_command_as_typed_without_an_earlier_resume(tmp_path):
    path = str(tmp_path / "it's a $HOME run" / "checkpoint-20")
    manifest = {
        "config": {"training_args": {}},
        "world_size": 1,
        "argv": ["train.py", "--lr", "1e-3"],
        "orig_argv": ["python", "-m", "pkg.train", "--resume_from_checkpoint", "old", "--lr", "1e-3"],
    }
    resume = resume_command(manifest, path)
    assert shlex.split(resume["command"]) == [
        "python",
        "-m",
        "pkg.train",
        "--lr",
        "1e-3",
        "--resume_from_checkpoint",
        path,
    ]
    assert ast.literal_eval(resume["trainer"].removeprefix("trainer.train(resume_from_checkpoint=")[:-1]) == path
    # Several ranks: the launcher (torchrun, accelerate launch) is not in any rank's command line.
    many = resume_command({**manifest, "world_size": 2, "argv": ["train.py", "--resume_from_checkpoint=old"]}, path)
    assert shlex.split(many["command"]) == ["train.py", "--resume_from_checkpoint", path]


# ---------------------------------------------------------------- real runs

pytest_slow = pytest.mark.slow
GUARDED = dict(
    steps=40,
    save_steps=10,
    save_total_limit=2,
    lr=1e-3,
    batch_size=4,
    max_length=64,
    profile="prod",
    probe_every=0,
    generate_every=0,
    eval_every=0,
    guard="raise",
)


@pytest_slow
def test_a_trainer_run_that_goes_nan_is_stopped_kept_audited_and_resumed(tmp_path, tokenizer_cache):
    """NaN at step 30 under save_steps 10 and save_total_limit 2: the run stops at step 30 without saving it,
    checkpoint-20 survives (kept), train() raises, the audit fails at 30 and rolls back to checkpoint-20, whose
    kept copy resumes after the original is rotated out. The folder's name needs quoting in a shell."""
    from sftaudit.fixtures.train import train_hf

    run = tmp_path / "it's a $HOME run" / "out"
    with pytest.raises(TrainingHalted, match="training halted at step 30: the loss is nan"):
        train_hf(run, faults={"nan_at": 30}, tokenizer_cache=tokenizer_cache, **GUARDED)
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-20"]  # no checkpoint-30
    assert (run / "sftaudit/kept/checkpoint-20/model.safetensors").exists()
    steps = [json.loads(x)["step"] for x in (rank_dir(run, 0) / "steps.jsonl").read_text().splitlines()]
    assert steps[-1] == 30  # stopped within the step
    halted = events(run, "close")[0]["halted"]
    assert (halted["source"], halted["step"], halted["kept"]) == ("nonfinite_loss", 30, "sftaudit/kept/checkpoint-20")

    verdict = audit(run)
    assert verdict["verdict"] == "fail" and verdict["rollback_checkpoint"] == "checkpoint-20"
    assert {(f["code"], f["severity"]) for f in verdict["findings"] if f["step"] == 30} >= {
        ("LOOP-05", "fail"),
        ("LOOP-24", "warn"),
    }
    shutil.rmtree(run / "checkpoint-20")  # rotated out by a later save: the kept copy stands in
    doc = replay(run)
    assert doc["rollback_checkpoint"] == {"name": "checkpoint-20", "step": 20, "path": "sftaudit/kept/checkpoint-20"}
    kept = str(run / "sftaudit/kept/checkpoint-20")
    assert shlex.split(doc["resume"]["command"])[-2:] == ["--resume_from_checkpoint", kept]
    assert ast.literal_eval(doc["resume"]["trainer"].removeprefix("trainer.train(resume_from_checkpoint=")[:-1]) == kept
    assert doc["resume"]["skip_steps"] == list(range(21, 31))
    text = to_text(doc)
    assert f"--resume_from_checkpoint {shlex.quote(kept)}" in text and "skip the data of steps 21-30" in text

    train_hf(run, resume_from=kept, tokenizer_cache=tokenizer_cache, **GUARDED)  # the fault fixed
    after = audit(run)
    assert after["verdict"] == "pass", [f["message"] for f in after["findings"] if f["severity"] != "info"]


@pytest_slow
def test_the_clean_twin_under_the_guard_runs_untouched_and_passes(tmp_path, tokenizer_cache):
    from sftaudit.fixtures.train import train_hf

    run = train_hf(tmp_path / "clean", tokenizer_cache=tokenizer_cache, **GUARDED)
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-30", "checkpoint-40"]
    assert not (run / "sftaudit/kept").exists() and not events(run, "halted")
    assert "halted" not in events(run, "close")[0]
    assert audit(run)["verdict"] == "pass"


@pytest_slow
def test_a_plain_loop_stops_at_the_step_after_a_stop_request(tmp_path, tokenizer_cache):
    """The loop of docs/recording.md with a real model: the request written mid-run (as `sftaudit watch` does)
    turns `should_stop` true at the next step; the loop ends there and the close record says why."""
    from sftaudit.fixtures import build_model, build_tokenizer, collate, load_dataset

    tok = build_tokenizer(tokenizer_cache)
    model, rows = build_model(tok), load_dataset()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Recorder(tmp_path, model, tok, optimizer=opt, profile="prod", max_steps=20, guard="stop") as rec:
        for step in range(1, 21):
            batch = collate(tok, rows[4 * step : 4 * step + 4], 64)
            rec.on_batch(step, batch)
            loss = model(**{k: batch[k] for k in ("input_ids", "attention_mask", "labels")}).loss
            loss.backward()
            rec.on_backward(step, loss)
            opt.step()
            rec.on_step_end(step)
            opt.zero_grad()
            if rec.should_stop:
                break
            if step == 4:
                write_stop_request(tmp_path, "stop for the night")
                time.sleep(1.0)  # the guard looks at most once a second (stop_check_seconds)
    assert step == 5
    halted = events(tmp_path, "close")[0]["halted"]
    assert (halted["reason"], halted["step"], halted["anomaly_step"], halted["kept"]) == (
        "stop requested: stop for the night",
        5,
        None,
        None,
    )
    loop24 = [f for f in audit(tmp_path)["findings"] if f["code"] == "LOOP-24"]
    assert [(f["severity"], f["step"]) for f in loop24] == [("warn", 5)]
