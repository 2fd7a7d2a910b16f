"""The training-side recorder: what every step did, written as crash-safe artifacts.

Call order in a plain PyTorch loop (one optimizer step = `step`)::

    rec.on_batch(step, batch)       # before forward, once per micro-batch
    loss.backward()
    rec.on_backward(step, loss)     # after backward, before clipping and optimizer.step()
    optimizer.step()
    rec.on_step_end(step, lr=...)   # after optimizer.step(), before zero_grad()
    if rec.should_stop: break       # the guard stopped the run (guard="stop"): save nothing more
    rec.on_checkpoint(step, path, training_state=...)  # after the loop saved one

Cost model: everything a step needs on the host (loss, per-tensor gradient norms,
batch statistics, evidence rows) is packed into one float32 vector and copied in
one transfer at `on_step_end`, so a recorded step adds one host sync. Probes
(next-token distributions, generations, eval) run on the profile's schedule.

The recorder never crashes or stalls training: each component runs under a guard
that records the exception as a `shim_error` event and switches that component
off; checkpoint files are hashed in a background thread.

Its parts, beside it: `sink` (guarded writes), `batches` (batch statistics), `gradients`
(norms, histograms), `probes`, the run description (`describe`, `weights`), and the `guard` that
stops a run going wrong (off by default).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.artifacts import rank_dir
from ..core.tokenizer import tokenizer_fingerprint
from .batches import Batches, attention_inputs
from .describe import (
    describe_state,
    find_loss_scaler,
    unwrap_model,
)
from .gradients import Gradients
from .guard import DEFAULT_CHECK_SECONDS, Guard, Halt, TrainingHalted
from .manifest import segment_manifest
from .pieces import local_pieces
from .probes import Probes
from .profiles import DEFAULT_PROFILE, resolve_schedule
from .sink import Sink, notice
from .weights import optimizer_step, param_fingerprints, param_norms


class Recorder:
    """Record one rank of an SFT run into ``RUN_DIR/sftaudit/rank-<r>/``.

    Args:
        run_dir: the run's folder; checkpoints should be saved inside it.
        model: the model being trained (a `torch.nn.Module`; HF models get richer manifests).
        tokenizer: the HF tokenizer; its chat template renders the probe prompts.
        profile: "dev", "preprod" or "prod" (see `profiles.py`); schedule fields override it.
        probe_prompts: user messages whose next-token distributions and generations are tracked.
        eval_set: items ``{"messages": [...], "reference": str}`` (optional "id") generated at eval steps.
        dataset: the training rows (list of dicts or HF dataset): their field names go to the manifest.
        grad_norm_source: what `on_backward` sees: "pre_clip" (the documented call order) or "post_clip".
        norms_at_backward_end: read the per-tensor gradient norms at the end of each backward pass (an
            autograd final callback, after DDP's and FSDP's own), before a loop's clipping that no hook
            precedes (the Trainer's); `record_gradients` then records the post-clip norms beside them.
        accumulation_steps: micro-batches per optimizer step, when known: with `norms_at_backward_end` the
            norms are read after the window's last backward only (a shorter window, such as an epoch's last,
            has them read after the clip: its step record says ``grad_norm_source: "post_clip"``).
        config: any run configuration to keep in the manifest.
        optimizer: the optimizer, optional: its step count at the segment's first step shows whether a
            resume restored its state.
        scheduler: the LR scheduler (optional): its class and state go to the manifest, so LOOP-14
            can rebuild the configured schedule and compare it with the LR recorded at every step.
        max_steps: the run's planned length in optimizer steps (stored as the config's ``max_steps``): a run
            whose records end before it without a ``close`` event stopped early. The profile's probe intervals
            are shortened to fit it (see `profiles`), and every probe runs at its last step.
        save_every: the loop's checkpoint interval in steps, when it saves on one: every probe runs at each
            save, on every rank alike. A single-process run also probes at each `on_checkpoint`.
        probe_milestones: False keeps the probes to their intervals: none at the last planned step or at
            saves (for a run that saves often and whose probes are dear).
        grad_scaler: the loop's `torch.amp.GradScaler`, when it has one (fp16): a step it skipped for
            non-finite gradients is then told apart from one whose non-finite update reached the weights.
            Without it, and with none inside the optimizer (accelerate's or DeepSpeed's), the manifest says the
            run had no loss scaler.
        guard: "off" (the default: record only), "stop" or "raise": stop the run at a step whose loss or gradient
            norm is non-finite (under a loss scaler: a streak of skipped steps that drove its scale below 1), or
            when a stop request appears in the run folder (`sftaudit.core.artifacts.StopRequest`): `should_stop`
            turns true, no checkpoint is due from the first bad step on (`poisoned`), the last one saved before it
            is kept under ``RUN_DIR/sftaudit/kept/``, and the close record says why; "raise" also raises
            `TrainingHalted` when the recorder closes. See `sftaudit.shim.guard`.
        stop_check_seconds: how often, at most, the guard looks for a stop request (one ``os.stat`` at a step end).
    """

    def __init__(
        self,
        run_dir: str | Path,
        model: torch.nn.Module,
        tokenizer: Any = None,
        *,
        profile: str = DEFAULT_PROFILE,
        probe_prompts: Sequence[str] = (),
        eval_set: Sequence[Mapping[str, Any]] = (),
        dataset: Iterable[Mapping[str, Any]] | None = None,
        run_id: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        grad_norm_source: str = "pre_clip",
        norms_at_backward_end: bool = False,
        accumulation_steps: int = 1,
        config: Mapping[str, Any] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        max_steps: int | None = None,
        save_every: int | None = None,
        probe_milestones: bool = True,
        grad_scaler: Any = None,
        guard: str = "off",
        stop_check_seconds: float = DEFAULT_CHECK_SECONDS,
        **schedule: int,
    ):
        self.run_dir = Path(run_dir)
        # A DeepSpeed engine's own optimizer (ZeRO's, around the one given): what steps, and skips on overflow.
        self.engine_optimizer = getattr(model, "optimizer", None) if type(model).__name__ == "DeepSpeedEngine" else None
        model = unwrap_model(model)  # DDP's `module.`, torch.compile's `_orig_mod.`: names as checkpoints have them
        self.model = model
        self.tokenizer = tokenizer
        self.schedule = resolve_schedule(profile, schedule, max_steps)
        self.max_steps = int(max_steps) if max_steps else None
        self.save_every = int(save_every) if probe_milestones and save_every and save_every > 0 else None
        self.probe_milestones = probe_milestones
        self.profile = profile
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        self.accumulation_steps = max(1, int(accumulation_steps))
        # Read at the end of backward, the norms are what the gradients were before any clipping.
        self.grad_norm_source = "pre_clip" if norms_at_backward_end else grad_norm_source
        self.probe_prompts = list(probe_prompts)
        self.eval_set = [dict(item) for item in eval_set]
        self.optimizer = optimizer
        self.grad_scaler = grad_scaler
        self._segment_started = False
        self._first_step: int | None = None  # the segment's first step: its rows are kept whole whatever the schedule
        self._sink = Sink(rank_dir(self.run_dir, self.rank), self.rank, lambda: self._step)
        self.segment, self.disabled = self._sink.segment, self._sink.disabled
        self._guard, self._write = self._sink.guard, self._sink.write
        # Each parameter's local piece on this rank (DDP/FSDP1/FSDP2 differ only in there): every
        # per-tensor value the recorder computes is over plain local tensors, with no collective.
        self._pieces = local_pieces(model, self.rank, self.world_size)
        self._batches = Batches(tokenizer, self.schedule, self._sink)
        self._grads = Gradients(self._pieces, self.schedule, self._sink, norms_at_backward_end)
        self._last_step: int | None = None  # the last step whose record was written (the close event names it)
        self._closed = False
        self._reset_step()
        config = dict(config or {})
        if max_steps is not None:
            config["max_steps"] = int(max_steps)
        manifest = segment_manifest(self, run_id, config, dataset, scheduler)
        self._write("manifest", manifest)
        self._halt_guard = Guard(
            guard,
            self.run_dir,
            rank_dir(self.run_dir, self.rank),
            self._sink,
            self.rank,
            self.world_size,
            find_loss_scaler(self.engine_optimizer or self.optimizer, grad_scaler)[0],
            bool((manifest.get("loss_scaler") or {}).get("skips_nonfinite_steps")),
            stop_check_seconds,
            lambda path: self._relative(Path(path)),
        )
        self._decided = False  # the guard decided on the step's transfer
        if self.rank == 0:  # said once, at start: what is recorded then is whatever the old release allows
            for name, v in manifest["unsupported_versions"].items():
                notice(
                    f"{name} {v['installed']} is older than {v['oldest_supported']}, the oldest sftaudit supports: "
                    f"recording goes on with what it allows, and the audit names what it cannot judge; upgrade "
                    f"{name} to record and judge the whole run"
                )
        self._write("events", {"kind": "start", "time": time.time()})
        self.probes = Probes(
            model,
            tokenizer,
            self.schedule,
            self._pieces,
            self._sink,
            self.rank,
            self.world_size,
            self.probe_prompts,
            self.eval_set,
        )
        # The model's own loss per micro-batch and the weight the backpropagated objective gives it
        # (LOOP-13 recomputes the intended token mean from them).
        self._loss_hook = model.register_forward_hook(self._after_forward, with_kwargs=True)

    # ------------------------------------------------------------------ public hooks

    def on_batch(self, step: int, batch: Mapping[str, Any]) -> None:
        """Before forward: shape, sample ids, lengths, padding and label statistics of one micro-batch."""
        if self.probes.active or "batches" in self.disabled:
            return
        if not self._segment_started:
            self._segment_started = True
            self._first_step = step
            with self._guard("segment_start"):
                # The weights' fingerprint and the optimizer's step count, which a resume must have
                # restored from its checkpoint (LOOP-11).
                self._write(
                    "events",
                    {
                        "kind": "segment_start",
                        "step": step,
                        "time": time.time(),
                        "param_norms": param_norms(self._pieces),
                        "optimizer_step": optimizer_step(self.optimizer),
                    },
                )
        with self._guard("batches"):
            self._begin_step(step)
            self._micro.append(self._batches.capture(step, batch, len(self._micro), step == self._first_step))

    def on_backward(self, step: int, loss: torch.Tensor | float) -> None:
        """After backward: the step's loss and per-tensor gradient L2 norms (one vectorised pass).

        With gradient accumulation call it after each backward: the gradients read at the last
        call are the step's. The step's loss is the token mean of the model's returned losses
        over the step's micro-batches (whatever share of it each backward received); when the
        model returns no loss, the mean of the losses given here."""
        self.record_loss(step, loss)
        if self._micro and torch.is_tensor(loss) and "losses" not in self.disabled:
            with self._guard("losses"):  # the scalar backpropagated for the latest micro-batch
                self._micro[-1]["parts"]["backprop"] = loss.detach()
        self.record_gradients(step)

    def record_loss(self, step: int, loss: torch.Tensor | float) -> None:
        """One micro-batch's loss (kept on device until the step's single transfer)."""
        if self.probes.active or "gradients" in self.disabled:
            return
        with self._guard("gradients"):
            self._begin_step(step)
            self._losses.append(_scalar(loss) if torch.is_tensor(loss) else torch.tensor(float(loss)))

    def record_gradients(self, step: int) -> None:
        """Per-tensor gradient norms as the gradients stand now (and histograms on schedule). With
        `norms_at_backward_end` these are the post-clip norms, beside the pre-clip ones read at the end
        of the last backward (when none was read there, they stand in for them, and the step says so)."""
        if self.probes.active or "gradients" in self.disabled:
            return
        with self._guard("gradients"):
            self._begin_step(step)
            self._grads.read(step)

    def on_step_end(self, step: int, lr: float | None = None) -> None:
        """After optimizer.step(): one host transfer, then the step's records, the guard's decision and the
        scheduled probes."""
        if self.probes.active:
            return
        guard_parts = self._halt_guard.parts(self._grads.norms, self._losses) if self._halt_guard.active else []
        self._decided = False
        if "steps" not in self.disabled:
            with self._guard("steps"):
                self._begin_step(step)
                self._finish_step(step, lr, guard_parts)
        if guard_parts and not self._decided:  # no step record: the guard's own values, on their own
            self._decide(
                step,
                None,
                None,
                {("guard", k): v for (k, _), v in zip(guard_parts, _to_host([t for _, t in guard_parts]))},
            )
        self._reset_step()
        at_end = self.probe_milestones and step == self.max_steps
        self.probes.run(step, every_probe=at_end or bool(self.save_every and step % self.save_every == 0))

    @property
    def should_stop(self) -> bool:
        """The guard stopped the run: end the loop now, saving no checkpoint (see `Recorder`'s ``guard``)."""
        return self._halt_guard.halt is not None

    @property
    def halted(self) -> Halt | None:
        """Why and where the guard stopped the run (None while it has not)."""
        return self._halt_guard.halt

    def poisoned(self, step: int) -> bool:
        """A checkpoint at `step` would hold what the guard stopped the run for: do not save it."""
        return self._halt_guard.poisoned(step)

    def on_checkpoint(self, step: int, path: str | Path, training_state: Mapping[str, Any] | None = None) -> None:
        """After the loop saved a checkpoint: where, which files, the training state's outline."""
        if "checkpoints" in self.disabled:
            return
        with self._guard("checkpoints"):
            path = Path(path)
            files = sorted(p for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file())
            record = {
                "event": "saved",
                "step": step,
                "path": self._relative(path),
                "files": [{"name": self._relative(f), "bytes": f.stat().st_size} for f in files],
                "training_state": describe_state(dict(training_state)) if training_state is not None else None,
                "tokenizer_fingerprint": tokenizer_fingerprint(self.tokenizer) if self.tokenizer is not None else None,
                "param_norms": param_norms(self._pieces),
                "param_fingerprints": param_fingerprints(self._pieces),
                "time": time.time(),
            }
            self._write("checkpoints", record)
            self._sink.sync()
            self._sink.hash_later(step, record["path"], files, [f["name"] for f in record["files"]])
        # What the saved model does, beside its files. With more ranks, only on the schedule (`save_every`):
        # a loop may call this on one rank only, and a probe of sharded weights needs all of them.
        if self.probe_milestones and self.world_size == 1 and not self.probes.active:
            self.probes.run(step, every_probe=True)

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Scalar metrics from the loop or trainer logs (eval_loss, the trainer's grad_norm, ...)."""
        if "metrics" in self.disabled:
            return
        with self._guard("metrics"):
            for name, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._write("metrics", {"step": step, "name": name, "value": float(value)})

    def close(self, error: BaseException | None = None) -> None:
        """The segment ended: a ``close`` event with its last recorded step (the exception that ended the loop,
        when one did; why the guard stopped it, when it did). A run killed outright leaves none. With
        ``guard="raise"``, a run the guard stopped raises `TrainingHalted` here (unless `error` is already on its way)."""
        if self._closed:
            return
        self._closed = True
        self._loss_hook.remove()
        self._sink.wait_for_hashes()
        record = {"kind": "close", "step": self._last_step, "time": time.time()}
        if error is not None:
            record["error"] = f"{type(error).__name__}: {error}"
        halt = self._halt_guard.halt
        if halt is not None:
            record["halted"] = halt.record()
        self._write("events", record)
        self._sink.close()
        if halt is not None and error is None and self._halt_guard.mode == "raise":
            raise TrainingHalted(halt)

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.close(exc)

    def _after_forward(self, module, args, kwargs, output) -> None:
        """After each training forward: the attention inputs, the backward-end norm read when due, and the
        model's own loss with its weight in the objective (`Batches.after_forward`)."""
        if self.probes.active or not module.training or not self._micro:
            return
        if "batches" not in self.disabled:
            with self._guard("batches"):
                self._micro[-1].update(attention_inputs(module, args, kwargs, output))
        # Only after the window's last backward is the clip next.
        if (
            self._grads.at_backward_end
            and "gradients" not in self.disabled
            and len(self._micro) >= self.accumulation_steps
        ):
            with self._guard("gradients"):
                self._grads.read_when_backward_ends(output, self._read_at_backward_end)
        if "losses" not in self.disabled:
            with self._guard("losses"):
                self._batches.after_forward(self._micro[-1], kwargs, output)

    def _read_at_backward_end(self) -> None:
        if "gradients" not in self.disabled and self._step is not None:
            with self._guard("gradients"):
                self._grads.capture(self._step)

    # ------------------------------------------------------------------ per step

    def _reset_step(self) -> None:
        self._step: int | None = None
        self._micro: list[dict] = []
        self._losses: list[torch.Tensor] = []
        self._grads.reset()
        self._step_started = time.perf_counter()

    def _begin_step(self, step: int) -> None:
        if self._step is None:
            self._step = step
        elif step != self._step:  # the previous step never reached on_step_end: drop, don't mix
            self._reset_step()
            self._step = step

    def _finish_step(self, step: int, lr: float | None, guard_parts: list[tuple[str, torch.Tensor]]) -> None:
        parts: list[tuple[Any, Any, torch.Tensor]] = []  # (owner, key, tensor) in pack order
        parts.extend(("loss", i, t) for i, t in enumerate(self._losses))  # averaged on the host
        parts.extend(("step", key, t) for key, t in self._grads.parts())
        parts.extend(("guard", key, t) for key, t in guard_parts)
        for m in self._micro:
            parts.extend((m["micro"], key, t) for key, t in m["parts"].items())
        host = _to_host([t for _, _, t in parts])
        values = {(owner, key): v for (owner, key, _), v in zip(parts, host)}
        self._batches.unpack(self._micro, values)
        grad_fields, grad_extra = self._grads.step_fields(values)
        losses = [values["loss", i] for i in range(len(self._losses))]
        mean = float(losses[0]) if len(losses) == 1 else float(np.mean(losses, dtype=np.float64)) if losses else None
        loss = self._batches.window_loss(self._micro, values, mean)
        tokens = sum(sum(values[m["micro"], "lengths"]) for m in self._micro)
        for m in self._micro:  # before the step's own record, which marks the step complete after a kill
            self._batches.write(step, m, values)
        self._write(
            "steps",
            {
                "step": step,
                "time": time.time(),
                "dt": time.perf_counter() - self._step_started,
                "loss": loss,
                "lr": lr,
                **grad_fields,
                "micro_batches": len(self._micro),
                "tokens": tokens,
                **grad_extra,
            },
        )
        self._last_step = step
        self._grads.after_step(step, values, grad_fields)
        if self._halt_guard.active:
            self._decide(step, loss, grad_fields["grad_norm"], values)

    def _decide(self, step: int, loss: float | None, grad_norm: float | None, values: dict) -> None:
        self._decided = True
        if "guard" not in self.disabled:
            with self._guard("guard"):
                self._halt_guard.after_step(step, loss, grad_norm, values)

    def _relative(self, path: Path) -> str:
        try:
            return str(path.resolve().relative_to(self.run_dir.resolve()))
        except ValueError:
            return str(path.resolve())


def _scalar(loss: torch.Tensor) -> torch.Tensor:
    """A loss as a detached float32 0-d tensor (no op where it is one already)."""
    loss = loss.detach()
    if loss.dtype != torch.float32:
        loss = loss.float()
    return loss.reshape(()) if loss.dim() else loss


def _to_host(tensors: list[torch.Tensor]) -> list[Any]:
    """One device-to-host copy for all of a step's values (float32 holds token ids < 2**24 exactly)."""
    if not tensors:
        return []
    # One call flattens and concatenates them all (cat promotes mixed dtypes: bool, int64, float32 to one); a
    # single conversion follows, a no-op when that is float32 already. All detached already.
    flat = torch._C._nn.flatten_dense_tensors(tensors).to(torch.float32).cpu().numpy()
    out, offset = [], 0
    for t in tensors:
        n = t.numel()
        out.append(flat[offset : offset + n].reshape(t.shape))
        offset += n
    return out


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    dist = torch.distributed
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", 0))
    if world_size is None:
        world_size = (
            dist.get_world_size()
            if dist.is_available() and dist.is_initialized()
            else int(os.environ.get("WORLD_SIZE", 1))
        )
    return rank, world_size
