"""Command line: `sftaudit import|probe|ingest|audit|report|preflight|replay|gate|demo`.

Exit codes everywhere: 0 pass (warn allowed unless --strict), 1 fail, 2 could not judge
(missing/corrupt input, bad arguments), with a one-line reason on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .core.terminal import json_safe, safe_name, shown
from .errors import InputError, one_line

EXIT_PASS, EXIT_FAIL, EXIT_CANNOT_JUDGE = 0, 1, 2
DEFAULT_REPORTS = Path("reports")
DATA_HELP = (
    "a run trained without the shim: its training data (JSONL of {id, messages} rows or a datasets folder), "
    "rendered with the run's saved tokenizer as preflight does, so LOOP-01..04, 08 and 12 judge it"
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors exit 2 too, in one line
        self.exit(EXIT_CANNOT_JUDGE, f"sftaudit: error: {shown(message)} (see {self.prog} --help)\n")


def _at_least(low: int):
    """An argparse type: an integer >= low, refused in one line otherwise."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is less than {low}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="sftaudit", description="Audit a supervised fine-tuning run from its sftaudit artifacts.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    s = sub.add_parser(
        "import",
        help="write artifacts for a Trainer/TRL output_dir trained without the shim "
        "(audit, replay and gate import such a folder themselves)",
    )
    s.add_argument("run_dir", type=Path)
    s.add_argument("--data", type=Path, help=DATA_HELP)

    s = sub.add_parser(
        "probe",
        help="run each surviving checkpoint of a run on probe prompts and an eval set "
        "(needs torch), so LOOP-06/07/08 run at checkpoint granularity",
    )
    s.add_argument("run_dir", type=Path)
    s.add_argument("--prompts", type=Path, required=True, help="text file: one probe prompt (user message) per line")
    s.add_argument("--eval", type=Path, help="JSONL eval set: {id, messages, reference} per line")
    s.add_argument("--base", type=Path, help="the base model folder: probed as step 0; PEFT adapters are applied to it")
    s.add_argument("--max-new-tokens", type=_at_least(1), default=32)
    s.add_argument("--samples", type=_at_least(1), default=4, help="sampled generations per prompt")
    s.add_argument("--quiet", action="store_true", help="no progress bar")

    s = sub.add_parser("ingest", help="load a run's artifacts into its DuckDB file (incremental)")
    s.add_argument("run_dir", type=Path)
    s.add_argument("--config", type=Path, help="TOML file whose [ingest] section sets the read limits")

    s = sub.add_parser("audit", help="ingest, run the checks, write verdict.json and report.html")
    s.add_argument("run_dir", type=Path)
    s.add_argument("--data", type=Path, help=DATA_HELP)
    s.add_argument("--out", type=Path, help="output folder (default: reports/<run>/)")
    s.add_argument("--config", type=Path, help="TOML file with check thresholds and disabled checks")
    s.add_argument("--strict", action="store_true", help="warn findings fail too")
    s.add_argument("--no-report", action="store_true", help="write verdict.json only")
    s.add_argument("--sarif", type=Path, help="write SARIF 2.1.0 here (for code-scanning views)")

    s = sub.add_parser("report", help="rebuild report.html from the audited DuckDB file (no checks re-run)")
    s.add_argument("run_dir", type=Path)
    s.add_argument("--out", type=Path, help="output folder (default: reports/<run>/)")

    s = sub.add_parser("preflight", help="checks LOOP-01..04 on a dataset + tokenizer + chat template, before training")
    s.add_argument("--data", type=Path, required=True, help="JSONL of chat rows ({id, messages}) or a datasets folder")
    s.add_argument("--tokenizer", type=Path, required=True, help="a saved tokenizer folder (save_pretrained)")
    s.add_argument("--template", type=Path, help="chat template file to use instead of the tokenizer's")
    s.add_argument("--collator", help="module:function called as function(tokenizer, rows) (default: completion-only)")
    s.add_argument("--batch-size", type=_at_least(1), default=8)
    s.add_argument(
        "--max-length", type=_at_least(1), help="truncate to this many tokens (default: the tokenizer's limit)"
    )
    s.add_argument("--out", type=Path, help="output folder (default: reports/preflight-<data>/)")
    s.add_argument("--config", type=Path, help="TOML file with check thresholds and disabled checks")
    s.add_argument("--strict", action="store_true", help="warn findings fail too")
    s.add_argument("--no-report", action="store_true", help="write verdict.json only")
    s.add_argument("--quiet", action="store_true", help="no progress bar")

    s = sub.add_parser("replay", help="a failed run's first anomalous step, findings, batches and how to resume")
    s.add_argument("run_dir", type=Path)
    s.add_argument("--data", type=Path, help=DATA_HELP)
    s.add_argument("--json", action="store_true", help="print the replay as JSON")
    s.add_argument("--config", type=Path, help="TOML file with check thresholds and the rollback margin")

    s = sub.add_parser("gate", help="exit 0 if a checkpoint passes, 1 if it fails, 2 if it cannot be judged")
    s.add_argument("run_dir", type=Path)
    s.add_argument("--data", type=Path, help=DATA_HELP)
    s.add_argument("--checkpoint", required=True, help="checkpoint name, step or path")
    s.add_argument("--policy", type=Path, help="TOML file: which severities and codes block")
    s.add_argument("--config", type=Path, help="TOML file with check thresholds and disabled checks")
    s.add_argument("--strict", action="store_true", help="warn findings block too")
    s.add_argument("--junit", type=Path, help="write JUnit XML here (one testcase per check)")
    s.add_argument("--json", type=Path, help="write the gate result as JSON here")
    s.add_argument("--sarif", type=Path, help="write SARIF 2.1.0 of the findings up to the checkpoint here")

    s = sub.add_parser(
        "diff",
        help="where run B starts to differ from run A (or from a golden file): exit 0 same, "
        "1 diverged, 2 cannot compare",
    )
    s.add_argument("run_a", type=Path, help="a run folder or a golden file")
    s.add_argument("run_b", type=Path, help="a run folder or a golden file")
    s.add_argument(
        "--tolerance",
        type=float,
        help="a relative difference above this diverges (default: against the runs' own step-to-step noise)",
    )
    s.add_argument("--exact", action="store_true", help="any difference diverges (same-seed CPU runs)")
    s.add_argument("--json", action="store_true", help="print the comparison as JSON")
    s.add_argument("--out", type=Path, help="write diff.html here")

    s = sub.add_parser("golden", help="write a run's golden file: what `diff` compares, small enough to keep in CI")
    s.add_argument("run_dir", type=Path)
    s.add_argument("--out", type=Path, required=True, help="the golden file to write (JSON)")
    s.add_argument("--stride", type=_at_least(1), default=10, help="per-tensor gradient norms every N steps")

    s = sub.add_parser("demo", help="train a clean and a faulty tiny run on CPU, audit both")
    s.add_argument("--workdir", type=Path, default=Path("runs"), help="where the demo runs are recorded")
    s.add_argument("--steps", type=_at_least(1), default=60)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if getattr(args, "run_dir", None) is None:
            return _COMMANDS[args.command](args)
        from .store.ingest import run_lock

        with run_lock(args.run_dir):  # one command at a time on a run's database: a second one waits
            return _COMMANDS[args.command](args)
    except InputError as exc:
        _error(str(exc))
        return EXIT_CANNOT_JUDGE
    except Exception as exc:  # noqa: BLE001 - could not judge: one line, never a traceback
        if os.environ.get("SFTAUDIT_DEBUG"):
            raise
        _error(f"could not {args.command} {_subject(args)}: {_describe(exc)}")
        return EXIT_CANNOT_JUDGE


def _error(message: str) -> None:
    """The one line a user sees when the input cannot be judged (escaped: it may quote the input)."""
    print(f"sftaudit: error: {shown(message)}", file=sys.stderr)


def _subject(args: argparse.Namespace) -> str:
    """The input a command was given, for the last-resort message."""
    for name in ("run_dir", "data", "workdir"):
        if getattr(args, name, None) is not None:
            return str(getattr(args, name))
    return "its input"


def _describe(exc: BaseException) -> str:
    """What went wrong, in words, and what to do (the last resort: a failure no input check foresaw)."""
    report = "if the input looks sound, this is a bug in sftaudit (SFTAUDIT_DEBUG=1 shows where)"
    if isinstance(exc, MemoryError):
        return f"ran out of memory reading it; free memory or lower the [ingest] limits of the config; {report}"
    if isinstance(exc, RecursionError):
        return f"it is nested too deeply to read; {report}"
    if isinstance(exc, UnicodeError):
        return f"a file in it is not UTF-8 text ({one_line(exc)}); {report}"
    if isinstance(exc, OSError):
        where = f" {exc.filename}" if exc.filename else ""
        return f"cannot read or write{where} ({exc.strerror or one_line(exc)}); check that path"
    return f"{one_line(exc) or 'an unexpected error'}; {report}"


def _say(text: str = "", end: str = "\n") -> None:
    """Print text built from the run's own strings: controls and bidi characters escaped."""
    print(shown(text, keep_newlines=True), end=end)


def _write(path: Path, text: str, what: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise InputError(
            f"{what} {path}: cannot write ({exc.strerror or one_line(exc)}); give a writable file path"
        ) from None


def _import(args: argparse.Namespace) -> int:
    from .imports import import_run

    done = import_run(args.run_dir, args.data, progress=True)
    resumed = f", resumed at step {done['resumed_at']}" if done["resumed_at"] is not None else ""
    _say(
        f"{args.run_dir}: imported {done['steps']} logged steps (logging_steps={done['logging_steps']}), "
        f"{done['metrics']} metrics, {done['checkpoints']} checkpoints{resumed}"
        + (f", {done['dataset_rows']} dataset rows" if done["dataset_rows"] else "")
        + ("" if done["tokenizer"] else "; no saved tokenizer")
    )
    return EXIT_PASS


def _probe(args: argparse.Namespace) -> int:
    from .imports import ensure_artifacts

    prompts = [line.strip() for line in _read(args.prompts).splitlines() if line.strip()]
    try:
        eval_set = [json.loads(line) for line in _read(args.eval).splitlines() if line.strip()] if args.eval else []
    except ValueError as exc:
        raise InputError(f"{args.eval}: not JSONL ({exc})") from None
    if any(not isinstance(it, dict) or "messages" not in it or "reference" not in it for it in eval_set):
        raise InputError(f"{args.eval}: each line needs messages and reference")
    if not prompts and not eval_set:
        raise InputError(f"{args.prompts}: no probe prompts")
    ensure_artifacts(args.run_dir)
    try:
        from .shim.posthoc import probe_checkpoints
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
        _say(f"{t['checkpoint']} (step {t['step']}): probed in {t['seconds']:.1f} s")
    _say(f"{len(timings)} checkpoint(s) probed" + ("" if timings else " (all were probed before)"))
    return EXIT_PASS


def _read(path: Path) -> str:
    from .verdict.config import read_small_text

    return read_small_text(path, "file", limit=256 * 2**20)


def _prepare(args: argparse.Namespace) -> None:
    """A Trainer output trained without the shim is imported first (or re-imported: it may have grown)."""
    from .imports import ensure_artifacts

    ensure_artifacts(args.run_dir, args.data)


def _ingest(args: argparse.Namespace) -> int:
    from .store.ingest import ingest
    from .verdict.config import AuditConfig

    config = AuditConfig.load(args.config)
    added = ingest(args.run_dir, config.max_record_bytes, config.max_file_bytes)
    _say(" ".join(f"{k}={v}" for k, v in added.items() if v) or "nothing new")
    return EXIT_PASS


def _out_dir(args: argparse.Namespace, run: str) -> Path:
    return args.out or DEFAULT_REPORTS / safe_name(run)


def _audit(args: argparse.Namespace) -> int:
    from .verdict.audit import audit
    from .verdict.config import AuditConfig

    config = AuditConfig.load(args.config)
    _prepare(args)
    verdict = audit(args.run_dir, config)
    out = _out_dir(args, verdict["run"])
    _write(out / "verdict.json", json.dumps(verdict, indent=2, sort_keys=True) + "\n", "--out")
    report = None
    if not args.no_report:
        from .outputs.report import write_report

        report = write_report(args.run_dir, out)
    if args.sarif:
        from .outputs.sarif import to_sarif

        _write(args.sarif, json.dumps(to_sarif(verdict, args.run_dir), indent=1) + "\n", "--sarif")
    _print_summary(verdict, out / "verdict.json", report)
    return _exit_code(verdict["verdict"], args.strict or config.strict)


def _report(args: argparse.Namespace) -> int:
    from .outputs.report import write_report
    from .verdict.audit import stored_verdict

    verdict = stored_verdict(args.run_dir)
    _say(str(write_report(args.run_dir, _out_dir(args, verdict["run"]))))
    return EXIT_PASS


def _preflight(args: argparse.Namespace) -> int:
    from .commands.preflight import preflight
    from .verdict.config import AuditConfig

    config = AuditConfig.load(args.config)
    out = _out_dir(args, f"preflight-{args.data.stem}")
    verdict = preflight(
        args.data,
        args.tokenizer,
        out,
        template=args.template,
        collator=args.collator,
        batch_size=args.batch_size,
        max_length=args.max_length,
        config=config,
        progress=not args.quiet,
    )
    _write(out / "verdict.json", json.dumps(verdict, indent=2, sort_keys=True) + "\n", "--out")
    report = None
    if not args.no_report:
        from .outputs.report import write_report

        report = write_report(out, out)
    _print_summary(verdict, out / "verdict.json", report)
    return _exit_code(verdict["verdict"], args.strict or config.strict)


def _replay(args: argparse.Namespace) -> int:
    from .commands.replay import replay, to_json, to_text
    from .verdict.config import AuditConfig

    config = AuditConfig.load(args.config)
    _prepare(args)
    doc = replay(args.run_dir, config)
    if args.json:
        print(json_safe(to_json(doc)), end="")
    else:
        _say(to_text(doc))
    return _exit_code(doc["verdict"], config.strict)


def _gate(args: argparse.Namespace) -> int:
    from .commands.gate import Policy, gate
    from .verdict.config import AuditConfig

    config = AuditConfig.load(args.config)
    _prepare(args)
    result = gate(args.run_dir, args.checkpoint, Policy.load(args.policy, args.strict or config.strict), config)
    for path, text in ((args.junit, result.to_junit), (args.json, result.to_json)):
        if path:
            _write(path, text(), "--junit" if text == result.to_junit else "--json")
    if args.sarif:
        from .outputs.sarif import to_sarif
        from .verdict.audit import stored_verdict

        considered = {**stored_verdict(args.run_dir), "findings": result.findings}
        _write(args.sarif, json.dumps(to_sarif(considered, args.run_dir), indent=1) + "\n", "--sarif")
    _say(result.summary())
    return EXIT_PASS if result.passed else EXIT_FAIL


def _diff(args: argparse.Namespace) -> int:
    from .commands.diff import compare, load

    if args.exact and args.tolerance is not None:
        raise InputError("--exact and --tolerance exclude each other: give one")
    result = compare(load(args.run_a), load(args.run_b), tolerance=args.tolerance, exact=args.exact)
    if args.out:
        from .outputs.report import write_diff_report

        write_diff_report(result, args.out)
    if args.json:
        keys = (
            "a",
            "b",
            "mode",
            "tolerance",
            "steps_compared",
            "first_divergent_step",
            "series",
            "tensors",
            "differences",
            "findings_only_in",
        )
        print(json_safe(json.dumps({k: result[k] for k in keys}, indent=2, default=str)))
    else:
        first = result["first_divergent_step"]
        _say(
            f"{result['b']} against {result['a']}: "
            + (
                f"diverged at step {first}"
                if first is not None
                else f"no divergence over {result['steps_compared']} steps"
            )
            + f" ({result['mode']})"
        )
        if result["tensors"]:
            _say("  tensors that moved first: " + ", ".join(result["tensors"]))
        for d in result["differences"]:
            _say(f"  differs: {d['what']}: {d['a']} -> {d['b']}")
        for side in ("a", "b"):
            only = (result["findings_only_in"] or {}).get(side) or []
            if only:
                _say(
                    f"  only in {result[side]}: "
                    + ", ".join(
                        f"{f['code']} {f['severity']}" + (f" @{f['step']}" if f["step"] is not None else "")
                        for f in only
                    )
                )
    return EXIT_FAIL if result["first_divergent_step"] is not None else EXIT_PASS


def _golden(args: argparse.Namespace) -> int:
    from .commands.diff import write_golden

    _say(str(write_golden(args.run_dir, args.out, stride=args.stride)))
    return EXIT_PASS


def _demo(args: argparse.Namespace) -> int:
    from .fixtures.demo import run_demo

    return run_demo(args.workdir, DEFAULT_REPORTS, steps=args.steps)


def _exit_code(verdict: str, strict: bool) -> int:
    if verdict == "unjudged":
        return EXIT_CANNOT_JUDGE
    if verdict == "fail" or (strict and verdict == "warn"):
        return EXIT_FAIL
    return EXIT_PASS


def _print_summary(verdict: dict, verdict_path: Path, report: Path | None) -> None:
    if verdict.get("cannot_judge"):
        from .verdict.audit import unjudged_reason

        _error(unjudged_reason(verdict))
    lines = [f"{shown(verdict['run'])}: {verdict['verdict'].upper()}"]
    window = (verdict.get("resolution") or {}).get("first_anomalous_window")
    if window:  # imported evidence: the step is only known to lie in a logging or checkpoint window
        lines[0] += f"; first anomalous {window['kind']}: steps {window['first_step']}-{window['last_step']}"
    elif verdict["first_anomalous_step"] is not None:
        lines[0] += f"; first anomalous step {verdict['first_anomalous_step']}"
    if verdict["rollback_checkpoint"]:
        lines[0] += f"; roll back to {shown(verdict['rollback_checkpoint'])}"
    for f in verdict["findings"]:
        where = f"step {f['step']}" if f["step"] is not None else "run"
        lines.append(f"  {f['code']} {f['severity']:<4} {where}: {shown(f['message'])}")
    lines += [f"  {e['code']} could not run: {shown(e['error'])}" for e in verdict["check_errors"]]
    evidence = verdict.get("evidence") or {}
    lines += [f"  partial evidence: {shown(note)}" for note in evidence.get("partial", [])]
    lines += [
        f"  unreadable lines: {b['lines']} of {b['of']} in {shown(b['file'])}" for b in evidence.get("bad_lines", [])
    ]
    lines += [f"  note: {shown(note)}" for note in (verdict.get("resolution") or {}).get("notes") or []]
    not_run = [c for c in verdict.get("checks", []) if c["status"] in ("not_run", "disabled")]
    if not_run:
        lines.append("  not run: " + "; ".join(f"{c['code']} ({shown(c['reason'])})" for c in not_run))
    lines.append(f"verdict: {shown(verdict_path)}")
    if report:
        lines.append(f"report:  {shown(report)}")
    _say("\n".join(lines))


_COMMANDS = {
    "import": _import,
    "probe": _probe,
    "ingest": _ingest,
    "audit": _audit,
    "report": _report,
    "preflight": _preflight,
    "replay": _replay,
    "gate": _gate,
    "diff": _diff,
    "golden": _golden,
    "demo": _demo,
}

if __name__ == "__main__":
    sys.exit(main())
