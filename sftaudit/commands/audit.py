"""`sftaudit audit RUN_DIR`: import, ingest, run the checks, write verdict.json, report.html and SARIF."""

from __future__ import annotations

import json

from .common import exit_code, out_dir, print_summary, write


def run(args) -> int:
    from ..verdict.audit import audited
    from ..verdict.config import AuditConfig

    config = AuditConfig.load(args.config)
    with audited(
        args.run_dir, config, data=args.data, source=args.source, log_file=args.log_file
    ) as done:  # the report reads what was judged
        verdict = done.verdict
        out = out_dir(args, verdict["run"], args.run_dir)
        write(out / "verdict.json", json.dumps(verdict, indent=2, sort_keys=True) + "\n", "--out")
        report = None
        if not args.no_report:
            from ..outputs.report import write_report

            report = write_report(args.run_dir, out)
    if args.sarif:
        from ..outputs.sarif import to_sarif

        write(args.sarif, json.dumps(to_sarif(verdict, args.run_dir), indent=1) + "\n", "--sarif")
    if args.github:
        from .common import with_github

        summary = lambda: print_summary(verdict, out / "verdict.json", report)  # noqa: E731 - printed by with_github
        with_github(summary, verdict, args.run_dir, strict=args.strict or config.strict)
    else:
        print_summary(verdict, out / "verdict.json", report)
    return exit_code(verdict["verdict"], args.strict or config.strict)
