"""`sftaudit audit RUN_DIR`: import, ingest, run the checks, write verdict.json, report.html and SARIF."""

from __future__ import annotations

from pathlib import Path

from .common import exit_code, out_dir, print_summary, write


def run(args) -> int:
    from ..outputs import Rendering, rendered
    from ..verdict.audit import audited
    from ..verdict.config import AuditConfig

    config = AuditConfig.load(args.config)
    strict = args.strict or config.strict
    with audited(
        args.run_dir, config, data=args.data, source=args.source, log_file=args.log_file
    ) as done:  # the report reads what was judged
        verdict = done.verdict
        r = Rendering(verdict, Path(args.run_dir), strict=strict)
        out = out_dir(args, verdict["run"], args.run_dir)
        written = {"verdict": out / "verdict.json", "report": None}
        write(written["verdict"], rendered("json", r), "--out")
        if not args.no_report:
            from .common import write_report

            written["report"] = write_report(args.run_dir, out)
    if args.sarif:
        write(args.sarif, rendered("sarif", r), "--sarif")
    if args.github:
        from .common import with_github

        summary = lambda: print_summary(verdict, written)  # noqa: E731 - printed by with_github
        with_github(summary, verdict, args.run_dir, strict=strict)
    else:
        print_summary(verdict, written)
    return exit_code(verdict["verdict"], strict)
