"""The report as a person sees it: opened from disk in real headless Chromium (Debian's build).

Skipped only when /usr/bin/chromium is absent (`.ci/install-browser` installs it).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sftaudit.audit import audit
from sftaudit.report import write_report
from tests.conftest import NAN_STEP
from tests.test_report import plant

CHROMIUM = os.environ.get("SFTAUDIT_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
LOAD_TIMEOUT_MS = 60_000  # generous: the CI box is shared; the load-time budget is measured by benchmarks/

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no Chromium at {CHROMIUM}")


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
                       return r.top >= 0 && r.top < window.innerHeight; }""", element_id)


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


@pytest.mark.parametrize("name", ["failed", "passed"])
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
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        for _ in range(20):  # plotly draws the hover label on its next animation frame
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
