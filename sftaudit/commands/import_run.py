"""`sftaudit import RUN_DIR`: write artifacts for a Trainer/TRL output_dir trained without the shim."""

from __future__ import annotations

from .common import EXIT_PASS, say


def run(args) -> int:
    from ..imports import import_run
    from ..store.import_state import imported_if_changed
    from ..store.rundb import inside_run_folder, run_lock

    done: dict = {}

    def imported() -> bool:
        done.update(import_run(args.run_dir, args.data, progress=True, source=args.source, file=args.log_file))
        return True

    with run_lock(inside_run_folder(args.run_dir)):  # not while an audit of the run reads its artifacts
        # always: the command imports, and keeps what it imported from for the audits that follow
        imported_if_changed(args.run_dir, imported, args.source, args.log_file, always=True)
    resumed = f", resumed at step {done['resumed_at']}" if done["resumed_at"] is not None else ""
    say(
        f"{args.run_dir}: imported {done['steps']} logged steps (logging_steps={done['logging_steps']}), "
        f"{done['metrics']} metrics, {done['checkpoints']} checkpoints{resumed}"
        + (f", {done['dataset_rows']} dataset rows" if done["dataset_rows"] else "")
        + ("" if done["tokenizer"] else "; no saved tokenizer")
    )
    return EXIT_PASS
