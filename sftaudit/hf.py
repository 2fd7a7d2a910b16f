"""Hugging Face `Trainer` / TRL `SFTTrainer` integration: one callback, no other change to user code.

The Trainer hands callbacks no batch, so the callback sees each micro-batch through
a forward pre-hook on the model (registered ``with_kwargs=True``: it sees every
``model(**inputs)`` call; eval-mode calls are skipped) and each micro-batch's loss
through a forward hook. The Trainer clips the gradients right after the last
backward, before any callback (``on_pre_optimizer_step`` comes after the clip, in
4.45 as in 5.x), so the per-tensor norms are read at the end of each backward pass
(an autograd final callback queued from the forward's output: pre-clip, after DDP's
reduction; ``grad_norm_source = "pre_clip"``, ``grad_norm_read = "backward_end"``),
and again in ``on_pre_optimizer_step``, after the clip (``grad_norms_post_clip``,
what the optimizer stepped with). Both reach the host in the step's one transfer.
The Trainer's own pre-clip total reaches ``on_log`` and is stored as the metric
``grad_norm``. Under DeepSpeed, accelerate
runs the optimizer step inside ``backward``: the gradients are read at the start of
the ZeRO optimizer's step instead, pre-clip (not run here: accelerate selects
DeepSpeed only with GPUs). A collator may add
``sample_ids`` to the batch: the pre-hook records and removes them before the
model sees them (set ``remove_unused_columns=False`` so the ids reach the collator).

With ``guard="stop"`` (or ``"raise"``) the recorder's guard (`sftaudit.shim.guard`) decides at the step's
``on_optimizer_step``; the callback's ``on_step_end``, which runs after the Trainer's own flow callback and before
the Trainer logs, evaluates and saves, then sets ``control.should_training_stop`` and, for a step at or after the
first bad one, turns ``control.should_save`` off (again at ``on_epoch_end``, which the Trainer calls once more on
its way out): the step-30 checkpoint of a run that went NaN at step 30 is never written, so it never rotates the
last good one out of ``save_total_limit``. With ``"raise"``, ``on_train_end`` raises `TrainingHalted`: the
``trainer.train()`` call does not return as if training had completed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from .shim.guard import TrainingHalted
from .shim.pieces.deepspeed import read_before_step, zero_optimizer
from .shim.recorder import Recorder


class SFTAuditCallback(TrainerCallback):
    """``trainer.add_callback(SFTAuditCallback(run_dir))``; run_dir defaults to ``args.output_dir``.

    Keyword options are passed to `sftaudit.shim.Recorder` (profile, probe_prompts, eval_set,
    dataset, schedule overrides, ``guard="stop"`` or ``"raise"``, stop_check_seconds).
    """

    def __init__(self, run_dir: str | Path | None = None, **recorder_options: Any):
        self.run_dir = run_dir
        self.options = recorder_options
        self.recorder: Recorder | None = None
        self._state = None
        self._lr: float | None = None
        self._handles: list[Any] = []
        self._reads_in_step = False

    # -- lifecycle

    def on_train_begin(
        self, args, state, control, model=None, processing_class=None, tokenizer=None, lr_scheduler=None, **kwargs
    ):
        if self.recorder is not None or model is None:
            return
        options = dict(self.options)
        options.setdefault("tokenizer", processing_class if processing_class is not None else tokenizer)
        # max_steps as the Trainer resolved it (from epochs when args.max_steps is -1): the LR schedule's length,
        # and the plan a run that stopped early fell short of.
        options.setdefault("config", {"training_args": args.to_dict()})
        options.setdefault("max_steps", state.max_steps)
        # Probes run at each save (on every rank: the schedule says when, not whichever rank saw the folder).
        if getattr(args.save_strategy, "value", args.save_strategy) == "steps" and state.save_steps:
            options.setdefault("save_every", int(state.save_steps))
        options.setdefault("optimizer", kwargs.get("optimizer"))
        options.setdefault("scheduler", lr_scheduler)
        self._state = state
        # Under DeepSpeed, accelerate runs the ZeRO step (and frees the gradients) inside backward,
        # before on_pre_optimizer_step: they are read at the start of that step instead, pre-clip.
        zero = zero_optimizer(kwargs.get("optimizer"))
        self.recorder = Recorder(
            self.run_dir or args.output_dir,
            model,
            grad_norm_source="pre_clip",
            norms_at_backward_end=zero is None,
            accumulation_steps=args.gradient_accumulation_steps,
            **options,
        )
        if zero is not None:
            read_before_step(zero, lambda: self.recorder.record_gradients(self._current_step()))
        self._reads_in_step = zero is not None
        self._handles = [
            model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            model.register_forward_hook(self._after_forward, with_kwargs=True),
        ]

    def on_train_end(self, args, state, control, **kwargs):
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.recorder is not None:
            self.recorder.close()  # guard="raise" on a halted run: TrainingHalted, out of trainer.train()

    def on_step_end(self, args, state, control, **kwargs):
        if self.recorder is not None and self.recorder.should_stop:
            control.should_training_stop = True
            self._no_poisoned_save(state, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.recorder is not None:
            self._no_poisoned_save(state, control)

    def _no_poisoned_save(self, state, control) -> None:
        if self.recorder.poisoned(state.global_step):
            control.should_save = False

    # -- per step

    def _current_step(self) -> int:
        return self._state.global_step + 1  # global_step counts finished optimizer steps

    def _before_forward(self, module, args, kwargs):
        sample_ids = kwargs.pop("sample_ids", None)
        if self.recorder is None or not module.training:
            return args, kwargs
        batch = dict(kwargs)
        if "input_ids" not in batch and args:
            batch["input_ids"] = args[0]
        if "input_ids" in batch:
            if sample_ids is not None:
                batch["sample_ids"] = sample_ids
            self.recorder.on_batch(self._current_step(), batch)
        return args, kwargs

    def _after_forward(self, module, args, kwargs, output):
        if self.recorder is None or not module.training:
            return None
        loss = getattr(output, "loss", None) if not isinstance(output, dict) else output.get("loss")
        if loss is not None:
            self.recorder.record_loss(self._current_step(), loss)
        return None

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if self.recorder is not None:
            self._lr = optimizer.param_groups[0]["lr"] if optimizer is not None else None
            if not self._reads_in_step:  # after the Trainer's clip: the post-clip norms
                self.recorder.record_gradients(self._current_step())

    def on_optimizer_step(self, args, state, control, **kwargs):
        # Still before zero_grad: gradients exist for histograms at a suspicious step.
        if self.recorder is not None:
            self.recorder.on_step_end(self._current_step(), lr=self._lr)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.recorder is not None and logs:
            self.recorder.log_metrics(state.global_step, logs)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self.recorder is not None and metrics:
            self.recorder.log_metrics(state.global_step, metrics)

    def on_save(self, args, state, control, **kwargs):
        if self.recorder is None:
            return
        path = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if path.exists():
            self.recorder.on_checkpoint(state.global_step, path, training_state=_trainer_state_outline(path, state))


def _trainer_state_outline(path: Path, state: Any) -> dict[str, Any]:
    """What a Trainer checkpoint folder holds for an exact resume (LOOP-09 inspects the files)."""
    names = set(os.listdir(path))
    return {
        "step": state.global_step,
        "epoch": state.epoch,
        "optimizer": "optimizer.pt" in names,
        "scheduler": "scheduler.pt" in names,
        "rng_states": sorted(n for n in names if n.startswith("rng_state")),
        "trainer_state": "trainer_state.json" in names,
        "training_args": "training_args.bin" in names,
    }


__all__: Sequence[str] = ["SFTAuditCallback", "TrainingHalted"]
