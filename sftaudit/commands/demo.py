"""`sftaudit demo`: train a clean and a faulty tiny run on CPU, then audit each as `sftaudit audit` does."""

from __future__ import annotations

import argparse

from . import audit
from .common import EXIT_FAIL, EXIT_PASS, say


def run(args) -> int:
    """Exit 0 when the clean run passes (warns allowed) and the faulty one fails."""
    from ..fixtures.demo import DEMO_RUNS, train_demo_run

    codes = {}
    for name in DEMO_RUNS:
        run_dir = train_demo_run(args.workdir, name, steps=args.steps)
        # The audit command itself, with its defaults: verdict.json and report.html in reports/<run>/, its summary.
        audit_args = argparse.Namespace(
            run_dir=run_dir,
            config=None,
            data=None,
            source=None,
            log_file=None,
            out=None,
            no_report=False,
            sarif=None,
            strict=False,
            github=False,
        )
        codes[name] = audit.run(audit_args)
    ok = codes["demo-clean"] == EXIT_PASS and codes["demo-nan"] == EXIT_FAIL
    say("demo ok" if ok else f"demo: unexpected exit codes {codes} (clean 0, NaN 1 expected)")
    return EXIT_PASS if ok else EXIT_FAIL
