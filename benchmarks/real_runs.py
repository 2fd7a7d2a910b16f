"""Audit every real, uninstrumented run folder in ``<repo>/../shared/realruns*`` and print one line per run.

Each run is copied to a temporary folder first (an audit writes its database into the run folder, and
the shared copies are read-only), then audited by the CLI in its own process with a time bound, so a
hang or a crash in one run cannot stall or hide the others. Per run: name, verdict, exit code, first
anomalous step, the warn/fail codes with a short message, the rollback and kept checkpoints, the checks not
run, check errors and what reached stderr beyond the CLI's own one-line error. Then a summary line.

With ``--peers``, three peer tools (benchmarks/peer_tools.py: ftdoctor, runmedic, trainproof, pinned)
are installed into side venvs under ~/.cache/sftaudit-bench/peers (reused when there) and each judges
its own fresh copy of every run. Every tool's CPU time (user+sys of its child process) is recorded.

Then, scored against the answer key ``benchmarks/real_runs_reading.toml`` (one table per run,
``["realruns2/<run>"]`` with ``kind`` clean | problem | nothing, ``expected`` pass | warn | fail |
unjudged and ``accept``, a list of other verdicts that are also right): one line per run with every
tool's verdict beside the expected one (``*`` marks a wrong one), the table of runs judged right per
folder, problems found (a warn or fail on a ``kind = "problem"`` run) in the new folders and the
median CPU seconds per log-only run (a folder holding only trainer_state.json / trainer_log.jsonl),
and the CPU spread per tool on those log-only runs (sftaudit's goal: <= 1 s with --no-report).

    python benchmarks/real_runs.py                      # sftaudit on all runs of both folders
    nice python benchmarks/real_runs.py --peers         # and the three peers beside it
    python benchmarks/real_runs.py lf-two-writers ...   # some of them (a name, or folder/name)
    python benchmarks/real_runs.py --root DIR --root DIR2 --timeout 300 --key KEY.toml
    python benchmarks/real_runs.py --log-only --cpu-only   # the CPU table alone, on the log-only runs

Every tool runs with its bytecode cached under ~/.cache/sftaudit-bench/pycache (a shell's
PYTHONDONTWRITEBYTECODE would make this source checkout recompile its modules on every run, which
an installed tool never does), after one untimed warm-up run each.
This is a benchmark, not a test (tests/test_real_runs.py audits a few of the runs).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peer_tools import PEERS, Outcome, Peer, child_env, run_child  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# `<repo>/../shared`; from a worktree one level deeper, the nearest `shared/` above the checkout.
SHARED = next((p / "shared" for p in REPO.parents if (p / "shared" / "realruns").is_dir()), REPO / ".." / "shared")
ROOTS = (SHARED / "realruns", SHARED / "realruns2")
KEY = REPO / "benchmarks" / "real_runs_reading.toml"
FOLDER_WORDS = {"realruns": "first", "realruns2": "new"}  # the table's words for the two folders
LOG_ONLY = {"trainer_state.json", "trainer_log.jsonl"}
MESSAGE_CHARS = 90


def fresh_copy(run: Path, tmp: Path) -> Path:
    """A writable copy of `run` in `tmp` (the shared copies are read-only; tools write beside them)."""
    copy = tmp / run.name
    shutil.copytree(run, copy, symlinks=True)
    for p in [copy, *copy.rglob("*")]:
        if not p.is_symlink():
            p.chmod(p.stat().st_mode | 0o200)
    return copy


def audit(run: Path, timeout: float) -> dict:
    """Audit a copy of `run`; what the verdict and the process said."""
    with tempfile.TemporaryDirectory(prefix="sftaudit-real-") as tmp:
        copy = fresh_copy(run, Path(tmp))
        out = Path(tmp) / "out"
        # The CLI in a subprocess, from the checkout's root: the harness never imports the package.
        cmd = [sys.executable, "-m", "sftaudit.cli", "audit", str(copy), "--out", str(out), "--no-report"]
        child = run_child(cmd, timeout, cwd=REPO, env=child_env())
        try:
            verdict = json.loads((out / "verdict.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            verdict = None
    word = (verdict or {}).get("verdict", "unjudged")
    why = "timeout" if child.rc is None else "" if verdict else f"exit {child.rc}, no verdict.json"
    return {
        "name": run.name,
        "rc": child.rc,
        "stderr": child.stderr,
        "verdict": verdict,
        "seconds": child.wall,
        "outcome": Outcome(word, why, child.rc, child.cpu, child.wall),
    }


def judge_with(peer: Peer, run: Path, timeout: float) -> Outcome:
    with tempfile.TemporaryDirectory(prefix=f"{peer.name}-real-") as tmp:
        return peer.judge(fresh_copy(run, Path(tmp)), timeout)


def said(result: dict) -> list[str]:
    """The CLI's own one-line messages on stderr (an input error, why a run cannot be judged)."""
    return [ln for ln in result["stderr"].splitlines() if ln.startswith(("sftaudit: error:", f"{result['name']}: "))]


def noise(result: dict) -> list[str]:
    """Everything else on stderr: tracebacks, library warnings, stray prints."""
    own = set(said(result))
    return [ln for ln in result["stderr"].splitlines() if ln.strip() and ln not in own]


def line(result: dict) -> str:
    v = result["verdict"] or {}
    rc = "timeout" if result["rc"] is None else str(result["rc"])
    parts = [
        f"{result['label']:<44} {v.get('verdict', '-'):<9} exit {rc:<7} first {str(v.get('first_anomalous_step')):<6}"
        f" cpu {result['outcome'].cpu:.2f} s"
    ]
    groups: dict[tuple[str, str], list[dict]] = {}
    for f in v.get("findings", []):
        if f["severity"] in ("warn", "fail"):
            groups.setdefault((f["code"], f["severity"]), []).append(f)
    for (code, severity), found in groups.items():
        f = found[0]
        msg = f["message"].split(" [imported logs")[0]
        msg = msg if len(msg) <= MESSAGE_CHARS else msg[: MESSAGE_CHARS - 3] + "..."
        more = f" (+{len(found) - 1} more)" if len(found) > 1 else ""
        parts.append(f"    {code} {severity} @{f['step']}{more}: {msg}")
    if v.get("rollback_checkpoint") or v.get("keep_checkpoint"):
        keep = v.get("keep") or {}
        parts.append(
            f"    roll back to {v.get('rollback_checkpoint')}; keep {v.get('keep_checkpoint')}"
            + (
                f" ({keep.get('metric')} {keep.get('value'):.4g} at step {keep.get('step')})"
                if v.get("keep_checkpoint")
                else ""
            )
        )
    not_run = [c["code"] for c in v.get("checks", []) if c.get("status") == "not_run"]
    if not_run:
        parts.append(f"    not run: {' '.join(c.removeprefix('LOOP-') for c in not_run)}")
    for e in v.get("check_errors", []):
        parts.append(f"    CHECK ERROR: {json.dumps(e)[:200]}")
    for note in (v.get("resolution") or {}).get("notes", []):
        parts.append(f"    note: {note[:200]}")
    for ln in said(result):
        parts.append(f"    said: {ln[:200]}")
    for ln in noise(result)[:6]:
        parts.append(f"    STDERR: {ln[:200]}")
    for peer, o in result["peers"].items():
        parts.append(f"    {peer:<10} {o.verdict:<8} cpu {o.cpu:5.2f} s  {o.why[:MESSAGE_CHARS]}".rstrip())
    return "\n".join(parts)


def summary(results: list[dict]) -> str:
    verdicts = [(r["verdict"] or {}).get("verdict") for r in results]
    count = {k: verdicts.count(k) for k in ("pass", "warn", "fail", "unjudged")}
    stderr = [noise(r) for r in results]
    return (
        f"{len(results)} runs: {count['pass']} pass, {count['warn']} warn, {count['fail']} fail, "
        f"{count['unjudged']} unjudged, {sum(v is None for v in verdicts)} without a verdict; "
        f"check errors {sum(len((r['verdict'] or {}).get('check_errors', [])) for r in results)}, "
        f"timeouts {sum(r['rc'] is None for r in results)}, "
        f"tracebacks {sum(any('Traceback' in ln for ln in s) for s in stderr)}, "
        f"warnings on stderr {sum(any('Warning' in ln for ln in s) for s in stderr)}, "
        f"exit codes outside 0/1/2 {sum(r['rc'] not in (0, 1, 2, None) for r in results)}; "
        f"{sum(r['seconds'] for r in results):.0f} s"
    )


def is_log_only(run: Path) -> bool:
    """Only a Trainer or LLaMA-Factory log in the folder: nothing but the log to read."""
    entries = [p for p in run.iterdir() if not p.name.startswith(".")]
    return bool(entries) and all(p.is_file() and not p.is_symlink() and p.name in LOG_ONLY for p in entries)


def outcomes(result: dict) -> dict[str, Outcome]:
    return {"sftaudit": result["outcome"], **result["peers"]}


def is_right(verdict: str, entry: dict) -> bool:
    return verdict == entry["expected"] or verdict in entry.get("accept", [])


def verdict_lines(results: list[dict], key: dict, tools: list[str]) -> list[str]:
    """One line per run: the expected verdict (and the others accepted), then every tool's; * = wrong."""
    rows = []
    for r in results:
        entry = key.get(r["label"])
        said_by = outcomes(r)
        cells = []
        for t in tools:
            o = said_by.get(t)
            mark = "*" if entry and o and not is_right(o.verdict, entry) else ""
            cells.append((o.verdict if o else "-") + mark)
        expected = "|".join([entry["expected"], *entry.get("accept", [])]) if entry else "-"
        rows.append([r["label"], entry.get("kind", "-") if entry else "-", expected, *cells])
    rows.insert(0, ["run", "kind", "expected", *tools])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(f"{cell:<{w}}" for cell, w in zip(row, widths)).rstrip() for row in rows]


def markdown_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def reading_table(results: list[dict], key: dict, tools: list[str]) -> list[str]:
    """Markdown, one row per keyed run: the reading of its log (the key's problem, else its reading's first
    sentence), the verdict expected, every tool's (* = wrong), and sftaudit's warn and fail codes."""
    head = f"| run | the reading of its log | expected | {tools[0]} ({' / '.join(tools[1:]) or 'no peers'}) | codes |"
    rows = [head, "| --- | --- | --- | --- | --- |"]
    for r in results:
        entry = key.get(r["label"])
        if not entry:
            continue
        reading = entry.get("problem") or entry.get("reading", "").split(". ")[0]
        said_by = outcomes(r)
        verdicts = [said_by[t].verdict + ("*" if not is_right(said_by[t].verdict, entry) else "") for t in tools]
        codes = sorted(
            {f["code"] for f in (r["verdict"] or {}).get("findings", []) if f["severity"] in ("warn", "fail")}
        )
        expected = " or ".join([entry["expected"], *entry.get("accept", [])])
        shown = verdicts[0] + (f" ({' / '.join(verdicts[1:])})" if len(verdicts) > 1 else "")
        rows.append(
            f"| {r['label']} | {entry.get('kind', '-')}: {markdown_cell(reading)} | {expected} | {shown} | {' '.join(codes) or '-'} |"
        )
    return rows


def median_cpu(results: list[dict], tool: str) -> float | None:
    cpu = [outcomes(r)[tool].cpu for r in results if r["log_only"] and tool in outcomes(r)]
    return statistics.median(cpu) if cpu else None


def score_table(results: list[dict], key: dict, tools: list[str], roots: list[Path]) -> list[str]:
    """Runs judged right per folder, problems found in the new folders, median CPU per log-only run."""
    by_root = {root.name: [r for r in results if r["root"] == root.name] for root in roots}
    by_root = {name: rs for name, rs in by_root.items() if rs}
    names = list(by_root)
    labels = {name: f"{FOLDER_WORDS.get(name, name)} {len(by_root[name])}" for name in names}
    problem_roots = [n for n in names if n != "realruns"] or names  # realruns/ was practice material
    head = (
        ["tool"]
        + [f"{labels[n]} right" for n in names]
        + [f"problems found in the {labels[n]}" for n in problem_roots]
        + ["median CPU s per log-only run"]
    )
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for tool in tools:
        cells = [tool]
        for n in names:
            keyed = [(r, key[r["label"]]) for r in by_root[n] if r["label"] in key and tool in outcomes(r)]
            right = sum(is_right(outcomes(r)[tool].verdict, e) for r, e in keyed)
            cells.append(f"{right}/{len(keyed)}")
        for n in problem_roots:
            problems = [
                r for r in by_root[n] if key.get(r["label"], {}).get("kind") == "problem" and tool in outcomes(r)
            ]
            found = sum(outcomes(r)[tool].verdict in ("warn", "fail") for r in problems)
            cells.append(f"{found}/{len(problems)}")
        m = median_cpu(results, tool)
        cells.append("-" if m is None else f"{m:.2f}")
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def cpu_table(results: list[dict], tools: list[str]) -> list[str]:
    """CPU seconds per log-only run, per tool: median, min-max and the ratio to sftaudit's median."""
    log_only = [r for r in results if r["log_only"]]
    if not log_only:
        return ["no log-only run among those audited"]
    base = median_cpu(results, "sftaudit")
    lines = [
        f"CPU s (user+sys) per log-only run, {len(log_only)} runs: {', '.join(r['label'] for r in log_only)}",
        "| tool | median | min-max | median / sftaudit's |",
        "| --- | --- | --- | --- |",
    ]
    for tool in tools:
        cpu = [outcomes(r)[tool].cpu for r in log_only if tool in outcomes(r)]
        if not cpu:
            continue
        m = statistics.median(cpu)
        ratio = f"{m / base:.2f}" if base else "-"
        lines.append(f"| {tool} | {m:.2f} | {min(cpu):.2f}-{max(cpu):.2f} | {ratio} |")
    if base is not None:
        lines.append(f"sftaudit audit --no-report: median {base:.2f} s CPU per log-only run (goal <= 1 s)")
    return lines


def load_key(path: Path) -> dict:
    """The answer key, by `folder/run`; empty (with a note) when it is not there or unreadable."""
    try:
        with path.open("rb") as f:
            key = tomllib.load(f)
    except OSError:
        print(f"no answer key at {path}: verdicts are not scored")
        return {}
    except tomllib.TOMLDecodeError as exc:
        print(f"{path}: not TOML ({exc}): verdicts are not scored")
        return {}
    bad = [name for name, e in key.items() if not isinstance(e, dict) or "expected" not in e]
    for name in bad:
        print(f"{path}: [{name}] has no expected verdict: not scored")
    return {name: e for name, e in key.items() if name not in bad}


def install_peers() -> list[Peer]:
    """The peers that are installed (or could be now), with their install size and time."""
    ready = []
    for peer in PEERS:
        cached = peer.installed
        why = peer.install()
        if why:
            print(f"{peer.name} {peer.version}: not installed ({why}); left out")
            continue
        facts = peer.install_facts()
        print(
            f"{peer.name} {peer.version}: {facts.get('bytes', 0) / 2**20:.0f} MiB venv, installed in "
            f"{facts.get('seconds', '?')} s{' (cached)' if cached else ''}: {peer.venv}"
        )
        ready.append(peer)
    return ready


def select_runs(roots: list[Path], names: list[str]) -> list[Path]:
    runs = [p for root in roots for p in sorted(root.iterdir()) if p.is_dir() and not p.name.startswith(".")]
    if not names:
        return runs
    chosen = [p for p in runs if p.name in names or f"{p.parent.name}/{p.name}" in names]
    missing = set(names) - {p.name for p in chosen} - {f"{p.parent.name}/{p.name}" for p in chosen}
    for name in sorted(missing):
        print(f"{name}: no such run in {', '.join(str(r) for r in roots)}", file=sys.stderr)
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", help="run folder names, or folder/name (default: all)")
    parser.add_argument(
        "--root", type=Path, action="append", help="folder of run folders (repeatable; default: both realruns folders)"
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run and tool")
    parser.add_argument("--peers", action="store_true", help="also run ftdoctor, runmedic and trainproof")
    parser.add_argument("--key", type=Path, default=KEY, help="answer key (TOML)")
    parser.add_argument("--log-only", action="store_true", help="only the log-only runs (of those named, or all)")
    parser.add_argument("--cpu-only", action="store_true", help="print the CPU table alone")
    parser.add_argument(
        "--table", type=Path, help="also write a Markdown table: each run's reading (the key's) beside every verdict"
    )
    args = parser.parse_args()
    roots = [r.resolve() for r in (args.root or [r for r in ROOTS if r.is_dir()])]
    for root in roots:
        if not root.is_dir():
            print(f"{root}: no such folder", file=sys.stderr)
            return 2
    if not roots:
        print(f"{ROOTS[0].parent.resolve()}: no realruns folder", file=sys.stderr)
        return 2
    runs = select_runs(roots, args.runs)
    if args.log_only:
        runs = [r for r in runs if is_log_only(r)]
    if not runs:
        return 2
    peers = install_peers() if args.peers else []
    tools = ["sftaudit", *(p.name for p in peers)]
    # One untimed run each first: bytecode compiled and files cached for every tool alike.
    warm = next((r for r in runs if is_log_only(r)), runs[0])
    audit(warm, args.timeout)
    for peer in peers:
        judge_with(peer, warm, args.timeout)

    results = []
    for run in runs:
        result = audit(run, args.timeout)
        result.update(root=run.parent.name, label=f"{run.parent.name}/{run.name}", log_only=is_log_only(run))
        result["peers"] = {peer.name: judge_with(peer, run, args.timeout) for peer in peers}
        results.append(result)
        if not args.cpu_only:
            print(line(result), flush=True)
    if args.cpu_only:
        print("\n".join(cpu_table(results, tools)))
        return 0
    print(summary(results))
    for peer in peers:
        said_by = [r["peers"][peer.name] for r in results]
        count = {v: sum(o.verdict == v for o in said_by) for v in ("pass", "warn", "fail", "unjudged")}
        print(
            f"{peer.name}: {count['pass']} pass, {count['warn']} warn, {count['fail']} fail, "
            f"{count['unjudged']} unjudged, timeouts {sum(o.rc is None for o in said_by)}; "
            f"{sum(o.wall for o in said_by):.0f} s"
        )

    key = load_key(args.key)
    print()
    print("\n".join(verdict_lines(results, key, tools)))
    if key:
        print()
        print("\n".join(score_table(results, key, tools, roots)))
        unkeyed = [r["label"] for r in results if r["label"] not in key]
        if unkeyed:
            print(f"not in the key, not scored: {' '.join(unkeyed)}")
        if args.table:
            args.table.write_text("\n".join(reading_table(results, key, tools)) + "\n", encoding="utf-8")
    print()
    print("\n".join(cpu_table(results, tools)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
