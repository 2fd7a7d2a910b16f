"""Three peer tools that audit fine-tuning run folders, installed side by side and run like sftaudit.

Each peer goes into its own venv under ``~/.cache/sftaudit-bench/peers/<tool>-<version>`` (reused when
present, never the project's venv), is run on a run folder in a child process with a time bound, and
its own outcome is mapped to one of sftaudit's words:

- **ftdoctor 0.1.0** ``ftdoctor diagnose RUN -f json``: exit 0 and a JSON ``worst`` of OK | INFO |
  WARNING | CRITICAL (the highest finding severity); exit 2 with one line on stderr when it finds no
  trainer_state.json. OK/INFO -> pass, WARNING -> warn, CRITICAL -> fail, no JSON -> unjudged.
  Its ``no_eval`` WARNING fires on every run that logged no eval metric; it is its verdict, kept.
- **runmedic 0.1.1** ``runmedic diagnose RUN --json``: a JSON list of the runs it found in the folder
  (TensorBoard, trainer_state.json, JSONL/CSV, text logs), each with findings of severity critical |
  warning | info; exit 1 with one line on stderr when it finds no metrics. The worst severity over all
  its runs: critical -> fail, warning -> warn, info or none -> pass; no JSON, or not one metric series
  read (only log lines), -> unjudged (it had nothing to judge, whatever its silence says).
- **trainproof 0.22.0** ``trainproof doctor RUN --json``: a JSON envelope whose ``worst_verdict`` is
  PASS | WARN | FAIL | NOT-CHECKED over every log it parsed (exit 0 | 1 | 2), or null with ``error``
  set (exit 2) when it found no readable log. PASS -> pass, WARN -> warn, FAIL -> fail, NOT-CHECKED or
  null -> unjudged.

A timeout or a crash (no parsable JSON) is unjudged for every tool. None of the three needs torch.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sftaudit-bench"
VERDICTS = ("pass", "warn", "fail", "unjudged")
INSTALL_TIMEOUT = 600


@dataclass
class Outcome:
    """What one tool said about one run, in sftaudit's words, and what it cost."""

    verdict: str  # pass | warn | fail | unjudged
    why: str  # the findings behind it, or why it could not judge
    rc: int | None  # None: killed at the time bound
    cpu: float  # user + sys seconds of the child process
    wall: float


@dataclass
class Child:
    rc: int | None
    stdout: str
    stderr: str
    cpu: float
    wall: float


def run_child(cmd: list[str], timeout: float, cwd: Path | None = None, env: dict | None = None) -> Child:
    """Run `cmd` with a time bound; its CPU time is the growth of this process's reaped-children usage
    (one child at a time, so the delta is this child's, with any grandchildren it waited for)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    with subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        cwd=cwd,
        env=env,
        start_new_session=True,  # its own process group, so a timeout kills what it started too
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            rc = None
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Child(rc, out, err, cpu, wall)


def child_env() -> dict:
    """The environment every audited tool runs in: bytecode cached (a pip-installed tool has its .pyc;
    a shell's PYTHONDONTWRITEBYTECODE would make a source checkout recompile every module on every run)
    under one prefix shared by all tools, and nothing that points a tool at a hub or a token."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "HF_TOKEN", "WANDB_API_KEY")}
    env["PYTHONPYCACHEPREFIX"] = str(CACHE / "pycache")
    env["HF_HUB_OFFLINE"] = "1"
    return env


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:160] if lines else ""


def _json(child: Child):
    try:
        return json.loads(child.stdout)
    except ValueError:
        return None


def _unjudged(child: Child, data) -> str | None:
    """Why there is no verdict to read, or None when there is one."""
    if child.rc is None:
        return "timeout"
    if data is None:
        return last_line(child.stderr) or f"exit {child.rc}, no JSON"
    return None


def ftdoctor_verdict(child: Child) -> tuple[str, str]:
    data = _json(child)
    if (why := _unjudged(child, data)) or not isinstance(data, dict):
        return "unjudged", why or "unexpected JSON"
    verdict = {"OK": "pass", "INFO": "pass", "WARNING": "warn", "CRITICAL": "fail"}.get(data.get("worst"), "unjudged")
    found = [f"{f['check']}({f['severity'].lower()[:4]})" for f in data.get("findings", [])]
    return verdict, " ".join(found)


def runmedic_verdict(child: Child) -> tuple[str, str]:
    data = _json(child)
    if (why := _unjudged(child, data)) or not isinstance(data, list):
        return "unjudged", why or "unexpected JSON"
    if not any(run.get("series") for run in data):
        return "unjudged", "no metric series read"
    severities = [f["severity"] for run in data for f in run.get("findings", [])]
    verdict = "fail" if "critical" in severities else "warn" if "warning" in severities else "pass"
    found = [
        f"{f['check']}({f['severity'][:4]})" for run in data for f in run.get("findings", []) if f["severity"] != "info"
    ]
    return verdict, " ".join([f"{len(data)} run(s)", *dict.fromkeys(found)])


def trainproof_verdict(child: Child) -> tuple[str, str]:
    data = _json(child)
    if (why := _unjudged(child, data)) or not isinstance(data, dict):
        return "unjudged", why or "unexpected JSON"
    if data.get("worst_verdict") is None:
        return "unjudged", str(data.get("error"))[:160]
    verdict = {"PASS": "pass", "WARN": "warn", "FAIL": "fail"}.get(data["worst_verdict"], "unjudged")
    found = [
        f["id"].removeprefix("TP-")
        for report in data.get("reports", [])
        for f in report.get("findings", [])
        if f.get("level") in ("WARN", "FAIL", "NOT-CHECKED")
    ]
    return verdict, " ".join([f"{len(data.get('reports', []))} log(s)", *dict.fromkeys(found)])


@dataclass
class Peer:
    name: str
    version: str
    args: Callable[[Path], list[str]]  # what follows the console script, for a run folder
    read: Callable[[Child], tuple[str, str]]
    venv: Path = field(init=False)

    def __post_init__(self) -> None:
        self.venv = CACHE / "peers" / f"{self.name}-{self.version}"

    @property
    def script(self) -> Path:
        return self.venv / "bin" / self.name

    @property
    def installed(self) -> bool:
        return (self.venv / ".installed").is_file() and self.script.is_file()

    def install(self) -> str | None:
        """Install into the side venv unless it is there; None, or why it could not be."""
        if self.installed:
            return None
        shutil.rmtree(self.venv, ignore_errors=True)
        self.venv.parent.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        # venv makes a side venv from the base interpreter, never one that chains to the project's packages
        made = run_child([sys.executable, "-m", "venv", str(self.venv)], INSTALL_TIMEOUT)
        if made.rc != 0:
            return f"venv: {last_line(made.stderr) or ('timeout' if made.rc is None else f'exit {made.rc}')}"
        pip = [
            str(self.venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "-q",
            "--retries",
            "1",
        ]
        got = run_child([*pip, f"{self.name}=={self.version}"], INSTALL_TIMEOUT)
        if got.rc != 0:
            shutil.rmtree(self.venv, ignore_errors=True)
            return f"pip: {'timeout' if got.rc is None else last_line(got.stderr)}"
        (self.venv / ".installed").write_text(
            json.dumps({"seconds": round(time.monotonic() - start, 1), "bytes": tree_bytes(self.venv)}),
            encoding="utf-8",
        )
        return None

    def install_facts(self) -> dict:
        try:
            return json.loads((self.venv / ".installed").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}

    def judge(self, run: Path, timeout: float) -> Outcome:
        child = run_child([str(self.script), *self.args(run)], timeout, env=child_env())
        verdict, why = self.read(child)
        return Outcome(verdict, why, child.rc, child.cpu, child.wall)


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


PEERS = (
    Peer("ftdoctor", "0.1.0", lambda run: ["diagnose", str(run), "-f", "json", "--no-color"], ftdoctor_verdict),
    Peer("runmedic", "0.1.1", lambda run: ["diagnose", str(run), "--json"], runmedic_verdict),
    Peer("trainproof", "0.22.0", lambda run: ["doctor", str(run), "--json"], trainproof_verdict),
)
