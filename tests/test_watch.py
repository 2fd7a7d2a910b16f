"""`sftaudit watch`: each new finding printed once, the webhook alert (a real HTTP server on 127.0.0.1), the stop
request the guard reads, the exits (first fail, clean close, idle, the guard's halt); and a run written step by step
by a subprocess while the watch follows it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sftaudit.fixtures.live_run import next_segment, write_live_run

from sftaudit.cli import main
from sftaudit.commands.watch import CpuBudget, Notifier, Watch
from sftaudit.core.artifacts import rank_dir, read_stop_request
from sftaudit.outputs.webhook import DISCORD_CONTENT_LIMIT, payload

NAN_AT = 40


class Hook:
    """A webhook on 127.0.0.1: records each POST's JSON body; answers 500 to the first `fail_first` of them."""

    def __init__(self, fail_first: int = 0):
        hook = self
        self.bodies: list[dict] = []
        self.attempts = 0
        self.fail_first = fail_first

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                hook.attempts += 1
                if hook.attempts <= hook.fail_first:
                    self.send_response(500)
                    self.end_headers()
                    return
                hook.bodies.append(json.loads(body))
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Hook:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setenv("no_proxy", "127.0.0.1")


def watch(run_dir, *options, capsys):
    code = main(["watch", str(run_dir), "--interval", "0.1", *map(str, options)])
    return code, capsys.readouterr()


def test_a_fail_is_printed_once_posted_once_and_asks_the_run_to_stop(tmp_path, capsys):
    run = tmp_path / "nan"
    write_live_run(run, 60, nan_at=NAN_AT, close=False)
    with Hook() as hook:
        code, out = watch(run, "--exit-on", "fail", "--stop-on", "fail", "--notify", hook.url, capsys=capsys)
    assert code == 1, out
    assert out.out.count(f"LOOP-05 fail step {NAN_AT}:") == 1
    assert "stopped watching at the first fail (LOOP-05)" in out.out
    # One alert, the fail's (info findings are printed, not posted).
    assert len(hook.bodies) == 1
    body = hook.bodies[0]
    assert body["text"].startswith(f"sftaudit FAIL LOOP-05 at step {NAN_AT} of run nan: loss became non-finite")
    assert body["content"] == body["text"] and body["allowed_mentions"] == {"parse": []}
    request = read_stop_request(run)
    assert (request.code, request.step) == ("LOOP-05", NAN_AT) and request.reason.startswith("LOOP-05 fail at step")


def test_the_clean_twin_exits_0_at_its_close_and_posts_nothing(tmp_path, capsys):
    run = tmp_path / "clean"
    write_live_run(run, 60)
    with Hook() as hook:
        code, out = watch(run, "--exit-on", "fail", "--stop-on", "fail", "--notify", hook.url, capsys=capsys)
    assert code == 0, out
    assert "clean: the run closed at step 60 (its close record)" in out.out and "clean: PASS" in out.out
    assert hook.attempts == 0 and read_stop_request(run) is None


def test_without_exit_on_a_fail_is_printed_once_across_polls_until_the_run_goes_idle(tmp_path, capsys):
    run = tmp_path / "nan"
    write_live_run(run, 60, nan_at=NAN_AT, close=False)
    code, out = watch(run, "--idle-timeout", "1", capsys=capsys)
    assert code == 1  # the final verdict's: fail
    assert out.out.count(f"LOOP-05 fail step {NAN_AT}:") == 1 and out.out.count("LOOP-03 info") == 1
    assert "no new record for 1 s (--idle-timeout): stopped watching at step 60; the run has not closed" in out.out


def test_polls_space_out_to_keep_the_watch_within_its_cpu_share(tmp_path, capsys, monkeypatch):
    """With no burst allowed, each poll starts no sooner than the last one's CPU seconds / --max-cpu after it
    (unpaced, the next would start as soon as a poll longer than the 0.1 s interval ends): the real polls
    timed, not replaced."""
    run = tmp_path / "idle"
    write_live_run(run, 60, close=False)
    polls: list[tuple[float, float]] = []  # (start, CPU seconds) of each poll
    poll = Watch._poll

    def timed(self):
        start, cpu = time.monotonic(), time.process_time()
        try:
            return poll(self)
        finally:
            polls.append((start, time.process_time() - cpu))

    monkeypatch.setattr(Watch, "_poll", timed)
    monkeypatch.setattr(CpuBudget, "BURST_S", 0.0)
    code = main(["watch", str(run), "--interval", "0.1", "--max-cpu", "0.5", "--idle-timeout", "2"])
    assert code == 0, capsys.readouterr()
    paced = [(following - start, cpu / 0.5) for (start, cpu), (following, _) in zip(polls, polls[1:])]
    assert paced and all(gap >= spacing for gap, spacing in paced)
    assert max(spacing for _, spacing in paced) > 0.1  # a gap longer than the interval: the pacing's own


@settings(max_examples=200, deadline=None)
@given(
    costs=st.lists(st.floats(0, 30), min_size=1, max_size=60),
    share=st.floats(0.05, 2),
    interval=st.floats(0.1, 10),
)
def test_the_cpu_budget_bounds_the_polls_cpu_over_any_stretch(costs, share, interval):
    """Polls of any CPU cost, each started as the watch starts them (at the interval, or once the budget's wait
    is over): by the end of each, the CPU spent is at most share x (its end + BURST_S), past the one poll that
    overdrew the balance."""
    now = 0.0
    budget = CpuBudget(share, clock=lambda: now)
    spent = 0.0
    for cost in costs:
        start = now
        now += cost  # its wall time: its CPU on one core
        budget.spend(cost)
        spent += cost
        assert spent <= share * (now + CpuBudget.BURST_S) + cost + 1e-6
        now = max(start + interval, now + budget.wait())


def test_a_close_by_the_guard_is_not_a_clean_end(tmp_path, capsys):
    run = tmp_path / "halted"
    write_live_run(run, 30, close=False)
    halted = {"source": "stop_request", "reason": "asked to stop", "step": 30, "anomaly_step": None}
    with open(rank_dir(run, 0) / "events.jsonl", "a") as f:
        f.write(json.dumps({"seg": 0, "kind": "close", "step": 30, "time": time.time(), "halted": halted}) + "\n")
    code, out = watch(run, capsys=capsys)
    assert code == 1
    assert "sftaudit's guard stopped the run at step 30: asked to stop" in out.out and "close record" not in out.out


def test_a_restart_and_a_torn_last_line_are_followed(tmp_path, capsys):
    run = tmp_path / "resumed"
    write_live_run(run, 30, close=False)  # killed: no close record
    with open(rank_dir(run, 0) / "steps.jsonl", "a") as f:
        f.write('{"seg": 0, "step": 31, "lo')  # the line the kill tore
    write_live_run(run, 30, first_step=21, seg=next_segment(run))  # resumed from step 20's checkpoint, closed
    code, out = watch(run, capsys=capsys)
    assert "resumed: the run closed at step 50 (its close record)" in out.out
    # The restart resumed from a step no checkpoint was saved at: LOOP-11's fail, said once.
    assert code == 1 and out.out.count("LOOP-11 fail step 21:") == 1


def test_github_annotates_each_new_finding_within_the_caps(tmp_path, capsys, monkeypatch):
    run = tmp_path / "nan"
    write_live_run(run, 60, nan_at=NAN_AT)
    summary = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    code, out = watch(run, "--github", capsys=capsys)
    assert code == 1
    assert out.out.count(f"::error title=LOOP-05 fail at step {NAN_AT}::loss became non-finite") == 1
    # The run's own text is printed with workflow commands off.
    assert out.out.index("::stop-commands::") < out.out.index(f"LOOP-05 fail step {NAN_AT}:")
    assert "## sftaudit watch" in summary.read_text()


def test_the_payload_escapes_slack_and_mentions_nobody():
    finding = {
        "code": "LOOP-05",
        "severity": "warn",
        "step": 3,
        "message": "<!channel> @here & <http://x|y> @everyone\x1b[2J",
    }
    body = payload(finding, "run <@U123>")
    assert "<" not in body["text"] and ">" not in body["text"] and "&amp;" in body["text"]
    for text in (body["text"], body["content"]):
        assert "@here" not in text and "@everyone" not in text and "@U123" not in text and "\x1b" not in text
    assert body["allowed_mentions"] == {"parse": []}
    long = payload({**finding, "message": "x" * 10_000}, "r")
    assert len(long["content"]) <= DISCORD_CONTENT_LIMIT


def test_the_notifier_retries_a_failed_post_and_never_blocks(tmp_path):
    with Hook(fail_first=1) as hook:
        notifier = Notifier(hook.url)
        notifier.BACKOFF_S = 0.05
        started = time.monotonic()
        notifier.send({"text": "a", "content": "a"})
        assert time.monotonic() - started < 0.05  # handed to the worker, not sent on the caller's thread
        notifier.close()
    assert hook.attempts == 2 and hook.bodies == [{"text": "a", "content": "a"}]
    assert notifier.sent == 1 and notifier.failed == 0 and notifier.summary() is None


def test_a_full_queue_drops_the_oldest_and_says_so():
    notifier = Notifier("http://127.0.0.1:9/unreachable")  # nothing listens on the discard port
    notifier.ATTEMPTS, notifier.QUEUE, notifier.DRAIN_S = 1, 3, 5.0
    for i in range(10):
        notifier.send({"text": str(i)})
    notifier.close()
    assert notifier.dropped >= 6 and notifier.sent == 0
    assert "dropped" in notifier.summary() and "127.0.0.1" not in notifier.summary()


def test_a_bad_webhook_address_is_one_line_and_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["watch", str(tmp_path), "--notify", "ftp://secret-token@example"])
    assert exc.value.code == 2
    assert "secret-token" not in capsys.readouterr().err


# A real watch follows a closed run to its end, then six threads allocate at once and glibc's heap arenas are
# counted (malloc_info's XML): the watch as it is ("watch"), or with `steady_heap` made a no-op ("default").
ARENAS_PROBE = """
import ctypes, sys, tempfile, threading
import sftaudit.commands.watch
from sftaudit.cli import main
if sys.argv[1] == "default":
    sftaudit.commands.watch.steady_heap = lambda: False
assert main(["watch", sys.argv[2], "--interval", "0.1"]) == 0
together = threading.Barrier(6)
def allocate():
    blocks = [bytearray(4096) for _ in range(100)]  # past pymalloc's sizes: glibc's malloc, in this thread
    together.wait()
threads = [threading.Thread(target=allocate) for _ in range(6)]
for t in threads: t.start()
for t in threads: t.join()
libc = ctypes.CDLL("libc.so.6")
libc.fopen.restype, libc.fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
libc.malloc_info.argtypes, libc.fclose.argtypes = [ctypes.c_int, ctypes.c_void_p], [ctypes.c_void_p]
with tempfile.NamedTemporaryFile(suffix=".xml") as f:
    out = libc.fopen(f.name.encode(), b"w")
    libc.malloc_info(0, out)
    libc.fclose(out)
    print(open(f.name).read().count("<heap nr="))
"""


@pytest.mark.skipif(
    not hasattr(os, "confstr") or "glibc" not in (os.confstr("CS_GNU_LIBC_VERSION") or ""), reason="glibc"
)
def test_the_watch_keeps_glibc_to_two_heap_arenas(tmp_path):
    """Threads (DuckDB's) each get an arena by default, where what a poll frees stays and fragments: the watch's
    memory between polls grew about a megabyte a poll, half that with two (benchmarks/poll_memory.py)."""
    run = tmp_path / "closed"
    write_live_run(run, 20)
    arenas = {
        heap: int(
            subprocess.run(
                [sys.executable, "-c", ARENAS_PROBE, heap, str(run)], capture_output=True, text=True, check=True
            ).stdout.splitlines()[-1]
        )
        for heap in ("default", "watch")
    }
    assert arenas["default"] > 2  # the probe sees the arenas the threads made
    assert arenas["watch"] <= 2


@pytest.mark.parametrize("share", ["0", "-1", "inf", "nan", "a quarter"])
def test_a_cpu_share_that_is_no_positive_number_is_one_line_and_exit_2(tmp_path, capsys, share):
    with pytest.raises(SystemExit) as exc:
        main(["watch", str(tmp_path), "--max-cpu", share])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--max-cpu" in err and err.count("\n") == 1


def test_a_run_folder_refused_for_what_it_is_exits_2_at_once(tmp_path, capsys):
    """A link out of the run never becomes readable: one line and exit 2, not a wait until --idle-timeout."""
    run = tmp_path / "run"
    (run / "sftaudit").mkdir(parents=True)
    (run / "sftaudit" / "rank-0").symlink_to(tmp_path)
    started = time.monotonic()
    code, out = watch(run, "--idle-timeout", 3600, capsys=capsys)
    assert code == 2 and time.monotonic() - started < 60
    assert "outside the run folder" in out.err and out.err.count("\n") == 1


@pytest.mark.slow
@pytest.mark.parametrize("nan_at", [NAN_AT, None], ids=["nan", "clean"])
def test_watch_follows_a_run_written_step_by_step(tmp_path, nan_at):
    """A writer subprocess at 10 steps a second; the watch in another: the planted fail is printed while the run
    trains, posted once, and ends the watch (exit 1); the clean twin ends at its close (exit 0), nothing posted."""
    run = tmp_path / ("nan" if nan_at else "clean")
    env = {**os.environ, "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    writer_args = ["--steps", "200" if nan_at else "60", "--rate", "10"] + (["--nan-at", str(nan_at)] if nan_at else [])
    with Hook() as hook:
        writer = subprocess.Popen(
            [sys.executable, "-m", "sftaudit.fixtures.live_run", str(run), *writer_args],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            result = subprocess.run(
                [sys.executable, "-m", "sftaudit.cli", "watch", str(run), "--interval", "0.5"]
                + ["--exit-on", "fail", "--stop-on", "fail", "--notify", hook.url, "--idle-timeout", "60"],
                capture_output=True,
                text=True,
                timeout=180,
                env=env,
            )
        finally:
            writer.kill()
            written = writer.communicate()[0]
    steps = [int(line.split()[0]) for line in written.splitlines()]
    if nan_at:
        assert result.returncode == 1, result.stdout + result.stderr
        assert result.stdout.count(f"LOOP-05 fail step {nan_at}:") == 1
        assert steps[-1] < 200  # seen while the run trained
        assert len(hook.bodies) == 1 and "LOOP-05" in hook.bodies[0]["content"]
        assert read_stop_request(run).step == nan_at
    else:
        assert result.returncode == 0, result.stdout + result.stderr
        assert "the run closed at step 60 (its close record)" in result.stdout
        assert hook.attempts == 0 and read_stop_request(run) is None


def test_a_trainer_output_dir_whose_state_grows_is_followed(tmp_path, capsys):
    """No shim: the Trainer's trainer_state.json, rewritten as it trains (10 more logged steps a second), goes
    through the audit's import at each poll; the non-finite loss logged at step 25 ends the watch."""
    run = tmp_path / "trainer-run"
    run.mkdir()

    def state(last: int) -> str:
        history = [
            {"epoch": s / 30, "learning_rate": 1e-4, "loss": float("nan") if s >= 25 else 2.0 - s / 60, "step": s}
            for s in range(1, last + 1)
        ]
        return json.dumps({"global_step": last, "max_steps": 30, "logging_steps": 1, "log_history": history})

    def train() -> None:
        for last in (10, 20, 30):
            (run / "trainer_state.json").write_text(state(last), encoding="utf-8")  # in place, as the Trainer does
            time.sleep(1.0)

    trainer = threading.Thread(target=train)
    trainer.start()
    try:
        code, out = watch(run, "--exit-on", "fail", "--idle-timeout", "30", capsys=capsys)
    finally:
        trainer.join()
    assert code == 1, out
    assert out.out.count("LOOP-25 fail step 25:") == 1  # the logged loss, judged as the Trainer logged it


def test_a_burst_told_by_loop27_then_by_loop05_alone_is_posted_once(tmp_path, capsys):
    """A gradient-norm burst in a Trainer log, seen as it starts: at the first poll LOOP-27 calls step 200 an
    isolated spike (LOOP-05's global rule folded into it); once the norm stays up, LOOP-27 withdraws and LOOP-05's
    finding of the same step stands alone. One event: posted once, LOOP-05's finding printed saying what told it.
    The log grows when the first alert has arrived (not after a sleep): the watch sees both states."""
    import numpy as np

    from .checks.curve_runs import history
    from .checks.logged_runs import falling

    n = 230
    loss = falling(n, 2.1, 0.4, noise=0.06, seed=3)
    norm = 0.4 * np.exp(0.2 * np.random.default_rng(3).standard_normal(n))
    norm[199:211] *= 30  # steps 200-211
    run = tmp_path / "trainer-run"
    run.mkdir()

    def write(last: int) -> None:
        state = {"global_step": last, "max_steps": n, "logging_steps": 1}
        state["log_history"] = history(loss[:last], 2e-4, norm[:last])
        (run / "trainer_state.json").write_text(json.dumps(state), encoding="utf-8")

    def train(hook) -> None:
        write(200)
        deadline = time.monotonic() + 120
        while not hook.bodies and time.monotonic() < deadline:
            time.sleep(0.05)
        write(n)

    with Hook() as hook:
        trainer = threading.Thread(target=train, args=(hook,))
        trainer.start()
        try:
            code, out = watch(run, "--notify", hook.url, "--idle-timeout", "3", capsys=capsys)
        finally:
            trainer.join()
    assert out.out.count("LOOP-27 warn step 200:") == 1
    assert out.out.count("LOOP-05 warn step 200:") == 1 and "(the event LOOP-27/spike told above)" in out.out
    assert [b["text"].split(":")[0] for b in hook.bodies] == ["sftaudit WARN LOOP-27 at step 200 of run trainer-run"]
    assert code == 0 and "trainer-run: WARN" in out.out


def test_a_finding_folded_into_one_printed_later_or_earlier_is_told_again_not_new(tmp_path):
    """Both orders of one event across polls: LOOP-05's finding printed, then LOOP-27's with it folded in (told
    again); LOOP-27's with LOOP-05 folded in, then LOOP-05's alone (told again). A finding at another step, or of a
    higher severity than the one printed, is new."""
    import argparse

    def finding(code, severity, step, folded=()):
        rule = {"LOOP-05": "LOOP-05/global-spike", "LOOP-27": "LOOP-27/spike"}[code]
        also = {"also_flagged_by": [{"rule": r, "message": "m"} for r in folded]} if folded else {}
        return {"code": code, "rule": rule, "severity": severity, "step": step, "checkpoint": None, "evidence": also}

    def polls(*verdicts):
        w = Watch(argparse.Namespace(run_dir=tmp_path, exit_on=None), None, None)
        out = []
        for findings in verdicts:
            new, retold = w._new({"findings": findings}, ended=False)
            out.append(([(f["code"], f["step"]) for f in new], [(f["code"], first) for f, first in retold]))
        return out

    forward = polls([finding("LOOP-05", "warn", 200)], [finding("LOOP-27", "warn", 200, ["LOOP-05/global-spike"])])
    assert forward == [([("LOOP-05", 200)], []), ([], [("LOOP-27", "LOOP-05/global-spike")])]
    reverse = polls([finding("LOOP-27", "warn", 200, ["LOOP-05/global-spike"])], [finding("LOOP-05", "warn", 200)])
    assert reverse == [([("LOOP-27", 200)], []), ([], [("LOOP-05", "LOOP-27/spike")])]
    other = polls(
        [finding("LOOP-27", "warn", 200, ["LOOP-05/global-spike"])],
        [finding("LOOP-05", "warn", 300), finding("LOOP-05", "fail", 200)],
    )
    assert other == [([("LOOP-27", 200)], []), ([("LOOP-05", 300), ("LOOP-05", 200)], [])]
