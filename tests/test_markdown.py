"""The verdict as Markdown (sftaudit.outputs.markdown): what it says, and that no run string can act on a reader.

The Markdown is rendered by a real CommonMark parser with GitHub's tables and strikethrough (markdown-it-py,
raw HTML on as in CommonMark): a string from the run must come out as its text and never as an element.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from markdown_it import MarkdownIt

from sftaudit.core.terminal import shown
from sftaudit.outputs.markdown import MAX_FINDINGS, TEXT_LIMIT, render, render_gate, text
from tests.github_runs import HOSTILE, VERSIONS, failed_verdict, hostile_verdict

GFM = MarkdownIt("commonmark").enable("table").enable("strikethrough")
# What our own Markdown makes: anything else in the HTML came from the run.
OURS = {"h2", "h3", "h4", "p", "strong", "em", "ul", "li", "table", "thead", "tbody", "tr", "th", "td"}
PUNCTUATION = list("\\`*_{}[]()#+-.!|~$&<>@:/;=\"'%^ wW\t\n\r\x1b\x07\u202e\u200b\u2028")


class Elements(HTMLParser):
    """The elements of a rendered page, its text, and the text of each table cell."""

    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.text: list[str] = []
        self.cells: list[str] = []
        self._in_cell = False
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag in ("td", "th"):
            self.cells.append("")
            self._in_cell = True

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self._in_cell = False

    def handle_data(self, data):
        self.text.append(data)
        if self._in_cell:
            self.cells[-1] += data


def rendered(markdown: str) -> Elements:
    return Elements(GFM.render(markdown))


@pytest.fixture(scope="module")
def verdict(tmp_path_factory):
    return failed_verdict(tmp_path_factory)


def test_the_verdict_says_what_to_do(verdict):
    assert verdict["verdict"] == "fail" and verdict["rollback_checkpoint"] == "checkpoint-80"
    md = render(verdict, versions=VERSIONS, audited_with="0.1.0")
    assert md.startswith("## Training audit\n\n**Verdict: ❌ FAIL** for run run.\n")
    assert "- **First anomalous logging window:** steps 89-90" in md
    assert "- **Roll back to:** checkpoint-80, the last intact checkpoint saved before it" in md
    assert f"- **Keep (to ship):** {verdict['keep_checkpoint']}: " in md
    assert "| checkpoint-80 | 80 | ✅ PASS | roll back here |" in md
    assert "| checkpoint-100 | 100 | ❌ FAIL |  |" in md
    # The library versions the manifest records, and what it does not.
    assert "| transformers | 4.45.2 |" in md and "| trl | not recorded |" in md
    # What was not judged, with the reason the verdict gives.
    loop07 = next(c for c in verdict["checks"] if c["code"] == "LOOP-07")
    assert (
        loop07["status"] == "not_run" and f"- **LOOP-07 generation diversity not run:** {text(loop07['reason'])}" in md
    )
    assert md.endswith("*Audited by sftaudit 0.1.0 (verdict schema 2).*\n")
    html = rendered(md)
    assert set(html.tags) <= OURS, set(html.tags) - OURS


def test_fail_and_warn_come_first_and_the_rest_is_counted(verdict):
    base = verdict["findings"][0]
    many = [{**base, "severity": "info", "message": f"info {i}"} for i in range(5)]
    many += [{**base, "severity": "warn", "message": f"warn {i}"} for i in range(8)]
    many += [{**base, "severity": "fail", "message": f"fail {i}"} for i in range(4)]
    md = render({**verdict, "findings": many})
    table = md[md.index("### Findings that matter") : md.index("### Checkpoints")]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == MAX_FINDINGS
    assert [r.split(" | ")[0] for r in rows] == ["| ❌ FAIL"] * 4 + ["| ⚠️ WARN"] * 6
    assert "4 fail, 8 warn, 5 info." in table
    assert "…and 7 more (2 warn, 5 info)" in table


def test_long_lists_are_cut_and_counted(verdict):
    many = {**verdict, "evidence": {**verdict["evidence"], "partial": [f"rank {r}: stopped" for r in range(64)]}}
    many["checkpoints"] = [{**verdict["checkpoints"][0], "name": f"checkpoint-{i}"} for i in range(100)]
    md = render(many)
    assert md.count("- **Partial evidence:** rank ") == 20 and "- …and 44 more (partial evidence)." in md
    assert len(re.findall(r"^\| checkpoint-\d+ \|", md, re.M)) == 30 and "…and 70 more checkpoints (70 pass)." in md


def test_versions_the_manifest_lacks_are_said_to_be_missing(verdict):
    assert "### Library versions" not in render(verdict)  # not read: not claimed either way
    assert "The run's manifest records no library versions." in render(verdict, versions={})


def test_a_run_judged_on_everything_says_so_and_an_unjudged_one_never_passes(verdict):
    complete = {**verdict, "checks": [{**c, "status": "ran", "reason": None} for c in verdict["checks"]]}
    complete["evidence"] = {**verdict["evidence"], "partial": [], "too_little": None}
    complete["resolution"] = {k: v for k, v in verdict["resolution"].items() if k != "notes"}
    assert "Every check ran, on complete evidence." in render(complete)
    unjudged = {**verdict, "verdict": "unjudged", "cannot_judge": "no training step was recorded"}
    md = render(unjudged)
    assert "**Verdict: ❔ COULD NOT JUDGE**" in md and "PASS**" not in md
    assert "- **Could not judge this run:** no training step was recorded" in md


@pytest.mark.parametrize("hostile", HOSTILE)
def test_hostile_run_text_is_shown_and_never_acts(verdict, hostile):
    planted = hostile_verdict(verdict, hostile)
    md = render(planted, versions={hostile: hostile})
    assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f\u202e]", md)  # no control or bidi character is left raw
    html = rendered(md)
    assert set(html.tags) <= OURS, set(html.tags) - OURS  # no link, image, script, code, strikethrough
    for marker in ("://", "www.", "WWW.", "@"):
        assert marker not in "".join(html.text)  # nothing to autolink or mention
    # Each string stays whole in its own cell: no pipe or line break split it, nothing of it was lost.
    seen = neutralised(hostile)
    messages = [c for c in html.cells if c.startswith(tuple(f["message"][:20] for f in verdict["findings"]))]
    assert len(messages) == len(planted["findings"]) and all(c.endswith(" " + seen) for c in messages)
    names = [c for c in html.cells if c.startswith("checkpoint-")]
    assert len(names) >= len(planted["checkpoints"]) and all(c.endswith(" " + seen) for c in names)
    assert f"for run {seen}." in "".join(html.text)


def neutralised(s: str) -> str:
    """What a reader sees of a run string (the module's documented rules): the CLI's rendering of it, with
    addresses defanged and mentions turned into the fullwidth at sign."""
    seen = re.sub(r"(?i)(www)\.", r"\1[.]", shown(s).replace("://", "[:]//"))
    return seen.replace("@", "＠")


def test_the_gate_result_heads_its_summary(verdict):
    findings = verdict["findings"]
    gate = {
        "run": "run",
        "checkpoint": {"name": "checkpoint-100", "step": 100, "path": "checkpoint-100"},
        "result": "fail",
        "policy": {"block": ["fail"], "codes": [], "ignore": ["LOOP-07"]},
        "blocking": [f for f in findings if f["severity"] == "fail"],
        "findings": findings,
    }
    md = render_gate(gate, verdict, versions=VERSIONS)
    assert md.startswith("## sftaudit gate\n\n**❌ FAIL**: checkpoint checkpoint-100 (step 100) of run run.\n")
    assert "Policy: blocks fail; ignores LOOP-07." in md and "### Blocking findings" in md
    assert "\n### The run's audit\n" in md and "\n#### Findings that matter\n" in md
    assert set(rendered(md).tags) <= OURS


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(st.sampled_from(PUNCTUATION) | st.characters(), max_size=60))
def test_any_string_renders_as_its_text_in_a_paragraph_and_in_a_cell(s):
    escaped = text(s)
    assert "\n" not in escaped and "\r" not in escaped
    paragraph = rendered(f"x {escaped} y")
    assert paragraph.tags == ["p"]
    cell = rendered(f"| a | b |\n| --- | --- |\n| x {escaped} y | z |")
    assert cell.tags == ["table", "thead", "tr", "th", "th", "tbody", "tr", "td", "td"]
    if len(shown(s)) <= TEXT_LIMIT:
        assert "".join(paragraph.text) == f"x {neutralised(s)} y\n"
        assert cell.cells == ["a", "b", f"x {neutralised(s)} y", "z"]


def test_neutralised_text_stays_readable():
    assert text("@org/team") == "＠org/team"
    assert (
        text("see https://evil.example or www.evil.example")
        == "see https\\[:\\]//evil.example or www\\[.\\]evil.example"
    )
    assert text("[click](javascript:alert(1))") == "\\[click\\]\\(javascript:alert\\(1\\)\\)"
    assert text("<script>") == "&lt;script&gt;" and text("&amp;") == "&amp;amp;"
    assert text("a\x1b[2Jb\u202ec\nd") == "a\\\\x1b\\[2Jb\\\\u202ec\\\\x0ad"
    assert text("x" * 2000).endswith("…") and len(text("x" * 2000)) == TEXT_LIMIT
