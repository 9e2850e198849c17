"""The report in a real headless Chromium (Debian's ``chromium``, driven by Playwright).

The page loads with no console errors and no failed requests, shows the expected number of episodes, its
images decode, and its filters work. Screenshots are kept under pytest's temporary folder and, when
``TURNRL_TEST_ARTIFACTS`` names a folder, copied there to be looked at.

Skipped, saying why, only where no Chromium can be found or started (``make`` installs Debian's package).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.viz.conftest import EVAL_EPISODES
from turnrl.viz.report import write_report

playwright_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator:
    executable = chromium_path()
    if executable is None:
        pytest.skip("no chromium on PATH: install Debian's package (apt-get install chromium) or run `make`")
    with playwright_api.sync_playwright() as playwright:
        try:
            browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        except playwright_api.Error as error:
            pytest.skip(f"{executable} cannot be started headless: {str(error).splitlines()[0]}")
        yield browser
        browser.close()


class PageProblems:
    """Console errors, uncaught exceptions and failed requests of a page."""

    def __init__(self, page) -> None:
        self.items: list[str] = []
        page.on("console", lambda m: self.items.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: self.items.append(f"uncaught: {e}"))
        page.on("requestfailed", lambda r: self.items.append(f"request failed: {r.url}"))
        page.on("response", lambda r: self.items.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)


def keep_screenshot(page, tmp_path: Path, name: str, **options) -> Path:
    path = tmp_path / name
    page.screenshot(path=str(path), **options)
    artifacts = os.environ.get("TURNRL_TEST_ARTIFACTS")
    if artifacts:
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(artifacts) / name)
    return path


def visible(page, selector: str) -> int:
    return page.locator(f"{selector}:visible").count()


def decode_all_images(page) -> list[dict]:
    """Load every image now (the page loads them lazily) and report each one's decoded width."""
    return page.evaluate("""async () => {
        const images = Array.from(document.images);
        images.forEach((image) => { image.loading = "eager"; });
        return Promise.all(images.map((image) => image.decode().then(
            () => ({src: image.getAttribute("src"), width: image.naturalWidth}),
            () => ({src: image.getAttribute("src"), width: 0}))));
    }""")


def test_evaluation_page_loads_shows_images_and_filters(browser, serve, eval_dir, tmp_path):
    write_report(eval_dir)
    episodes = [json.loads(line) for line in (eval_dir / "trajectories.jsonl").read_text().splitlines()]
    successes = sum(e["success"] for e in episodes)
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    problems = PageProblems(page)
    page.goto(f"{serve(eval_dir)}/report.html", wait_until="load")

    assert visible(page, "#episodes details.episode") == EVAL_EPISODES
    assert page.text_content("#shown-count") == str(EVAL_EPISODES)
    page.click("#expand-all")
    assert page.locator("#episodes details.episode[open]").count() == EVAL_EPISODES
    images = decode_all_images(page)
    assert len(images) == sum(len(e["images"]) + len(e["final_images"]) for e in episodes) > 0
    assert all(image["width"] > 0 for image in images), [i for i in images if not i["width"]]

    page.select_option("#filter-success", "1")
    assert visible(page, "#episodes details.episode") == successes
    assert page.text_content("#shown-count") == str(successes)
    page.select_option("#filter-success", "0")
    assert visible(page, "#episodes details.episode") == EVAL_EPISODES - successes
    page.select_option("#filter-success", "all")
    status = episodes[0]["status"]
    page.select_option("#filter-status", status)
    assert visible(page, "#episodes details.episode") == sum(e["status"] == status for e in episodes)
    page.select_option("#filter-status", "all")
    page.locator("#episodes details.episode").first.scroll_into_view_if_needed()
    keep_screenshot(page, tmp_path, "viewer_evaluation.png")
    assert problems.items == []


def test_run_page_shows_curves_pairs_steps_and_advantages(browser, serve, run_with_advantages, tmp_path):
    write_report(run_with_advantages)
    folder = run_with_advantages / "trajectories"
    counts = {p.stem: len(p.read_text().splitlines()) for p in folder.glob("*.jsonl") if "advantages" not in p.name}
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    problems = PageProblems(page)
    page.goto(f"{serve(run_with_advantages)}/report.html", wait_until="load")

    assert visible(page, "#episodes details.episode") == sum(counts.values())
    images = decode_all_images(page)
    assert {image["src"] for image in images} >= {"plots/success.png", "plots/reward.png", "plots/step_time.png"}
    assert all(image["width"] > 0 for image in images)
    keep_screenshot(page, tmp_path, "viewer_run_top.png")

    assert visible(page, "#pairs details.pair") == counts["val_before_rl"]
    page.select_option("#filter-source", "step_000001")
    assert visible(page, "#episodes details.episode") == counts["step_000001"]
    page.click("#expand-all")
    assert visible(page, "#episodes .heatmap .tok") > 0
    page.locator("#episodes details.episode[open] .heatmap").first.scroll_into_view_if_needed()
    keep_screenshot(page, tmp_path, "viewer_run_advantages.png")
    page.select_option("#filter-source", "val_after_rl")
    assert visible(page, "#episodes details.episode") == counts["val_after_rl"]
    assert visible(page, "#episodes .heatmap .tok") == 0
    assert problems.items == []
