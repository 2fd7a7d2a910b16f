"""`sftaudit watch RUN_DIR`: follow a run as it trains; print each new finding once, alert, ask the run to stop.

Every `--interval` seconds or more (`CpuBudget`) the run goes through the audit's one entry point
(`sftaudit.verdict.audit.audited`: import a Trainer output again, ingest what is new, judge again only when the
database changed). A finding is new the first time its (code, severity, step, checkpoint) is seen: it is printed
then, posted to `--notify` when it is a warn or fail, and annotated with `--github`; one that tells again an event
printed before (a finding folded into it, or it into one: `also_flagged_by`) is printed saying so, not posted.
LOOP-24 (the run ended before its plan) is held back while the run trains: a run that has not ended has not stopped
early. The watch ends at the first blocking finding (`--exit-on`), when the run's close record appears, or when
nothing new came for `--idle-timeout` seconds.

A poll still costs time in proportion to the run's length (the checks of the per-step log judge it whole), so
the watch paces itself (`CpuBudget`): over any stretch of time it takes at most `--max-cpu` of a core, plus a
burst of two minutes' worth (the first judgement of a long history); what grows with the run is the time
between polls.
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from .._version import __version__
from ..core.safe_io import UnsafeFile
from ..core.terminal import shown
from ..errors import InputError, one_line
from .common import EXIT_CANNOT_JUDGE, EXIT_FAIL, error, exit_code, say

# Checks whose finding is about how the run ended: judged only once it has (closed, or gone idle).
JUDGED_AT_END = frozenset({"LOOP-24"})
M_ARENA_MAX = -8  # glibc's `mallopt` parameter (<malloc.h>)


def run(args) -> int:
    from ..verdict.config import AuditConfig

    config = AuditConfig.load(args.config)
    steady_heap()
    notifier = Notifier(args.notify) if args.notify else None
    try:
        return Watch(args, config, notifier).follow()
    finally:
        if notifier is not None:
            notifier.close()
            if notifier.summary():
                error(notifier.summary())


def steady_heap() -> bool:
    """Set glibc's allocator up for a process that polls for hours; whether it could (glibc only).

    By default each thread that allocates (DuckDB's) gets a heap arena of its own, up to eight a core, and what a
    poll frees stays in them, fragmented by the next poll's blocks of other sizes: a watch held about a megabyte more
    after each poll that judged new steps, half that with two arenas (`benchmarks/poll_memory.py`; its peak over a
    420,000-step soak 534 MB, 708 without). Mapping large blocks on their own as well kept it flatter still, at a
    quarter more CPU a poll: not done."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return False
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (ValueError, OSError, AttributeError):  # not glibc
        return False
    return mallopt(M_ARENA_MAX, 2) == 1


class CpuBudget:
    """A token bucket of CPU seconds: `share` of a second earned each second, up to `BURST_S` seconds' worth
    (the bucket starts full); a poll spends the CPU it took (`process_time`: DuckDB's threads included) and the
    next waits until the balance is no longer negative. Over any T seconds the polls take at most
    share x (T + BURST_S) CPU seconds, and the one poll that overdrew the balance."""

    BURST_S = 120.0

    def __init__(self, share: float, clock=time.monotonic):
        self.share, self.clock = share, clock
        self.balance, self.at = share * self.BURST_S, clock()

    def spend(self, cpu_seconds: float) -> None:
        now = self.clock()
        self.balance = min(self.share * self.BURST_S, self.balance + (now - self.at) * self.share) - cpu_seconds
        self.at = now

    def wait(self) -> float:
        """Seconds until the balance is back to zero (0 while it is not below)."""
        return max(0.0, -self.balance / self.share)


def finding_key(f: dict[str, Any]) -> tuple:
    """What makes a finding the same finding from one poll to the next (its message may grow with the run)."""
    return (f["code"], f["severity"], f["step"], f.get("checkpoint"))


class Watch:
    def __init__(self, args, config, notifier: Notifier | None):
        self.args, self.config, self.notifier = args, config, notifier
        self.run_dir: Path = args.run_dir
        self.blocking = ("fail", "warn") if args.exit_on == "warn" else ("fail",)
        self.seen: set[tuple] = set()
        self.told: dict[tuple, str] = {}  # the key of a finding folded into one printed -> that one's rule
        self.annotated = {"error": 0, "warning": 0}
        self.unannotated: dict[str, list[str]] = {"error": [], "warning": []}
        self.stop_written = False

    def follow(self) -> int:
        say(
            f"watching {shown(self.run_dir)} every {self.args.interval:g} s or more, taking at most "
            f"{self.args.max_cpu:.0%} of a core"
            + (f" (until {self.args.idle_timeout:g} s without a new record)" if self.args.idle_timeout else "")
        )
        last_news, waiting, verdict = time.monotonic(), None, None
        budget = CpuBudget(self.args.max_cpu)
        while True:
            polled, cpu = time.monotonic(), time.process_time()
            try:
                verdict, grew, end = self._poll()
                waiting = None
            except UnsafeFile:  # refused for what it is (a link out of the run, a FIFO): no wait makes it readable
                raise
            except InputError as exc:  # nothing to read yet (a run about to start), or not yet readable
                grew, end = False, None
                if str(exc) != waiting:
                    waiting = str(exc)
                    say(f"waiting: {shown(waiting)}")
            if grew:
                last_news = polled
            idle = self.args.idle_timeout and time.monotonic() - last_news >= self.args.idle_timeout
            if verdict is not None:
                new, retold = self._new(verdict, ended=bool(end or idle))
                self._report(verdict, new, retold)
                if any(f["severity"] in self.blocking for f in new) and self.args.exit_on:
                    first = next(f for f in new if f["severity"] in self.blocking)
                    say(f"{shown(verdict['run'])}: stopped watching at the first {first['severity']} ({first['code']})")
                    return self._finish(verdict, EXIT_FAIL)
            if end:
                return self._finish(verdict, self._ended(verdict, end))
            if idle:
                if verdict is None:
                    raise InputError(f"{waiting} (still, after {self.args.idle_timeout:g} s)")
                say(
                    f"{shown(verdict['run'])}: no new record for {self.args.idle_timeout:g} s (--idle-timeout): "
                    f"stopped watching at step {_last_step(verdict)}; the run has not closed"
                )
                return self._finish(verdict, self._exit(verdict))
            budget.spend(time.process_time() - cpu)
            time.sleep(max(0.0, self.args.interval - (time.monotonic() - polled), budget.wait()))

    def _poll(self) -> tuple[dict[str, Any], bool, dict[str, Any] | None]:
        """One audit of what the run holds now: the verdict, whether anything new was read, its close record."""
        from ..store.rundb import connect, has_table
        from ..verdict.audit import audited

        args = self.args
        if not self.run_dir.is_dir():  # a watch started before its run
            raise InputError(f"{self.run_dir}: no such folder yet")
        with audited(
            self.run_dir, self.config, data=args.data, source=args.source, log_file=args.log_file, judge="if_stale"
        ) as done:
            if done.verdict is None:
                raise InputError(f"{self.run_dir}: nothing recorded yet")
            con = connect(self.run_dir, read_only=True, views=False)  # its events alone
            try:
                end = None
                if has_table(con, "events") and has_table(con, "manifest"):
                    row = con.execute(
                        """SELECT step, error, halted FROM events WHERE rank = 0 AND kind = 'close'
                           AND seg = (SELECT max(seg) FROM manifest WHERE rank = 0) ORDER BY step DESC LIMIT 1"""
                    ).fetchone()
                    end = None if row is None else {"step": row[0], "error": row[1], "halted": _json(row[2])}
            finally:
                con.close()
            return done.verdict, any(done.added.values()), end

    def _new(self, verdict: dict[str, Any], ended: bool) -> tuple[list[dict[str, Any]], list[tuple[dict, str]]]:
        """The findings first seen at this poll: those of a new event, and those that tell again, at the same
        severity, an event a finding printed at an earlier poll told, with what told it. A spike LOOP-05 flags is
        folded into LOOP-27's finding of it (`also_flagged_by`) while LOOP-27 calls it isolated: LOOP-27's finding
        may come a poll after LOOP-05's, or give way to it when the norm stays up."""
        new, retold = [], []
        for f in verdict["findings"]:
            key = finding_key(f)
            if key in self.seen or (f["code"] in JUDGED_AT_END and not ended):
                continue
            self.seen.add(key)
            folded = {
                (x["rule"].split("/")[0], f["severity"], f["step"], f.get("checkpoint")): x["rule"]
                for x in f["evidence"].get("also_flagged_by") or []
            }
            first = [rule for k, rule in folded.items() if k in self.seen]
            if not first and key in self.told:
                first = [self.told[key]]
            if first:
                retold.append((f, ", ".join(first)))
            else:
                new.append(f)
            self.told.update(dict.fromkeys(folded, f["rule"]))
        return new, retold

    def _report(self, verdict: dict[str, Any], new: list[dict[str, Any]], retold: list[tuple[dict, str]]) -> None:
        """Print each new finding (post and annotate its warn or fail); print a retold one with what told it
        first, and nothing more: its event was posted, annotated and acted on then."""
        if not new and not retold:
            return
        lines = [f"{f['code']} {f['severity']:<4} {_where(f)}: {shown(f['message'])}" for f in new]
        lines += [
            f"{f['code']} {f['severity']:<4} {_where(f)}: {shown(f['message'])} (the event {first} told above)"
            for f, first in retold
        ]
        if self.args.github:
            from ..outputs import github

            with github.commands_off():
                say("\n".join(lines))
            self._annotate(verdict, new)
        else:
            say("\n".join(lines))
        sys.stdout.flush()
        alerts = [f for f in new if f["severity"] in ("warn", "fail")]
        if self.notifier is not None:
            from ..outputs.webhook import payload

            for f in alerts:
                self.notifier.send(payload(f, verdict["run"]))
        if self.args.stop_on and not self.stop_written:
            self._request_stop(verdict, alerts)

    def _request_stop(self, verdict: dict[str, Any], alerts: list[dict[str, Any]]) -> None:
        """`--stop-on fail|warn`: the first such finding becomes the stop request the run's guard reads."""
        from ..core.artifacts import write_stop_request

        stopping = ("fail", "warn") if self.args.stop_on == "warn" else ("fail",)
        first = next((f for f in alerts if f["severity"] in stopping), None)
        if first is None:
            return
        path = write_stop_request(
            self.run_dir,
            f"{first['code']} {first['severity']} at {_where(first)}: {first['message']}",
            step=first["step"],
            code=first["code"],
        )
        self.stop_written = True
        say(f"asked the run to stop ({shown(path)}): sftaudit's guard stops it at its next step")

    def _annotate(self, verdict: dict[str, Any], new: list[dict[str, Any]]) -> None:
        """Each new warn or fail as a GitHub annotation, within GitHub's per-step caps (the rest are counted and
        rolled up in one line at the end)."""
        from ..outputs import github

        strict = self.args.exit_on == "warn"
        for f in new:
            line = github.annotations(
                {"findings": [f], "checkpoints": verdict.get("checkpoints") or []}, self.run_dir, strict=strict
            )
            if not line:
                continue
            level = "error" if line.startswith("::error") else "warning"
            if self.annotated[level] < github.ANNOTATIONS_PER_LEVEL - 1:
                self.annotated[level] += 1
                sys.stdout.write(line)
            else:
                self.unannotated[level].append(f["code"])
        sys.stdout.flush()

    def _ended(self, verdict: dict[str, Any], end: dict[str, Any]) -> int:
        name = shown(verdict["run"])
        if end["halted"]:
            halted = end["halted"]
            say(f"{name}: sftaudit's guard stopped the run at step {end['step']}: {shown(halted.get('reason'))}")
            return max(EXIT_FAIL, self._exit(verdict))
        if end["error"]:
            say(f"{name}: the run closed at step {end['step']} on an error: {shown(end['error'])}")
            return max(EXIT_FAIL, self._exit(verdict))
        say(f"{name}: the run closed at step {end['step']} (its close record)")
        return self._exit(verdict)

    def _exit(self, verdict: dict[str, Any]) -> int:
        """The audit's exit code for the final verdict, said in one line."""
        if verdict.get("cannot_judge"):
            from ..verdict.audit import unjudged_reason

            error(unjudged_reason(verdict))
        else:
            say(f"{shown(verdict['run'])}: {verdict['verdict'].upper()}")
        return exit_code(verdict["verdict"], self.args.exit_on == "warn")

    def _finish(self, verdict: dict[str, Any] | None, code: int) -> int:
        if self.args.github and verdict is not None:
            from ..outputs import github
            from ..outputs.markdown import render
            from .common import manifest_versions

            rolled = [
                github.command(
                    level,
                    f"{len(codes)} more {level}s not annotated (GitHub shows {github.ANNOTATIONS_PER_LEVEL} per step): "
                    + ", ".join(sorted(set(codes))),
                    title=f"sftaudit: {len(codes)} more {level}s",
                )
                + "\n"
                for level, codes in self.unannotated.items()
                if codes
            ]
            markdown = render(verdict, heading="sftaudit watch", versions=manifest_versions(self.run_dir))
            github.publish("".join(rolled), markdown, os.environ.get("GITHUB_STEP_SUMMARY"))
        return code if verdict is not None else EXIT_CANNOT_JUDGE


def _where(f: dict[str, Any]) -> str:
    return "run" if f["step"] is None else f"step {f['step']}"


def _last_step(verdict: dict[str, Any]) -> Any:
    ranks = (verdict.get("evidence") or {}).get("ranks") or []
    return max((r["last_step"] for r in ranks if r.get("last_step") is not None), default=None)


def _json(value: Any) -> Any:
    try:
        return json.loads(value) if isinstance(value, str) else value
    except ValueError:
        return {"reason": value}


class Notifier:
    """Posts alerts to a webhook from a worker thread, so a slow or failing endpoint never holds the watch up.

    The queue holds at most `QUEUE` alerts: when full, the oldest is dropped (and counted). Each alert is tried
    up to `ATTEMPTS` times, waiting `BACKOFF_S` x 2^n between tries (a 429's Retry-After, up to `MAX_WAIT_S`);
    a 4xx other than 408 and 429 is not retried (the payload or the address is wrong). The URL is never printed:
    a webhook's address is its secret."""

    QUEUE = 100
    ATTEMPTS = 5
    BACKOFF_S = 0.5
    MAX_WAIT_S = 30.0
    TIMEOUT_S = 10.0
    DRAIN_S = 15.0  # at the end, how long the last alerts may take to go out

    def __init__(self, url: str):
        self.url = url
        self.queue: collections.deque[dict[str, Any]] = collections.deque()
        self.ready = threading.Condition()
        self.closing = False
        self.sent = self.dropped = self.failed = 0
        self.last_error: str | None = None
        self.thread = threading.Thread(target=self._work, name="sftaudit-notify", daemon=True)
        self.thread.start()

    def send(self, body: dict[str, Any]) -> None:
        with self.ready:
            if len(self.queue) >= self.QUEUE:
                self.queue.popleft()
                self.dropped += 1
            self.queue.append(body)
            self.ready.notify()

    def close(self) -> None:
        """Let the queued alerts go out, for at most DRAIN_S seconds (the thread is a daemon: never waited on longer)."""
        with self.ready:
            self.closing = True
            self.ready.notify()
        self.thread.join(self.DRAIN_S)

    def summary(self) -> str | None:
        if not (self.dropped or self.failed):
            return None
        return (
            f"--notify: {self.sent} alert(s) posted, {self.failed} failed"
            + (f" (last: {self.last_error})" if self.last_error else "")
            + (f", {self.dropped} dropped (more than {self.QUEUE} waiting)" if self.dropped else "")
        )

    def _work(self) -> None:
        while True:
            with self.ready:
                while not self.queue and not self.closing:
                    self.ready.wait()
                if not self.queue:
                    return
                body = self.queue.popleft()
            if self._post(json.dumps(body).encode("utf-8")):
                self.sent += 1
            else:
                self.failed += 1

    def _post(self, data: bytes) -> bool:
        request = urllib.request.Request(
            self.url,
            data=data,
            headers={"Content-Type": "application/json", "User-Agent": f"sftaudit/{__version__}"},
            method="POST",
        )
        for attempt in range(self.ATTEMPTS):
            wait = self.BACKOFF_S * 2**attempt
            try:
                with urllib.request.urlopen(request, timeout=self.TIMEOUT_S) as response:
                    response.read(1024)
                return True
            except urllib.error.HTTPError as exc:
                self.last_error = f"HTTP {exc.code}"
                if exc.code == 429:
                    wait = _retry_after(exc.headers.get("Retry-After"), wait)
                elif 400 <= exc.code < 500 and exc.code != 408:
                    return False
            except (OSError, ValueError) as exc:  # refused, timed out, DNS: worth another try
                self.last_error = one_line(getattr(exc, "reason", exc))
            if attempt + 1 < self.ATTEMPTS:
                time.sleep(min(wait, self.MAX_WAIT_S))
        return False


def _retry_after(value: str | None, default: float) -> float:
    try:
        return max(0.0, float(value)) if value is not None else default
    except ValueError:
        return default
