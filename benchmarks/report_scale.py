"""Report size and headless load time for a long synthetic run (the issue's budget: a
100,000-step run's report stays under 10 MB and opens in under 1 second on 2 cores).

    python benchmarks/report_scale.py [--steps 100000] [--tensors 200] [--loads 3] [--keep DIR]

Writes a real-format synthetic run (`synthetic_run.write_synthetic_run`), audits it, renders
the report, then opens it from disk in headless Chromium several times and prints: the
report's size, the time to first paint (the verdict is readable) and the time until the
page is open: the charts in view drawn (the report draws the others as they are scrolled to). For scale, it also times a page holding only the inlined plotly.js bundle
the report ships (the cartesian partial bundle) on the same machine: that floor is the cost
of parsing plotly.js, which the report pays once; and one holding the full bundle that the
plotly Python package ships, which the report inlined before.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sftaudit.fixtures.browser import CHROMIUM, CHROMIUM_ARGS  # noqa: E402
from synthetic_run import write_synthetic_run  # noqa: E402  (benchmarks/synthetic_run.py)

from sftaudit.outputs.report import write_report  # noqa: E402
from sftaudit.store.rundb import database_path  # noqa: E402
from sftaudit.verdict.audit import audit, stored_verdict  # noqa: E402


def load_times(pages: list[Path], loads: int) -> dict[Path, list[tuple[float, float, float, float, float]]]:
    """Per page and load, in seconds from navigation start, as the page itself stamps them: first
    contentful paint, open (the text and the charts in view drawn), the first chart drawn
    (for a report whose first viewport holds no chart: the one just below), and plotly.js and
    the figures' JSON parsed (the rest of the first chart's time is plotly drawing it); and the
    CPU seconds the page's main thread had spent when the first chart was drawn (Chromium's
    ThreadTime metric): what the first chart costs on an idle machine, whatever the load."""
    from playwright.sync_api import sync_playwright

    out: dict[Path, list[tuple[float, float, float, float, float]]] = {p: [] for p in pages}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        for _ in range(loads):
            for path in pages:
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                cdp = page.context.new_cdp_session(page)
                cdp.send("Performance.enable")
                page.goto(path.as_uri())
                page.wait_for_selector("body[data-first-chart]", timeout=120_000)
                metrics = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
                page.wait_for_selector("body[data-open-ready]", timeout=120_000)
                ready, chart, parsed = (
                    float(page.locator("body").get_attribute(a)) / 1000
                    for a in ("data-open-ready", "data-first-chart", "data-plotly-ready")
                )
                paint = (
                    page.evaluate(
                        "(performance.getEntriesByName('first-contentful-paint')[0] || {startTime: NaN}).startTime"
                    )
                    / 1000
                )
                out[path].append((paint, ready, chart, parsed, metrics.get("ThreadTime", float("nan"))))
                page.close()
        browser.close()
    return out


def plotly_floor(folder: Path, name: str, bundle: str) -> Path:
    path = folder / f"{name}-only.html"
    stamp = "String(performance.now())"
    path.write_text(
        "<!doctype html><meta charset='utf-8'><p>plotly.js only</p><script>"
        + bundle
        + f"</script><script>document.body.setAttribute('data-open-ready', {stamp});"
        + f"document.body.setAttribute('data-first-chart', {stamp});"
        + f"document.body.setAttribute('data-plotly-ready', {stamp})</script>",
        encoding="utf-8",
    )
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--tensors", type=int, default=200)
    p.add_argument("--loads", type=int, default=3)
    p.add_argument("--keep", type=Path, help="keep the run and report here instead of a temporary folder")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        run_dir = root / f"synthetic-{args.steps}"
        t0 = time.perf_counter()
        audited = args.keep and run_dir.is_dir() and database_path(run_dir).is_file()  # --keep: reuse the audited run
        if not audited:
            write_synthetic_run(run_dir, steps=args.steps, tensors=args.tensors, seed=0)
        t1 = time.perf_counter()
        verdict = stored_verdict(run_dir) if audited else audit(run_dir)
        t2 = time.perf_counter()
        report = write_report(run_dir, root / "report")
        t3 = time.perf_counter()
        size = report.stat().st_size
        from plotly.offline import get_plotlyjs

        from sftaudit.outputs.report import plotly_js

        floor_page = plotly_floor(root, "cartesian", plotly_js())
        full_page = plotly_floor(root, "full", get_plotlyjs())
        times = load_times([report, floor_page, full_page], args.loads)
        paint = statistics.median(t[0] for t in times[report])
        ready = statistics.median(t[1] for t in times[report])
        chart = statistics.median(t[2] for t in times[report])
        parsed = statistics.median(t[3] for t in times[report])
        chart_cpu = statistics.median(t[4] for t in times[report])
        floor_cpu = statistics.median(t[4] for t in times[floor_page])
        floor = statistics.median(t[1] for t in times[floor_page])
        full = statistics.median(t[1] for t in times[full_page])

        print(
            f"run: {args.steps} steps x {args.tensors} tensors, verdict {verdict['verdict']}, "
            f"{len(verdict['findings'])} findings"
        )
        print(f"write synthetic run  {t1 - t0:7.1f} s")
        print(f"ingest + audit       {t2 - t1:7.1f} s")
        print(f"render report        {t3 - t2:7.1f} s")
        print(f"report size          {size / 1e6:7.2f} MB  (budget 10 MB)")
        print(f"first paint          {paint:7.2f} s  (median of {args.loads} loads)")
        print(f"opened, charts in view drawn {ready:5.2f} s  (budget 1 s; median of {args.loads} loads)")
        print(f"plotly.js + figures parsed {parsed:5.2f} s  (as the first chart nears the viewport)")
        print(f"first chart drawn    {chart:7.2f} s  (the timeline: plotly.js parsed, then its draw)")
        print(f"  main-thread CPU    {chart_cpu:7.2f} s  (spent by then: the first chart's time on an idle machine)")
        print(f"plotly.js-only page  {floor:7.2f} s  (the cartesian bundle the report inlines: its floor)")
        print(f"  main-thread CPU    {floor_cpu:7.2f} s")
        print(f"full plotly.js page  {full:7.2f} s  (the full bundle, for comparison)")
        print(
            f"load average         {os.getloadavg()[0]:7.1f}    on {os.cpu_count()} cores (shared machines time slower)"
        )


if __name__ == "__main__":
    main()
