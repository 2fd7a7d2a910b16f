"""Command line: `sftaudit import|probe|ingest|audit|watch|report|card|preflight|replay|gate|diff|golden|demo`: the
arguments of every subcommand; each one runs in its own module of `sftaudit.commands`.

Exit codes everywhere: 0 pass (warn allowed unless --strict), 1 fail, 2 could not judge
(missing/corrupt input, bad arguments), with a one-line reason on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from .commands.common import EXIT_CANNOT_JUDGE, error
from .core.terminal import shown
from .errors import InputError, one_line

DATA_HELP = (
    "a run trained without the shim: its training data (JSONL of {id, messages} rows or a datasets folder), "
    "rendered with the run's saved tokenizer as preflight does, so LOOP-01..04, 08 and 12 judge it"
)
GITHUB_HELP = (
    "in GitHub Actions: print the findings as workflow annotations and append a Markdown summary to "
    "$GITHUB_STEP_SUMMARY (when set)"
)


SOURCE_HELP = (
    "a run trained without the shim: the kind of training log to read (llamafactory, tensorboard, ...; "
    "trainer_state: the Trainer states alone), where the files' content does not tell"
)
RUN_HELP = "the run folder (or, for a run trained without the shim, its training log file)"


def _run_path(text: str) -> Path:
    """An argparse type: a run on the local disk; a remote address (a URL, s3://, wandb://, runs:/) is refused in
    one line that says how to copy it locally (nothing is ever fetched)."""
    from .imports.remote import remote_hint

    hint = remote_hint(text)
    if hint:
        raise argparse.ArgumentTypeError(hint)
    return Path(text)


_run_path.__name__ = "run path"


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


def _seconds(low: float):
    """An argparse type: a number of seconds >= low."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not value >= low or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{text} is not a number of seconds >= {low:g}")
        return value

    parse.__name__ = "seconds"
    return parse


def _cpu_share(text: str) -> float:
    """An argparse type: a share of one core's time, more than 0 (1: a whole core)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a share of a core above 0 (0.25: a quarter of one)")
    return value


def _webhook(text: str) -> str:
    """An argparse type: an http(s) URL with a host (never repeated in the error: a webhook's address is its secret)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname)
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError("give the webhook's http:// or https:// address")
    return text


_webhook.__name__ = "webhook URL"


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="sftaudit", description="Audit a supervised fine-tuning run from its sftaudit artifacts.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    s = sub.add_parser(
        "import",
        help="write artifacts for a Trainer/TRL output_dir trained without the shim "
        "(audit, replay and gate import such a folder themselves)",
    )
    s.add_argument("run_dir", type=_run_path, help=RUN_HELP)
    s.add_argument("--data", type=Path, help=DATA_HELP)
    s.add_argument("--source", metavar="NAME", help=SOURCE_HELP)

    s = sub.add_parser(
        "probe",
        help="run each surviving checkpoint of a run on probe prompts and an eval set "
        "(needs torch), so LOOP-06/07/08 run at checkpoint granularity",
    )
    s.add_argument("run_dir", type=_run_path, help=RUN_HELP)
    s.add_argument("--prompts", type=Path, required=True, help="text file: one probe prompt (user message) per line")
    s.add_argument("--eval", type=Path, help="JSONL eval set: {id, messages, reference} per line")
    s.add_argument("--base", type=Path, help="the base model folder: probed as step 0; PEFT adapters are applied to it")
    s.add_argument("--max-new-tokens", type=_at_least(1), default=32)
    s.add_argument("--samples", type=_at_least(1), default=4, help="sampled generations per prompt")
    s.add_argument("--quiet", action="store_true", help="no progress bar")

    s = sub.add_parser("ingest", help="load a run's artifacts into its database in sftaudit's cache (incremental)")
    s.add_argument("run_dir", type=_run_path, help=RUN_HELP)
    s.add_argument("--config", type=Path, help="TOML file whose [ingest] section sets the read limits")

    s = sub.add_parser("audit", help="ingest, run the checks, write verdict.json and report.html")
    s.add_argument("run_dir", type=_run_path, help=RUN_HELP)
    s.add_argument("--data", type=Path, help=DATA_HELP)
    s.add_argument("--source", metavar="NAME", help=SOURCE_HELP)
    s.add_argument(
        "--out",
        type=Path,
        help="output folder (default: reports/<run>/, or reports/<run>-<hash>/ when that one holds another run's)",
    )
    s.add_argument("--config", type=Path, help="TOML file with check thresholds and disabled checks")
    s.add_argument("--strict", action="store_true", help="warn findings fail too")
    s.add_argument("--no-report", action="store_true", help="write verdict.json only")
    s.add_argument("--sarif", type=Path, help="write SARIF 2.1.0 here (for code-scanning views)")
    s.add_argument("--github", action="store_true", help=GITHUB_HELP)

    s = sub.add_parser(
        "watch",
        help="follow a run as it trains: print each new finding once, post warn/fail to a webhook, and exit at "
        "the first fail (--exit-on) or when the run closes",
    )
    s.add_argument("run_dir", type=_run_path, help=RUN_HELP)
    s.add_argument("--data", type=Path, help=DATA_HELP)
    s.add_argument("--source", metavar="NAME", help=SOURCE_HELP)
    s.add_argument("--config", type=Path, help="TOML file with check thresholds and disabled checks")
    s.add_argument(
        "--interval",
        type=_seconds(0.1),
        default=2.0,
        help="the fewest seconds between two looks (default 2; more as --max-cpu requires)",
    )
    s.add_argument(
        "--idle-timeout",
        type=_seconds(0),
        default=3600.0,
        help="stop watching after this many seconds without a new record (default 3600; 0: never)",
    )
    s.add_argument(
        "--max-cpu",
        type=_cpu_share,
        default=0.5,
        metavar="SHARE",
        help="the most CPU time the watch takes, as a share of one core (default 0.5), over any stretch of time "
        "beyond a burst of two minutes' worth: the polls space out as the run grows",
    )
    s.add_argument(
        "--exit-on",
        choices=("fail", "warn"),
        help="exit 1 at the first finding this severe (warn: warn or fail) instead of watching on",
    )
    s.add_argument(
        "--stop-on",
        choices=("fail", "warn"),
        help="at the first finding this severe, ask the run to stop (RUN_DIR/sftaudit/stop-request.json, read by "
        "the shim's guard)",
    )
    s.add_argument(
        "--notify",
        type=_webhook,
        metavar="URL",
        help="post each new warn or fail as JSON to this webhook (Slack and Discord incoming webhooks take it)",
    )
    s.add_argument("--github", action="store_true", help=GITHUB_HELP)

    s = sub.add_parser(
        "report", help="rebuild report.html from the stored verdict (the checks run again only if the run grew)"
    )
    s.add_argument("run_dir", type=_run_path, help=RUN_HELP)
    s.add_argument(
        "--out",
        type=Path,
        help="output folder (default: reports/<run>/, or reports/<run>-<hash>/ when that one holds another run's)",
    )

    s = sub.add_parser(
        "card",
        help="the run's audit as a 'Training audit' section for a Hugging Face model card "
        "(audits the run first if it has no stored verdict)",
    )
    s.add_argument("run_dir", type=_run_path, help=RUN_HELP)
    s.add_argument(
        "--into",
        type=Path,
        help="write it into this model card (README.md) between <!-- sftaudit:start --> and <!-- sftaudit:end -->, "
        "appended when absent; the rest of the file is left byte for byte (default: print it)",
    )

    s = sub.add_parser("preflight", help="checks LOOP-01..04 on a dataset + tokenizer + chat template, before training")
    s.add_argument("--data", type=Path, required=True, help="JSONL of chat rows ({id, messages}) or a datasets folder")
    s.add_argument("--tokenizer", type=Path, required=True, help="a saved tokenizer folder (save_pretrained)")
    s.add_argument("--template", type=Path, help="chat template file to use instead of the tokenizer's")
    s.add_argument("--collator", help="module:function called as function(tokenizer, rows) (default: completion-only)")
    s.add_argument("--batch-size", type=_at_least(1), default=8)
    s.add_argument(
        "--max-length", type=_at_least(1), help="truncate to this many tokens (default: the tokenizer's limit)"
    )
    s.add_argument(
        "--out", type=Path, help="output folder (default: reports/preflight-<data>/, or -<hash> appended as for audit)"
    )
    s.add_argument("--config", type=Path, help="TOML file with check thresholds and disabled checks")
    s.add_argument("--strict", action="store_true", help="warn findings fail too")
    s.add_argument("--no-report", action="store_true", help="write verdict.json only")
    s.add_argument("--quiet", action="store_true", help="no progress bar")

    s = sub.add_parser("replay", help="a failed run's first anomalous step, findings, batches and how to resume")
    s.add_argument("run_dir", type=_run_path, help=RUN_HELP)
    s.add_argument("--data", type=Path, help=DATA_HELP)
    s.add_argument("--source", metavar="NAME", help=SOURCE_HELP)
    s.add_argument("--json", action="store_true", help="print the replay as JSON")
    s.add_argument("--config", type=Path, help="TOML file with check thresholds and the rollback margin")

    s = sub.add_parser("gate", help="exit 0 if a checkpoint passes, 1 if it fails, 2 if it cannot be judged")
    s.add_argument("run_dir", type=_run_path, help=RUN_HELP)
    s.add_argument("--data", type=Path, help=DATA_HELP)
    s.add_argument("--source", metavar="NAME", help=SOURCE_HELP)
    s.add_argument(
        "--checkpoint",
        required=True,
        help="checkpoint name, step or path; `best`: the checkpoint the verdict keeps (best on the run's selection metric)",
    )
    s.add_argument("--policy", type=Path, help="TOML file: which severities and codes block")
    s.add_argument("--config", type=Path, help="TOML file with check thresholds and disabled checks")
    s.add_argument("--strict", action="store_true", help="warn findings block too")
    s.add_argument("--junit", type=Path, help="write JUnit XML here (one testcase per check)")
    s.add_argument("--json", type=Path, help="write the gate result as JSON here")
    s.add_argument("--sarif", type=Path, help="write SARIF 2.1.0 of the findings up to the checkpoint here")
    s.add_argument("--github", action="store_true", help=GITHUB_HELP)

    s = sub.add_parser(
        "diff",
        help="where run B starts to differ from run A (or from a golden file): exit 0 same, "
        "1 diverged, 2 cannot compare",
    )
    s.add_argument("run_a", type=_run_path, help="a run folder or a golden file")
    s.add_argument("run_b", type=_run_path, help="a run folder or a golden file")
    s.add_argument(
        "--tolerance",
        type=float,
        help="a relative difference above this diverges (default: against the runs' own step-to-step noise)",
    )
    s.add_argument("--exact", action="store_true", help="any difference diverges (same-seed CPU runs)")
    s.add_argument("--json", action="store_true", help="print the comparison as JSON")
    s.add_argument("--out", type=Path, help="write diff.html here")

    s = sub.add_parser("golden", help="write a run's golden file: what `diff` compares, small enough to keep in CI")
    s.add_argument("run_dir", type=_run_path, help=RUN_HELP)
    s.add_argument("--out", type=Path, required=True, help="the golden file to write (JSON)")
    s.add_argument("--stride", type=_at_least(1), default=10, help="per-tensor gradient norms every N steps")

    s = sub.add_parser("demo", help="train a clean and a faulty tiny run on CPU, audit both")
    s.add_argument("--workdir", type=Path, default=Path("runs"), help="where the demo runs are recorded")
    s.add_argument("--steps", type=_at_least(1), default=60)
    return p


# Each subcommand is one module of sftaudit.commands, imported only when it runs (the CLI starts light).
COMMAND_MODULES = {
    "import": "import_run",
    "probe": "probe",
    "ingest": "ingest",
    "audit": "audit",
    "watch": "watch",
    "report": "report",
    "card": "card",
    "preflight": "preflight",
    "replay": "replay",
    "gate": "gate",
    "diff": "diff",
    "golden": "golden",
    "demo": "demo",
}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if hasattr(args, "source"):  # a command that imports: the run may be given by its log file's path
            args.log_file = args.run_dir if args.run_dir.is_file() else None
            args.run_dir = args.run_dir.parent if args.log_file is not None else args.run_dir
        command = importlib.import_module(f"{__package__}.commands.{COMMAND_MODULES[args.command]}")
        return command.run(args)  # each takes the run's lock where it uses the run (`sftaudit.verdict.audit`)
    except InputError as exc:
        _cannot_judge(args, str(exc))
        return EXIT_CANNOT_JUDGE
    except Exception as exc:  # noqa: BLE001 - could not judge: one line, never a traceback
        if os.environ.get("SFTAUDIT_DEBUG"):
            raise
        _cannot_judge(args, f"could not {args.command} {_subject(args)}: {_describe(exc, args.command)}")
        return EXIT_CANNOT_JUDGE


def _cannot_judge(args: argparse.Namespace, reason: str) -> None:
    """The one line on stderr; in GitHub Actions (--github), an error annotation too."""
    error(reason)
    if getattr(args, "github", False):
        from .outputs.github import command

        print(command("error", reason, title=f"sftaudit {args.command}: could not judge"), flush=True)


def _subject(args: argparse.Namespace) -> str:
    """The input a command was given, for the last-resort message."""
    for name in ("run_dir", "data", "workdir"):
        if getattr(args, name, None) is not None:
            return str(getattr(args, name))
    return "its input"


# What a command that ran out of memory can lower: only the commands that read a config's [ingest] limits
# (audit, replay, gate, ingest) have them.
_INGEST_LIMITS = "lower the [ingest] limits (max_record_bytes, max_file_bytes) in the file given with --config"
MEMORY_ADVICE = {
    **dict.fromkeys(("ingest", "audit", "replay", "gate"), _INGEST_LIMITS),
    "golden": "keep fewer per-tensor norms (a larger --stride)",
    "preflight": "check a sample of the dataset (a smaller --data file) or a shorter --max-length",
}


def _describe(exc: BaseException, command: str = "") -> str:
    """What went wrong, in words, and what to do (the last resort: a failure no input check foresaw)."""
    report = "if the input looks sound, this is a bug in sftaudit (SFTAUDIT_DEBUG=1 shows where)"
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryException":  # Python's, or DuckDB's
        lower = MEMORY_ADVICE.get(command)
        return "ran out of memory reading it; free memory" + (f", or {lower}" if lower else "")
    if isinstance(exc, RecursionError):
        return f"it is nested too deeply to read; {report}"
    if isinstance(exc, UnicodeError):
        return f"a file in it is not UTF-8 text ({one_line(exc)}); {report}"
    if isinstance(exc, OSError):
        where = f" {exc.filename}" if exc.filename else ""
        return f"cannot read or write{where} ({exc.strerror or one_line(exc)}); check that path"
    return f"{one_line(exc) or 'an unexpected error'}; {report}"


if __name__ == "__main__":
    sys.exit(main())
