"""The guard: a run stopped at the step it goes wrong, or when asked, with its last good checkpoint kept.

Off by default: the shim records only. With ``guard="stop"`` (or ``"raise"``) the recorder acts on

* a fail it sees itself in the values the step's one host transfer already brings: a non-finite loss or global
  gradient norm. Under a loss scaler, which skips such a step and lowers its scale, one is no fail; a streak of
  them is, once it has driven the scale below 1 (every scale the scaler could try overflowed: the values are
  non-finite unscaled). A scaler whose scale cannot be read, or a static one, is given the halvings that take
  the default starting scale (2**16, torch's and DeepSpeed's) down to 1: 16 skipped steps in a row.
* a stop request in the run folder (`sftaudit.core.artifacts.StopRequest`, written by ``sftaudit watch``
  or by hand), looked for with one ``os.stat`` at most every ``check_seconds`` at a step's end. A request older
  than the recorder's start is left from an earlier segment and ignored.

When it acts (once): `Recorder.should_stop` turns true (the Trainer callback sets
``control.should_training_stop`` from it); a step at or after the first bad one is `poisoned`, and no checkpoint
is saved there (the callback turns ``control.should_save`` off; a plain loop checks ``should_stop`` before it
saves); the last checkpoint saved before the first bad step is kept out of the trainer's rotation as hard links
under ``RUN_DIR/sftaudit/kept/<name>/`` (a ``kept`` checkpoint record names it; rank 0); a ``halted`` event
and the close record say why; and with ``"raise"``, closing the recorder raises `TrainingHalted`.

Cost on an ordinary step, one process: a few comparisons of floats already on the host and one clock read; no
device work, no host sync. With several ranks every rank must stop at the same step (one that went on would
wait for the others forever), so each rank's local verdict (non-finite value, request seen) is all-reduced
(MAX, two floats) and the result rides in the step's one transfer: a collective per step, no extra host sync.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.artifacts import KEPT_DIR, StopRequest, artifact_root, read_stop_request, stop_request_path
from .sink import Sink, notice
from .writer import read_jsonl

MODES = ("off", "stop", "raise")
DEFAULT_CHECK_SECONDS = 1.0
# A scaler whose scale cannot be read: the halvings from the default starting scale, 2**16, down to 1.
UNREAD_SCALE_STREAK = 16


@dataclass
class Halt:
    """Why and where the guard stopped the run (the ``halted`` event and the close record's ``halted``)."""

    source: str  # nonfinite_loss | nonfinite_grad | skipped_steps | stop_request
    reason: str
    step: int  # the step it acted at
    anomaly_step: int | None  # the first bad step: no checkpoint from it on is saved or kept
    code: str | None = None
    kept: str | None = None  # the kept copy of the last checkpoint before anomaly_step, relative to RUN_DIR
    kept_from: str | None = None  # that checkpoint, relative to RUN_DIR

    def record(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def message(self) -> str:
        kept = f"; {self.kept_from} kept as {self.kept}: resume from it" if self.kept else ""
        return f"training halted at step {self.step}: {self.reason}{kept}"


class TrainingHalted(RuntimeError):
    """Raised when a recorder with ``guard="raise"`` closes on a run its guard stopped: the run did not complete."""

    def __init__(self, halt: Halt):
        super().__init__(halt.message())
        self.halt = halt


class Guard:
    """One recorder's guard. `parts` adds its device values to the step's transfer; `after_step` decides."""

    def __init__(
        self,
        mode: str,
        run_dir: Path,
        rank_folder: Path,
        sink: Sink,
        rank: int,
        world_size: int,
        scaler: Any,
        skips_nonfinite: bool,
        check_seconds: float,
        relative: Any,
    ):
        if mode not in MODES:
            raise ValueError(f"guard must be one of {', '.join(MODES)}, not {mode!r}")
        self.mode = mode
        self.active = mode != "off"
        self.halt: Halt | None = None
        self._run_dir = run_dir
        self._checkpoints = rank_folder / "checkpoints.jsonl"
        self._request_path = stop_request_path(run_dir)
        self._sink = sink
        dist = torch.distributed
        self._rank = rank
        self._agree = self.active and world_size > 1 and dist.is_available() and dist.is_initialized()
        self._scaler = scaler if skips_nonfinite else None
        self._check_seconds = max(0.0, float(check_seconds))
        self._relative = relative  # Path -> str relative to RUN_DIR
        self._started = time.time()  # a request older than this is left from an earlier segment
        self._next_check = 0.0  # time.monotonic() of the next look for a request
        self._request: StopRequest | None = None
        self._ignored: set[float] = set()  # requested_at of requests already said to be ignored
        self._streak, self._streak_start = 0, None

    # ------------------------------------------------------------------ per step

    def parts(self, reference: torch.Tensor | None, losses: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """The guard's device values for the step's transfer: the loss scaler's scale when it is a tensor on the
        step's device, and with several ranks the agreed verdict. Looks for a stop request when one is due."""
        if not self.active or self.halt is not None:
            return []
        out = []
        if "guard" not in self._sink.disabled:
            with self._sink.guard("guard"):
                self._look_for_request()
                scale = getattr(self._scaler, "_scale", None)
                if torch.is_tensor(scale) and reference is not None and scale.device == reference.device:
                    out.append(("scale", scale.reshape(1)))
        if self._agree:  # on every rank at every step, whatever failed before it
            out.append(("agreed", self._agreed(reference, losses)))
        return out

    def after_step(self, step: int, loss: float | None, grad_norm: float | None, values: dict) -> Halt | None:
        """Decide on the step's host values (``values[("guard", key)]`` from `parts`); the halt, when it acts now."""
        if not self.active or self.halt is not None:
            return None
        loss_bad = loss is not None and not math.isfinite(loss)
        grad_bad = grad_norm is not None and not math.isfinite(grad_norm)
        requested = self._request is not None
        if ("guard", "agreed") in values:  # every rank decides on what any rank saw
            agreed = values["guard", "agreed"]
            if agreed[0] > 0 and not (loss_bad or grad_bad):
                grad_bad = True  # another rank's loss or gradient piece
            if agreed[1] > 0 and not requested:
                self._request = self._read_request(any_age=True)
                requested = True
        if requested:
            r = self._request or StopRequest("stop requested on another rank")
            return self._act("stop_request", f"stop requested: {r.reason}", step, r.step, r.code)
        if not (loss_bad or grad_bad):
            self._streak, self._streak_start = 0, None
            return None
        what = f"the loss is {loss}" if loss_bad else f"the gradient norm is {grad_norm}"
        if self._scaler is None:
            source = "nonfinite_loss" if loss_bad else "nonfinite_grad"
            return self._act(source, what, step, step)
        self._streak += 1
        if self._streak_start is None:
            self._streak_start = step
        scale, dynamic = self._scale(values)
        if (dynamic and scale is not None and scale < 1) or (not dynamic and self._streak > UNREAD_SCALE_STREAK):
            at = f" and its scale fell to {scale:g}, below 1" if dynamic else ""
            return self._act(
                "skipped_steps",
                f"{self._streak} steps in a row skipped by the loss scaler for non-finite values since step "
                f"{self._streak_start}{at}: {what} at step {step}",
                step,
                self._streak_start,
            )
        return None

    def poisoned(self, step: int) -> bool:
        """Whether a checkpoint at `step` would hold what the guard stopped the run for."""
        h = self.halt
        return h is not None and h.anomaly_step is not None and step >= h.anomaly_step

    # ------------------------------------------------------------------ acting

    def _act(self, source: str, reason: str, step: int, anomaly_step: int | None, code: str | None = None) -> Halt:
        self.halt = halt = Halt(source, reason, step, anomaly_step, code)
        if self._rank == 0 and anomaly_step is not None:
            with self._sink.guard("guard_keep"):
                self._keep_last_good(halt)
        self._sink.write("events", {"kind": "halted", "step": step, "time": time.time(), "halted": halt.record()})
        if self._rank == 0:
            notice(f"guard: {halt.message()}")
        return halt

    def _keep_last_good(self, halt: Halt) -> None:
        """The last checkpoint saved before the first bad step, hard-linked under ``sftaudit/kept/``: the trainer's
        rotation (``save_total_limit``) deletes only ``checkpoint-*`` folders at the top of its output_dir."""
        latest: dict[str, dict] = {}  # path -> its last save (a resumed run may save a path again)
        for r in read_jsonl(self._checkpoints):
            if r.get("event") == "saved" and isinstance(r.get("step"), int) and isinstance(r.get("path"), str):
                latest[r["path"]] = r
        before = [r for r in latest.values() if r["step"] < halt.anomaly_step]
        for record in sorted(before, key=lambda r: r["step"], reverse=True):
            source = Path(record["path"])
            source = source if source.is_absolute() else self._run_dir / source
            if source.exists():
                kept = keep_copy(self._run_dir, source)
                halt.kept, halt.kept_from = self._relative(kept), record["path"]
                self._sink.write(
                    "checkpoints",
                    {
                        "event": "kept",
                        "step": record["step"],
                        "path": record["path"],
                        "kept_path": halt.kept,
                        "time": time.time(),
                    },
                )
                return

    # ------------------------------------------------------------------ inputs

    def _look_for_request(self) -> None:
        if self._request is not None:
            return
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + self._check_seconds
        try:
            os.stat(self._request_path)
        except OSError:
            return
        self._request = self._read_request()

    def _read_request(self, any_age: bool = False) -> StopRequest | None:
        """The request, when it is one for this segment; else None, said once in the events."""
        try:
            request = read_stop_request(self._run_dir)
        except Exception as exc:  # noqa: BLE001 - a file that is not a request must not stop the run
            self._ignore(None, f"{type(exc).__name__}: {exc}")
            return None
        if request is not None and not any_age and request.requested_at < self._started:
            self._ignore(request.requested_at, "requested before this segment started")
            return None
        return request

    def _ignore(self, at: float | None, why: str) -> None:
        if at in self._ignored:
            return
        self._ignored.add(at)
        self._sink.write("events", {"kind": "stop_request_ignored", "time": time.time(), "error": why})
        if self._rank == 0:
            notice(f"guard: the stop request in the run folder was ignored ({why})")

    def _agreed(self, reference: torch.Tensor | None, losses: list[torch.Tensor]) -> torch.Tensor:
        """[any rank saw a non-finite loss or gradient, any rank saw a request], reduced on device (no host sync:
        the result is read in the step's transfer). Every rank calls the collective every step, whatever failed."""
        device = reference.device if reference is not None else losses[0].device if losses else torch.device("cpu")
        try:
            local = torch.cat([t.reshape(-1).float() for t in (*losses, reference) if t is not None])
            bad = local.isfinite().logical_not().any().float().reshape(1)
        except Exception:  # noqa: BLE001 - the collective below must still run
            bad = torch.zeros(1, device=device)
        flags = torch.cat([bad, torch.full_like(bad, 1.0 if self._request is not None else 0.0)])
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        return flags

    def _scale(self, values: dict) -> tuple[float | None, bool]:
        """(the loss scaler's current scale, whether it backs off when it skips)."""
        if ("guard", "scale") in values:
            return float(values["guard", "scale"][0]), True
        scale = getattr(self._scaler, "cur_scale", None)  # DeepSpeed's: a Python number
        if isinstance(scale, (int, float)) and not isinstance(scale, bool):
            return float(scale), bool(getattr(self._scaler, "dynamic", True))
        return None, False


def keep_copy(run_dir: Path, source: Path) -> Path:
    """`source` (a checkpoint folder or file) copied as hard links under ``RUN_DIR/sftaudit/kept/`` (a plain copy
    where the file system has none), under its own name or, when that is taken, ``<name>.2``, ``<name>.3``..."""
    folder = artifact_root(run_dir) / KEPT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    target, n = folder / source.name, 1
    while target.exists():
        n += 1
        target = folder / f"{source.name}.{n}"
    staging = folder / f".{target.name}.partial"
    if staging.exists():
        shutil.rmtree(staging) if staging.is_dir() else staging.unlink()
    if source.is_dir():
        shutil.copytree(source, staging, symlinks=True, copy_function=_link_or_copy)
    else:
        _link_or_copy(source, staging)
    os.replace(staging, target)  # whole or not at all
    return target


def _link_or_copy(src: str | Path, dst: str | Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


__all__ = ["DEFAULT_CHECK_SECONDS", "MODES", "Guard", "Halt", "TrainingHalted", "keep_copy"]
