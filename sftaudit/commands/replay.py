"""`sftaudit replay RUN_DIR`: for a failed or diverged run, where it went wrong and how to resume.

The run is audited (a run killed mid-step audits: the torn last record is skipped). The
replay holds the first anomalous step, the chain of anomalies from the rollback checkpoint
to `window` steps after the anomaly, the run's configuration findings (what to change, not
batches to skip), the sample ids of every batch from the rollback
checkpoint to the anomaly (to inspect or skip), the rollback checkpoint, and the command
to resume from it: the training loop's own ``resume_command`` (recorder config, a template
with ``{checkpoint}``) or, for a Trainer run, the recorded command line (as typed, with its
interpreter) with ``--resume_from_checkpoint PATH`` and the equivalent
``trainer.train(resume_from_checkpoint=PATH)``. A checkpoint the shim's guard kept out of the
trainer's rotation is resumed from its kept copy (``RUN_DIR/sftaudit/kept/<name>``). Everything
printed for a shell is shell-quoted: paths with spaces, quotes or ``$`` paste as one word.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

from ..store.rundb import connect, load_manifest
from ..verdict.audit import audited
from ..verdict.config import AuditConfig

DEFAULT_WINDOW = 10


def replay(
    run_dir: str | Path,
    config: AuditConfig | None = None,
    window: int = DEFAULT_WINDOW,
    data: str | Path | None = None,
    source: str | None = None,
    log_file: str | Path | None = None,
) -> dict[str, Any]:
    with audited(
        run_dir, config, data=data, source=source, log_file=log_file
    ) as done:  # the audit and the read of its batches see one state
        return _replay(Path(run_dir), done.verdict, window)


def _replay(run_dir: Path, verdict: dict[str, Any], window: int) -> dict[str, Any]:
    first = verdict["first_anomalous_step"]
    out: dict[str, Any] = {
        "run": verdict["run"],
        "verdict": verdict["verdict"],
        "first_anomalous_step": first,
        "rollback_checkpoint": None,
        "rollback_margin": verdict["rollback_margin"],
        "rollback_deleted": verdict["rollback_deleted"],
        "chain": [],
        "batches": [],
        "resume": None,
        "configuration": configuration(verdict),
        **kept(verdict),
    }
    if first is None:
        return out
    rollback = next((c for c in verdict["checkpoints"] if c["name"] == verdict["rollback_checkpoint"]), None)
    since = rollback["step"] if rollback else 0
    out["chain"] = chain(verdict, since, first + window)
    con = connect(run_dir, read_only=True)
    try:
        rows = con.execute(
            """SELECT step, flatten(list(sample_ids ORDER BY micro)) FROM (
                   SELECT step, micro, sample_ids FROM batches WHERE rank = 0 AND step > ? AND step <= ?)
               GROUP BY step ORDER BY step""",
            [since, first],
        ).fetchall()
        manifest = load_manifest(con)
    finally:
        con.close()
    out["batches"] = [{"step": step, "sample_ids": ids} for step, ids in rows]
    if rollback:
        out["rollback_checkpoint"] = {k: rollback[k] for k in ("name", "step", "path")}
        path = str(run_dir / rollback["path"])
        skip = [b["step"] for b in out["batches"]]
        out["resume"] = {
            "resume_from_checkpoint": path,
            "skip_steps": skip,
            "skip_sample_ids": [i for b in out["batches"] for i in b["sample_ids"] or []],
            **resume_command(manifest, path, skip),
        }
    return out


def kept(verdict: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint to ship (name, step, path; None when none can be named) and the verdict's `keep` object."""
    keep = verdict.get("keep")
    chosen = next((c for c in verdict["checkpoints"] if c["name"] == verdict.get("keep_checkpoint")), None)
    return {"keep_checkpoint": {k: chosen[k] for k in ("name", "step", "path")} if chosen else None, "keep": keep}


def keep_line(doc: dict[str, Any]) -> list[str]:
    """The kept checkpoint in one line (none when the run logged no evaluation)."""
    keep, chosen = doc.get("keep"), doc.get("keep_checkpoint")
    if not keep:
        return []
    if chosen:
        return [f"keep {chosen['name']} to ship (step {chosen['step']}): {keep['why']}"]
    return [f"no checkpoint to keep: {keep['why']}"]


def chain(verdict: dict[str, Any], since: int, until: int) -> list[dict[str, Any]]:
    """The anomalies after step `since` up to `until`: what went wrong around the first one (a
    configuration or a risk is no bad step, and skipping batches does not undo it)."""
    return [
        f
        for f in verdict["findings"]
        if f["scope"] == "run"
        and f["step"] is not None
        and f.get("category", "anomaly") == "anomaly"
        and since < f["step"] <= until
    ]


def configuration(verdict: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's configuration findings: what to change in the setup, not batches to skip."""
    return [
        {k: f[k] for k in ("code", "severity", "step", "message")}
        for f in verdict["findings"]
        if f.get("category") == "configuration"
    ]


def resume_command(manifest: dict[str, Any], path: str, skip_steps: list[int] = ()) -> dict[str, str | None]:
    """How this run resumes: the loop's own `resume_command` template (recorder config, with a
    ``{checkpoint}`` field and optionally ``{skip_steps}``, filled with a list such as [11, 12]),
    or for a Trainer run its recorded command line plus ``--resume_from_checkpoint`` and the
    equivalent `trainer.train` call."""
    config = manifest.get("config") or {}
    if isinstance(config.get("resume_command"), str):
        return {"command": fill_template(config["resume_command"], path, list(skip_steps)), "trainer": None}
    if "training_args" in config:
        argv = _command_line(manifest)
        return {
            "command": shlex.join([*argv, "--resume_from_checkpoint", path]) if argv else None,
            "trainer": f"trainer.train(resume_from_checkpoint={path!r})",
        }
    return {"command": None, "trainer": None}


def _command_line(manifest: dict[str, Any]) -> list[str]:
    """The recorded command line without a ``--resume_from_checkpoint`` it already had: as typed (with the
    interpreter: ``python -m pkg.train ...``) for one process; the script and its arguments for several ranks,
    whose launcher (torchrun, accelerate launch) the ranks do not see."""
    typed = manifest.get("orig_argv") if (manifest.get("world_size") or 1) == 1 else None
    argv = [str(a) for a in (typed or manifest.get("argv") or [])]
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--resume_from_checkpoint":
            skip = True
        elif not arg.startswith("--resume_from_checkpoint="):
            out.append(arg)
    return out


# A path this plain may stand inside a quoted argument (a Python string in `python -c '...'`) as is.
_PLAIN_PATH = re.compile(r"[\w./+,=:@%-]+")


def fill_template(template: str, path: str, skip_steps: list[int]) -> str | None:
    """The resume template filled in, safe to paste into a shell: it is split into words, each word
    filled, and the words joined again with shell quoting, so a checkpoint folder named
    ``checkpoint-5'$(touch x)'`` stays one literal word. A path with quotes or other specials that
    would sit *inside* a word (``resume_from="{checkpoint}"``, whose language we cannot quote for)
    is not filled in: None, and replay names the checkpoint instead."""
    try:
        words = shlex.split(template)
    except ValueError:  # unbalanced quotes: not a command we can fill safely
        return None
    if any("{checkpoint}" in w and w != "{checkpoint}" for w in words) and not _PLAIN_PATH.fullmatch(path):
        return None
    steps = json.dumps(skip_steps)
    return shlex.join(w.replace("{checkpoint}", path).replace("{skip_steps}", steps) for w in words)


def to_json(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def to_text(doc: dict[str, Any]) -> str:
    changes = [f"  {f['code']} {f['severity']}: {f['message']}" for f in doc.get("configuration") or []]
    if changes:
        changes.insert(0, "configuration to change (no bad step: rolling back or skipping batches does not fix it):")
    if doc["first_anomalous_step"] is None:
        return "\n".join(
            [f"{doc['run']}: {doc['verdict'].upper()}; no anomalous step, nothing to replay", *keep_line(doc), *changes]
        )
    lines = [f"{doc['run']}: {doc['verdict'].upper()}; first anomalous step {doc['first_anomalous_step']}"]
    lines.append("findings:")
    lines += [f"  step {f['step']} {f['code']} {f['severity']}: {f['message']}" for f in doc["chain"]]
    lines += changes
    rb = doc["rollback_checkpoint"]
    deleted = (
        f"; {doc['rollback_deleted']} would have been, but it is no longer on disk"
        if doc.get("rollback_deleted")
        else ""
    )
    if rb is None:
        lines.append(
            f"no intact checkpoint on disk at least {doc['rollback_margin']} steps before the anomaly"
            f"{deleted}: restart from scratch"
        )
    else:
        lines.append(
            f"roll back to {rb['name']} (step {rb['step']}; rollback margin {doc['rollback_margin']}){deleted}"
        )
    lines += keep_line(doc)
    lines.append("batches up to the anomaly (inspect or skip; sample ids shell-quoted):")
    lines += [f"  step {b['step']}: {' '.join(map(shlex.quote, b['sample_ids'] or []))}" for b in doc["batches"]]
    if doc["resume"]:
        r = doc["resume"]
        lines.append("resume:")
        lines += [f"  {r[k]}" for k in ("command", "trainer") if r[k]]
        if not (r["command"] or r["trainer"]):
            lines.append(f"  restore everything from {shlex.quote(r['resume_from_checkpoint'])} in your loop")
        if r["skip_steps"]:
            lines.append(
                f"  and skip the data of steps {_steps(r['skip_steps'])} ({len(r['skip_sample_ids'])} sample(s), listed "
                "above): drop those ids from the dataset, or those batches from the loop"
            )
    return "\n".join(lines)


def _steps(steps: list[int]) -> str:
    contiguous = steps == list(range(steps[0], steps[-1] + 1))
    return f"{steps[0]}-{steps[-1]}" if contiguous and len(steps) > 1 else ", ".join(map(str, steps))


def run(args) -> int:
    """The CLI: audit, then print the replay (text, or JSON with --json)."""
    from ..core.terminal import json_safe
    from .common import exit_code, say

    config = AuditConfig.load(args.config)
    doc = replay(args.run_dir, config, data=args.data, source=args.source, log_file=args.log_file)
    if args.json:
        print(json_safe(to_json(doc)), end="")
    else:
        say(to_text(doc))
    return exit_code(doc["verdict"], config.strict)
