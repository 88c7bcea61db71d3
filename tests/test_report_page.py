"""The report page in a real headless browser (playwright driving the system's chromium): it loads without
console errors, hovering the chart shows an op, scrolling zooms in, and the page carries every section of the
terminal report. ``REPORT_SCREENSHOT=path`` saves the screenshot the docs show (docs/img/report_page.png)."""

from __future__ import annotations

import os
import shutil

import pytest

from analysis.cli import main
from tests.tiny_models import tiny_model

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def page_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("page")
    config = folder / "config.json"
    tiny_model("llama").config.to_json_file(config)
    path = folder / "report.html"
    argv = ["analyze", str(config), "--batch-size", "2", "--seq-len", "32", "--gpu", "h100", "--quiet"]
    assert main([*argv, "--html", str(path)]) == 0
    return path


def test_the_page_has_every_section_of_the_report(page_path, capsys):
    page = page_path.read_text()
    for text in ("Estimated peak allocated memory", "Breakdown at the peak", "What is live at the peak", "Fits the"):
        assert text in page
    assert "By module (depth 3)" in page and "model.layers.0" in page
    assert "http" not in page.split("<script>")[1]  # nothing fetched


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine (.ci/run installs Debian's)")
def test_the_page_works_in_a_headless_browser(page_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    errors: list[str] = []
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(page_path.as_uri())
        chart = page.locator("#chart")
        box = chart.bounding_box()
        page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.5)
        info = page.inner_text("#info")
        assert info.startswith("op ") and "module:" in info and "live" in info
        before = page.evaluate("hi - lo")
        page.mouse.wheel(0, -300)
        assert page.evaluate("hi - lo") < before  # zoomed in
        page.dblclick("#chart")
        assert page.evaluate("hi - lo") == before
        if os.environ.get("REPORT_SCREENSHOT"):  # the docs' picture, of a bundled model
            shown = page_path.parent / "gpt2.html"
            argv = ["analyze", "gpt2", "--batch-size", "8", "--seq-len", "1024", "--gpu", "a10g", "--quiet"]
            assert main([*argv, "--html", str(shown)]) == 0
            page.goto(shown.as_uri())
            page.mouse.move(box["x"] + box["width"] * 0.33, box["y"] + box["height"] * 0.6)
            page.screenshot(path=os.environ["REPORT_SCREENSHOT"], clip={"x": 0, "y": 0, "width": 1280, "height": 760})
        browser.close()
    assert errors == []


def test_the_plan_page_has_the_table_and_the_recommended_layouts_report(tmp_path):
    config = tmp_path / "config.json"
    tiny_model("llama").config.to_json_file(config)
    path = tmp_path / "plan.html"
    argv = ["plan", str(config), "--gpus", "2", "--seq-len", "32", "--gpu-memory", "4GiB", "--quiet", "--no-offload"]
    assert main([*argv, "--html", str(path)]) == 0
    page = path.read_text()
    assert "<h2>Plan</h2>" in page and "Recommended:" in page
    assert "<h2>Report</h2>" in page and "Estimated peak allocated memory" in page and "<canvas" in page
