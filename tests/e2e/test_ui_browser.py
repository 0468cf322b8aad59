"""What a person sees in the MLflow UI: a real headless Chromium, driven by Playwright, over a
real tracking server (`python -m train.server`) and a real 2-rank run. Takes the screenshots
of docs/img/: into that folder only with UPDATE_SCREENSHOTS=1, else into the test's tmp_path."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from mlflow import MlflowClient

from tests.conftest import REPO, run_train, skip_or_fail
from tests.servers import tracking_server

if TYPE_CHECKING:
    from playwright.sync_api import Page

CHROMIUM = "/usr/bin/chromium"
# Headless as root on a machine that reaches nothing but loopback: no sandbox, no background
# services that would call out, a fresh profile per launch (Playwright adds --user-data-dir).
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
DOCS_IMG = REPO / "docs" / "img"
SCREENSHOT_NAMES = ("ui-runs.png", "ui-run.png", "ui-charts.png", "ui-confusion.png")
WAIT_MS = 60_000  # the UI loads its bundle and polls; wait for text, never for network idle
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def screenshots(tmp_path: Path) -> Path:
    """docs/img with UPDATE_SCREENSHOTS=1 (to refresh the README's pictures); else a scratch
    folder, so that a test run leaves the working tree alone."""
    folder = DOCS_IMG if os.environ.get("UPDATE_SCREENSHOTS") == "1" else tmp_path / "img"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def settled_screenshot(page: Page, path: Path, timeout_s: float = 10.0) -> None:
    """A screenshot once the page stops changing (charts animate in): two identical frames in
    a row, polled until the deadline; past it, the latest frame (a spinner never settles)."""
    deadline = time.monotonic() + timeout_s
    frame = page.screenshot()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        previous, frame = frame, page.screenshot()
        if frame == previous:
            break
    path.write_bytes(frame)


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's chromium, installed with apt-get when missing (Playwright downloads nothing)."""
    if Path(CHROMIUM).exists():
        return CHROMIUM
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        skip_or_fail("chromium is missing and cannot be installed here (needs root and "
                     "apt-get): apt-get install -y chromium")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "chromium"]
    done = subprocess.run(install, env=env, capture_output=True, text=True)
    if done.returncode != 0:  # most often: no package lists yet
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
        done = subprocess.run(install, env=env, capture_output=True, text=True)
    if done.returncode != 0 or not Path(CHROMIUM).exists():
        skip_or_fail(f"apt-get install -y chromium failed: {done.stderr[-800:]}")
    return CHROMIUM


def test_a_run_shows_its_name_params_metrics_and_artifacts(chromium: str, tmp_path: Path,
                                                           screenshots: Path) -> None:
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    with tracking_server(tmp_path / "server") as url:
        result = run_train("distributed.nproc_per_node=2", "trainer.epochs=2",
                           "tracking.run_name=ui-check", f"hydra.run.dir={tmp_path}/job",
                           env={"MLFLOW_TRACKING_URI": url})
        assert result.returncode == 0, result.stderr[-3000:]
        run = json.loads((tmp_path / "job" / "mlflow_run.json").read_text())
        logged = MlflowClient(tracking_uri=url).get_run(run["run_id"]).data.metrics
        prefixed = {p: [k for k in logged if k.startswith(f"{p}/")] for p in ("train", "val")}
        # loss, accuracy, accuracy_top5 (10 classes), samples and samples/s of the validation set
        assert len(prefixed["train"]) >= 7 and len(prefixed["val"]) == 5
        runs_page = f"{url}/#/experiments/{run['experiment_id']}/runs"

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=FLAGS, headless=True)
            # Logged in as a person is: the UI asks the browser for basic-auth credentials
            # (Playwright answers with them; a user types them once).
            login = {"username": os.environ["MLFLOW_TRACKING_USERNAME"],
                     "password": os.environ["MLFLOW_TRACKING_PASSWORD"]}
            page = browser.new_page(viewport={"width": 1280, "height": 800},
                                    http_credentials=login)

            # Without the login, the browser gets nothing but the refusal (headless, it cannot
            # ask for one: the 401 surfaces as an authentication error).
            anonymous = browser.new_page()
            with pytest.raises(PlaywrightError, match="ERR_INVALID_AUTH_CREDENTIALS"):
                anonymous.goto(runs_page)
            anonymous.close()

            # The experiment's runs table lists the run by its name.
            page.goto(runs_page)
            page.get_by_text("ui-check").first.wait_for(timeout=WAIT_MS)
            # For the pictures: close the assistant panel that opens on a first visit, and
            # show the "Model training" navigation instead of the GenAI one.
            page.get_by_role("button", name="Close").click()
            page.get_by_text("Model training").first.click()
            page.get_by_text("1 matching run").wait_for(timeout=WAIT_MS)
            settled_screenshot(page, screenshots / "ui-runs.png")

            # Its page: the latest value of every metric, and the params.
            page.get_by_text("ui-check").first.click()
            page.wait_for_url(re.compile(rf"/runs/{run['run_id']}"))
            page.get_by_text("optim.lr").first.wait_for(timeout=WAIT_MS)
            body = page.inner_text("body")
            for name in ("optim.lr", "model.name", "data.num_train", "train/loss",
                         "val/accuracy", "Finished", "digits-train"):
                assert name in body, name
            page.get_by_text("Metrics (").first.scroll_into_view_if_needed()
            settled_screenshot(page, screenshots / "ui-run.png")

            # The metrics tab: one chart per metric, in sections by prefix (train/, val/).
            page.get_by_text("Model metrics").first.click()
            # Where the step time went, before train/: rank 0's 6 phases (seconds, share), the
            # step and the slowest rank, then that rank's 6 shares.
            page.get_by_text("ui-check (time/backward)").first.wait_for(timeout=WAIT_MS)
            body = page.inner_text("body")
            assert re.search(r"time\s*\(14\)", body) and re.search(r"time/slowest\s*\(6\)", body)
            page.get_by_text("train", exact=True).last.scroll_into_view_if_needed()  # the section
            page.get_by_text("ui-check (train/loss)").first.wait_for(timeout=WAIT_MS)
            settled_screenshot(page, screenshots / "ui-charts.png")
            # One chart per train/ metric of the run, in the train section.
            assert re.search(rf"train\s*\({len(prefixed['train'])}\)", page.inner_text("body"))
            # Charts below the fold are drawn only once scrolled to.
            page.get_by_text("val", exact=True).first.scroll_into_view_if_needed()
            page.get_by_text("ui-check (val/accuracy)").first.wait_for(timeout=WAIT_MS)
            assert re.search(rf"val\s*\({len(prefixed['val'])}\)", page.inner_text("body"))

            # The artifacts, fetched through the server: the config and the confusion matrix.
            page.goto(f"{runs_page}/{run['run_id']}/artifacts")
            page.get_by_text("config.yaml").first.wait_for(timeout=WAIT_MS)
            page.get_by_text("confusion_matrix.svg").first.wait_for(timeout=WAIT_MS)
            page.get_by_text("confusion_matrix.svg").first.click()
            preview = page.locator("img[src^='blob:']").first  # the image, as the UI shows it
            preview.wait_for(timeout=WAIT_MS)
            assert preview.evaluate("img => img.naturalWidth") > 300
            settled_screenshot(page, screenshots / "ui-confusion.png")
            # Where each rank's time went, as a picture on the run's page.
            page.get_by_text("step_time.svg").first.click()
            page.wait_for_function(  # its own width, not the confusion matrix's
                "() => [...document.images].some(i => i.src.startsWith('blob:') "
                "&& i.naturalWidth === 640)", timeout=WAIT_MS)
            browser.close()

    for name in SCREENSHOT_NAMES:
        picture = (screenshots / name).read_bytes()
        assert picture.startswith(PNG_SIGNATURE) and len(picture) > 10_000, name
