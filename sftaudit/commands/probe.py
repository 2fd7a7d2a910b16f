"""`sftaudit probe RUN_DIR`: run each surviving checkpoint on probe prompts and an eval set (needs torch), so
LOOP-06/07/08 run at checkpoint granularity."""

from __future__ import annotations

import json

from ..errors import InputError, one_line
from .common import EXIT_PASS, read, say


def run(args) -> int:
    from ..store.rundb import inside_run_folder, run_lock

    with run_lock(inside_run_folder(args.run_dir)):  # not while an audit of the run reads its artifacts
        return _probe(args)


def _probe(args) -> int:
    from ..imports import ensure_artifacts

    prompts = [line.strip() for line in read(args.prompts).splitlines() if line.strip()]
    try:
        eval_set = [json.loads(line) for line in read(args.eval).splitlines() if line.strip()] if args.eval else []
    except ValueError as exc:
        raise InputError(f"{args.eval}: not JSONL ({one_line(exc, 120)})") from None
    except RecursionError:
        raise InputError(f"{args.eval}: not JSONL this sftaudit reads (a line nested too deeply)") from None
    if any(not isinstance(it, dict) or "messages" not in it or "reference" not in it for it in eval_set):
        raise InputError(f"{args.eval}: each line needs messages and reference")
    if not prompts and not eval_set:
        raise InputError(f"{args.prompts}: no probe prompts")
    ensure_artifacts(args.run_dir)
    try:
        from ..shim.posthoc import probe_checkpoints
    except ImportError as exc:
        raise InputError(
            f"probing runs the checkpoints and needs the training side: pip install 'sftaudit[shim]' ({exc})"
        ) from None
    timings = probe_checkpoints(
        args.run_dir,
        prompts,
        eval_set,
        base=args.base,
        progress=not args.quiet,
        max_new_tokens=args.max_new_tokens,
        generations_per_prompt=args.samples,
    )
    ensure_artifacts(args.run_dir)  # the manifest gains the prompts and the eval set
    for t in timings:
        say(f"{t['checkpoint']} (step {t['step']}): probed in {t['seconds']:.1f} s")
    say(f"{len(timings)} checkpoint(s) probed" + ("" if timings else " (all were probed before)"))
    return EXIT_PASS
