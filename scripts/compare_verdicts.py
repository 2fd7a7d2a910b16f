"""Audit run folders with two sftaudit checkouts and print whether their verdict.json bytes are the same, apart from
fields this checkout added (a schema_version keeps what was there byte for byte; fields are only added).

    .venv/bin/python scripts/compare_verdicts.py --base-python OTHER_CHECKOUT/.venv/bin/python RUN_DIR [RUN_DIR ...]

Each run folder is copied twice under a temporary folder (the audit writes into the run's sftaudit/ folder and
its cache), audited by the base checkout's interpreter and by this one, and compared. Exit 1 when any differs.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Fields this checkout added to verdict.json, by where they sit: removed before comparing with an older checkout.
NEW_FINDING_FIELDS = ("rule",)
AUDIT = "import json, sys; from sftaudit.verdict.audit import audit; print(json.dumps(audit(sys.argv[1])))"


def audited(python: str, run: Path, cache: Path) -> str:
    env = {**os.environ, "SFTAUDIT_CACHE_DIR": str(cache)}
    done = subprocess.run([python, "-c", AUDIT, str(run)], capture_output=True, text=True, env=env, cwd=run.parent)
    if done.returncode:
        raise SystemExit(f"{python} could not audit {run}: {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout.strip()


def without_new_fields(text: str) -> str:
    verdict = json.loads(text)
    for finding in verdict["findings"] + [f for c in verdict["checkpoints"] for f in c["findings"]]:
        for key in NEW_FINDING_FIELDS:
            finding.pop(key, None)
    return json.dumps(verdict)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-python", required=True, help="the base checkout's interpreter")
    parser.add_argument("runs", nargs="+", type=Path)
    args = parser.parse_args()
    differ = 0
    with tempfile.TemporaryDirectory(prefix="sftaudit-compare-") as tmp:
        for run in args.runs:
            copies = {}
            for side, python in (("base", args.base_python), ("this", sys.executable)):
                copy = Path(tmp) / side / run.name
                shutil.copytree(run, copy, symlinks=True)
                copies[side] = audited(python, copy, Path(tmp) / f"cache-{side}")
            base, this = copies["base"], without_new_fields(copies["this"])
            same = base == this
            differ += not same
            print(f"{run.name}: {'identical apart from new fields' if same else 'DIFFERENT'}")
            if not same:
                lines = difflib.unified_diff(
                    json.dumps(json.loads(base), indent=1).splitlines(),
                    json.dumps(json.loads(this), indent=1).splitlines(),
                    lineterm="",
                    n=1,
                )
                print("\n".join(list(lines)[:40]))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
