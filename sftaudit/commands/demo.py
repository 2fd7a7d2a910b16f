"""`sftaudit demo`: train a clean and a faulty tiny run on CPU, audit both."""

from __future__ import annotations

from .common import DEFAULT_REPORTS


def run(args) -> int:
    from ..fixtures.demo import run_demo

    return run_demo(args.workdir, DEFAULT_REPORTS, steps=args.steps)
