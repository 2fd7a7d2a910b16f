"""The report as a person sees it: opened from disk in real headless Chromium (Debian's build).

Skipped only when /usr/bin/chromium is absent (`.ci/install-browser` installs it).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from sftaudit.fixtures.browser import CHROMIUM, CHROMIUM_ARGS

from sftaudit.outputs.report import write_report
from sftaudit.verdict.audit import audit
from tests.conftest import NAN_STEP
from tests.test_report import XSS_SCRIPT, plant, plant_unjudged, preflight_report, ranks_report

LOAD_TIMEOUT_MS = 60_000  # generous: the CI box is shared; the load-time budget is measured by benchmarks/

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no Chromium at {CHROMIUM}")]


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


class Opened:
    """A report page with everything it asked the network for and everything it logged as an error."""

    def __init__(self, browser, report: Path):
        self.report = report
        self.page = browser.new_page(viewport={"width": 1280, "height": 900})
        self.requests: list[str] = []
        self.errors: list[str] = []
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(report.as_uri())
        self.page.wait_for_selector("body[data-open-ready]", timeout=LOAD_TIMEOUT_MS)
        # Charts below the fold are drawn as they come into view: scroll through them as a reader would.
        charts = self.page.locator("div.chart")
        for i in range(charts.count()):
            charts.nth(i).scroll_into_view_if_needed()
            self.page.wait_for_selector(f"#{charts.nth(i).get_attribute('id')}[data-drawn]", timeout=LOAD_TIMEOUT_MS)
        self.page.wait_for_selector("body[data-charts-ready]", timeout=LOAD_TIMEOUT_MS)
        self.page.evaluate("window.scrollTo(0, 0)")

    def in_viewport(self, element_id: str) -> bool:
        return self.page.evaluate(
            """id => { const r = document.getElementById(id).getBoundingClientRect();
                       return r.top >= 0 && r.top < window.innerHeight; }""",
            element_id,
        )


@pytest.fixture(scope="module")
def failed(browser, nan_run, tmp_path_factory):
    audit(nan_run)
    run = plant(nan_run, tmp_path_factory.mktemp("planted-browser") / "planted-run")
    opened = Opened(browser, write_report(run, run.parent / "report"))
    yield opened
    opened.page.close()


@pytest.fixture(scope="module")
def passed(browser, clean_run, tmp_path_factory):
    audit(clean_run)
    opened = Opened(browser, write_report(clean_run, tmp_path_factory.mktemp("clean-browser")))
    yield opened
    opened.page.close()


@pytest.fixture(scope="module")
def two_ranks(browser, distributed_runs, tmp_path_factory):
    opened = Opened(browser, ranks_report(distributed_runs, tmp_path_factory.mktemp("ranks-browser")))
    yield opened
    opened.page.close()


@pytest.mark.parametrize("name", ["failed", "passed", "two_ranks"])
def test_loads_offline_without_console_errors_and_draws_every_chart(name, request):
    opened = request.getfixturevalue(name)
    assert opened.errors == []
    assert opened.requests == [opened.report.as_uri()]  # the file itself and nothing else
    charts = opened.page.locator("div.chart")
    assert charts.count() >= 2
    for i in range(charts.count()):  # plotly drew each: its SVG holds plotted traces
        chart = charts.nth(i)
        assert chart.locator("svg.main-svg").count() >= 1, chart.get_attribute("id")
        assert chart.locator("g.trace, g.hm, image").count() >= 1, chart.get_attribute("id")


def test_charts_far_below_are_drawn_only_once_scrolled_to(browser, failed):
    """A fresh load draws the charts near the first screen; one far below stays empty (no plotly SVG)
    until the reader scrolls to it, and is drawn then."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        page.goto(failed.report.as_uri())
        page.wait_for_selector("body[data-open-ready]", timeout=LOAD_TIMEOUT_MS)
        tops = page.evaluate("""() => Array.from(document.querySelectorAll('div.chart')).map(
            el => [el.id, el.getBoundingClientRect().top - window.innerHeight])""")
        near = [i for i, below in tops if below < 800]  # the page draws ahead of the viewport by 800 px
        far = [i for i, below in tops if below > 3000]
        assert near and far, tops
        for i in near:  # everything the page meant to draw has been drawn ...
            page.wait_for_selector(f"#{i}[data-drawn]", timeout=LOAD_TIMEOUT_MS)
        page.wait_for_timeout(300)
        for i in far:  # ... and nothing far below was
            assert page.locator(f"#{i}").get_attribute("data-drawn") is None, i
            assert page.locator(f"#{i} svg.main-svg").count() == 0, i
        page.locator(f"#{far[-1]}").scroll_into_view_if_needed()
        page.wait_for_selector(f"#{far[-1]}[data-drawn]", timeout=LOAD_TIMEOUT_MS)
        assert page.locator(f"#{far[-1]} svg.main-svg").count() >= 1
    finally:
        page.close()


def test_screenshot_of_the_top_is_written_next_to_the_report(failed):
    shot = failed.report.parent / "report-top.png"
    failed.page.evaluate("window.scrollTo(0, 0)")
    failed.page.screenshot(path=str(shot))
    assert shot.stat().st_size > 10_000
    assert failed.page.locator("#verdict").inner_text() == "FAIL"


def test_clicking_a_timeline_marker_scrolls_to_its_evidence(failed):
    page = failed.page
    page.evaluate("window.scrollTo(0, 0)")
    marker = page.locator("#timeline .scatterlayer .trace").first.locator("path.point").first
    marker.scroll_into_view_if_needed()
    box = marker.bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    target = page.evaluate("document.querySelector('.finding.flash').id")
    assert target.startswith("finding-")
    assert failed.in_viewport(target)
    step = page.locator(f"#{target} .where").inner_text()
    assert step.startswith("step ")


def test_clicking_a_finding_link_scrolls_to_its_evidence(failed):
    page = failed.page
    page.evaluate("window.scrollTo(0, 0)")
    link = page.locator("a.to-evidence", has_text=f"gradients became non-finite at step {NAN_STEP}")
    target = link.get_attribute("href").lstrip("#")
    assert not failed.in_viewport(target)
    link.click()
    assert failed.in_viewport(target)
    assert "model.embed_tokens.weight" in page.locator(f"#{target}").inner_text()


def test_untrusted_sample_text_stays_text(failed):
    page = failed.page
    # Centred, so that no marker hides under the sticky header while the mouse hovers it.
    page.evaluate("document.getElementById('timeline').scrollIntoView({block: 'center'})")
    hovered = []
    for marker in page.locator("#timeline .scatterlayer .trace path.point").all():  # hover labels are SVG text
        box = marker.bounding_box()
        if box is None:
            continue
        # Off the chart first, until the last label is gone: a label still showing is another marker's.
        page.mouse.move(0, 0)
        for _ in range(100):
            if not page.locator("#timeline .hoverlayer").text_content():
                break
            page.wait_for_timeout(50)
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        for _ in range(100):  # plotly draws the hover label on its next animation frame (later on a busy machine)
            text = page.locator("#timeline .hoverlayer").text_content()
            if text:
                break
            page.wait_for_timeout(50)
        hovered.append(text)
    assert any("<script>window.__xss = 1</script>" in h for h in hovered)
    assert page.evaluate("window.__xss") is None
    assert page.locator("img").count() == 0
    assert "<script>window.__xss = 1</script>" in page.locator("#summary").inner_text()
    mismatched = page.locator(".tok.mismatch:not(.legend .tok)")
    assert mismatched.count() == 2
    assert mismatched.first.inner_text() == "<script>window.__xss = 1</script>"


@pytest.fixture(scope="module")
def dataset(browser, tokenizer_cache, tmp_path_factory):
    opened = Opened(browser, preflight_report(tokenizer_cache, tmp_path_factory.mktemp("dataset-browser")))
    yield opened
    opened.page.close()


def test_dataset_report_loads_offline_and_shows_a_real_sample_token_by_token(dataset):
    page = dataset.page
    assert dataset.errors == [] and dataset.requests == [dataset.report.as_uri()]
    assert page.locator("h1").inner_text().startswith("Dataset preflight")
    first = page.locator(".label-view").first
    assert first.locator(".tokens .tok").first.inner_text() == "<|begin_of_text|>"
    trained = first.locator(".tokens .tok.trained").all_inner_texts()
    assert "".join(trained).strip() == "No.<|eot_id|>"  # the answer and its end-of-turn marker, nothing else
    assert first.locator(".tokens .tok.mismatch").count() == 0
    # The render preview highlights the template's markers and shows the sample's text as text.
    render = page.locator(".render").first
    assert "<|start_header_id|>assistant<|end_header_id|>" in render.locator("mark").all_inner_texts()
    assert XSS_SCRIPT in render.inner_text() and page.evaluate("window.__xss") is None
    markers = page.locator("#marker-table").inner_text()
    assert re.search(r"<\|eot_id\|>\tend of turn\t\d+\t✓ atomic\ttrained \d+ of \d+", markers), markers
    for chart in ("hist-lengths", "hist-trained"):
        assert page.locator(f"#{chart} g.trace").count() >= 1


def test_dataset_report_never_shows_a_training_check_as_passing(dataset):
    page = dataset.page
    tiles = page.locator(".tiles .tile")
    assert sorted(t.split()[1] for t in tiles.all_inner_texts()) == ["LOOP-01", "LOOP-02", "LOOP-03", "LOOP-04"]
    assert "LOOP-05, LOOP-06" in page.locator("#training-checks").inner_text()
    assert page.locator("#check-LOOP-05").count() == 0


def test_keyboard_moves_through_the_findings(failed):
    page = failed.page
    page.evaluate("window.scrollTo(0, 0); document.activeElement.blur()")
    page.keyboard.press("j")
    first = page.evaluate("document.activeElement.id")
    assert first == page.locator(".finding").first.get_attribute("id") and failed.in_viewport(first)
    page.keyboard.press("j")
    second = page.evaluate("document.activeElement.id")
    assert second != first and failed.in_viewport(second)
    page.keyboard.press("k")
    assert page.evaluate("document.activeElement.id") == first


@pytest.mark.parametrize("name", ["failed", "dataset"])
def test_prints_to_pdf_with_every_chart(name, request):
    opened = request.getfixturevalue(name)
    pdf = opened.page.pdf(format="A4", print_background=True)
    assert pdf.startswith(b"%PDF") and len(pdf) > 50_000
    assert opened.page.locator("div.chart:not([data-drawn])").count() == 0
    assert (
        opened.page.evaluate("getComputedStyle(document.querySelector('header.top nav')).display") != "none"
    )  # screen
    opened.page.emulate_media(media="print")
    try:
        assert opened.page.evaluate("getComputedStyle(document.querySelector('header.top nav')).display") == "none"
    finally:
        opened.page.emulate_media(media="screen")


def test_two_rank_run_draws_a_line_per_rank_in_each_lane(two_ranks):
    lanes = two_ranks.page.locator("#ranks")
    assert set(lanes.locator("g.legend text.legendtext").all_text_contents()) == {"rank 0", "rank 1", "not finite"}
    assert lanes.locator(".scatterlayer g.trace").count() == 7  # 3 lanes x 2 ranks, and the rank-1 NaN crosses


@pytest.fixture(scope="module")
def unjudged(browser, clean_run, tmp_path_factory):
    audit(clean_run)
    run = plant_unjudged(clean_run, tmp_path_factory.mktemp("unjudged-browser") / "unjudged-run")
    opened = Opened(browser, write_report(run, run.parent / "report"))
    yield opened
    opened.page.close()


GREEN = "rgb(46, 125, 50)"  # --pass


def test_nothing_unsaved_unjudged_or_not_run_is_drawn_green(unjudged, passed):
    """As painted: the checkpoint strip of a run that could not be judged (and the steps it never saved),
    the verdict, and the badges of checks that did not run, ran on partial evidence or raised."""
    colours = """sel => Array.from(document.querySelectorAll(sel)).map(e => {
                     const s = getComputedStyle(e); return [s.backgroundColor, s.color]; })"""
    page = unjudged.page
    painted = {
        sel: page.evaluate(colours, sel)
        for sel in (
            "#checkpoint-strip .win",
            "#verdict",
            ".tile .icon.notrun, .tile .icon.partial, .tile .icon.error",
            ".check > h3 .badge.notrun, .check > h3 .badge.partial, .check > h3 .badge.error",
            "#run .badge",
        )
    }
    assert (
        len(painted["#checkpoint-strip .win"]) == 3
        and len(painted[".tile .icon.notrun, .tile .icon.partial, .tile .icon.error"]) >= 2
    )
    assert all(GREEN not in pair for pairs in painted.values() for pair in pairs), painted
    # The same strip of a judged run is green where it passed: the colour still means something.
    assert {bg for bg, _ in passed.page.evaluate(colours, "#checkpoint-strip .win")} == {GREEN}


def test_a_checks_description_is_closed_until_asked_for(passed):
    """Each check shows its purpose and its page's link; the full description (kept for offline reading)
    opens on a click on its summary, and the page grows by what it shows."""
    page = passed.page
    section = page.locator("#check-LOOP-09")
    assert section.locator("p.purpose a.page").get_attribute("href").endswith("/checks/LOOP-09/")
    assert page.locator("details.check-doc[open]").count() == 0 and page.locator("details.check-doc").count() >= 25
    doc = section.locator("details.check-doc .doc")
    assert not doc.is_visible()
    height = page.evaluate("document.documentElement.scrollHeight")
    section.locator("details.check-doc summary").click()
    assert doc.is_visible() and "What it detects" in doc.inner_text()
    assert page.evaluate("document.documentElement.scrollHeight") > height
    section.locator("details.check-doc summary").click()  # closed again for the tests that share the page
    assert passed.requests == [passed.report.as_uri()]  # opening it fetched nothing


def test_no_check_shows_a_tick_without_its_evidence(browser, nan_probed_run, tmp_path):
    """As a reader sees the report of a run whose probes turned NaN, with one generation step and two
    evaluations: a ✓ (tile or badge) only on a check that judged all of its evidence and found nothing; the
    others say what they could not judge, in the tile's tooltip and beside the behaviour charts."""
    verdict = audit(nan_probed_run)
    opened = Opened(browser, write_report(nan_probed_run, tmp_path / "report"))
    page = opened.page
    tiles = page.evaluate(
        """() => Array.from(document.querySelectorAll('.tiles .tile')).map(t =>
               [t.querySelector('b').textContent, t.querySelector('.icon').textContent, t.title])"""
    )
    badges = page.evaluate(
        """() => Array.from(document.querySelectorAll('section.check')).map(s =>
               [s.id, s.querySelector('h3 .badge').textContent.trim()[0], s.innerText])"""
    )
    with_findings = {f["code"] for f in verdict["findings"]}
    fully_judged = {c["code"] for c in verdict["checks"] if c["status"] == "ran"} - with_findings
    assert {code for code, icon, _ in tiles if icon == "✓"} == fully_judged
    assert {s.removeprefix("check-") for s, icon, _ in badges if icon == "✓"} == fully_judged
    icons = {code: (icon, title) for code, icon, title in tiles}
    assert icons["LOOP-06"][0] == "◐" and "1 of 4 probe steps (from step 8)" in icons["LOOP-06"][1]
    assert icons["LOOP-07"][0] == "–" and icons["LOOP-08"][0] == "◐"
    assert all("no data recorded" not in text for _, icon, text in badges if icon == "✓")
    behaviour = page.locator("#behaviour ~ p.nodata-box, #behaviour ~ p.warnbox").all_inner_texts()
    assert any(t.startswith("LOOP-07 not run: 1 generation step(s)") for t in behaviour)  # its values shown, unjudged
    assert any(t.startswith("LOOP-06 partial evidence: 1 of 4 probe steps") for t in behaviour)
    assert opened.errors == []
    opened.page.close()
