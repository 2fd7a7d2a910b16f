"""`sftaudit report RUN_DIR`: rebuild report.html from the audited database (no check runs again)."""

from __future__ import annotations

from .common import EXIT_PASS, out_dir, say


def run(args) -> int:
    from ..outputs.report import write_report
    from ..verdict.audit import stored_verdict

    verdict = stored_verdict(args.run_dir)
    say(str(write_report(args.run_dir, out_dir(args, verdict["run"], args.run_dir))))
    return EXIT_PASS
