"""Run folders as users have them (issue 26): a log two processes wrote at once, other loggers' key names,
checkpoint folders not named checkpoint-N, Git LFS pointers in place of the logs, the planned length and
vocabulary the import puts in the manifest, degenerate logs read without a numpy warning."""

from __future__ import annotations

import contextlib
import io
import json
import math
import warnings
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from sftaudit.cli import main
from sftaudit.imports import import_run
from sftaudit.imports.trainer import checkpoint_dirs

LFS_POINTER = (
    "version https://git-lfs.github.com/spec/v1\n"
    "oid sha256:408e0deacdea0c8618dba746a9b1f705959b06396fe4c8b3651d8fd7b030bd11\nsize 4419\n"
)


def _loss(step: int, branch: int = 0) -> float:
    return round(2.2 * math.exp(-step / 80) + 0.9 + 0.02 * math.sin(step * 2.7 + branch), 4)


def _clock(seconds: float) -> str:
    """LogCallback's elapsed_time (str of a timedelta)."""
    days, rest = divmod(int(seconds), 86400)
    text = f"{rest // 3600}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days} day{'s' if days > 1 else ''}, {text}" if days else text


def _line(step: int, loss: float, elapsed: float, total: int = 200) -> dict:
    return {
        "current_steps": step,
        "total_steps": total,
        "loss": loss,
        "lr": 1e-5 * (1 - step / total),
        "epoch": step / 100,
        "percentage": round(100 * step / total, 2),
        "elapsed_time": _clock(elapsed),
        "remaining_time": _clock(3 * (total - step)),
    }


def _two_writers(steps: range, start: float, branch: int) -> list[dict]:
    """Two processes logging the same steps into one file: each line twice (the second writer's loss off by
    the last rounded digit, its clock its own), the second writer a line behind from the middle on, and
    one line written twice over."""
    first = [_line(s, _loss(s, branch), start + 3 * i) for i, s in enumerate(steps)]
    second = [_line(s, round(_loss(s, branch) + 1e-4 * (i % 2), 4), start + 1 + 3 * i) for i, s in enumerate(steps)]
    half = len(first) // 2
    out = [x for pair in zip(first[:half], second[:half]) for x in pair]
    out += [first[half]] + [x for pair in zip(first[half + 1 :], second[half:]) for x in pair] + [second[-1]]
    return out[:5] + [out[4]] + out[5:]  # an exact duplicate


def _write_log(run: Path, lines: list[dict]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "trainer_log.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")


def _audit(run: Path, out: Path) -> tuple[int, str, str, dict]:
    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        code = main(["audit", str(run), "--out", str(out), "--no-report"])
    verdict_file = out / "verdict.json"
    verdict = json.loads(verdict_file.read_text(encoding="utf-8")) if verdict_file.is_file() else {}
    return code, printed.getvalue(), errors.getvalue(), verdict


def _manifest(run: Path) -> dict:
    return json.loads((run / "sftaudit" / "rank-0" / "manifest.jsonl").read_text(encoding="utf-8").splitlines()[0])


def _steps(run: Path) -> list[dict]:
    return pq.read_table(run / "sftaudit" / "rank-0" / "steps.parquet").to_pylist()


# ---------------------------------------------------------------------------- several writers of one log


def test_two_writers_of_one_log_are_one_run_not_a_resume(tmp_path):
    run = tmp_path / "run"
    lines = _two_writers(range(10, 201, 10), 0, 0)
    assert [x["current_steps"] for x in lines] != sorted(x["current_steps"] for x in lines)  # steps go back
    _write_log(run, lines)
    done = import_run(run)
    assert done["resumed_at"] is None and done["abandoned_steps"] == [] and done["steps"] == 20
    assert [s["step"] for s in _steps(run)] == list(range(10, 201, 10))
    assert all(s["loss"] == _loss(s["step"]) for s in _steps(run))  # the first writer's line of each step
    code, _, _, verdict = _audit(run, tmp_path / "out")
    assert not [f for f in verdict["findings"] if f["code"] == "LOOP-11"], verdict["findings"]
    assert verdict["check_errors"] == [] and code in (0, 1)


def test_a_resume_written_by_two_writers_stays_a_resume(tmp_path):
    """Both processes crash after step 150 and are started again from checkpoint-100: the new processes'
    clocks start again and their losses are their own; steps 110-150 of the first start are abandoned."""
    run = tmp_path / "run"
    _write_log(run, _two_writers(range(10, 151, 10), 0, 0) + _two_writers(range(110, 201, 10), 0, 1))
    done = import_run(run)
    assert done["resumed_at"] == 110 and done["abandoned_steps"] == [110, 120, 130, 140, 150]
    steps = _steps(run)
    assert [s["step"] for s in steps if s["seg"] == 1] == list(range(110, 201, 10))
    assert {s["step"]: s["loss"] for s in steps if s["seg"] == 1}[120] == _loss(120, 1)


def test_a_resume_without_clocks_is_told_by_its_steps(tmp_path):
    """Older logs without elapsed_time: a training log repeating its step is a restart."""
    run = tmp_path / "run"
    lines = [
        {k: v for k, v in _line(s, _loss(s, b), 0).items() if k != "elapsed_time"}
        for b, steps in enumerate((range(1, 31), range(21, 51)))
        for s in steps
    ]
    _write_log(run, lines)
    done = import_run(run)
    assert done["resumed_at"] == 21 and done["abandoned_steps"] == list(range(21, 31))


# ---------------------------------------------------------------------------- key aliases


def _state(history: list[dict], **fields) -> dict:
    return {
        "global_step": max(e["step"] for e in history),
        "max_steps": 60,
        "logging_steps": 1,
        "num_train_epochs": 1,
        "train_batch_size": 8,
        "log_history": history,
    } | fields


def _write_state(folder: Path, state: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "trainer_state.json").write_text(json.dumps(state), encoding="utf-8")


def test_other_loggers_key_names_are_read_as_the_trainers(tmp_path):
    """A custom trainer logging `lr`, and W&B-style `train/...`, `eval/...` keys: the learning rate, the loss,
    the gradient norm and the eval loss are the Trainer's own; LOOP-10 and LOOP-14 judge them."""
    run = tmp_path / "run"
    history = [
        {
            "step": s,
            "train/loss": _loss(s),
            "lr": 5e-5 * (1 - (s - 1) / 60),
            "train/grad_norm": 1.0 + 0.01 * (s % 3),
            "epoch": s / 60,
        }
        for s in range(1, 61)
    ]
    history += [{"step": s, "eval/loss": 1.2 - s / 600, "epoch": s / 60} for s in (20, 40, 60)]
    _write_state(run, _state(history))
    import_run(run)
    steps = _steps(run)
    assert len(steps) == 60 and steps[9]["lr"] == pytest.approx(5e-5 * (1 - 9 / 60)) and steps[9]["grad_norm"] == 1.01
    metrics = pq.read_table(run / "sftaudit" / "rank-0" / "metrics.parquet").to_pylist()
    assert [m["value"] for m in metrics if m["name"] == "eval_loss"] == [1.2 - s / 600 for s in (20, 40, 60)]
    code, _, _, verdict = _audit(run, tmp_path / "out")
    checks = {c["code"]: c for c in verdict["checks"]}
    assert (
        verdict["check_errors"] == [] and checks["LOOP-10"]["status"] == "ran" and checks["LOOP-14"]["status"] == "ran"
    )
    assert not [f for f in verdict["findings"] if f["code"] == "LOOP-14" and f["severity"] != "info"], verdict[
        "findings"
    ]


def test_the_trainers_own_key_wins_over_an_alias(tmp_path):
    run = tmp_path / "run"
    _write_state(
        run,
        _state(
            [{"step": s, "loss": _loss(s), "lr": 9.0, "learning_rate": 1e-5, "epoch": s / 60} for s in range(1, 11)],
            max_steps=10,
        ),
    )
    import_run(run)
    assert {s["lr"] for s in _steps(run)} == {1e-5}


# ---------------------------------------------------------------------------- checkpoint folders


def test_checkpoint_folders_by_other_names(tmp_path):
    """`last-checkpoint/` (a Hub push), `checkpoint_20/`, `best_checkpoint/`: checkpoints at their step; a
    named folder repeating a numbered one's step is that save, once; folders without a state are not."""
    run = tmp_path / "run"
    history = [{"step": s, "loss": _loss(s), "learning_rate": 1e-5, "epoch": s / 60} for s in range(1, 41)]
    _write_state(run, _state(history, global_step=40))
    for folder, step in (
        ("checkpoint_20", 20),
        ("last-checkpoint", 40),
        ("best_checkpoint", 30),
        ("checkpoint-30", 30),
    ):
        _write_state(run / folder, _state([e for e in history if e["step"] <= step], global_step=step))
    (run / "final_model").mkdir()
    (run / "final_model" / "config.json").write_text("{}", encoding="utf-8")
    assert [(s, p.name) for s, p in checkpoint_dirs(run)] == [
        (20, "checkpoint_20"),
        (30, "checkpoint-30"),
        (40, "last-checkpoint"),
    ]
    done = import_run(run)
    assert done["checkpoints"] == 3
    records = [json.loads(x) for x in (run / "sftaudit" / "rank-0" / "checkpoints.jsonl").read_text().splitlines()]
    assert [(r["step"], r["path"]) for r in records] == [
        (20, "checkpoint_20"),
        (30, "checkpoint-30"),
        (40, "last-checkpoint"),
    ]


# ---------------------------------------------------------------------------- planned length, vocabulary


def test_the_planned_length_comes_from_the_state_the_epochs_or_the_log(tmp_path):
    history = [{"step": s, "loss": _loss(s), "learning_rate": 1e-5, "epoch": s / 50} for s in range(5, 101, 5)]
    planned = {}
    for name, fields in (("max_steps", {"max_steps": 500}), ("epochs", {"max_steps": 0, "num_train_epochs": 3})):
        run = tmp_path / name
        _write_state(run, {k: v for k, v in _state(history, **fields).items() if k != "logging_steps"})
        import_run(run)
        planned[name] = (_manifest(run)["config"]["max_steps"], _manifest(run)["granularity"]["logging_steps"])
    run = tmp_path / "log"
    _write_log(run, [_line(s, _loss(s), s, total=6566) for s in range(10, 101, 10)])
    import_run(run)
    planned["log"] = (_manifest(run)["config"]["max_steps"], _manifest(run)["granularity"]["logging_steps"])
    # logging_steps as the log shows it when the state does not say it (older Trainers)
    assert planned == {"max_steps": (500, 5), "epochs": (150, 5), "log": (6566, 10)}


def _save_safetensors(path: Path, tensors: dict[str, tuple[int, ...]]) -> None:
    from safetensors.numpy import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: np.zeros(shape, dtype=np.float32) for k, shape in tensors.items()}, str(path))


@pytest.mark.parametrize(
    "saved, vocab",
    [
        ({"config.json": {"vocab_size": 32000}}, 32000),
        ({"config.json": {"model_type": "gemma3", "text_config": {"vocab_size": 262208}}}, 262208),
        ({"weights": {"model.embed_tokens.weight": (531, 8), "model.layers.0.mlp.up_proj.weight": (16, 8)}}, 531),
        ({"weights": {"base_model.model.model.layers.0.q_proj.lora_A.weight": (4, 8)}}, None),  # an adapter: not known
    ],
)
def test_the_vocabulary_size_comes_from_the_config_or_the_embedding_rows(tmp_path, saved, vocab):
    run = tmp_path / "run"
    history = [{"step": s, "loss": _loss(s), "learning_rate": 1e-5, "epoch": s / 60} for s in range(1, 11)]
    _write_state(run / "checkpoint-10", _state(history, max_steps=10))
    if "config.json" in saved:
        (run / "checkpoint-10" / "config.json").write_text(json.dumps(saved["config.json"]), encoding="utf-8")
    if "weights" in saved:
        _save_safetensors(run / "checkpoint-10" / "model.safetensors", saved["weights"])
    import_run(run)
    assert _manifest(run)["vocab_size"] == vocab


# ---------------------------------------------------------------------------- Git LFS pointers


def test_lfs_pointer_logs_are_named_once(tmp_path):
    """Event files a clone without git-lfs left as pointers, beside a readable trainer_state.json: the run is
    audited on the state, the pointers are said once (in the verdict's resolution notes), not skipped silently."""
    run = tmp_path / "run"
    _write_state(
        run,
        _state(
            [{"step": s, "loss": _loss(s), "learning_rate": 1e-5, "epoch": s / 60} for s in range(1, 31)], max_steps=30
        ),
    )
    for name in (
        "runs/Jan28_15-12-11_gpu07/events.out.tfevents.1674944078.gpu07.12415.0",
        "runs/Jan28_23-42-14_gpu07/events.out.tfevents.1674974582.gpu07.94170.0",
    ):
        (run / name).parent.mkdir(parents=True)
        (run / name).write_text(LFS_POINTER, encoding="utf-8")
    done = import_run(run)
    [said] = [n for n in _manifest(run)["notes"] if n["key"] == "lfs_pointers"]
    assert done["steps"] == 30 and said["text"] in done["notes"]
    assert said["text"].startswith("2 log file(s) (runs/Jan28_15-12-11_gpu07/events.out.tfevents")
    assert said["text"].endswith("Git LFS pointer, not the data: run `git lfs pull`")
    assert said["files"] == [
        "runs/Jan28_15-12-11_gpu07/events.out.tfevents.1674944078.gpu07.12415.0",
        "runs/Jan28_23-42-14_gpu07/events.out.tfevents.1674974582.gpu07.94170.0",
    ]
    code, _, errors, verdict = _audit(run, tmp_path / "out")
    assert verdict["resolution"]["notes"] == done["notes"] and errors == ""


def test_a_run_whose_logs_are_all_lfs_pointers_is_one_line_and_exit_2(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoint-10").mkdir(parents=True)
    for name in ("trainer_state.json", "checkpoint-10/trainer_state.json", "trainer_log.jsonl"):
        (run / name).write_text(LFS_POINTER, encoding="utf-8")
    code, printed, errors, _ = _audit(run, tmp_path / "out")
    assert code == 2 and len(errors.strip().splitlines()) == 1 and "run `git lfs pull`" in errors, errors
    assert "3 log file(s)" in errors


# ---------------------------------------------------------------------------- degenerate logs


@pytest.mark.parametrize(
    "history",
    [
        [{"step": 1, "loss": 2.0, "learning_rate": 1e-5}],  # one point
        [{"step": s, "loss": 1.5, "learning_rate": 0.0, "grad_norm": 0.0} for s in range(1, 30)],  # constant, LR 0
        [{"step": s, "loss": float("nan"), "grad_norm": float("nan")} for s in range(1, 30)],  # NaN throughout
        [{"step": s, "loss": 0.0, "learning_rate": 1e-5, "grad_norm": float("inf")} for s in range(1, 30)],
        [{"step": 10 * s, "loss": _loss(s), "lr": None, "epoch": None} for s in range(1, 30)],  # nulls
    ],
    ids=["one-point", "constant", "nan", "zero-inf", "nulls"],
)
def test_degenerate_logs_are_imported_and_resolved_without_a_numpy_warning(tmp_path, history):
    run = tmp_path / "run"
    _write_state(run, _state(history, max_steps=30))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, _, errors, verdict = _audit(run, tmp_path / "out")
    ours = [w for w in caught if "sftaudit" in w.filename and "/checks/" not in w.filename]
    assert ours == [], [f"{w.filename}:{w.lineno}: {w.message}" for w in ours]
    assert code in (0, 1, 2) and "SFTAUDIT_DEBUG" not in errors, errors


def test_a_prediction_log_is_said_to_be_no_training(tmp_path):
    """LLaMA-Factory's `do_predict`: its trainer_log.jsonl has progress lines only."""
    run = tmp_path / "run"
    _write_log(
        run, [{k: v for k, v in _line(s, 0.0, s).items() if k not in ("loss", "lr", "epoch")} for s in range(5, 51, 5)]
    )
    code, _, errors, _ = _audit(run, tmp_path / "out")
    assert code == 2 and len(errors.strip().splitlines()) == 1
    assert "10 record(s) without a loss or an eval number: a prediction or evaluation run" in errors, errors


def test_tensorboard_alone_gives_the_plan_and_the_vocabulary_from_its_texts(tmp_path):
    """The Trainer's TensorBoardCallback writes the run's arguments and the model config as text summaries;
    a final evaluation in a writer of its own continues the run (no restart)."""
    pytest.importorskip("tensorboard")
    from types import SimpleNamespace

    from transformers import LlamaConfig, TrainerControl, TrainerState, TrainingArguments
    from transformers.integrations import TensorBoardCallback

    run = tmp_path / "run"
    args = TrainingArguments(
        output_dir=str(run), report_to=["tensorboard"], use_cpu=True, num_train_epochs=4, logging_steps=5
    )
    model = SimpleNamespace(
        config=LlamaConfig(
            vocab_size=531, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4
        )
    )
    callback, state = TensorBoardCallback(), TrainerState()
    callback.on_train_begin(args, state, TrainerControl(), model=model)
    for step in range(5, 101, 5):
        state.global_step = step
        callback.on_log(
            args, state, TrainerControl(), logs={"loss": _loss(step), "learning_rate": 1e-4, "epoch": step / 50}
        )
    callback.on_train_end(args, state, TrainerControl())
    final = TensorBoardCallback()  # trainer.evaluate() after training, as a later writer
    final.on_train_begin(args, state, TrainerControl())
    final.on_log(args, state, TrainerControl(), logs={"eval_loss": 1.1, "epoch": 2.0})
    final.on_train_end(args, state, TrainerControl())
    done = import_run(run)
    assert done["resumed_at"] is None and done["steps"] == 20
    manifest = _manifest(run)
    assert manifest["config"]["max_steps"] == 200 and manifest["vocab_size"] == 531  # 4 epochs x 50 steps
    assert manifest["granularity"]["logging_steps"] == 5
