"""Real Trainer / TRL runs trained WITHOUT the shim (no callback), with planted faults, shared by the
import tests and LOOP-18's: each is trained once per invocation (a copy per worker), then audited from what it
left on disk.
Several independent faults share one training where their windows do not overlap."""

from __future__ import annotations

from pathlib import Path

from ..shared import shared_dir

GRAD_DROPPED = "model.layers.0.mlp.up_proj.weight"
SCALED = "model.layers.1.self_attn.v_proj.weight"
SCALED_WEIGHTS = "model.layers.0.self_attn.o_proj.weight"
TINY = dict(batch_size=2, max_length=64, record=False)

RUNS = {
    # logging_steps 5: a NaN at step 13 (hidden by logging_nan_inf_filter) lies in the logged window 11-15;
    # one tensor's gradient is dropped before every optimizer step; Adam's eps is large enough to dominate.
    "window": dict(
        steps=15,
        save_steps=5,
        logging_steps=5,
        trainer_options={"adam_epsilon": 0.05},
        faults={"nan_at": 13, "grad_dropped": GRAD_DROPPED},
    ),
    # logging_steps 1, checkpoints every 6 steps: one tensor's gradient x100 from step 8 (moment jump in 7-12),
    # a loss spike at step 11, a tensor's weights x10 at step 14 (movement in 13-18), a NaN at step 21.
    "exact": dict(
        steps=24,
        save_steps=6,
        logging_steps=1,
        faults={
            "grad_scale_from": {"step": 8, "tensor": SCALED, "factor": 100.0},
            "loss_scale_at": 11,
            "weights_scaled_at": {"step": 14, "tensor": SCALED_WEIGHTS},
            "nan_at": 21,
        },
    ),
    # TRL's SFTTrainer, nothing planted.
    "clean_trl": dict(steps=8, save_steps=4, logging_steps=1, trl=True),
}
_MADE: dict[str, Path] = {}


def posthoc_run(tmp_path_factory, tokenizer_cache, name: str) -> Path:
    """The run's output_dir, trained on first request (never imported here: tests import or audit it)."""
    from sftaudit.fixtures.train import train_hf

    if name not in _MADE:
        _MADE[name] = (
            shared_dir(
                tmp_path_factory,
                f"posthoc-{name}",
                lambda folder: train_hf(folder / name, tokenizer_cache=tokenizer_cache, **TINY, **RUNS[name]),
            )
            / name
        )
    return _MADE[name]


_AUDITED: dict[str, tuple[int, str, dict]] = {}


def audited(tmp_path_factory, tokenizer_cache, name: str) -> tuple[int, str, dict]:
    """(exit code, printed summary, verdict) of `sftaudit audit` on the run: imported, then audited, once."""
    import contextlib
    import io
    import json

    from sftaudit.cli import main

    if name not in _AUDITED:
        run = posthoc_run(tmp_path_factory, tokenizer_cache, name)
        out = tmp_path_factory.mktemp(f"posthoc-{name}-report")
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = main(["audit", str(run), "--out", str(out), "--no-report"])
        _AUDITED[name] = (code, printed.getvalue(), json.loads((out / "verdict.json").read_text(encoding="utf-8")))
    return _AUDITED[name]
