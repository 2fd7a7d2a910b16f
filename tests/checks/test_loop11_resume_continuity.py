"""LOOP-11: a clean resume is silent; a resume that restarts the LR warmup, loses the weights, the
optimizer state or the data position is found at its first resumed step; so is a resume from a
checkpoint that fails LOOP-09. Multi-epoch runs in three data orders (cyclic, the Trainer's seeded
sampler, a seeded DataLoader shuffle with content-hashed ids); plain loop and Trainer."""

import json
import shutil

import numpy as np
import pytest

from sftaudit.checks.loop11_resume_continuity import epoch_starts, numbered_occurrences
from sftaudit.core.artifacts import rank_dir
from sftaudit.store.rundb import connect
from sftaudit.verdict.audit import audit

from ..shared import cached_audit, shared_dir
from .logged_runs import audited, falling, findings, logged, save_state
from .resume_runs import FAULTS, ORDERS, resume_runs


def loop11(verdict):
    return [f for f in verdict["findings"] if f["code"] == "LOOP-11"]


@pytest.fixture(scope="module")
def verdict(resumed_run):
    return audit(resumed_run)


def test_each_faulty_resume_is_found_at_its_first_step(verdict):
    found = {(f["step"], f["severity"], f["message"].split(" ")[1]) for f in loop11(verdict)}
    # Resumes at 11 (clean), 16 (warmup restarted), 21 (weights lost), 26 (data position lost).
    assert found == {(16, "fail", "learning"), (21, "fail", "weights"), (26, "fail", "resuming")}


def test_restarted_warmup(verdict):
    lr = next(f for f in loop11(verdict) if f["step"] == 16)
    assert lr["evidence"]["lr_before"] == pytest.approx(3e-3)
    assert lr["evidence"]["lr_after"] == pytest.approx(3e-3 * 2 / 5)  # LambdaLR warmup, first step again
    assert lr["checkpoint"] == "checkpoint-20"


def test_lost_weights_differ_from_the_checkpoint_fingerprint(verdict):
    lost = next(f for f in loop11(verdict) if f["step"] == 21)["evidence"]
    assert lost["source_checkpoint"] == "checkpoint-20" and lost["count"] == 21  # every tensor: a fresh model


def test_reread_data_names_the_samples_and_steps(verdict, resumed_run):
    reread = next(f for f in loop11(verdict) if f["step"] == 26)
    con = connect(resumed_run, read_only=True)
    try:
        # The lost data position restarts the epoch: steps 26-30 train the batches of steps 1-5 again.
        first_batches = con.execute(
            "SELECT flatten(list(sample_ids ORDER BY step)) FROM batches WHERE seg = 0 AND step <= 5"
        ).fetchall()[0][0]
    finally:
        con.close()
    assert reread["evidence"]["count"] == len(first_batches) == 40
    assert reread["evidence"]["sample_ids"] == first_batches
    assert reread["evidence"]["steps"] == [26, 27, 28, 29, 30]


def test_resume_from_a_checkpoint_that_fails_integrity(resumed_run, tmp_path):
    run = tmp_path / "resumed-copy"
    shutil.copytree(resumed_run, run)
    weights = run / "checkpoint-10" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    found = [f for f in loop11(audit(run)) if f["step"] == 11]
    assert len(found) == 1 and found[0]["severity"] == "fail"
    assert found[0]["evidence"]["source_checkpoint"] == "checkpoint-10"


def test_runs_never_resumed_are_silent(clean_run):
    assert loop11(cached_audit(clean_run)) == []


def test_resume_from_a_checkpoint_never_recorded(resumed_run, tmp_path):
    # As if checkpoint-10 had been written while the shim was off: the resume's source is unknown.
    run = tmp_path / "unrecorded"
    shutil.copytree(resumed_run, run, ignore=shutil.ignore_patterns("audit.duckdb"))
    records = rank_dir(run, 0) / "checkpoints.jsonl"
    lines = records.read_text().splitlines(keepends=True)
    records.write_text("".join(line for line in lines if json.loads(line)["path"] != "checkpoint-10"))
    found = [f for f in loop11(audit(run)) if f["step"] == 11]
    assert len(found) == 1 and found[0]["severity"] == "fail"
    assert found[0]["evidence"] == {"resume_step": 11, "checkpoint_name": "checkpoint-10"}


@pytest.fixture(scope="module")
def trainer_resumed_run(tmp_path_factory, tokenizer_cache):
    """A Trainer run (linear LR decay) resumed cleanly from checkpoint-10, then from checkpoint-5
    after it lost its scheduler.pt (the Trainer then starts a fresh schedule and optimizer)."""
    from sftaudit.fixtures.train import train_hf

    def build(folder):
        run = folder / "hf-resumed"
        train_hf(run, steps=12, save_steps=5, tokenizer_cache=tokenizer_cache)
        train_hf(run, steps=12, save_steps=5, tokenizer_cache=tokenizer_cache, resume_from=run / "checkpoint-10")
        (run / "checkpoint-5" / "scheduler.pt").unlink()
        train_hf(run, steps=12, save_steps=5, tokenizer_cache=tokenizer_cache, resume_from=run / "checkpoint-5")

    return shared_dir(tmp_path_factory, "hf-resumed", build) / "hf-resumed"


def test_trainer_resumes(trainer_resumed_run):
    found = loop11(audit(trainer_resumed_run))
    # The clean resume at step 11 is silent; the one at 6 jumps the LR back to its start, restarts
    # Adam and came from a checkpoint that fails LOOP-09 (no scheduler state).
    assert {f["step"] for f in found} == {6}
    lr = next(f for f in found if "learning rate" in f["message"])
    assert lr["evidence"]["lr_before"] == pytest.approx(2e-3) and lr["evidence"]["lr_after"] == pytest.approx(3e-3)
    source = next(f for f in found if "LOOP-09" in f["message"])
    assert source["evidence"]["source_checkpoint"] == "checkpoint-5" and "scheduler" in source["message"]
    # Without scheduler.pt the Trainer loads neither: the optimizer starts again too.
    optimizer = next(f for f in found if "optimizer state" in f["message"])
    assert optimizer["evidence"]["optimizer_step"] == 0 and optimizer["evidence"]["checkpoint_step"] == 5
    # LOOP-09's info (checkpoint-5 cannot resume exactly) bit here: one warn naming the part to save.
    [bit] = [f for f in found if f["category"] == "risk"]
    assert bit["severity"] == "warn" and bit["evidence"]["missing_state"] == ["scheduler"]
    assert bit["evidence"]["broke"] == ["learning rate", "optimizer state"]


def state_saver(drop: str):
    """checkpoint-N/ as the plain loop saves it (model.safetensors, training_state.pt), without `drop`."""
    import torch
    from safetensors.torch import save_file
    from sftaudit.fixtures.layouts import training_state, untied_state_dict

    def save(run, step, position):
        path = run.run_dir / f"checkpoint-{step}"
        path.mkdir(parents=True, exist_ok=True)
        save_file(untied_state_dict(run.model), str(path / "model.safetensors"))
        state = {k: v for k, v in training_state(run, step, position).items() if k != drop}
        torch.save(state, path / "training_state.pt")
        return path, state

    return save


@pytest.mark.parametrize("drop", ["scheduler", "rng_states"])
@pytest.mark.slow
def test_a_resume_from_a_checkpoint_lacking_state(drop, tmp_path, tokenizer_cache):
    """Resumed from checkpoint-5, saved without its scheduler (the warmup restarts: the risk bit, one
    warn) or without its RNG states (the seeded data order and dropout-free model continue exactly:
    LOOP-09's info alone, the run passes)."""
    from sftaudit.fixtures.train import train_plain

    options = dict(
        steps=8,
        checkpoint_every=5,
        saver=state_saver(drop),
        profile="prod",
        dataset_rows=16,
        batch_size=4,
        tokenizer_cache=tokenizer_cache,
    )
    run = train_plain(tmp_path / drop, **options)
    train_plain(run, resume_from=run / "checkpoint-5", **options)
    verdict = audit(run)
    risks = [
        (f["code"], f["severity"], f["step"], f["evidence"]["missing_state"])
        for f in verdict["findings"]
        if f["category"] == "risk"
    ]
    if drop == "scheduler":
        assert ("LOOP-11", "warn", 6, ["scheduler"]) in risks
        assert any(f["severity"] == "fail" and "learning rate" in f["message"] for f in loop11(verdict))
    else:
        assert risks == [("LOOP-09", "info", None, {"rng_states": ["checkpoint-5"]})]
        assert loop11(verdict) == [] and verdict["verdict"] == "pass", verdict["findings"]


# ---------------------------------------------------------------- multi-epoch runs, three orders


@pytest.fixture(scope="module", params=ORDERS)
def order_runs(request, tmp_path_factory, tokenizer_cache):
    return resume_runs(request.param, tmp_path_factory, tokenizer_cache)


def test_correct_resumes_audit_pass(order_runs):
    clean, verdict, _, _ = order_runs
    assert verdict["verdict"] == "pass", verdict["findings"]
    assert loop11(verdict) == []
    con = connect(clean, read_only=True)
    try:
        live = con.execute("SELECT seg, min(step), max(step) FROM steps GROUP BY seg ORDER BY seg").fetchall()
        abandoned = con.execute("SELECT seg, step FROM superseded_steps ORDER BY step").fetchall()
    finally:
        con.close()
    # Died a step past checkpoint-4 (its step 5 kept as superseded), resumed; stopped at checkpoint-8, resumed.
    assert live == [(0, 1, 4), (1, 5, 8), (2, 9, 9)] and abandoned == [(0, 5)]


def test_each_planted_fault_is_found_at_its_resume_step(order_runs):
    _, _, _, verdict = order_runs
    found = {f["step"]: f for f in loop11(verdict)}
    assert sorted(found) == sorted(FAULTS) and {f["severity"] for f in found.values()} == {"fail"}
    named = {9: "trained", 11: "trained", 13: "learning rate", 15: "weights", 17: "optimizer state"}
    for step, words in named.items():
        assert words in found[step]["message"], found[step]["message"]
    assert found[15]["evidence"]["source_checkpoint"] == "checkpoint-14"
    assert found[17]["evidence"]["optimizer_step"] == 0 and found[17]["evidence"]["checkpoint_step"] == 16


def test_restarted_data_names_the_samples_and_where_the_order_restarted(order_runs):
    _, _, faulty, verdict = order_runs
    data = next(f for f in loop11(verdict) if f["step"] == 9)["evidence"]
    # The resume from checkpoint-8 went back to the start of the epoch in progress.
    assert data["restarted_at"] == f"the start of epoch {data['current_epoch']}"
    assert data["restarted_at_step"] == data["epoch_started_at_step"]
    con = connect(faulty, read_only=True)
    try:
        resumed = con.execute("SELECT flatten(list(sample_ids ORDER BY step)) FROM batches WHERE step >= 9").fetchall()[
            0
        ][0]
        before = con.execute("SELECT flatten(list(sample_ids ORDER BY step)) FROM batches WHERE step < 9").fetchall()[
            0
        ][0]
    finally:
        con.close()
    # Everything this epoch had trained before the resume is trained again, in the same order.
    again = data["trained_this_epoch"]
    assert data["count"] == again > 0 and data["sample_ids"] == resumed[:again] == before[-again:]
    assert data["steps"][0] == 9 and all(r["last_trained_at"] < 9 for r in data["reread"])


def test_epochs_are_inferred_from_the_order():
    # 90 rows in a cyclic stream (epochs start mid-batch), 3.5 epochs.
    assert epoch_starts(np.arange(315) % 90).tolist() == [0, 90, 180, 270]
    # Seeded shuffles: a new permutation each epoch, the last partial.
    rng = np.random.default_rng(0)
    shuffled = np.concatenate([rng.permutation(90) for _ in range(3)] + [rng.permutation(90)[:40]])
    assert epoch_starts(shuffled).tolist() == [0, 90, 180, 270]
    # A duplicated row (same content hash): it comes back within each epoch without ending it.
    rows = np.r_[np.arange(9), 4]
    duplicated = np.concatenate([rng.permutation(rows) for _ in range(3)])
    assert epoch_starts(numbered_occurrences(duplicated, len(duplicated))).tolist() == [0, 10, 20]


@pytest.mark.slow
def test_a_trainer_resume_that_ignores_the_data_skip(tmp_path, tokenizer_cache):
    """The Trainer's own seeded sampler over 10 rows in batches of 4 (3 steps an epoch, the last
    partial): resumed from checkpoint-4 with `ignore_data_skip`, it trains epoch 2 from its start."""
    from sftaudit.fixtures.train import train_hf

    options = dict(
        save_steps=2,
        dataset_rows=10,
        batch_size=4,
        max_length=64,
        probe_every=0,
        generate_every=0,
        eval_every=0,
        tokenizer_cache=tokenizer_cache,
    )
    run = train_hf(tmp_path / "hf", steps=6, **options)
    train_hf(run, steps=6, resume_from=run / "checkpoint-4", trainer_options={"ignore_data_skip": True}, **options)
    found = loop11(audit(run))
    assert [(f["step"], f["severity"]) for f in found] == [(5, "fail")]
    data = found[0]["evidence"]
    assert data["restarted_at"] == "the start of epoch 2" and data["restarted_at_step"] == 4
    assert data["count"] == data["trained_this_epoch"] == 4


# ---------------------------------------------------------------------------- runs imported from their logs


def _imported_folder(run_dir, second_run: bool):
    """Checkpoints saved every 10 steps. `second_run`: a second training (its own first log, a loss 50% higher)
    saved checkpoint-10/20 over the first one's and stopped at 20; the first ran to 30. Else one run resumed
    from checkpoint-10 with its weights lost (the loss 50% higher from step 11), saving checkpoint-20 over the
    abandoned branch's and ending at 40; the abandoned branch's checkpoint-30 is left."""
    steps = np.arange(1, 41)
    loss, lr = falling(40, seed=3), [1e-4] * 40
    first = logged(steps[:30], loss[:30], lr)
    higher = logged(steps, loss * 1.5, lr)
    save_state(run_dir, "checkpoint-30", first, max_steps=40, save_steps=10)
    if second_run:
        for k in (10, 20):
            save_state(run_dir, f"checkpoint-{k}", higher[:k], max_steps=40, save_steps=10)
        return run_dir
    resumed = first[:10] + higher[10:]
    for k in (10, 20, 40):
        save_state(run_dir, f"checkpoint-{k}", resumed[:k], max_steps=40, save_steps=10)
    return run_dir


def test_two_runs_in_one_folder_are_never_read_as_a_resume_and_a_resume_of_one_still_is(tmp_path):
    """Two runs sharing a folder: no resume, nothing from LOOP-11 (the other run is named once by the import).
    The twin, one run resumed with its weights lost: LOOP-11 warns at the resume step that the loss jumped, and
    says that its source checkpoint (holding no weights now) cannot be checked, and that it lacked the state an
    exact resume needs (risks)."""
    two = audited(_imported_folder(tmp_path / "two", second_run=True))
    assert findings(two, "LOOP-11") == []
    assert any("1 other run's checkpoints share this folder" in n for n in two["resolution"]["notes"])
    resumed = audited(_imported_folder(tmp_path / "resumed", second_run=False))
    found = {(f["severity"], f["category"], f["step"]) for f in findings(resumed, "LOOP-11")}
    assert found == {("warn", "anomaly", 11), ("info", "risk", 11), ("warn", "risk", 11)}
    [jump] = [f for f in findings(resumed, "LOOP-11") if f["category"] == "anomaly"]
    assert "the loss jumped" in jump["message"]
    [source] = [f for f in findings(resumed, "LOOP-11") if f["severity"] == "info"]
    assert "from checkpoint-10 as the logs place it, which now fails LOOP-09" in source["message"]
