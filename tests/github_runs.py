"""Runs and verdicts for the Markdown, GitHub Actions and model card tests, built in the test: a Trainer output
evaluated every 20 steps with a checkpoint at each evaluation (real safetensors weights), whose loss turns NaN
at step 90 (a failed run with a checkpoint to roll back to and one to keep), audited as `sftaudit audit` does;
hostile strings planted in a verdict; the runner's own parser of workflow commands."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.selection_runs import eval_run
from tests.shared import cached_audit, shared_dir

# Every way a run's own text could act on a reader: terminal escapes and BEL, a bidi override, line breaks,
# HTML, a javascript: link and an image, mentions and addresses, autolinks, Markdown syntax, table pipes,
# math, entities, and GitHub's workflow commands (current and legacy).
HOSTILE = [
    "\x1b]0;owned\x07\x1b[2Jwiped",
    "model.\u202egnp.exe",
    "one\ntwo\r\n## three",
    "<script>alert(1)</script><img src=x onerror=alert(1)>",
    "[click](javascript:alert(1)) ![x](https://evil.example/x.png)",
    "@org/team and ops@example.com",
    "https://evil.example/path and WWW.evil.example",
    "| a | b |",
    "`code` *em* _em_ ~~del~~ $x^2$ #1 &lt; &amp; \\",
    "%0A::error::injected",
    "##[error]legacy",
    "::stop-commands::pause",
]
VERSIONS = {"transformers": "4.45.2", "trl": None}
TIMEOUT_S = 600  # an audit of a small folder takes seconds; only a hang reaches this


def failed_run(root: Path, name: str = "run") -> Path:
    """A Trainer output whose loss is NaN at step 90, written as the Trainer leaves it (each checkpoint's state
    holds the history up to it; the top-level state is written last)."""
    run = eval_run(
        root / name,
        {"eval_loss": [1.5, 1.2, 1.0, 0.95, 0.97, 1.1]},
        every=20,
        logging_steps=2,
        config={"model_type": "llama", "vocab_size": 512, "transformers_version": VERSIONS["transformers"]},
    )
    states = sorted(run.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[1]))
    for path in [*states, run / "trainer_state.json"]:
        state = json.loads(path.read_text(encoding="utf-8"))
        for entry in state["log_history"]:
            if entry["step"] == 90 and "loss" in entry:
                entry["loss"] = float("nan")
        path.write_text(json.dumps(state), encoding="utf-8")
        time.sleep(0.01)  # the Trainer writes them in this order: the importer reads their times
    return run


def shared_failed_run(tmp_path_factory) -> Path:
    """This worker's copy of `failed_run`, built once per test invocation (imported, not audited)."""
    return shared_dir(tmp_path_factory, "github-failed-run", lambda folder: failed_run(folder)) / "run"


_AUDITED: dict[str, Path] = {}  # per worker: the copy of `failed_run` that `failed_verdict` audits


def failed_verdict(tmp_path_factory) -> dict[str, Any]:
    """The verdict of `failed_run`, audited once per worker (for tests that only read it)."""
    from sftaudit.imports import import_run

    if "run" not in _AUDITED:
        _AUDITED["run"] = shared_failed_run(tmp_path_factory)
        import_run(_AUDITED["run"])
    return cached_audit(_AUDITED["run"])


def cli(*args: Any, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sftaudit.cli", *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )


def hostile_verdict(verdict: dict[str, Any], text: str) -> dict[str, Any]:
    """`verdict` with `text` in every string a run can put there: its name, checkpoint names and paths,
    messages, reasons, notes."""
    v = copy.deepcopy(verdict)
    v["run"] = text
    renamed = {c["name"]: f"{c['name']} {text}" for c in v["checkpoints"]}
    for c in v["checkpoints"]:
        c["name"], c["path"] = renamed[c["name"]], f"{c['path']}/{text}"
    for key in ("rollback_checkpoint", "keep_checkpoint", "rollback_deleted"):
        v[key] = renamed.get(v[key], v[key])
    for f in v["findings"] + [f for c in v["checkpoints"] for f in c["findings"]]:
        f["message"] = f"{f['message']} {text}"
        f["checkpoint"] = renamed.get(f["checkpoint"], f["checkpoint"])
    for c in v["checks"]:
        c["reason"] = f"{c['reason']} {text}" if c["reason"] else c["reason"]
        c["sources"] = [f"{s} {text}" for s in c["sources"]]
    v["keep"]["why"] = f"{v['keep']['why']} {text}"
    v["cannot_judge"] = text
    v["check_errors"] = [{"code": "LOOP-07", "error": text}]
    v["evidence"]["partial"] = [text]
    v["evidence"]["too_little"] = text
    v.setdefault("resolution", {})["notes"] = [text]
    return v


def parse_command(line: str) -> tuple[str, dict[str, str], str] | None:
    """A line as the Actions runner reads it (actions/runner, ActionCommand.TryParseV2): after leading
    whitespace, `::name props::data`; props split on `,` then on the first `=`; then unescaped."""
    line = line.lstrip()
    if not line.startswith("::"):
        return None
    end = line.find("::", 2)
    if end < 0:
        return None
    info = line[2:end]
    name, _, props = info.partition(" ")
    properties = {}
    for pair in filter(None, props.strip().split(",")):
        key, sep, value = pair.partition("=")
        if sep and key and value:
            properties[key] = _unescape(value, ("%0D", "\r"), ("%0A", "\n"), ("%3A", ":"), ("%2C", ","), ("%25", "%"))
    return name, properties, _unescape(line[end + 2 :], ("%0D", "\r"), ("%0A", "\n"), ("%25", "%"))


def _unescape(text: str, *mappings: tuple[str, str]) -> str:
    for escaped, token in mappings:
        text = text.replace(escaped, token)
    return text
