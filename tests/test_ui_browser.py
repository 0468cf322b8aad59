"""What a person sees in the MLflow UI, in a real headless Chromium driven by Playwright."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, run_train, skip_or_fail
from tests.mlflow_server import tracking_server

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
# Headless on a machine with no network but loopback: no background services that would call
# out, no sandbox (root), a fresh profile per launch.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOTS = REPO / "docs" / "img"


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's chromium, installed when missing (Playwright downloads no browser)."""
    if not Path(CHROMIUM).exists():
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            skip_or_fail("chromium is not installed and cannot be installed here (needs root "
                         "and apt-get): apt-get install chromium")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "-q", "chromium"]
        if subprocess.run(install, env=env, capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
            done = subprocess.run(install, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                skip_or_fail(f"apt-get install chromium failed: {done.stderr[-500:]}")
    return CHROMIUM


def test_a_run_shows_its_name_charts_params_and_confusion_matrix(chromium: str,
                                                                 tmp_path: Path) -> None:
    from mlflow import MlflowClient
    from playwright.sync_api import sync_playwright

    with tracking_server(tmp_path / "server") as server:
        result = run_train("distributed.nproc_per_node=2", "trainer.epochs=2",
                           "tracking.run_name=ui-check", f"hydra.run.dir={tmp_path}/job",
                           env={"MLFLOW_TRACKING_URI": server.url})
        assert result.returncode == 0, result.stderr
        info = json.loads((tmp_path / "job" / "mlflow_run.json").read_text())
        run = MlflowClient(tracking_uri=server.url).get_run(info["run_id"])
        base = f"{server.url}/#/experiments/{info['experiment_id']}/runs"
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=FLAGS, headless=True)
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            # The experiment's runs table lists the run by name (wait for text: the UI keeps
            # polling, so "network idle" never comes).
            page.goto(base)
            page.get_by_text("ui-check").first.wait_for(timeout=60_000)
            page.screenshot(path=str(SCREENSHOTS / "ui-runs.png"))

            page.get_by_text("ui-check").first.click()
            page.get_by_text("Parameters").first.wait_for(timeout=60_000)
            body = page.inner_text("body")
            for metric in ("train/loss", "val/accuracy", "val/samples"):
                assert metric in body
                assert str(run.data.metrics[metric]).rstrip("0").rstrip(".") in body, metric
            for param in ("optim.lr", "model.name", "data.num_train"):
                assert param in body
            assert "digits-train" in body  # the data set input
            page.screenshot(path=str(SCREENSHOTS / "ui-run.png"), full_page=True)

            # Charts, grouped by metric prefix (train/, val/).
            page.get_by_text("Model metrics").first.click()
            page.get_by_text("ui-check (train/loss)").first.wait_for(timeout=60_000)
            page.wait_for_timeout(2000)  # let the charts draw before the screenshot
            charts = page.inner_text("body")
            # One section per prefix: 7 train/ charts, 3 val/ charts.
            assert re.search(r"train\s*\(7\)", charts) and re.search(r"val\s*\(3\)", charts)
            page.screenshot(path=str(SCREENSHOTS / "ui-charts.png"))

            page.goto(f"{base}/{info['run_id']}/artifacts")
            page.get_by_text("confusion_matrix.png").first.wait_for(timeout=60_000)
            assert "config.yaml" in page.inner_text("body")
            page.get_by_text("confusion_matrix.png").first.click()
            # The preview: an image the UI fetched through the server (a blob: URL).
            preview = page.locator("img[src^='blob:']").first
            preview.wait_for(timeout=60_000)
            assert preview.evaluate("img => img.naturalWidth") > 300
            page.screenshot(path=str(SCREENSHOTS / "ui-confusion.png"))
            browser.close()
