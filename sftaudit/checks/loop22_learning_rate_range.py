"""LOOP-22 learning rate outside any sane range for the optimizer."""

from __future__ import annotations

import numpy as np

from .base import AuditContext, CannotJudge, Check, Finding, positive
from .stats.rolling import column, run_config, step_frame

# The largest learning rate a fine-tune uses with each optimizer family, generously: Adam-style updates are
# about lr per element whatever the gradient's scale, so lr 0.1 moves every weight by ~0.1 per step (P-tuning
# prefixes train at 2e-2; LoRA rarely above 1e-3). SGD-style updates scale with the gradient: lr up to ~1 is used.
FAMILY_LIMITS = {"adam": 0.1, "sgd": 10.0}
ADAM_LIKE = (
    "adam",
    "lion",
    "adafactor",
    "lamb",
    "rmsprop",
    "ademamix",
    "galore",
    "apollo",
    "schedule_free",
    "adan",
    "came",
    "sophia",
    "muon",
)
SGD_LIKE = ("sgd", "lomo", "adagrad")
TRAINER_DEFAULT = "adamw_torch"
# Classes that wrap the optimizer that steps and say nothing of its family: accelerate's (every Trainer and TRL
# run, on transformers 4.45 as on 5), DeepSpeed's ZeRO and mixed-precision wrappers, torch's
# ZeroRedundancyOptimizer, Lightning's, the Trainer's layer-wise placeholder.
WRAPPERS = (
    "acceleratedoptimizer",
    "deepspeedoptimizerwrapper",
    "deepspeedzerooptimizer",
    "zeroredundancyoptimizer",
    "fp16_optimizer",
    "bf16_optimizer",
    "fp16_unfusedoptimizer",
    "lightningoptimizer",
    "layerwisedummyoptimizer",
)


def is_wrapper(name: str) -> bool:
    n = name.lower()
    return any(n.startswith(w) for w in WRAPPERS)


def optimizer_name(manifest: dict) -> tuple[str | None, bool]:
    """The optimizer the run stepped with, read through its wrappers, and whether it is assumed (an import: the
    Trainer's default, AdamW). The manifest's `optimizer` names its class (and, recorded through the wrappers,
    the class of the one inside: any `...class` key, nested or not); a wrapper's name is passed over for the
    wrapped class, else for the run's configured `optim`."""
    c = run_config(manifest)
    recorded = _recorded_classes(manifest.get("optimizer"))
    for value in (
        *[n for n in recorded if not is_wrapper(n)],
        c.get("optim"),
        c.get("optimizer"),
        c.get("optimizer_class"),
    ):
        if isinstance(value, str) and value and not is_wrapper(value):
            return value, False
    # Not on disk (an import), or hidden in a wrapper the run did not see into: the Trainer's default, as the
    # same run's logs are judged (a recorded run never judges less than its logs).
    if manifest.get("imported") or (recorded and all(is_wrapper(n) for n in recorded)):
        return TRAINER_DEFAULT, True
    return None, False


def _recorded_classes(optimizer) -> list[str]:
    """The class names the manifest's `optimizer` records, the innermost last: a string, or a dict whose keys
    ending in `class` name one (nested dicts: the optimizers it wraps)."""
    if isinstance(optimizer, str):
        return [optimizer]
    if not isinstance(optimizer, dict):
        return []
    names = [v for k, v in optimizer.items() if isinstance(v, str) and v and k.endswith("class")]
    for value in optimizer.values():
        if isinstance(value, dict):
            names += _recorded_classes(value)
    return names[::-1]


def optimizer_family(name: str) -> str | None:
    n = name.lower().replace("-", "_")
    if any(k in n for k in SGD_LIKE):
        return "sgd"
    if any(k in n for k in ADAM_LIKE):
        return "adam"
    return None


class LearningRateRange(Check):
    """Learning rate outside any sane range (trigger point: run start, from the logged learning rates).

    What it detects:
        A peak learning rate far above what any fine-tune uses with the optimizer logged (lr 5 with AdamW),
        or a learning rate that is 0 (or negative) at every logged step.
    Why it matters:
        An Adam-style update moves every weight by about lr per step whatever its gradient: at lr 5 the first
        update replaces the pretrained weights with noise (a QLoRA run at lr 5: loss 1.64 -> 11.8 at step 2).
        A learning rate of 0 trains nothing while everything else looks normal.
    Statistic:
        The largest logged learning rate against the optimizer family's limit: Adam-style (AdamW, Adafactor,
        Lion, LAMB, RMSprop, 8-bit and paged variants) 0.1; SGD-style (SGD, LOMO, Adagrad) 10. The optimizer is
        the manifest's, read through its wrappers (accelerate's AcceleratedOptimizer, which every Trainer and TRL
        run records, DeepSpeed's and torch's ZeRO, Lightning's): the wrapped class where recorded, else the
        Trainer's `optim`; an imported run's is not on disk and is taken to be the Trainer's default, AdamW (the
        message says so), as is a recorded run's that names only a wrapper (a hand-written accelerate loop
        without a config): a recorded run is judged on no less than its own logs would be.
    Threshold:
        Peak above the limit: warn; above 10x the limit: fail. Every logged learning rate <= 0: fail. No
        learning rate logged, or an optimizer of no known family: not judged. The finding is a configuration
        (the cause, stated once at run scope, with what to change); when the rate wrecks the run, the loss-curve
        checks date the anomaly (the loss jump) and fail the run, and this finding names its cause.
    Evidence:
        The peak learning rate and its step, the optimizer and whether it was assumed, its family's limit.
    """

    code = "LOOP-22"
    name = "learning-rate range"
    rules = {
        "zero-learning-rate": "the learning rate is 0 at every logged step",
        "peak-too-high": "the peak learning rate is above any sane range for the optimizer",
    }
    needs = ("steps",)
    defaults = {"adam_limit": positive(FAMILY_LIMITS["adam"]), "sgd_limit": positive(FAMILY_LIMITS["sgd"])}

    def run(self, ctx: AuditContext) -> list[Finding]:
        frame = step_frame(ctx, "lr")
        lr = column(frame, "lr")
        finite = np.isfinite(lr)
        if not finite.any():
            raise CannotJudge("no learning rate logged")
        steps = frame["step"].to_numpy()[finite]
        lr = lr[finite]
        if lr.max() <= 0:
            return [
                self.finding(
                    "zero-learning-rate",
                    "fail",
                    f"the learning rate is {lr.max():.3g} at every logged step ({lr.size}): nothing is trained; "
                    "check the scheduler (a warmup that never ends, a decay that starts at 0) and the optimizer's lr",
                    category="configuration",
                    value=float(lr.max()),
                    logged_steps=int(lr.size),
                )
            ]
        name, assumed = optimizer_name(ctx.manifest)
        if name is None:
            raise CannotJudge("the optimizer is not recorded (pass config={'optimizer': ...} to the Recorder)")
        family = optimizer_family(name)
        if family is None:
            raise CannotJudge(f"optimizer {name!r}: no known sane learning-rate range")
        limit = self.params[f"{family}_limit"]
        i = int(np.argmax(lr))
        peak = float(lr[i])
        if peak <= limit:
            return []
        wrapped = _recorded_classes(ctx.manifest.get("optimizer"))
        which = (
            name
            if not assumed
            else f"{name} (the Trainer's default: the optimizer is not on disk)"
            if ctx.manifest.get("imported")
            else f"{name} (the Trainer's default: the run recorded only its wrapper, {wrapped[0]})"
        )
        return [
            self.finding(
                "peak-too-high",
                "fail" if peak > 10 * limit else "warn",
                f"peak learning rate {peak:.3g} (step {steps[i]}) is above any sane range for {which}: "
                f"{'Adam-style' if family == 'adam' else 'SGD-style'} fine-tunes stay at or below {limit:g}, usually "
                f"1e-5..1e-3; lower it"
                + (" (was a value such as 5e-5 written as 5?)" if peak >= 1 and family == "adam" else ""),
                category="configuration",
                value=peak,
                peak_step=int(steps[i]),
                optimizer=name,
                optimizer_assumed=assumed,
                family=family,
                threshold=limit,
            )
        ]
