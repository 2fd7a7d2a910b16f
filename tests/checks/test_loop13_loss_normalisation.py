"""LOOP-13: a mean of micro-batch means (Z22), a logged loss x GA (Z23) and a NaN step the Trainer's
logging filter hides (Z18) are found at their step; correctly normalised runs stay quiet."""

import numpy as np
import pytest

from sftaudit.store.ingest import ingest
from sftaudit.store.rundb import connect
from sftaudit.verdict.audit import audit

from ..conftest import NAN_STEP
from ..shared import cached_audit, shared_dir
from .dynamics_runs import MEAN_OF_MEANS_STEP, of, recorded_loop, run

HF_NAN_STEP = 4
GA = 4


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory, tokenizer_cache):
    """A real Trainer with its default logging_nan_inf_filter, GA 4 (num_items_in_batch passed to the
    model), the logged loss multiplied by GA (Z23) and a NaN loss at HF_NAN_STEP (Z18)."""
    from sftaudit.fixtures.train import train_hf

    return (
        shared_dir(
            tmp_path_factory,
            "hf-loss",
            lambda folder: train_hf(
                folder / "hf-loss",
                steps=6,
                grad_accum=GA,
                batch_size=2,
                save_steps=100,
                tokenizer_cache=tokenizer_cache,
                probe_every=0,
                generate_every=0,
                eval_every=0,
                faults={"logged_loss_times_accumulation": True, "nan_at": HF_NAN_STEP},
            ),
        )
        / "hf-loss"
    )


def test_mean_of_micro_batch_means_fails_at_its_step_naming_the_over_weighted_samples(runs):
    verdict = audit(run(runs, "mean_of_means"))
    [finding] = of(verdict, "LOOP-13")
    assert (finding["severity"], finding["step"]) == ("fail", MEAN_OF_MEANS_STEP)  # steps 1-4 token-mean: quiet
    evidence = finding["evidence"]
    assert evidence["convention"] == "mean of micro-batch means" and "mean of micro-batch means" in finding["message"]
    micro = evidence["micro_batches"]
    assert len(micro) == 4 and evidence["value"] > 0.01
    # The most over-weighted micro-batch is the one with the fewest target tokens; its samples are named.
    fewest = min(micro, key=lambda m: m["target_tokens"])
    assert max(micro, key=lambda m: m["relative_error"]) == fewest
    assert len(evidence["over_weighted_samples"]) == 4 and all(
        s["sample_id"].startswith("s") for s in evidence["over_weighted_samples"]
    )


def test_trainer_with_accumulation_is_normalised_but_its_logged_loss_is_ga_times_too_big(trainer_run):
    verdict = audit(trainer_run)
    findings = of(verdict, "LOOP-13")
    assert not [f for f in findings if "weights tokens unequally" in f["message"]]
    logged = next(f for f in findings if "logged training loss" in f["message"])
    assert (logged["severity"], logged["step"]) == ("fail", 1)
    assert logged["evidence"]["ratio"] == pytest.approx(GA, rel=1e-3) and "gradient-accumulation" in logged["message"]


def test_the_step_loss_is_the_models_token_mean_over_the_accumulation_window(trainer_run, tokenizer_cache):
    """Each micro-batch's loss is a sum over num_items_in_batch tokens (1/GA of the window's mean each): the step's
    loss is their token mean, recomputed here from step 1's recorded rows with the untrained model."""
    import torch
    from sftaudit.fixtures import build_model, build_tokenizer

    ingest(trainer_run)
    con = connect(trainer_run, read_only=True)
    recorded = con.execute("SELECT loss FROM steps WHERE step = 1").fetchone()[0]
    micro = con.execute(
        "SELECT micro, list(input_ids ORDER BY row), list(labels ORDER BY row), list(attention_mask ORDER BY row) "
        "FROM samples WHERE step = 1 GROUP BY micro ORDER BY micro"
    ).fetchall()
    assert len(micro) == GA
    model = build_model(build_tokenizer(tokenizer_cache))
    summed = tokens = 0.0
    with torch.no_grad():
        for _, ids, labels, mask in micro:
            logits = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
            targets = torch.tensor(labels)[:, 1:]
            summed += float(torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), targets, reduction="sum"))
            tokens += int((targets != -100).sum())
    assert recorded == pytest.approx(summed / tokens, rel=1e-4)


def test_nan_hidden_by_the_trainers_logging_filter_is_found_at_its_step(trainer_run):
    verdict = audit(trainer_run)
    hidden = next(f for f in of(verdict, "LOOP-13") if "logging_nan_inf_filter" in f["message"])
    assert (hidden["severity"], hidden["step"]) == ("fail", HF_NAN_STEP)
    assert isinstance(hidden["evidence"]["logged"], float)  # the Trainer logged a finite number there
    assert any(f["step"] == HF_NAN_STEP for f in of(verdict, "LOOP-05"))
    assert verdict["first_anomalous_step"] == 1  # the logged-loss scale finding comes first


def test_clean_and_failed_plain_runs_raise_nothing(clean_run, nan_run):
    assert of(cached_audit(clean_run), "LOOP-13") == []
    # The plain loop logs no trainer loss: a NaN step is LOOP-05's, not a hidden one.
    assert of(cached_audit(nan_run), "LOOP-13") == [] and NAN_STEP


def test_a_loss_computed_outside_the_model_is_not_run_saying_why(tmp_path, tokenizer_cache):
    import torch

    def token_mean_outside(model, batch):  # the model gets no labels: it returns logits only
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), batch["labels"][:, 1:])

    verdict = audit(recorded_loop(tmp_path / "custom", tokenizer_cache, loss=token_mean_outside))
    assert of(verdict, "LOOP-13", ("info", "warn", "fail")) == []
    [status] = [c for c in verdict["checks"] if c["code"] == "LOOP-13"]
    assert status["status"] == "not_run" and "custom loss" in status["reason"] and "labels" in status["reason"]


def test_a_first_loss_far_above_a_uniform_guess_warns_at_step_1(tmp_path, tokenizer_cache):
    verdict = audit(
        recorded_loop(tmp_path / "hot-head", tokenizer_cache, break_model=lambda m: m.lm_head.weight.mul_(300))
    )
    [finding] = [f for f in of(verdict, "LOOP-13") if "uniform guess" in f["message"]]
    assert (finding["severity"], finding["step"]) == ("warn", 1)
    assert (
        finding["evidence"]["value"]
        > finding["evidence"]["threshold"]
        == pytest.approx(2 * np.log(finding["evidence"]["vocab_size"]))
    )


def _hf(tmp_path_factory, tokenizer_cache, name, **options):
    from sftaudit.fixtures.train import train_hf

    return train_hf(
        tmp_path_factory.mktemp(name) / name,
        steps=4,
        grad_accum=GA,
        batch_size=2,
        save_steps=100,
        max_length=64,
        tokenizer_cache=tokenizer_cache,
        probe_every=0,
        generate_every=0,
        eval_every=0,
        **options,
    )


@pytest.mark.slow
def test_a_loss_not_divided_by_accumulation_is_found_though_logged_and_trained_agree(tmp_path_factory, tokenizer_cache):
    """Planted: the installed Trainer made to behave as transformers 4.47 does with a model whose forward takes
    no **kwargs (GPT-2): no num_items_in_batch, no division by GA. Each micro-batch backpropagates its own mean,
    and the logged loss is their sum: GA x the token mean, and the gradients with it."""
    verdict = audit(_hf(tmp_path_factory, tokenizer_cache, "hf-ga-bug", faults={"ga_loss_not_divided": True}))
    logged = next(f for f in of(verdict, "LOOP-13") if "logged training loss" in f["message"])
    assert (logged["severity"], logged["step"]) == ("fail", 1)
    evidence = logged["evidence"]
    assert evidence["ratio"] == pytest.approx(GA, rel=0.1) and evidence["objective_scaled"]
    assert evidence["objective_ratio"] == pytest.approx(evidence["ratio"], rel=0.02)
    assert "gradients are scaled" in logged["message"] and "GPT-2" in logged["message"]


@pytest.mark.slow
def test_an_objective_ga_times_the_loss_is_found_though_the_log_shows_the_loss(tmp_path_factory, tokenizer_cache):
    """Planted: transformers 4.46 with a model whose forward takes no **kwargs: each backward gets its whole
    micro-batch mean (the objective is GA x the trained loss), while the log shows their mean, the trained loss.
    The log agrees, so only the objective names the scale."""
    faults = {"ga_loss_not_divided": True, "logged_loss_over_accumulation": True}
    verdict = audit(_hf(tmp_path_factory, tokenizer_cache, "hf-ga-446", faults=faults))
    assert not [f for f in of(verdict, "LOOP-13") if "logged training loss" in f["message"]]
    objective = next(f for f in of(verdict, "LOOP-13") if "backpropagated objective" in f["message"])
    assert (objective["severity"], objective["step"]) == ("fail", 1)
    assert objective["evidence"]["objective_ratio"] == pytest.approx(GA, rel=0.02)
    assert (
        f"= {GA} x the trained loss" in objective["message"] and "gradient-accumulation steps" in objective["message"]
    )
    assert "transformers 4.46" in objective["message"] and "looks right" in objective["message"]


@pytest.mark.slow
def test_the_clean_accumulating_trainer_twin_is_quiet(tmp_path_factory, tokenizer_cache):
    run = _hf(tmp_path_factory, tokenizer_cache, "hf-ga-clean")
    verdict = audit(run)
    assert of(verdict, "LOOP-13") == []
    assert [c["status"] for c in verdict["checks"] if c["code"] == "LOOP-13"] == ["ran"]
    # With accumulation the norms are read after the window's last backward: pre-clip, as the Trainer's total
    con = connect(run, read_only=True)
    rows = con.execute(
        "SELECT s.grad_norm, m.value, s.grad_norm_source FROM steps s JOIN metrics m "
        "ON m.step = s.step AND m.name = 'grad_norm'"
    ).fetchall()
    con.close()
    assert len(rows) == 4 and all(pre == pytest.approx(total, rel=1e-5) and src is None for pre, total, src in rows)


@pytest.mark.slow
def test_trl_computing_its_own_loss_is_judged_through_its_log_probs(tmp_path_factory, tokenizer_cache):
    """TRL >= 1.15 computes the loss from its fused LM head's log-probs: the model's `loss` never reaches
    backward. The weights come from the log-probs' gradient, so a planted logged loss x GA is still found."""
    import trl

    run = _hf(tmp_path_factory, tokenizer_cache, "trl-loss", trl=True, faults={"logged_loss_times_accumulation": True})
    ingest(run)
    con = connect(run, read_only=True)
    weights = con.execute(
        "SELECT step, sum(loss_weight), count(loss_weight), count(*) FROM batches GROUP BY step ORDER BY step"
    ).fetchall()
    con.close()
    # Every micro-batch weighted; a window's weights sum to 1 (a token mean over the window)
    assert all(n == total == GA and w == pytest.approx(1.0, rel=1e-5) for _, w, n, total in weights), (
        trl.__version__,
        weights,
    )
    verdict = audit(run)
    [status] = [c for c in verdict["checks"] if c["code"] == "LOOP-13"]
    assert status["status"] == "ran"
    assert not [f for f in of(verdict, "LOOP-13") if "weights tokens unequally" in f["message"]]
    logged = next(f for f in of(verdict, "LOOP-13") if "logged training loss" in f["message"])
    assert logged["step"] == 1 and logged["evidence"]["ratio"] == pytest.approx(GA, rel=1e-3)
    assert not logged["evidence"]["objective_scaled"]
