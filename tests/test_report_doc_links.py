"""A report's check documentation links, followed offline in real headless Chromium (Debian's build): the first
leads to the check's description embedded in the report and opens it; the second is the published page.

Skipped only when the browser is absent (`.ci/install-browser` installs it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sftaudit.fixtures.browser import CHROMIUM, CHROMIUM_ARGS

from sftaudit.imports import import_run
from sftaudit.outputs.report import write_report
from sftaudit.outputs.report.evidence import check_page
from sftaudit.verdict.audit import audit
from tests.github_runs import failed_run

ROOT = Path(__file__).resolve().parents[1]
LOAD_TIMEOUT_MS = 60_000  # generous: the machine is shared

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no Chromium at {CHROMIUM}")]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    run = failed_run(tmp_path_factory.mktemp("doc-links"))
    import_run(run)
    audit(run)
    return write_report(run, run.parent / "report")


def test_the_documentation_link_opens_the_embedded_description_offline(report):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            requests, errors = [], []
            page.on("request", lambda r: requests.append(r.url))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(report.as_uri())
            page.wait_for_selector("body[data-open-ready]", timeout=LOAD_TIMEOUT_MS)
            details = page.locator("#doc-LOOP-25")
            assert details.evaluate("d => d.tagName") == "DETAILS" and not details.evaluate("d => d.open")
            page.click("#check-LOOP-25 a.doc-link")
            assert details.evaluate("d => d.open") and page.evaluate("location.hash") == "#doc-LOOP-25"
            assert details.locator("div.doc").is_visible()
            online = page.locator("#check-LOOP-25 a.page")
            assert online.inner_text() == "online" and online.get_attribute("href") == check_page("LOOP-25")
            # Opened at an anchor (a link from elsewhere), or the anchor changed in place: open too.
            page.goto(report.as_uri() + "#doc-LOOP-10")
            assert page.locator("#doc-LOOP-10").evaluate("d => d.open")
            fresh = browser.new_page()
            fresh.goto(report.as_uri() + "#doc-LOOP-11")
            fresh.wait_for_selector("body[data-open-ready]", timeout=LOAD_TIMEOUT_MS)
            assert fresh.locator("#doc-LOOP-11").evaluate("d => d.open")
            assert errors == [] and all(url.startswith("file:") for url in requests)
        finally:
            browser.close()
    # The page the online link names is one the docs site builds.
    assert (ROOT / "docs" / "checks" / "LOOP-25.md").is_file()
