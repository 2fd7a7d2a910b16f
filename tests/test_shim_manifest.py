"""What the manifest says about the run that the analyzer cannot see otherwise: the optimizer that updates the
weights (through its wrappers), whether a non-finite step can have been skipped (a loss scaler), the probe
schedule fitted to the run's planned length, and libraries older than sftaudit supports."""

import json

import pytest
import torch
from sftaudit.fixtures import build_model, build_tokenizer, collate, load_dataset

from sftaudit.core.artifacts import rank_dir
from sftaudit.shim import Recorder
from sftaudit.shim.profiles import resolve_schedule


def records(run, kind):
    return [json.loads(line) for line in (rank_dir(run, 0) / f"{kind}.jsonl").read_text().splitlines()]


def manifest(run):
    return records(run, "manifest")[0]


def train(rec, model, tok, steps, opt, save_at=()):
    rows = load_dataset()[:4]
    for step in range(1, steps + 1):
        batch = collate(tok, rows, max_length=32)
        rec.on_batch(step, batch)
        loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
        loss.backward()
        rec.on_backward(step, loss)
        opt.step()
        rec.on_step_end(step, lr=opt.param_groups[0]["lr"])
        opt.zero_grad()
        if step in save_at:
            path = rec.run_dir / f"checkpoint-{step}"
            path.mkdir()
            (path / "state.txt").write_text(str(step))
            rec.on_checkpoint(step, path)


def test_the_optimizer_its_groups_and_no_loss_scaler(tmp_path, tokenizer_cache):
    """A warmup has set the group's lr to 0 when the recorder starts: `initial_lr` keeps the configured one."""
    tok = build_tokenizer(tokenizer_cache)
    model = build_model(tok)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda s: s / 10)
    Recorder(tmp_path, model, tok, optimizer=opt).close()
    recorded = manifest(tmp_path)
    assert {k: recorded["optimizer"][k] for k in ("class", "module", "wrappers")} == {
        "class": "AdamW",
        "module": "torch.optim.adamw",
        "wrappers": [],
    }
    [group] = recorded["optimizer"]["groups"]
    assert {k: group[k] for k in ("lr", "initial_lr", "betas", "eps", "weight_decay")} == {
        "lr": 0.0,
        "initial_lr": 3e-4,
        "betas": [0.9, 0.95],
        "eps": 1e-8,
        "weight_decay": 0.1,
    }
    assert group["numel"] == sum(p.numel() for p in model.parameters())
    assert recorded["loss_scaler"] == {"present": False, "skips_nonfinite_steps": False}
    assert recorded["unsupported_versions"] == {}


@pytest.mark.parametrize("enabled", [True, False])
def test_a_grad_scaler_given_skips_steps_only_when_enabled(tmp_path, tokenizer_cache, enabled):
    tok = build_tokenizer(tokenizer_cache)
    model = build_model(tok)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    Recorder(tmp_path, model, tok, optimizer=opt, grad_scaler=torch.amp.GradScaler("cpu", enabled=enabled)).close()
    assert manifest(tmp_path)["loss_scaler"] == {
        "present": True,
        "class": "GradScaler",
        "source": "recorder",
        "enabled": enabled,
        "skips_nonfinite_steps": enabled,
    }


def test_probe_intervals_fit_the_planned_length():
    """A profile's intervals are for long runs: an 80-step preprod run probes every 10 steps, not never."""
    assert {
        k: getattr(resolve_schedule("preprod", {}, 80), k) for k in ("probe_every", "generate_every", "eval_every")
    } == {
        "probe_every": 10,
        "generate_every": 10,
        "eval_every": 10,
    }
    long = resolve_schedule("preprod", {}, 100_000)
    assert (long.probe_every, long.generate_every, long.eval_every) == (50, 200, 200)
    given = resolve_schedule("preprod", {"eval_every": 40}, 80)
    assert (given.eval_every, given.generate_every) == (40, 10)  # an interval given stands as given
    off = resolve_schedule("prod", {}, 80)
    assert (off.probe_every, off.generate_every, off.eval_every) == (0, 0, 10)  # what a profile switches off stays off
    assert resolve_schedule("preprod", {}, 3).eval_every == 1


def test_a_short_run_is_probed_on_its_fitted_schedule_at_each_save_and_at_its_end(tmp_path, tokenizer_cache):
    """17 planned steps under the default profile: every 2 steps (17 // 8), at the save at step 5, at step 17."""
    tok = build_tokenizer(tokenizer_cache)
    model = build_model(tok)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    eval_set = [{"messages": [{"role": "user", "content": "2+2?"}], "reference": "4"}]
    options = dict(probe_prompts=["hi"], eval_set=eval_set, generations_per_prompt=1, max_new_tokens=2)
    with Recorder(tmp_path, model, tok, optimizer=opt, max_steps=17, **options) as rec:
        train(rec, model, tok, 17, opt, save_at=(5,))
    expected = [2, 4, 5, 6, 8, 10, 12, 14, 16, 17]
    for kind in ("probes", "generations", "evals"):
        assert [r["step"] for r in records(tmp_path, kind)] == expected, kind
    assert manifest(tmp_path)["schedule"]["eval_every"] == 2


def test_without_milestones_the_probes_keep_their_intervals(tmp_path, tokenizer_cache):
    tok = build_tokenizer(tokenizer_cache)
    model = build_model(tok)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Recorder(
        tmp_path, model, tok, optimizer=opt, max_steps=6, probe_prompts=["hi"], probe_every=4, probe_milestones=False
    ) as rec:
        train(rec, model, tok, 6, opt, save_at=(3,))
    assert [r["step"] for r in records(tmp_path, "probes")] == [4]


def test_a_shim_failure_is_one_line_on_stderr_and_no_python_warning(tmp_path, tokenizer_cache, capfd, recwarn):
    tok = build_tokenizer(tokenizer_cache)
    model = build_model(tok)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def broken_generate(*args, **kwargs):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0\nat sampling")

    model.generate = broken_generate
    with Recorder(tmp_path, model, tok, optimizer=opt, probe_prompts=["hi"], generate_every=1) as rec:
        train(rec, model, tok, 2, opt)
    assert [line for line in capfd.readouterr().err.splitlines() if "sftaudit" in line] == [
        "sftaudit: generations recording failed at step 1 and was switched off (RuntimeError: probability tensor "
        "contains either `inf`, `nan` or element < 0 at sampling); training goes on, further shim errors go to the "
        "run's events only"
    ]
    assert not [w for w in recwarn if "sftaudit" in str(w.message)]


def test_a_library_older_than_supported_is_named_once_at_start_and_recording_goes_on(
    tmp_path, tokenizer_cache, capfd, monkeypatch
):
    """The version read from the installed package's metadata, as the recorder reads it (transformers 4.44 has no
    on_pre_optimizer_step, so a run under it records no learning rate: the line says recording goes on)."""
    from sftaudit.shim import manifest as manifest_module

    installed = {**manifest_module.library_versions(), "transformers": "4.44.2"}
    monkeypatch.setattr(manifest_module, "library_versions", lambda: installed)
    tok = build_tokenizer(tokenizer_cache)
    model = build_model(tok)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(tmp_path, model, tok, optimizer=opt) as rec:
        train(rec, model, tok, 2, opt)
    assert [line for line in capfd.readouterr().err.splitlines() if "sftaudit" in line] == [
        "sftaudit: transformers 4.44.2 is older than 4.45, the oldest sftaudit supports: recording goes on with what "
        "it allows, and the audit names what it cannot judge; upgrade transformers to record and judge the whole run"
    ]
    assert manifest(tmp_path)["unsupported_versions"] == {
        "transformers": {"installed": "4.44.2", "oldest_supported": "4.45"}
    }
    assert len(records(tmp_path, "steps")) == 2


def test_the_audit_names_a_transformers_too_old_to_render_templates_and_judges_the_rest(
    tmp_path, tokenizer_cache, monkeypatch
):
    """transformers 4.44 has neither the compiled-template helpers nor `render_jinja_template`: the checks that
    render the chat template are not run, naming the version; the rest judge the run (no "bug in sftaudit")."""
    import transformers  # as sys.modules has it now (another test may have imported it afresh)
    import transformers.utils.chat_template_utils as chat_template_utils

    from sftaudit.dataset import render, sandbox
    from sftaudit.verdict.audit import audit

    tok = build_tokenizer(tokenizer_cache)
    model = build_model(tok)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Recorder(tmp_path, model, tok, optimizer=opt) as rec:
        train(rec, model, tok, 4, opt)
    monkeypatch.setattr(sandbox, "_internals", lambda: (None, None))
    monkeypatch.setattr(render, "_normalisers", lambda: None)
    monkeypatch.delattr(chat_template_utils, "render_jinja_template")
    monkeypatch.setattr(transformers, "__version__", "4.44.2")
    verdict = audit(tmp_path)
    assert verdict["check_errors"] == [] and verdict["verdict"] != "unjudged"
    status = {c["code"]: (c["status"], c["reason"] or "") for c in verdict["checks"]}
    for code in ("LOOP-01", "LOOP-02", "LOOP-04"):
        assert status[code][0] == "not_run" and "transformers 4.44.2 is older than 4.45" in status[code][1], code
    assert status["LOOP-05"][0] == "ran"


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "ddp"])
def test_deepspeed_optimizers_are_read_through_and_skip_overflowing_steps(distributed_runs, name):
    """Given the engine, the recorder reads the optimizer that steps (ZeRO's, around AdamW): DeepSpeed skips every
    step it finds an overflow in, whatever the dtype. DDP steps the optimizer it was given: no loss scaler."""
    for rank in (0, 1):
        recorded = json.loads((rank_dir(distributed_runs / name, rank) / "manifest.jsonl").read_text().splitlines()[0])
        assert recorded["optimizer"]["class"] == "AdamW"
        if name == "ddp":
            assert recorded["optimizer"]["wrappers"] == [] and recorded["loss_scaler"]["present"] is False
        else:
            assert recorded["optimizer"]["wrappers"][0].startswith("DeepSpeedZeroOptimizer")
            assert recorded["loss_scaler"]["source"] == "deepspeed" and recorded["loss_scaler"]["skips_nonfinite_steps"]
