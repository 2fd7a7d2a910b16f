"""Audit every real, uninstrumented run folder in ``<repo>/../shared/realruns`` and print one line per run.

Each run is copied to a temporary folder first (an audit writes its database into the run folder, and
the shared copies are read-only), then audited by the CLI in its own process with a time bound, so a
hang or a crash in one run cannot stall or hide the others. Per run: name, verdict, exit code, first
anomalous step, the warn/fail codes with a short message, the rollback and kept checkpoints, the checks not
run, check errors and what reached stderr beyond the CLI's own one-line error. Then a summary line.

    python benchmarks/real_runs.py                      # all runs
    python benchmarks/real_runs.py lf-two-writers ...   # some of them
    python benchmarks/real_runs.py --root DIR --timeout 300

This is a benchmark, not a test (tests/test_real_runs.py audits a few of the runs).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / ".." / "shared" / "realruns"
MESSAGE_CHARS = 90


def audit(run: Path, timeout: float) -> dict:
    """Audit a copy of `run`; what the verdict and the process said."""
    with tempfile.TemporaryDirectory(prefix="sftaudit-real-") as tmp:
        copy = Path(tmp) / run.name
        shutil.copytree(run, copy, symlinks=True)
        for p in [copy, *copy.rglob("*")]:  # the shared copies are read-only; the audit writes beside them
            if not p.is_symlink():
                p.chmod(p.stat().st_mode | 0o200)
        out = Path(tmp) / "out"
        cmd = [sys.executable, "-m", "sftaudit.cli", "audit", str(copy), "--out", str(out), "--no-report"]
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            rc, stderr = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, stderr = (
                None,
                exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or ""),
            )
        seconds = time.monotonic() - start
        try:
            verdict = json.loads((out / "verdict.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            verdict = None
    return {"name": run.name, "rc": rc, "stderr": stderr, "verdict": verdict, "seconds": seconds}


def said(result: dict) -> list[str]:
    """The CLI's own one-line messages on stderr (an input error, why a run cannot be judged)."""
    return [ln for ln in result["stderr"].splitlines() if ln.startswith(("sftaudit: error:", f"{result['name']}: "))]


def noise(result: dict) -> list[str]:
    """Everything else on stderr: tracebacks, library warnings, stray prints."""
    own = set(said(result))
    return [ln for ln in result["stderr"].splitlines() if ln.strip() and ln not in own]


def line(result: dict) -> str:
    v = result["verdict"] or {}
    rc = "timeout" if result["rc"] is None else str(result["rc"])
    parts = [
        f"{result['name']:<26} {v.get('verdict', '-'):<9} exit {rc:<7} first {str(v.get('first_anomalous_step')):<6}"
    ]
    groups: dict[tuple[str, str], list[dict]] = {}
    for f in v.get("findings", []):
        if f["severity"] in ("warn", "fail"):
            groups.setdefault((f["code"], f["severity"]), []).append(f)
    for (code, severity), found in groups.items():
        f = found[0]
        msg = f["message"].split(" [imported logs")[0]
        msg = msg if len(msg) <= MESSAGE_CHARS else msg[: MESSAGE_CHARS - 3] + "..."
        more = f" (+{len(found) - 1} more)" if len(found) > 1 else ""
        parts.append(f"    {code} {severity} @{f['step']}{more}: {msg}")
    if v.get("rollback_checkpoint") or v.get("keep_checkpoint"):
        keep = v.get("keep") or {}
        parts.append(
            f"    roll back to {v.get('rollback_checkpoint')}; keep {v.get('keep_checkpoint')}"
            + (
                f" ({keep.get('metric')} {keep.get('value'):.4g} at step {keep.get('step')})"
                if v.get("keep_checkpoint")
                else ""
            )
        )
    not_run = [c["code"] for c in v.get("checks", []) if c.get("status") == "not_run"]
    if not_run:
        parts.append(f"    not run: {' '.join(c.removeprefix('LOOP-') for c in not_run)}")
    for e in v.get("check_errors", []):
        parts.append(f"    CHECK ERROR: {json.dumps(e)[:200]}")
    for note in (v.get("resolution") or {}).get("notes", []):
        parts.append(f"    note: {note[:200]}")
    for ln in said(result):
        parts.append(f"    said: {ln[:200]}")
    for ln in noise(result)[:6]:
        parts.append(f"    STDERR: {ln[:200]}")
    return "\n".join(parts)


def summary(results: list[dict]) -> str:
    verdicts = [(r["verdict"] or {}).get("verdict") for r in results]
    count = {k: verdicts.count(k) for k in ("pass", "warn", "fail", "unjudged")}
    stderr = [noise(r) for r in results]
    return (
        f"{len(results)} runs: {count['pass']} pass, {count['warn']} warn, {count['fail']} fail, "
        f"{count['unjudged']} unjudged, {sum(v is None for v in verdicts)} without a verdict; "
        f"check errors {sum(len((r['verdict'] or {}).get('check_errors', [])) for r in results)}, "
        f"timeouts {sum(r['rc'] is None for r in results)}, "
        f"tracebacks {sum(any('Traceback' in ln for ln in s) for s in stderr)}, "
        f"warnings on stderr {sum(any('Warning' in ln for ln in s) for s in stderr)}, "
        f"exit codes outside 0/1/2 {sum(r['rc'] not in (0, 1, 2, None) for r in results)}; "
        f"{sum(r['seconds'] for r in results):.0f} s"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", help="run folder names (default: all)")
    parser.add_argument("--root", type=Path, default=ROOT, help="folder of run folders")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run")
    args = parser.parse_args()
    if not args.root.is_dir():
        print(f"{args.root}: no such folder", file=sys.stderr)
        return 2
    runs = [args.root / n for n in args.runs] if args.runs else sorted(p for p in args.root.iterdir() if p.is_dir())
    results = []
    for run in runs:
        results.append(audit(run, args.timeout))
        print(line(results[-1]), flush=True)
    print(summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
