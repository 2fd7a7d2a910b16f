"""The training-side recorder: what every step did, written as crash-safe artifacts.

Call order in a plain PyTorch loop (one optimizer step = `step`)::

    rec.on_batch(step, batch)       # before forward, once per micro-batch
    loss.backward()
    rec.on_backward(step, loss)     # after backward, before clipping and optimizer.step()
    optimizer.step()
    rec.on_step_end(step, lr=...)   # after optimizer.step(), before zero_grad()
    rec.on_checkpoint(step, path, training_state=...)  # after the loop saved one

Cost model: everything a step needs on the host (loss, per-tensor gradient norms,
batch statistics, evidence rows) is packed into one float32 vector and copied in
one transfer at `on_step_end`, so a recorded step adds one host sync. Probes
(next-token distributions, generations, eval) run on the profile's schedule.

The recorder never crashes or stalls training: each component runs under a guard
that records the exception as a `shim_error` event and switches that component
off; checkpoint files are hashed in a background thread.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import sys
import threading
import time
import traceback
import uuid
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from .. import __version__
from ..artifacts import GRAD_HIST_EDGES, SCHEMA_VERSION, TOKENIZER_DIR, artifact_root, rank_dir, template_fingerprint
from ..tokenizer_info import describe_tokenizer, tokenizer_fingerprint
from .describe import describe_dataset, describe_scheduler, describe_state, jsonable, unwrap_model
from .pieces import local_pieces
from .profiles import DEFAULT_PROFILE, resolve_schedule
from .writer import JsonlWriter, read_jsonl

IGNORE_INDEX = -100
# A step whose global gradient norm exceeds this multiple of its running mean gets histograms
# recorded on the spot, so the evidence of a spike exists even between scheduled histograms.
SPIKE_FACTOR = 10.0
GENERATION_CHUNK = 32  # rows per generate() call: large eval sets are split to bound probe memory
# Batch keys through which a loop hands the model per-sample boundaries (varlen / packed attention).
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens", "seq_lens", "seq_idx", "block_mask")


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
            whose records end before it without a ``close`` event stopped early.
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
        **schedule: int,
    ):
        self.run_dir = Path(run_dir)
        model = unwrap_model(model)  # DDP's `module.`, torch.compile's `_orig_mod.`: names as checkpoints have them
        self.model = model
        self.tokenizer = tokenizer
        self.schedule = resolve_schedule(profile, schedule)
        self.profile = profile
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        self.norms_at_backward_end = norms_at_backward_end
        self.accumulation_steps = max(1, int(accumulation_steps))
        # Read at the end of backward, the norms are what the gradients were before any clipping.
        self.grad_norm_source = "pre_clip" if norms_at_backward_end else grad_norm_source
        self.probe_prompts = list(probe_prompts)
        self.eval_set = [dict(item) for item in eval_set]
        self.disabled: set[str] = set()
        self.optimizer = optimizer
        self._segment_started = False
        self._first_step: int | None = None  # the segment's first step: its rows are kept whole whatever the schedule
        self._writer = JsonlWriter(rank_dir(self.run_dir, self.rank))
        self.segment = len(read_jsonl(self._writer.folder / "manifest.jsonl"))
        # Each parameter's local piece on this rank (DDP/FSDP1/FSDP2 differ only in there): every
        # per-tensor value the recorder computes is over plain local tensors, with no collective.
        self._pieces = local_pieces(model, self.rank, self.world_size)
        self._param_info, tied = self._pieces.params, self._pieces.tied
        self._hashers: list[threading.Thread] = []
        self._last_step: int | None = None  # the last step whose record was written (the close event names it)
        self._probing = False
        self._closed = False
        self._reset_step()
        self._grad_norm_ema: float | None = None
        self._template: tuple[Any, str | None] = (None, None)  # (template object, its fingerprint)
        config = dict(config or {})
        if max_steps is not None:
            config["max_steps"] = int(max_steps)

        manifest = {
            "schema_version": SCHEMA_VERSION,
            "run_id": run_id or self.run_dir.resolve().name,
            "seg": self.segment,
            "rank": self.rank,
            "world_size": self.world_size,
            "profile": profile,
            "schedule": self.schedule.__dict__,
            "started": time.time(),
            "versions": {"sftaudit": __version__, "torch": torch.__version__, **_library_versions()},
            "instance_id": uuid.uuid4().hex,
            "argv": list(sys.argv),  # the command that ran, for `sftaudit replay`'s resume command
            "model": _describe_model(model),
            "params": self._param_info,  # with each parameter's layout on this rank (see `pieces`)
            "framework": self._pieces.framework,
            "tied": tied,
            "grad_norm_source": self.grad_norm_source,
            # Where the norms were read: "on_backward" (the loop's call) or "backward_end" (the autograd callback,
            # with each step's post-clip norms beside them in grad_norms_post_clip).
            "grad_norm_read": "backward_end" if norms_at_backward_end else "on_backward",
            "tokenizer": None,
            "dataset": None,
            "probe_prompts": self.probe_prompts,
            "eval_set": [
                {"id": str(it.get("id", i)), "messages": it["messages"], "reference": it["reference"]}
                for i, it in enumerate(self.eval_set)
            ],
            "config": jsonable(config),
            "param_norms": None,
            "scheduler": None,
        }
        with self._guard("manifest"):
            if tokenizer is not None:
                manifest["tokenizer"] = describe_tokenizer(tokenizer)
                manifest["marker_rows"] = _marker_rows(model, tokenizer) if self._pieces.framework == "plain" else None
                self._save_tokenizer()
            if dataset is not None:
                manifest["dataset"] = describe_dataset(dataset)
            manifest["param_norms"] = self._param_norms()
            if scheduler is not None:
                manifest["scheduler"] = describe_scheduler(scheduler, config.get("max_steps"))
            if optimizer is not None:  # LOOP-22 judges the learning rate against the optimizer's family
                manifest["optimizer"] = {"class": type(optimizer).__name__}
        self._write("manifest", manifest)
        self._write("events", {"kind": "start", "time": time.time()})
        self._probe_inputs = self._encode_prompts([[{"role": "user", "content": p}] for p in self.probe_prompts])
        self._eval_inputs = self._encode_prompts([it["messages"] for it in self.eval_set])
        per_prompt = self.schedule.generations_per_prompt
        # Per probe kind: this rank's rows (global indices), their left-padded batch, its generate() calls.
        self._shares = {
            "probes": self._share(self._probe_inputs),
            "generations": self._share([p for p in self._probe_inputs for _ in range(per_prompt)]),
            "evals": self._share(self._eval_inputs),
        }
        # The model's own loss per micro-batch and the weight the backpropagated objective gives it
        # (LOOP-13 recomputes the intended token mean from them).
        self._loss_hook = model.register_forward_hook(self._after_forward, with_kwargs=True)

    # ------------------------------------------------------------------ public hooks

    def on_batch(self, step: int, batch: Mapping[str, Any]) -> None:
        """Before forward: shape, sample ids, lengths, padding and label statistics of one micro-batch."""
        if self._probing or "batches" in self.disabled:
            return
        if not self._segment_started:
            self._segment_started = True
            self._first_step = step
            with self._guard("segment_start"):
                self._record_segment_start(step)
        with self._guard("batches"):
            self._begin_step(step)
            input_ids = batch["input_ids"]
            given = batch.get("attention_mask")
            # A 2-D padding mask; a 4-D or block mask carries sample boundaries (varlen), not padding.
            padding_mask = torch.is_tensor(given) and given.shape == input_ids.shape
            attention_mask = given if padding_mask else torch.ones_like(input_ids)
            labels = batch.get("labels")
            trained = labels != IGNORE_INDEX if labels is not None else torch.zeros_like(input_ids, dtype=torch.bool)
            padding = attention_mask == 0
            micro = len(self._micro)
            rows, length = input_ids.shape
            sample_ids = batch.get("sample_ids")
            keep_rows = self._rows_to_keep(step, rows)
            counts = {
                "lengths": attention_mask.sum(1),
                "label_tokens": trained.sum(1),
                # A causal LM's shifted loss averages over the labels after the first: the host
                # subtracts this column (cheaper than summing a strided slice).
                "first_trained": trained[:, 0],
                "padding_trained": (trained & padding).sum(1),
                "left_padded": padding[:, 0],
                **self._segments(batch, input_ids, padding),
            }
            # The per-row counts travel as one tensor (stack promotes the bool columns): fewer pieces at the transfer.
            parts = {"row_counts": torch.stack(list(counts.values()))}
            # Rows are kept whole as evidence on schedule; when no ids were given, a hash of the
            # row's attended tokens (padding dropped: -1) serves as its sample id.
            if sample_ids is None:
                parts["hashed_ids"] = input_ids.masked_fill(padding, -1)
            if keep_rows:
                parts["input_ids"] = input_ids
                parts["labels"] = labels[:keep_rows] if labels is not None else torch.full_like(input_ids[:keep_rows], IGNORE_INDEX)
                parts["attention_mask"] = attention_mask[:keep_rows]
            if sample_ids is not None:
                sample_ids = [str(s) for s in (sample_ids.tolist() if torch.is_tensor(sample_ids) else sample_ids)]
            varlen = any(k in batch for k in VARLEN_KEYS) or (torch.is_tensor(given) and given.dim() == 4)
            self._micro.append({"micro": micro, "shape": [rows, length], "sample_ids": sample_ids, "varlen": varlen,
                                "keep_rows": keep_rows, "parts": parts, "row_counts": list(counts),
                                **self._tokenizer_state()})

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
        if self._probing or "gradients" in self.disabled:
            return
        with self._guard("gradients"):
            self._begin_step(step)
            self._losses.append(loss.detach().float().reshape(()) if torch.is_tensor(loss) else torch.tensor(float(loss)))

    def record_gradients(self, step: int) -> None:
        """Per-tensor gradient norms as the gradients stand now (and histograms on schedule). With
        `norms_at_backward_end` these are the post-clip norms, beside the pre-clip ones read at the end
        of the last backward (when none was read there, they stand in for them, and the step says so)."""
        if self._probing or "gradients" in self.disabled:
            return
        with self._guard("gradients"):
            self._begin_step(step)
            if self.norms_at_backward_end and self._norms is not None:
                grads = [self._pieces.grads()[i] for i in self._norm_index]
                if all(g is not None for g in grads):
                    self._post_norms = torch.stack(torch._foreach_norm(grads)).float()
                return
            self._capture_grads(step)
            self._norms_read_now = self.norms_at_backward_end

    def on_step_end(self, step: int, lr: float | None = None) -> None:
        """After optimizer.step(): one host transfer, then the step's records and scheduled probes."""
        if self._probing:
            return
        if "steps" not in self.disabled:
            with self._guard("steps"):
                self._begin_step(step)
                self._finish_step(step, lr)
        self._reset_step()
        self._run_probes(step)

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
                "param_norms": self._param_norms(),
                "param_fingerprints": self._param_fingerprints(),
                "time": time.time(),
            }
            self._write("checkpoints", record)
            self._writer.sync()
            worker = threading.Thread(target=self._hash_files, args=(step, record["path"], files), daemon=True)
            worker.start()
            self._hashers.append(worker)

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Scalar metrics from the loop or trainer logs (eval_loss, the trainer's grad_norm, ...)."""
        if "metrics" in self.disabled:
            return
        with self._guard("metrics"):
            for name, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._write("metrics", {"step": step, "name": name, "value": float(value)})

    def close(self, error: BaseException | None = None) -> None:
        """The segment ended: a ``close`` event with its last recorded step (and the exception that ended
        the loop, when one did). A run killed outright leaves none."""
        if self._closed:
            return
        self._closed = True
        self._loss_hook.remove()
        for worker in self._hashers:
            worker.join(timeout=60)
        record = {"kind": "close", "step": self._last_step, "time": time.time()}
        if error is not None:
            record["error"] = f"{type(error).__name__}: {error}"
        self._write("events", record)
        self._writer.close()

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.close(exc)

    def _after_forward(self, module, args, kwargs, output) -> None:
        """The model's returned loss for the latest micro-batch, and (through a gradient hook on it)
        d(backpropagated objective)/d(that loss): its weight in what the optimizer minimised. A loop that
        computes its own loss from the per-token log-probabilities (TRL's fused LM head: the model's
        `loss` then never reaches backward) gives the weight through them: with every trained token
        weighted alike, d(objective)/d(loss) = -sum of the gradient on the trained tokens' log-probs x
        (the tokens the loss divides by) / (the trained tokens)."""
        if self._probing or not module.training or not self._micro:
            return
        if "batches" not in self.disabled:
            with self._guard("batches"):
                self._micro[-1].update(_attention_inputs(module, args, kwargs, output))
        if self.norms_at_backward_end and "gradients" not in self.disabled:
            with self._guard("gradients"):
                self._read_norms_when_backward_ends(output)
        if "losses" in self.disabled:
            return
        with self._guard("losses"):
            loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
            if not torch.is_tensor(loss) or loss.numel() != 1:
                return
            parts = self._micro[-1]["parts"]
            parts["model_loss"] = loss.detach()  # converted at the step's one transfer, with everything else
            items = kwargs.get("num_items_in_batch")  # HF: the loss is then a sum over this many tokens
            if items is not None:
                parts["num_items"] = items.detach() if torch.is_tensor(items) else torch.tensor(float(items))
            if loss.requires_grad:
                def weight(grad: torch.Tensor) -> None:
                    parts["loss_weight"] = grad.detach()
                loss.register_hook(weight)
            log_probs = getattr(output, "log_probs", None)
            mask = getattr(output, "label_mask", None)
            if (torch.is_tensor(log_probs) and log_probs.requires_grad and torch.is_tensor(mask)
                    and mask.shape == log_probs.shape):
                trained = mask.sum().clamp(min=1)
                divides_by = parts.get("num_items", trained)

                def token_weight(grad: torch.Tensor) -> None:
                    parts["loss_weight"] = -(grad.detach() * mask).sum() * divides_by / trained
                log_probs.register_hook(token_weight)

    def _read_norms_when_backward_ends(self, output) -> None:
        """When backward reaches this forward's output, queue a read of the gradient norms for the end of
        that backward pass. The callback queues itself once more so that it runs after the final callbacks
        queued during the pass (DDP's reduction, FSDP's), on the gradients the clipping will then see."""
        if len(self._micro) < self.accumulation_steps:  # not the window's last backward: the clip is not next
            return
        get = output.get if isinstance(output, Mapping) else lambda k: getattr(output, k, None)
        # Whichever of them the loop's objective was computed from (TRL's own loss uses log_probs, not loss).
        tensors = [t for t in (get(k) for k in ("loss", "log_probs", "logits")) if torch.is_tensor(t) and t.requires_grad]
        engine = torch.autograd.Variable._execution_engine
        queued = []

        def at_end() -> None:
            if "gradients" not in self.disabled and self._step is not None:
                with self._guard("gradients"):
                    self._capture_grads(self._step)

        def started(_grad: torch.Tensor) -> None:
            if not queued:  # once per backward pass, whichever output it reaches first
                queued.append(True)
                engine.queue_callback(lambda: engine.queue_callback(at_end))

        for tensor in tensors:
            tensor.register_hook(started)

    # ------------------------------------------------------------------ per step

    def _reset_step(self) -> None:
        self._step: int | None = None
        self._micro: list[dict] = []
        self._losses: list[torch.Tensor] = []
        self._norms: torch.Tensor | None = None
        self._post_norms: torch.Tensor | None = None  # after the loop's clipping (norms_at_backward_end)
        self._norms_read_now = False  # norms_at_backward_end, but this step's were read after clipping
        self._norm_index: list[int] = []
        self._hist: torch.Tensor | None = None
        self._hist_index: list[int] = []
        self._step_started = time.perf_counter()

    def _begin_step(self, step: int) -> None:
        if self._step is None:
            self._step = step
        elif step != self._step:  # the previous step never reached on_step_end: drop, don't mix
            self._reset_step()
            self._step = step

    def _tokenizer_state(self) -> dict[str, Any]:
        """Cheap per-batch identity of the tokenizer (vocabulary size, chat template): a tokenizer
        or template swapped mid-run shows at the step it happened, not only at the next checkpoint."""
        tok = self.tokenizer
        if tok is None:
            return {"tokenizer_length": None, "template_fingerprint": None}
        template = getattr(tok, "chat_template", None)
        if template is not self._template[0]:  # hash only when the template object changes
            self._template = (template, template_fingerprint(template))
        return {"tokenizer_length": len(tok), "template_fingerprint": self._template[1]}

    def _segments(self, batch: Mapping[str, Any], input_ids: torch.Tensor, padding: torch.Tensor) -> dict:
        """Per row: sequence starts (attended BOS tokens: a packed row holds one per sample) and, when
        the batch gives position_ids, how often they restart at 0 (LOOP-16, packing boundaries)."""
        bos = getattr(self.tokenizer, "bos_token_id", None) if self.tokenizer is not None else None
        out = {}
        if bos is not None:
            out["bos_starts"] = (input_ids == bos).logical_and_(~padding).sum(1)
        positions = batch.get("position_ids")
        if torch.is_tensor(positions) and positions.shape[-1] == input_ids.shape[1]:
            positions = positions.reshape(-1, input_ids.shape[1]).expand(input_ids.shape[0], -1)
            out["position_resets"] = (positions[:, 1:] == 0).sum(1)
        return out

    def _rows_to_keep(self, step: int, rows: int) -> int:
        """Rows kept whole as evidence: on the schedule, and every row of each segment's first step (a
        run's start or a resume), so a data bug present from the first batch is dated there in any profile."""
        if "samples" in self.disabled:
            return 0
        if step == self._first_step:
            return rows
        every = self.schedule.samples_every
        return min(rows, self.schedule.samples_per_batch) if every and step % every == 0 else 0

    def _capture_grads(self, step: int) -> None:
        all_grads = self._pieces.grads()
        index = [i for i, g in enumerate(all_grads) if g is not None]
        if not index:
            return
        grads = [all_grads[i] for i in index]
        self._norms = torch.stack(torch._foreach_norm(grads)).float()
        self._norm_index = index
        every = self.schedule.grad_hist_every
        if every and step % every == 0 and "grad_hists" not in self.disabled:
            self._hist, self._hist_index = _histograms(grads), index

    def _finish_step(self, step: int, lr: float | None) -> None:
        parts: list[tuple[str, Any, torch.Tensor]] = []  # (owner, key, tensor) in pack order
        parts.extend(("loss", i, t) for i, t in enumerate(self._losses))  # averaged on the host
        if self._norms is not None:
            parts.append(("step", "norms", self._norms))
        if self._post_norms is not None:
            parts.append(("step", "post_norms", self._post_norms))
        if self._hist is not None:
            parts.append(("step", "hist", self._hist))
        for m in self._micro:
            parts.extend((m["micro"], key, t) for key, t in m["parts"].items())
        host = _to_host([t for _, _, t in parts])
        values = {(owner, key): v for (owner, key, _), v in zip(parts, host)}
        for m in self._micro:
            values.update({(m["micro"], name): row for name, row in zip(m["row_counts"], values[m["micro"], "row_counts"])})
            values[m["micro"], "target_tokens"] = values[m["micro"], "label_tokens"] - values[m["micro"], "first_trained"]

        norms: list[float | None] = [None] * len(self._param_info)
        nonfinite, global_norm = {}, None
        if ("step", "norms") in values:
            host_norms = values["step", "norms"].astype(np.float64)
            for i, v in zip(self._norm_index, host_norms.tolist()):
                norms[i] = v
            global_norm = float(np.sqrt(np.square(host_norms).sum()))
            bad = np.flatnonzero(~np.isfinite(host_norms))
            if bad.size:
                nonfinite = self._count_nonfinite([self._norm_index[j] for j in bad])
        extra = {}
        if ("step", "post_norms") in values:
            post = values["step", "post_norms"].astype(np.float64)
            post_norms: list[float | None] = [None] * len(self._param_info)
            for i, v in zip(self._norm_index, post.tolist()):
                post_norms[i] = v
            extra = {"grad_norm_post_clip": float(np.sqrt(np.square(post).sum())), "grad_norms_post_clip": post_norms}
        elif self._norms_read_now:
            extra = {"grad_norm_source": "post_clip"}  # no backward-end read this step: the norms are post-clip
        losses = [values["loss", i] for i in range(len(self._losses))]
        loss = self._window_loss(values, float(np.mean(losses, dtype=np.float64)) if losses else None)
        tokens = sum(int(values[m["micro"], "lengths"].sum()) for m in self._micro)
        for m in self._micro:  # before the step's own record, which marks the step complete after a kill
            self._write_batch(step, m, values)
        self._write("steps", {
            "step": step, "time": time.time(), "dt": time.perf_counter() - self._step_started,
            "loss": loss, "lr": lr, "grad_norm": global_norm, "grad_norms": norms,
            "nonfinite_grads": nonfinite, "micro_batches": len(self._micro), "tokens": tokens, **extra,
        })
        self._last_step = step
        if ("step", "hist") in values:
            self._write_hists(step, self._hist_index, values["step", "hist"], "scheduled")
        elif nonfinite or self._is_spike(global_norm):
            self._write_triggered_hists(step, "nonfinite" if nonfinite else "spike")
        if global_norm is not None and np.isfinite(global_norm):
            self._grad_norm_ema = global_norm if self._grad_norm_ema is None else 0.9 * self._grad_norm_ema + 0.1 * global_norm

    def _window_loss(self, values: dict, recorded: float | None) -> float | None:
        """The step's loss: the token mean of the model's own losses over the optimizer window when
        every micro-batch returned one. With gradient accumulation what each backward receives is a
        share of the objective (the loss / the accumulation steps, or a sum over the Trainer's
        `num_items_in_batch`), so the mean of those is 1/GA of the trained loss. Otherwise the mean
        of the recorded losses; a non-finite recorded loss (corrupted after the model) stays."""
        if not self._micro or (recorded is not None and not np.isfinite(recorded)):
            return recorded
        if any((m["micro"], "model_loss") not in values for m in self._micro):
            return recorded
        n = np.array([values[m["micro"], "target_tokens"].sum() for m in self._micro], dtype=np.float64)
        loss = np.array([values[m["micro"], "model_loss"] for m in self._micro], dtype=np.float64)
        # The model's loss is its summed token loss / num_items_in_batch when the Trainer passes it, else / n.
        divides_by = np.array([values.get((m["micro"], "num_items"), k) for m, k in zip(self._micro, n)], dtype=np.float64)
        trained = n > 0  # a micro-batch without target tokens adds nothing (its own mean is 0/0)
        return float((loss * divides_by)[trained].sum() / n[trained].sum()) if trained.any() else recorded

    def _write_batch(self, step: int, m: dict, values: dict) -> None:
        micro = m["micro"]
        rows, length = m["shape"]
        ids = m["sample_ids"]
        if ids is None:
            ids = ["h:" + hashlib.blake2b(row[row >= 0].astype("int64").tobytes(), digest_size=8).hexdigest()
                   for row in values[micro, "hashed_ids"].reshape(rows, length)]
        self._write("batches", {
            "step": step, "micro": micro, "rows": rows, "seq_len": length, "sample_ids": ids,
            "lengths": values[micro, "lengths"].astype("int64").tolist(),
            "label_tokens": values[micro, "label_tokens"].astype("int64").tolist(),
            "padding_trained": values[micro, "padding_trained"].astype("int64").tolist(),
            "left_padded_rows": int(values[micro, "left_padded"].sum()),
            "target_tokens": values[micro, "target_tokens"].astype("int64").tolist(),
            **{key: values[micro, key].astype("int64").tolist() for key in ("bos_starts", "position_resets")
               if (micro, key) in values},
            "varlen": m["varlen"], "attention_mask_kind": m.get("attention_mask_kind"), "cache_built": m.get("cache_built"),
            **{key: float(values[micro, key]) for key in ("model_loss", "loss_weight", "num_items", "backprop")
               if (micro, key) in values},
            "tokenizer_length": m["tokenizer_length"], "template_fingerprint": m["template_fingerprint"],
        })
        keep = m["keep_rows"]
        if keep:
            full_ids = values[micro, "input_ids"].reshape(rows, length).astype("int64")
            labels = values[micro, "labels"].reshape(keep, length).astype("int64")
            mask = values[micro, "attention_mask"].reshape(keep, length).astype("int64")
            for r in range(keep):
                self._write("samples", {
                    "step": step, "micro": micro, "row": r, "sample_id": ids[r],
                    "input_ids": full_ids[r].tolist(), "labels": labels[r].tolist(),
                    "attention_mask": mask[r].tolist(),
                })

    def _record_segment_start(self, step: int) -> None:
        """Once per segment, before its first forward: the weights' fingerprint and the optimizer's
        step count, which a resume must have restored from its checkpoint (LOOP-11)."""
        self._write("events", {"kind": "segment_start", "step": step, "time": time.time(),
                               "param_norms": self._param_norms(), "optimizer_step": self._optimizer_step()})

    def _optimizer_step(self) -> int | None:
        """Adam-style optimizers count their steps in each parameter's state: 0 when the state is
        empty (fresh); None for optimizers that keep no step count, or when none was given."""
        opt = self.optimizer
        if opt is None:
            return None
        state = next(iter(opt.state.values()), None)
        if state:
            return int(state["step"]) if "step" in state else None
        return 0 if "betas" in getattr(opt, "defaults", {}) else None

    def _param_norms(self) -> list[float]:
        """Per-tensor weight L2 norms (of this rank's pieces) in float64 (one transfer): equal norms at
        two saves mean the tensor did not move, which is how LOOP-05 finds parameters left out of the
        optimizer. NaN where the rank holds none of a tensor: an empty piece says nothing about it."""
        weights = self._pieces.weights()
        if not weights:
            return []
        with torch.no_grad():
            norms = torch.stack([w.double().norm() for w in weights]).cpu().tolist()
        return [n if w.numel() else float("nan") for n, w in zip(norms, weights)]

    def _param_fingerprints(self) -> list[int]:
        """Per tensor, the integer sum of the bit patterns of this rank's piece (one transfer): exact
        and independent of summation order, so replicas holding the same weights agree bit for bit
        (LOOP-17 compares data-parallel replicas at each checkpoint)."""
        weights = self._pieces.weights()
        with torch.no_grad():
            return torch.stack([_bit_sum(w) for w in weights]).cpu().tolist() if weights else []

    def _is_spike(self, global_norm: float | None) -> bool:
        ema = self._grad_norm_ema
        return global_norm is not None and ema is not None and ema > 0 and global_norm > SPIKE_FACTOR * ema

    def _count_nonfinite(self, bad: list[int]) -> dict[str, int]:
        counts = {}
        grads = self._pieces.step_grads()
        for i in bad:  # rare path: only tensors whose norm is already non-finite
            grad = grads[i]
            if grad is not None:
                counts[self._param_info[i]["name"]] = int((~torch.isfinite(grad)).sum())
        return counts

    def _write_triggered_hists(self, step: int, reason: str) -> None:
        """Histograms of this step's gradient pieces, taken after the optimizer step: only when the
        pieces still have the norms recorded for the step, or all of them one multiple of those (an
        in-place clip: `clip_grad_norm_`, DeepSpeed's bf16 accumulation buffer), which is undone; else
        (freed, reused, zeroed) an event saying they could not be taken."""
        if "grad_hists" in self.disabled:
            return
        grads = self._pieces.step_grads()
        index = [i for i, g in enumerate(grads) if g is not None]
        pieces = [grads[i] for i in index]
        scale = self._scale_since_recorded(pieces) if self._norms is not None and index == self._norm_index else None
        if scale is None:
            self._write("events", {"kind": "grad_hists_not_recorded", "step": step, "time": time.time(),
                                   "error": f"{reason} step: its gradients were freed or changed by the optimizer "
                                            f"step before the histograms ({self._pieces.framework})"})
            return
        if scale != 1.0:
            pieces = torch._foreach_div(pieces, scale)
        self._write_hists(step, index, _histograms(pieces).cpu().numpy(), reason)

    def _scale_since_recorded(self, pieces: list[torch.Tensor]) -> float | None:
        """1.0 when the pieces' norms are the recorded ones; c when every piece was multiplied by one
        finite c > 0 since (norms zero before stay zero); None otherwise. A rare path: one more pass
        over the gradients and one more transfer are fine here."""
        now = torch.stack(torch._foreach_norm(pieces)).float()
        if torch.equal(now.nan_to_num(nan=-1.0), self._norms.nan_to_num(nan=-1.0)):  # NaN where it was NaN
            return 1.0
        now, then = now.double().cpu().numpy(), self._norms.double().cpu().numpy()
        moved = np.isfinite(then) & (then > 0)
        if not moved.any() or not np.isfinite(then[~moved]).all() or (now[~moved] != 0).any():
            return None
        ratios = now[moved] / then[moved]
        scale = float(np.median(ratios))
        uniform = np.isfinite(ratios).all() and scale > 0 and np.abs(ratios / scale - 1).max() <= 1e-4
        return scale if uniform else None

    def _write_hists(self, step: int, index: list[int], hist: Any, reason: str) -> None:
        hist = hist.reshape(len(index), -1).astype("int64")
        for i, counts in zip(index, hist):
            self._write("grad_hists", {
                "step": step, "tensor": self._param_info[i]["name"], "reason": reason,
                "zeros": int(counts[0]), "nonfinite": int(counts[1]), "counts": counts[2:].tolist(),
            })

    # ------------------------------------------------------------------ probes

    def _run_probes(self, step: int) -> None:
        s = self.schedule
        due = {
            "probes": s.probe_every and step % s.probe_every == 0 and self._probe_inputs,
            "generations": s.generate_every and s.generations_per_prompt and step % s.generate_every == 0 and self._probe_inputs,
            "evals": s.eval_every and step % s.eval_every == 0 and self._eval_inputs,
        }
        due = [name for name, on in due.items() if on and name not in self.disabled and self._shares[name][1] is not None]
        if not due:
            return
        with self._probe_mode():
            for name in due:
                with self._guard(name, step):
                    for record in getattr(self, f"_probe_{name}")(step, *self._shares[name]):
                        self._write(name, record)

    def _share(self, prompts: list[list[int]]) -> tuple[list[int], tuple[torch.Tensor, torch.Tensor] | None, int]:
        """This rank's rows of a probe batch: every world_size-th from its rank, so data-parallel ranks
        probe in parallel, each writing its own rows (batch None: nothing to run). A sharded model's
        forward gathers its weights from every rank, so there every rank runs each probe the same
        number of times: one with no rows of its own runs row 0 and writes nothing, and generation is
        split into as many chunks as the largest share needs. Built once: the prompts never change."""
        rows = list(range(self.rank, len(prompts), self.world_size))
        largest = -(-len(prompts) // self.world_size)  # rows of the largest share (ceil)
        chunks = max(1, -(-largest // GENERATION_CHUNK))
        if not rows and self._pieces.shards_weights and prompts:
            return [], self._left_padded(prompts[:1]), chunks
        return rows, self._left_padded([prompts[i] for i in rows]) if rows else None, chunks

    @contextmanager
    def _probe_mode(self):
        """Eval mode, no grad, and the training RNG untouched: probing must not change the run."""
        was_training = self.model.training
        devices = [self._device().index] if self._device().type == "cuda" else []
        self._probing = True
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                self.model.eval()
                yield
        finally:
            self.model.train(was_training)
            self._probing = False

    def _probe_probes(self, step: int, rows: list[int], batch, _chunks: int) -> list[dict]:  # one forward
        ids, mask = self._on_device(batch)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding must not shift the positions
        logp = torch.log_softmax(self.model(input_ids=ids, attention_mask=mask, position_ids=positions)
                                 .logits[:, -1].float(), dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        top = logp.exp().topk(min(self.schedule.probe_top_k, logp.shape[-1]), dim=-1)
        probs, top_ids, entropy = (t.cpu().tolist() for t in (top.values, top.indices, entropy))
        return [{"step": step, "prompt": i, "entropy": entropy[k], "top_ids": top_ids[k], "top_probs": probs[k]}
                for k, i in enumerate(rows)]

    def _probe_generations(self, step: int, rows: list[int], batch, chunks: int) -> list[dict]:
        n = self.schedule.generations_per_prompt
        torch.manual_seed(0)  # the same sampling noise at every step: differences are the model's
        texts, lengths, stopped = self._generate(batch, chunks, sample=True)
        return [{"step": step, "prompt": r // n, "sample": r % n, "text": texts[k], "new_tokens": lengths[k],
                 "stopped": stopped[k]} for k, r in enumerate(rows)]

    def _probe_evals(self, step: int, rows: list[int], batch, chunks: int) -> list[dict]:
        texts, lengths, stopped = self._generate(batch, chunks, sample=False)
        return [{"step": step, "item": i, "id": str(self.eval_set[i].get("id", i)), "prediction": texts[k],
                 "reference": self.eval_set[i]["reference"], "new_tokens": lengths[k], "stopped": stopped[k]}
                for k, i in enumerate(rows)]

    def _generate(self, batch: tuple[torch.Tensor, torch.Tensor], chunks: int,
                  sample: bool) -> tuple[list[str], list[int], list[bool]]:
        """Batched generation on left-padded prompts, in `chunks` calls of at most GENERATION_CHUNK rows
        so a large eval set fits in memory; with sharded weights every rank generates to the last rank's
        last token (synced_gpus)."""
        tok = self.tokenizer
        eos = tok.eos_token_id
        texts, lengths, stopped = [], [], []
        sharded = self._pieces.shards_weights
        for ids, mask in zip(*(t.tensor_split(chunks) for t in self._on_device(batch))):
            with self._pieces.generation_context():
                out = self.model.generate(
                    input_ids=ids, attention_mask=mask, do_sample=sample, max_new_tokens=self.schedule.max_new_tokens,
                    pad_token_id=self._pad_id(), eos_token_id=eos, synced_gpus=sharded,  # every rank to the last token
                    **({"top_k": 0, "top_p": 1.0, "temperature": 1.0} if sample else {}),
                )[:, ids.shape[1]:].cpu()
            ended = (out == eos).any(1) if eos is not None else torch.zeros(len(out), dtype=torch.bool)
            length = torch.where(ended, (out == eos).int().argmax(1) + 1, out.shape[1]).tolist()
            texts += tok.batch_decode([row[:k] for row, k in zip(out, length)], skip_special_tokens=True)
            lengths += length
            stopped += ended.tolist()
        return texts, lengths, stopped

    def _left_padded(self, prompts: list[list[int]], repeat: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts as one left-padded batch (built once: the prompts never change)."""
        rows = [p for p in prompts for _ in range(repeat)]
        width = max((len(r) for r in rows), default=0)
        ids = torch.full((len(rows), width), self._pad_id() if rows else 0, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, row in enumerate(rows):
            ids[r, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[r, width - len(row):] = 1
        return ids, mask

    def _on_device(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        device = self._device()
        return batch[0].to(device), batch[1].to(device)

    def _pad_id(self) -> int:
        tok = self.tokenizer
        return tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)

    def _encode_prompts(self, conversations: list[list[dict]]) -> list[list[int]]:
        if not conversations:
            return []
        if self.tokenizer is None:
            self._write("events", {"kind": "probe_disabled", "probe": "prompts", "error": "no tokenizer given"})
            return []
        with self._guard("prompts"):
            return [list(self.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
                    for c in conversations]
        return []

    # ------------------------------------------------------------------ plumbing

    @contextmanager
    def _guard(self, component: str, step: int | None = None):
        """Run one component; on any exception record it, switch the component off, carry on.

        Callers skip components already in `self.disabled` before entering."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - the shim must never take training down
            self.disabled.add(component)
            step = self._step if step is None else step
            record = {"kind": "shim_error", "probe": component, "step": step, "time": time.time(),
                      "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)}
            try:
                self._write("events", record)
                self._write("events", {"kind": "probe_disabled", "probe": component, "step": step})
            except Exception:  # noqa: BLE001
                pass
            if self.rank == 0 and len(self.disabled - {"writer"}) == 1:
                # One line for the run: later failures (other components, other ranks) are in the events.
                warnings.warn(f"sftaudit: {component} recording failed at step {step} and was switched off "
                              f"({type(exc).__name__}: {exc}); further shim errors go to the run's events "
                              f"only", stacklevel=3)

    def _write(self, kind: str, record: dict) -> None:
        if "writer" in self.disabled:
            return
        try:
            self._writer.write(kind, {"seg": self.segment, **record})
        except Exception as exc:  # noqa: BLE001 - a full disk must not stop training either
            self.disabled.add("writer")
            warnings.warn(f"sftaudit: writing artifacts failed; recording stopped: {exc}", stacklevel=3)

    def _hash_files(self, step: int, path: str, files: list[Path]) -> None:
        try:
            hashes = {}
            for f in files:
                h = hashlib.sha256()
                with open(f, "rb") as fh:
                    for chunk in iter(lambda: fh.read(1 << 20), b""):
                        h.update(chunk)
                hashes[self._relative(f)] = h.hexdigest()
            self._write("checkpoints", {"event": "hashed", "step": step, "path": path, "sha256": hashes})
        except Exception as exc:  # noqa: BLE001
            self._write("events", {"kind": "shim_error", "probe": "checkpoint_hash", "step": step,
                                   "error": f"{type(exc).__name__}: {exc}", "time": time.time()})

    def _save_tokenizer(self) -> None:
        target = artifact_root(self.run_dir) / TOKENIZER_DIR
        if self.rank == 0 and not target.exists() and hasattr(self.tokenizer, "save_pretrained"):
            self.tokenizer.save_pretrained(str(target))

    def _relative(self, path: Path) -> str:
        try:
            return str(path.resolve().relative_to(self.run_dir.resolve()))
        except ValueError:
            return str(path.resolve())

    def _device(self) -> torch.device:
        return next((w.device for w in self._pieces.weights()[:1]), torch.device("cpu"))


def _to_host(tensors: list[torch.Tensor]) -> list[Any]:
    """One device-to-host copy for all of a step's values (float32 holds token ids < 2**24 exactly)."""
    if not tensors:
        return []
    # cat promotes mixed dtypes (bool, int64, float32) to one; a single conversion follows. All detached already.
    flat = torch.cat([t.reshape(-1) for t in tensors]).to(torch.float32).cpu().numpy()
    out, offset = [], 0
    for t in tensors:
        n = t.numel()
        out.append(flat[offset:offset + n].reshape(t.shape))
        offset += n
    return out


def _bit_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of a tensor's elements read as integers of their width (int64 wraps on overflow)."""
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().contiguous().view(bits).sum(dtype=torch.int64)


def _attention_inputs(module, args, kwargs, output) -> dict:
    """What decides whether packed samples attend to each other in a transformers forward (LOOP-16): the
    attention mask handed to the model ("none", a 2-D "padding" mask, or a "custom" 4-D / block mask) and
    whether the forward built a KV cache. With a 2-D mask or a cache, sdpa and eager attention ignore
    position_ids restarts (masking_utils only reads them when both are absent). No tensor is read."""
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    kind = "none" if mask is None else "padding" if torch.is_tensor(mask) and mask.dim() == 2 else "custom"
    if isinstance(output, Mapping) and hasattr(type(output), "past_key_values"):  # a transformers ModelOutput
        # Its fields are keys only when not None; transformers 5 renamed past_key_values (which then warns).
        cache = ("cache" if hasattr(type(output), "cache") else "past_key_values") in output
    else:
        cache = kwargs.get("use_cache", getattr(getattr(module, "config", None), "use_cache", None))
    return {"attention_mask_kind": kind, "cache_built": cache}


def _histograms(grads: list[torch.Tensor]) -> torch.Tensor:
    """Per tensor: [zeros, non-finite, counts of log10|g| in GRAD_HIST_EDGES bins]."""
    lo, hi, bins = GRAD_HIST_EDGES[0], GRAD_HIST_EDGES[-1], len(GRAD_HIST_EDGES) - 1
    rows = []
    for g in grads:
        g = g.detach().float().reshape(-1)
        finite = torch.isfinite(g)
        mag = torch.log10(g[finite].abs().clamp_min(1e-30))
        rows.append(torch.cat([
            (g == 0).sum().reshape(1).float(), (~finite).sum().reshape(1).float(),
            torch.histc(mag.clamp(lo, hi - 1e-6), bins=bins, min=lo, max=hi),
        ]))
    return torch.stack(rows)


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    dist = torch.distributed
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", 0))
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    return rank, world_size


def _describe_model(model: torch.nn.Module) -> dict:
    config = getattr(model, "config", None)
    return {
        "class": type(model).__name__,
        "config": jsonable(config.to_dict()) if hasattr(config, "to_dict") else None,
        "tie_word_embeddings": getattr(config, "tie_word_embeddings", None),
        # What generate() stops on (LOOP-02 compares it with the template's end-of-turn marker).
        "generation_eos": jsonable(getattr(getattr(model, "generation_config", None), "eos_token_id", None)),
        "attn_implementation": getattr(config, "_attn_implementation", None),
        "dropout": {k: v for k, v in (config.to_dict().items() if hasattr(config, "to_dict") else [])
                    if "dropout" in k and isinstance(v, (int, float))},
    }


def _marker_rows(model: torch.nn.Module, tokenizer: Any) -> dict | None:
    """Embedding and output row norms of the added tokens the chat template writes, with the median
    row norm, at start: a base model's untrained chat markers are near zero. One host sync."""
    template = getattr(tokenizer, "chat_template", None)
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids = sorted(int(i) for i, t in added.items() if isinstance(template, str) and t.content and t.content in template)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not ids or embed is None or max(ids) >= embed.weight.shape[0]:
        return None
    with torch.no_grad():
        rows = [embed.weight] + ([output.weight] if output is not None and output.weight.shape[0] > max(ids) else [])
        norms = [w.float().norm(dim=1) for w in rows]
        stats = torch.stack([torch.cat([n[ids], n.median().reshape(1)]) for n in norms]).cpu().tolist()
    return {"ids": ids, "tokens": [added[i].content for i in ids], "embed_norm": stats[0][:-1],
            "embed_median": stats[0][-1], "embed_trainable": bool(embed.weight.requires_grad),
            "output_norm": stats[1][:-1] if len(stats) > 1 else None,
            "output_median": stats[1][-1] if len(stats) > 1 else None,
            "output_trainable": bool(output.weight.requires_grad) if len(stats) > 1 else None}


def _library_versions() -> dict[str, str]:
    """Versions of the training libraries installed, from their package metadata (importing them here
    would cost seconds), so two runs in one environment record the same, whatever each imported."""
    found = {}
    for name in ("transformers", "trl", "accelerate", "peft", "deepspeed"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found
