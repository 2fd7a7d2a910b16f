"""Run against run, or run against a golden file: where did this run start to differ from the good one?

`profile(run)` reads what two runs can be compared on: per step the loss, learning rate and global
gradient norm, per tensor its gradient norm (at a stride), the probe distributions where recorded,
the data order (sample ids per step), and what should be equal in two runs meant to train the same:
the config, the library versions, the chat template and tokenizer fingerprints, the checkpoints'
digests, and the warn/fail findings. A golden file is that profile saved as JSON
(`sftaudit golden RUN --out golden.json`), so CI can gate a training-code change on "still trains
the same" without keeping the reference run.

Divergence is judged per series on the steps both runs have:
- exact (`exact=True`): any bit of difference (same-seed CPU runs are bit-identical);
- `tolerance=T`: a relative difference above T;
- otherwise against run-to-run noise: a difference above `NOISE_K` times the series' own
  step-to-step noise (1.4826 x MAD of its first differences, pooled over both runs; gradient norms
  and probe probabilities in log space), so two runs of another seed do not diverge at every step.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError, one_line
from ..schema.golden import GOLDEN_VERSION

NOISE_K = 6.0
TENSORS_LISTED = 10
# A series whose own noise is zero (a deterministic LR schedule) diverges above this relative gap.
CONSTANT_RTOL = 1e-6


def profile(run_dir: str | Path, stride: int = 1, with_findings: bool = True) -> dict[str, Any]:
    """What `compare` reads from a run (recorded or imported)."""
    from ..store.rundb import connect, load_manifest
    from ..verdict.audit import audited

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise InputError(f"{run_dir}: no such run directory")
    if stride < 1:
        raise InputError(f"--stride must be 1 or more, not {stride}")
    with audited(run_dir, judge="always" if with_findings else "never") as done:  # the reads see what was judged
        verdict = done.verdict if with_findings else None
        con = connect(run_dir, read_only=True)
        try:
            manifest = load_manifest(con)
            steps = con.sql("SELECT step, loss, lr, grad_norm FROM steps WHERE rank = 0 ORDER BY step").fetchnumpy()
            grads = con.sql(f"""SELECT tensor, list(step ORDER BY step) AS steps, list(norm ORDER BY step) AS norms
                                FROM grad_norms WHERE rank = 0 AND step % {int(stride)} = 0
                                GROUP BY tensor, idx ORDER BY idx""").fetchall()
            probes = con.sql("""SELECT step, prompt, top_ids[1] AS top_id, top_probs[1] AS top_prob FROM probes
                                ORDER BY step, prompt""").fetchall()
            order = con.sql("""SELECT step, list(sample_ids ORDER BY micro) FROM batches WHERE rank = 0
                               GROUP BY step ORDER BY step""").fetchall()
            templates = [
                t
                for (t,) in con.sql(
                    "SELECT DISTINCT template_fingerprint FROM batches WHERE template_fingerprint IS NOT NULL ORDER BY 1"
                ).fetchall()
            ]
            digests = con.sql("""SELECT path, any_value(sha256) FROM checkpoints WHERE event = 'hashed'
                                 GROUP BY path ORDER BY path""").fetchall()
        finally:
            con.close()
    tokenizer = manifest.get("tokenizer") or {}
    from ..core.artifacts import template_fingerprint

    return {
        "run": manifest.get("run_id") or run_dir.name,
        "source": str(run_dir),
        "stride": stride,
        "steps": {"step": [int(s) for s in steps["step"].tolist()]}
        | {k: [_plain(v) for v in steps[k].tolist()] for k in ("loss", "lr", "grad_norm")},
        "tensors": {name: {"steps": s, "norms": [_plain(v) for v in n]} for name, s, n in grads},
        "probes": [[s, p, i, _plain(v)] for s, p, i, v in probes],
        "data_order": {str(s): hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16] for s, ids in order},
        "fingerprints": {
            "tokenizer": tokenizer.get("fingerprint"),
            "chat_template": template_fingerprint(tokenizer.get("chat_template")),
            "templates_trained": templates,
        },
        # What the tokenizer is, to name what differs (the template by its fingerprint).
        "tokenizer": {
            **{k: tokenizer.get(k) for k in ("class", "length", "special_tokens", "added_tokens", "identity")},
            "chat_template": template_fingerprint(tokenizer.get("chat_template")),
        },
        "first_anomalous_step": None if verdict is None else verdict["first_anomalous_step"],
        "config": _without_location(manifest.get("config") or {}, run_dir),
        "versions": manifest.get("versions") or {},
        "checkpoints": {path: json.loads(sha) if isinstance(sha, str) else sha for path, sha in digests},
        "findings": None
        if verdict is None
        else sorted(
            {(f["code"], f["severity"], f["step"]) for f in verdict["findings"] if f["severity"] != "info"},
            key=lambda f: (f[2] is None, f[2] or 0, f[0]),
        ),
    }


def write_golden(run_dir: str | Path, out: str | Path, stride: int = 10) -> Path:
    golden = {"sftaudit_golden": GOLDEN_VERSION, **profile(run_dir, stride=stride)}
    golden["not_finite"] = _nulls_for_not_finite(golden)
    out = Path(out)
    out.write_text(json.dumps(golden, indent=None, separators=(",", ":"), allow_nan=False), encoding="utf-8")
    return out


# A golden file larger than this is refused before it is read (a long run's, at the default stride, is a few MB).
MAX_GOLDEN_BYTES = 256 * 1024 * 1024
_SERIES = ("loss", "lr", "grad_norm")


def _golden_series(golden: dict[str, Any]):
    """(where, list) for each list of numbers in a golden file that may hold a value that is not finite."""
    for key in _SERIES:
        yield ["steps", key], golden["steps"][key]
    for name, tensor in golden["tensors"].items():
        yield ["tensors", name, "norms"], tensor["norms"]


def _nulls_for_not_finite(golden: dict[str, Any]) -> list[dict[str, Any]]:
    """Replace each NaN and infinity of the series with null (JSON has neither), in place; where they stood."""
    out = []

    def put(series, values, index):
        out.append({"series": series, "index": index, "value": str(values[index])})  # nan, inf or -inf
        values[index] = None

    for series, values in _golden_series(golden):
        for i in np.flatnonzero(
            ~np.isfinite(np.array(values, dtype=float)) & np.array([v is not None for v in values])
        ):
            put(series, values, int(i))
    for i, probe in enumerate(golden["probes"]):
        if probe[3] is not None and not np.isfinite(probe[3]):
            out.append({"series": ["probes"], "index": i, "value": str(probe[3])})
            probe[3] = None
    return out


def _golden_schema():
    import importlib.resources

    from jsonschema import Draft202012Validator

    text = (importlib.resources.files("sftaudit.schema") / "golden.schema.json").read_text(encoding="utf-8")
    return Draft202012Validator(json.loads(text))


def _read_golden(source: Path) -> dict[str, Any]:
    """A golden file: a regular file under the size limit, JSON, valid against golden.schema.json, its series of
    matching lengths; the values that were not finite put back. InputError in one line otherwise."""
    from ..core.safe_io import read_bytes

    again = f"write it again with `sftaudit golden RUN --out {source.name}`"
    data = read_bytes(source, max_bytes=MAX_GOLDEN_BYTES)
    try:
        golden = json.loads(data.decode("utf-8"))
    except RecursionError:
        raise InputError(f"{source}: not a golden file (nested too deeply to read); {again}") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise InputError(f"{source}: not a golden file (not JSON: {one_line(exc, 120)}); {again}") from None
    if not isinstance(golden, dict) or golden.get("sftaudit_golden") != GOLDEN_VERSION:
        raise InputError(f"{source}: not a golden file of version {GOLDEN_VERSION}; {again}")
    from jsonschema.exceptions import best_match

    error = best_match(_golden_schema().iter_errors(golden))
    if error is not None:
        where = "/".join(map(str, error.absolute_path)) or "the top level"
        raise InputError(f"{source}: not a valid golden file (at {where}: {one_line(error.message, 160)}); {again}")
    steps = len(golden["steps"]["step"])
    lengths = {f"steps/{key}": (len(golden["steps"][key]), steps) for key in _SERIES}
    lengths |= {f"tensors/{n}": (len(t["norms"]), len(t["steps"])) for n, t in golden["tensors"].items()}
    uneven = [where for where, (values, at) in lengths.items() if values != at]
    if uneven:
        raise InputError(f"{source}: not a valid golden file ({uneven[0]} is not as long as its steps); {again}")
    for null in golden.get("not_finite") or []:
        values = _lookup(golden, null["series"])
        if values is None or not 0 <= null["index"] < len(values):
            raise InputError(f"{source}: not a valid golden file (not_finite names no value); {again}")
        if null["series"] == ["probes"]:
            values[null["index"]][3] = float(null["value"])
        else:
            values[null["index"]] = float(null["value"])
    return golden


def _lookup(golden: dict[str, Any], series: list[str]) -> list | None:
    node: Any = golden
    for key in series:
        node = node.get(key) if isinstance(node, dict) else None
    return node if isinstance(node, list) else None


def load(source: str | Path) -> dict[str, Any]:
    """A run folder's profile, or a golden file's."""
    source = Path(source)
    if source.is_dir():
        return profile(source)
    if not source.exists():
        raise InputError(f"{source}: neither a run folder nor a golden file")
    golden = _read_golden(source)
    golden["source"] = str(source)
    golden["findings"] = (
        [tuple(f) for f in golden.get("findings") or []] if golden.get("findings") is not None else None
    )
    return golden


def compare(
    a: dict[str, Any], b: dict[str, Any], tolerance: float | None = None, exact: bool = False
) -> dict[str, Any]:
    """Where b starts to differ from a: first divergent step, the tensors that moved first, what else
    differs, and the findings one run has that the other lacks."""
    if tolerance is not None and not (tolerance >= 0):
        raise InputError(f"--tolerance must be a number >= 0, not {tolerance}")
    steps_a, steps_b = np.array(a["steps"]["step"], dtype=np.int64), np.array(b["steps"]["step"], dtype=np.int64)
    common, ia, ib = np.intersect1d(steps_a, steps_b, return_indices=True)
    if not common.size:
        raise InputError(f"{a['run']} and {b['run']} share no recorded step: nothing to compare")
    judge, bitwise = _judge(tolerance, exact), _judge(None, True)
    series, differs_from = {}, {}
    for key, log in (("loss", False), ("lr", False), ("grad_norm", True)):
        x, y = (np.array(p["steps"][key], dtype=float)[i] for p, i in ((a, ia), (b, ib)))
        if np.isnan(x).all() and np.isnan(y).all():
            continue
        series[key] = _first(common, judge(x, y, log))
        differs_from[key] = _first(common, bitwise(x, y, log))  # any difference at all, beside the judged one
    tensors = _tensor_divergence(a, b, judge)
    probes = _probe_divergence(a, b, judge)
    if probes is not None:
        series["probes"], differs_from["probes"] = probes, _probe_divergence(a, b, bitwise)
    firsts = [s for s in [*series.values(), *(t["step"] for t in tensors)] if s is not None]
    moved = sorted((t for t in tensors if t["step"] is not None), key=lambda t: (t["step"], -t["gap"]))
    only_in = _findings_only_in(a, b)
    # The audits' word counts as the series' does: a run whose audit finds something at a step the other's does
    # not has diverged there, however small the gap in the series.
    found = [f["step"] for side in (only_in or {}).values() for f in side if f["step"] is not None]
    first = min(firsts + found, default=None)
    return {
        "a": a["run"],
        "b": b["run"],
        "mode": "exact" if exact else ("tolerance" if tolerance is not None else "noise"),
        "tolerance": tolerance,
        "steps_compared": int(common.size),
        "first_divergent_step": first,
        "diverged_by": _diverged_by(first, series, tensors, only_in, a["run"], b["run"]),
        "first_anomalous_step": {"a": a.get("first_anomalous_step"), "b": b.get("first_anomalous_step")},
        "series": series,
        "series_differ_from": differs_from,
        "tensors": [t["tensor"] for t in moved if t["step"] == first][:TENSORS_LISTED]
        or [t["tensor"] for t in moved][:TENSORS_LISTED],
        "differences": _differences(a, b, steps_a, steps_b),
        "findings_only_in": only_in,
    }


def _diverged_by(first, series, tensors, only_in, name_a: str, name_b: str) -> list[str]:
    """What sets the first divergent step: the series, tensors and findings that diverge there."""
    if first is None:
        return []
    out = [name.replace("_", " ") for name, step in series.items() if step == first]
    moved = [t["tensor"] for t in tensors if t["step"] == first]
    if moved:
        out.append(f"{len(moved)} tensor(s)' gradient norms")
    for side, name in (("a", name_a), ("b", name_b)):
        out += [
            f"{f['code']} {f['severity']} only in {name}" for f in (only_in or {}).get(side) or [] if f["step"] == first
        ]
    return out


def _judge(tolerance: float | None, exact: bool):
    """A function (x, y, log) -> per-step bool array: does y diverge from x there."""

    def differs(x, y, log):
        nan_mismatch = np.isnan(x) != np.isnan(y)
        with np.errstate(invalid="ignore", divide="ignore"):
            if exact:
                return nan_mismatch | ((x != y) & ~(np.isnan(x) & np.isnan(y)))
            if log:
                x, y = np.log(np.where(x > 0, x, np.nan)), np.log(np.where(y > 0, y, np.nan))
            gap = np.abs(x - y)
            if tolerance is not None:
                scale = np.fmax(np.abs(x), np.abs(y))
                return nan_mismatch | (gap > tolerance * np.where(scale > 0, scale, 1.0))
            noise = _noise(x, y)
            limit = NOISE_K * noise if noise > 0 else CONSTANT_RTOL * np.fmax(np.abs(x), np.abs(y))
            return nan_mismatch | (np.nan_to_num(gap, nan=0.0) > limit)

    return differs


def _noise(x: np.ndarray, y: np.ndarray) -> float:
    """Pooled step-to-step noise of two series: 1.4826 x MAD of their finite first differences."""
    d = np.concatenate([np.diff(x[np.isfinite(x)]), np.diff(y[np.isfinite(y)])])
    if not d.size:
        return 0.0
    return float(1.4826 * np.median(np.abs(d - np.median(d))))


def _first(steps: np.ndarray, diverged: np.ndarray) -> int | None:
    hits = np.flatnonzero(diverged)
    return int(steps[hits[0]]) if hits.size else None


def _tensor_divergence(a, b, judge) -> list[dict[str, Any]]:
    out = []
    for name in a["tensors"].keys() & b["tensors"].keys():
        ta, tb = a["tensors"][name], b["tensors"][name]
        common, ia, ib = np.intersect1d(
            np.array(ta["steps"], dtype=np.int64), np.array(tb["steps"], dtype=np.int64), return_indices=True
        )
        if not common.size:
            continue
        x, y = np.array(ta["norms"], dtype=float)[ia], np.array(tb["norms"], dtype=float)[ib]
        step = _first(common, judge(x, y, True))
        gap = 0.0
        if step is not None:
            k = int(np.searchsorted(common, step))
            with np.errstate(invalid="ignore", divide="ignore"):
                gap = float(np.nan_to_num(abs(np.log(y[k]) - np.log(x[k])), nan=np.inf))
        out.append({"tensor": name, "step": step, "gap": gap})
    return out


def _probe_divergence(a, b, judge) -> int | None:
    pa = {(s, p): (i, v) for s, p, i, v in a.get("probes") or []}
    pb = {(s, p): (i, v) for s, p, i, v in b.get("probes") or []}
    keys = sorted(pa.keys() & pb.keys())
    if not keys:
        return None
    x = np.array([pa[k][1] for k in keys], dtype=float)
    y = np.array([pb[k][1] for k in keys], dtype=float)
    top_changed = np.array([pa[k][0] != pb[k][0] for k in keys])
    hits = np.flatnonzero(judge(x, y, True) | top_changed)
    return int(keys[hits[0]][0]) if hits.size else None


def _differences(a, b, steps_a, steps_b) -> list[dict[str, Any]]:
    out = []
    if steps_a.size != steps_b.size or (steps_a.size and (steps_a[-1] != steps_b[-1])):
        out.append({"what": "steps recorded", "a": _span(steps_a), "b": _span(steps_b)})
    out += _tokenizer_differences(a, b)
    for key in ("chat_template", "templates_trained"):
        if a["fingerprints"].get(key) != b["fingerprints"].get(key):
            out.append(
                {
                    "what": f"{key.replace('_', ' ')} fingerprint",
                    "a": a["fingerprints"].get(key),
                    "b": b["fingerprints"].get(key),
                }
            )
    out += _dict_diff("config", a["config"], b["config"]) + _dict_diff("version", a["versions"], b["versions"])
    order_a, order_b = a["data_order"], b["data_order"]
    differing = sorted(int(s) for s in order_a.keys() & order_b.keys() if order_a[s] != order_b[s])
    if differing:
        out.append(
            {
                "what": "data order",
                "a": f"first differs at step {differing[0]}",
                "b": f"{len(differing)} step(s) differ",
            }
        )
    for path in sorted(a["checkpoints"].keys() & b["checkpoints"].keys()):
        if a["checkpoints"][path] != b["checkpoints"][path]:
            out.append(
                {
                    "what": f"checkpoint digest {path}",
                    "a": _digest(a["checkpoints"][path]),
                    "b": _digest(b["checkpoints"][path]),
                }
            )
    return out


def _tokenizer_differences(a, b) -> list[dict[str, Any]]:
    """What differs between the two runs' tokenizers, by name (the pad token, added tokens, the template), not
    by fingerprint; the fingerprints when that is all the profiles hold (a golden file written before)."""
    from ..core.tokenizer import current_fingerprint, tokenizer_changes

    fa, fb = a["fingerprints"].get("tokenizer"), b["fingerprints"].get("tokenizer")
    ta, tb = a.get("tokenizer"), b.get("tokenizer")
    if ta and tb:
        out = []
        for c in tokenizer_changes(ta, tb):
            if c["part"] == "chat_template":
                continue  # the chat template fingerprint's row says it
            if c["part"] == "special_tokens":
                out.append({"what": f"tokenizer {c['role']} token", "a": c["before"], "b": c["after"]})
            else:
                out.append({"what": f"tokenizer {c['part'].replace('_', ' ')}", "a": "", "b": c["text"]})
        if out or current_fingerprint(fa) != current_fingerprint(fb):
            return out  # fingerprints of two kinds are not compared
    if fa != fb:
        return [{"what": "tokenizer fingerprint", "a": fa, "b": fb}]
    return []


def _dict_diff(what: str, x: dict, y: dict, prefix: str = "") -> list[dict[str, Any]]:
    out = []
    for key in sorted(x.keys() | y.keys(), key=str):
        u, v = x.get(key), y.get(key)
        if isinstance(u, dict) and isinstance(v, dict):
            out += _dict_diff(what, u, v, f"{prefix}{key}.")
        elif u != v:
            out.append({"what": f"{what} {prefix}{key}", "a": u, "b": v})
    return out


def _findings_only_in(a, b) -> dict[str, list[dict[str, Any]]] | None:
    if a.get("findings") is None or b.get("findings") is None:
        return None
    fa = {(c, s) for c, _, s in a["findings"]}
    fb = {(c, s) for c, _, s in b["findings"]}
    shape = lambda fs, keep: [{"code": c, "severity": sev, "step": s} for c, sev, s in fs if (c, s) in keep]  # noqa: E731
    return {"a": shape(a["findings"], fa - fb), "b": shape(b["findings"], fb - fa)}


def _without_location(value: Any, run_dir: Path) -> Any:
    """The config with the run's own folder written as RUN_DIR: two runs in two folders are not
    different for that (output_dir, logging_dir, a resume command naming the path)."""
    if isinstance(value, dict):
        return {k: _without_location(v, run_dir) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_location(v, run_dir) for v in value]
    if isinstance(value, str):
        for form in sorted({str(run_dir.resolve()), str(run_dir)}, key=len, reverse=True):
            value = value.replace(form, "RUN_DIR")
    return value


MODE_WORDS = {"exact": "any difference", "tolerance": "the tolerance", "noise": "run-to-run noise"}


def distinguishing_names(a: str | Path, b: str | Path) -> tuple[str, str]:
    """Two paths named by their shortest trailing parts that differ (`a/run` and `b/run`, not `run` twice)."""
    pa, pb = Path(a).resolve().parts, Path(b).resolve().parts
    for k in range(1, max(len(pa), len(pb)) + 1):
        na, nb = "/".join(pa[-k:]), "/".join(pb[-k:])
        if na != nb:
            return na, nb
    return str(a), str(b)


def _span(steps: np.ndarray) -> str:
    return f"{steps.size} steps ({int(steps[0])}-{int(steps[-1])})" if steps.size else "no steps"


def _digest(sha: Any) -> str:
    return hashlib.sha256(json.dumps(sha, sort_keys=True).encode()).hexdigest()[:12]


def _plain(value: Any) -> Any:
    """A float, or None where nothing was recorded (`write_golden` writes the values that are not finite as null)."""
    return None if value is None else float(value)


def run(args) -> int:
    """The CLI: compare, write diff.html where asked, print the comparison (text, or JSON with --json)."""
    from ..core.terminal import json_safe
    from .common import EXIT_FAIL, EXIT_PASS, say

    if args.exact and args.tolerance is not None:
        raise InputError("--exact and --tolerance exclude each other: give one")
    a, b = load(args.run_a), load(args.run_b)
    if a["run"] == b["run"]:  # two folders of one name (both `run`): named by the part of their paths that differs
        a["run"], b["run"] = distinguishing_names(a.get("source", str(args.run_a)), b.get("source", str(args.run_b)))
    result = compare(a, b, tolerance=args.tolerance, exact=args.exact)
    if args.out:
        from ..outputs.report import write_diff_report

        write_diff_report(result, args.out)
    if args.json:
        keys = (
            "a",
            "b",
            "mode",
            "tolerance",
            "steps_compared",
            "first_divergent_step",
            "diverged_by",
            "first_anomalous_step",
            "series",
            "series_differ_from",
            "tensors",
            "differences",
            "findings_only_in",
        )
        print(json_safe(json.dumps({k: result[k] for k in keys}, indent=2, default=str)))
    else:
        first = result["first_divergent_step"]
        say(
            f"{result['b']} against {result['a']}: "
            + (
                f"diverged at step {first} ({', '.join(result['diverged_by'])})"
                if first is not None
                else f"no divergence over {result['steps_compared']} steps"
            )
            + f" [{MODE_WORDS[result['mode']]}]"
        )
        anomalous = result["first_anomalous_step"]
        if anomalous["a"] != anomalous["b"]:
            say(
                "  first anomalous step (the audits): "
                + ", ".join(f"{result[side]} {anomalous[side] or 'none'}" for side in ("a", "b"))
            )
        for name, step in result["series"].items():
            since = result["series_differ_from"].get(name)
            if since is not None and step != since:
                words = MODE_WORDS[result["mode"]]
                judged = f"beyond {words} from step {step}" if step is not None else f"within {words} throughout"
                say(f"  {name}: differs from step {since}, {judged}")
        if result["tensors"]:
            say("  tensors that moved first: " + ", ".join(result["tensors"]))
        for d in result["differences"]:
            say(f"  differs: {d['what']}: {d['a']} -> {d['b']}")
        for side in ("a", "b"):
            only = (result["findings_only_in"] or {}).get(side) or []
            if only:
                say(
                    f"  only in {result[side]}: "
                    + ", ".join(
                        f"{f['code']} {f['severity']}" + (f" @{f['step']}" if f["step"] is not None else "")
                        for f in only
                    )
                )
    return EXIT_FAIL if result["first_divergent_step"] is not None else EXIT_PASS
