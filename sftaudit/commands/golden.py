"""`sftaudit golden RUN_DIR --out FILE`: a run's golden file, what `diff` compares, small enough to keep in CI."""

from __future__ import annotations

from .common import EXIT_PASS, say


def run(args) -> int:
    from .diff import write_golden

    say(str(write_golden(args.run_dir, args.out, stride=args.stride)))
    return EXIT_PASS
