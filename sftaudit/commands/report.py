"""`sftaudit report RUN_DIR`: rebuild report.html from the verdict this sftaudit stored (the checks run again only
when the run gained records since, or was never audited by this version)."""

from __future__ import annotations

from .common import EXIT_PASS, out_dir, say


def run(args) -> int:
    from ..outputs.report import write_report
    from ..verdict.audit import audited

    with audited(args.run_dir, judge="if_stale") as done:
        say(str(write_report(args.run_dir, out_dir(args, done.verdict["run"], args.run_dir))))
    return EXIT_PASS
