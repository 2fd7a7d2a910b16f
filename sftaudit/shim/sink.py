"""The recorder's guarded sink: every record goes through it, and no failure of the shim reaches training.

A component (batches, gradients, a probe, ...) runs under `guard`: an exception is recorded as a
``shim_error`` event and switches that component off. A failing writer (a full disk) switches all
recording off. Checkpoint files are hashed in background threads.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from ..core.hashing import file_sha256
from .writer import JsonlWriter, read_jsonl


class Sink:
    """One rank folder's records, each stamped with its segment (how many manifests came before)."""

    def __init__(self, folder: Path, rank: int, current_step: Callable[[], int | None]):
        self._writer = JsonlWriter(folder)
        self.segment = len(read_jsonl(folder / "manifest.jsonl"))
        self.rank = rank
        self.disabled: set[str] = set()
        self._current_step = current_step  # the step an error is dated at, read when it happens
        self._hashers: list[threading.Thread] = []

    def guard(self, component: str, step: int | None = None) -> _Guard:
        """Run one component; on any exception record it, switch the component off, carry on.

        Callers skip components already in `disabled` before entering."""
        return _Guard(self, component, step)

    def _failed(self, component: str, step: int | None, exc: Exception) -> None:
        self.disabled.add(component)
        step = self._current_step() if step is None else step
        record = {
            "kind": "shim_error",
            "probe": component,
            "step": step,
            "time": time.time(),
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=8)),
        }
        try:
            self.write("events", record)
            self.write("events", {"kind": "probe_disabled", "probe": component, "step": step})
        except Exception:  # noqa: BLE001
            pass
        if self.rank == 0 and len(self.disabled - {"writer"}) == 1:
            # One line for the run: later failures (other components, other ranks) are in the events.
            notice(
                f"{component} recording failed at step {step} and was switched off ({type(exc).__name__}: "
                f"{exc}); training goes on, further shim errors go to the run's events only"
            )

    def write(self, kind: str, record: dict) -> None:
        if "writer" in self.disabled:
            return
        try:
            self._writer.write(kind, {"seg": self.segment, **record})
        except Exception as exc:  # noqa: BLE001 - a full disk must not stop training either
            self.disabled.add("writer")
            notice(f"writing artifacts failed; recording stopped, training goes on: {exc}")

    def sync(self) -> None:
        self._writer.sync()

    def hash_later(self, step: int, path: str, files: list[Path], names: list[str]) -> None:
        """A checkpoint's files hashed in a background thread: a ``hashed`` record when done."""
        worker = threading.Thread(target=self._hash_files, args=(step, path, files, names), daemon=True)
        worker.start()
        self._hashers.append(worker)

    def _hash_files(self, step: int, path: str, files: list[Path], names: list[str]) -> None:
        try:
            hashes = {name: file_sha256(f) for f, name in zip(files, names)}
            self.write("checkpoints", {"event": "hashed", "step": step, "path": path, "sha256": hashes})
        except Exception as exc:  # noqa: BLE001
            self.write(
                "events",
                {
                    "kind": "shim_error",
                    "probe": "checkpoint_hash",
                    "step": step,
                    "error": f"{type(exc).__name__}: {exc}",
                    "time": time.time(),
                },
            )

    def wait_for_hashes(self) -> None:
        for worker in self._hashers:
            worker.join(timeout=60)

    def close(self) -> None:
        self._writer.close()


NOTICE_CHARS = 400


def notice(text: str) -> None:
    """What the shim must tell the person watching training: one line on stderr, prefixed ``sftaudit:`` (a
    Python warning prints its source line under it, which reads like a crash). Never raises."""
    line = " ".join(str(text).split())
    try:
        print(f"sftaudit: {line[:NOTICE_CHARS]}", file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - a closed stderr must not stop training
        pass


class _Guard:
    """`Sink.guard`'s context: a plain class, entered several times a step (a generator-based context
    manager costs a generator and its frames each time)."""

    __slots__ = ("_sink", "_component", "_step")

    def __init__(self, sink: Sink, component: str, step: int | None):
        self._sink, self._component, self._step = sink, component, step

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None or not isinstance(exc, Exception):  # BaseException (KeyboardInterrupt) goes on up
            return False
        self._sink._failed(self._component, self._step, exc)  # the shim must never take training down
        return True
