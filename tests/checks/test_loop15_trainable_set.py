"""LOOP-15: layers without gradients under reentrant checkpointing (Z26), a module declared trainable
but frozen (Z27) and stale gradients (Z29) are found at their step; clean runs stay quiet."""

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sftaudit.verdict.audit import audit

from .dynamics_runs import STALE_STEP, of, run


def test_reentrant_checkpointing_and_a_frozen_declared_module_fail(runs):
    findings = of(audit(run(runs, "trainable_set")), "LOOP-15")
    declared = next(f for f in findings if "declared" in f["message"])
    assert (declared["severity"], declared["step"]) == ("fail", 1)
    assert declared["evidence"]["tensors"] == ["lm_head.weight"]
    starved = next(f for f in findings if "no gradient" in f["message"])
    assert (starved["severity"], starved["step"]) == ("fail", 3)  # min_steps = 3 steps in a row
    tensors = {t["tensor"] for t in starved["evidence"]["tensors"]}
    assert "model.layers.0.self_attn.q_proj.weight" in tensors and "model.layers.1.mlp.down_proj.weight" in tensors
    assert not any(t.startswith(("model.norm", "model.embed_tokens", "lm_head")) for t in tensors)
    assert not [f for f in findings if "bit-identical" in f["message"]]


def test_stale_gradients_fail_at_their_first_step_naming_the_layer(runs):
    [finding] = of(audit(run(runs, "stale_grads")), "LOOP-15")
    assert (finding["severity"], finding["step"]) == ("fail", STALE_STEP)
    tensors = [t["tensor"] for t in finding["evidence"]["tensors"]]
    assert tensors and all(t.startswith("model.layers.1.") for t in tensors)
    assert finding["evidence"]["steps_affected"] == 8 - STALE_STEP + 1


def test_clean_and_failed_runs_raise_nothing(clean_run, nan_run):
    for run_dir in (clean_run, nan_run):
        assert of(audit(run_dir), "LOOP-15") == []


def _series(tmp_path, name, stale=(), chance_cells=0, steps=10_000, tensors=200, seed=15):
    """A 2-million-norm recorded series (float32 norms varying ~15% a step, as the synthetic benchmark's);
    `chance_cells` isolated equal neighbours stand for what chance gives at 10^8 norms; `stale`:
    (first step, tensors, steps) blocks of norms repeated from the step before."""
    import numpy as np

    from .dynamics_runs import recorded_series_run

    rng = np.random.default_rng(seed)
    scale = np.exp(rng.normal(-3, 1.0, tensors))
    norms = (scale * np.exp(0.15 * rng.standard_normal((steps, tensors)))).astype(np.float32).astype(np.float64)
    for step, tensor in zip(rng.integers(100, steps, chance_cells), rng.integers(0, tensors, chance_cells)):
        norms[step - 1, tensor] = norms[step - 2, tensor]
    for first, which, length in stale:
        norms[first - 1 : first - 1 + length, which] = norms[first - 2, which]
    names = [f"model.layers.{i // 8}.block.{i % 8}.weight" for i in range(tensors)]
    lr = [1e-4] * steps
    loss = (2.0 + 0.01 * rng.standard_normal(steps)).tolist()
    return recorded_series_run(tmp_path / name, lr, loss, norms, names)


def test_isolated_equal_norms_chance_explains_at_scale_stay_quiet(tmp_path):
    """12 single equal neighbours among 2 million norms: about what chance gives at 10^8 float32
    norms (the synthetic 1,000-tensor benchmark's false fail), so no finding."""
    findings = [
        f for f in of(audit(_series(tmp_path, "chance", chance_cells=12)), "LOOP-15") if "bit-identical" in f["message"]
    ]
    assert findings == []


def test_a_stale_buffer_among_chance_equalities_fails_at_its_step(tmp_path):
    """The same run with chance equalities, plus a reused buffer: 3 tensors repeat step 7,199's norm for
    3 steps. Chance does not explain it: a fail at 7,200 naming those tensors; the chance ones stay out."""
    run_dir = _series(tmp_path, "stale", chance_cells=12, stale=[(7_200, [40, 41, 42], 3)])
    [finding] = [f for f in of(audit(run_dir), "LOOP-15") if "bit-identical" in f["message"]]
    assert (finding["severity"], finding["step"]) == ("fail", 7_200)
    assert [t["tensor"] for t in finding["evidence"]["tensors"]] == [
        "model.layers.5.block.0.weight",
        "model.layers.5.block.1.weight",
        "model.layers.5.block.2.weight",
    ]
    assert finding["evidence"]["steps_affected"] == 3
    assert finding["evidence"]["chance_expected"] < finding["evidence"]["threshold"]


def test_one_tensor_repeated_twice_is_beyond_chance_too(tmp_path):
    run_dir = _series(tmp_path, "single", stale=[(5_000, [7], 2)])
    [finding] = [f for f in of(audit(run_dir), "LOOP-15") if "bit-identical" in f["message"]]
    assert (finding["step"], finding["evidence"]["tensor_count"]) == (5_000, 1)


@settings(max_examples=40, deadline=None)
@example(seed=1, tensors=2, levels=0, cuts=[900] + [100] * 39, open_steps=0, rises=True)
@given(
    seed=st.integers(0, 2**32 - 1),
    tensors=st.integers(1, 4),
    levels=st.sampled_from([0, 5, 40]),  # 0: continuous norms; else norms from so many values (ties, equal neighbours)
    cuts=st.lists(st.integers(1, 900), min_size=1, max_size=40),
    open_steps=st.integers(0, 300),
    rises=st.booleans(),
)
def test_the_carried_smallest_changes_give_a_fresh_audits_change_densities(
    seed, tensors, levels, cuts, open_steps, rises
):
    """Audits as the run grows, each carrying the sorted smallest closed changes to the next (judged whole when
    they fall short, as the check does): each one's change densities, counts and kept smallest equal a fresh
    audit's, and the kept ones are the true smallest of the closed changes. The run grows past a quarter of
    what was kept, so the carried ones fall short too; `rises`: the norms vary ten times more after the first audit
    (few new changes among the kept smallest, which a kept list widened with new changes got wrong)."""
    from sftaudit.checks.loop15_trainable_set import _stale_cells

    rng = np.random.default_rng(seed)
    steps = sum(cuts) + open_steps + 2
    noise = np.where(rises & (np.arange(steps) > cuts[0]), 1.5, 0.15)
    norms = np.exp(noise * rng.standard_normal((tensors, steps))).astype(np.float32)
    if levels:
        norms = rng.choice(norms[:, :levels].ravel(), size=norms.shape)
    norms[rng.random(norms.shape) < 0.02] = np.nan
    norms[rng.random(norms.shape) < 0.02] = 0.0
    consecutive = np.ones(steps - 1, dtype=bool)
    none = (np.zeros(tensors, dtype=np.int64), np.zeros((tensors, 0), dtype=np.float32))
    carried, closed_pairs = none, 0
    for closing in np.cumsum(cuts):
        end = closing + 1 + open_steps  # the audit sees the steps past what it closes too
        fresh = _stale_cells(0, norms[:, :end], consecutive[: end - 1], 0, closing, none)
        grown = _stale_cells(0, norms[:, :end], consecutive[: end - 1], closed_pairs, closing, carried)
        if grown[-1]:  # short: judged whole
            grown = fresh
        np.testing.assert_array_equal(grown[4], fresh[4])  # density
        np.testing.assert_array_equal(grown[2], fresh[2])  # closed count
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = np.abs(norms[:, 1 : closing + 1] / norms[:, :closing] - 1).astype(np.float32)
            before, after = norms[:, :closing], norms[:, 1 : closing + 1]
            usable = np.isfinite(ratio) & (before > 0) & (after > 0) & (before != after)
        truth = np.sort(np.where(usable, ratio, np.inf), axis=1)
        kept = grown[3]
        width = min(kept.shape[1], truth.shape[1])
        np.testing.assert_array_equal(kept[:, :width], truth[:, :width])
        assert np.isinf(kept[:, width:]).all()
        carried, closed_pairs = (grown[2], kept), closing
