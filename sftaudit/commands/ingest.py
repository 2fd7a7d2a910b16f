"""`sftaudit ingest RUN_DIR`: load a run's artifacts into its database (incremental)."""

from __future__ import annotations

from .common import EXIT_PASS, say


def run(args) -> int:
    from ..store.ingest import ingest
    from ..verdict.config import AuditConfig

    config = AuditConfig.load(args.config)
    added = ingest(args.run_dir, config.max_record_bytes, config.max_file_bytes)
    say(" ".join(f"{k}={v}" for k, v in added.items() if v) or "nothing new")
    return EXIT_PASS
