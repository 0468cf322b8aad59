"""`make bench-gpu` kept from rotting between the rare GPU windows: bench/gpu_checks.sh (the
one command a lent GPU node runs) with `python -m bench.gpu --device cpu --smoke` runs every arm
at tiny sizes on the CPU, each in its own process under the meter, and writes every figure, with
the service's loss agreeing with its plain peer's; the GPU tests it runs before and after skip
here, with their reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_arms import ARMS, STEPS
from bench.gpu_report import PAIRS
from tests.conftest import REPO, skip_or_fail

FIGURES = ("rate", "window_rates", "step_s", "first_step_s", "compile_s", "peak_rss_gb",
           "losses", "tflops", "mfu_of_matmul", "items_per_step", "sync_sites")
GPU_ONLY = ("mfu", "host_syncs", "host_syncs_outside_logging", "peak_allocated_gb",
            "peak_reserved_gb")
"""Figures a CPU has no value for: present, and None."""


LIGHTNING = REPO / ".venv" / "lightning"
"""Where `make test`'s set-up installs Lightning for the bench's peer (Makefile: not in the
venv, where mlflow.pytorch would import it at every logged model)."""


@pytest.mark.timeout(1200)  # the deadline below and more: a slow machine's smoke still ends
def test_the_gpu_bench_runs_every_arm_on_the_cpu(tmp_path: Path) -> None:
    if not (LIGHTNING / "lightning").is_dir():
        skip_or_fail(f"no Lightning for the bench's peer in {LIGHTNING} (`make setup` puts it)")
    folder = tmp_path / "checks"
    out = folder / "gpu.jsonl"
    path = os.pathsep.join(filter(None, (str(LIGHTNING), os.environ.get("PYTHONPATH"))))
    # A deadline far beyond the smoke's 1-3 minutes: a slow machine still runs every arm.
    done = subprocess.run(["bash", "bench/gpu_checks.sh", str(folder), "1000"], cwd=REPO,
                          capture_output=True, text=True, timeout=1100,
                          env={**os.environ, "PYTHONPATH": path, "PYTHON": sys.executable,
                               "BENCH_ARGS": "--device cpu --smoke"})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    # The GPU tests, split in two around the bench, all ran and skipped for want of CUDA.
    logs = {name: (folder / f"pytest-{name}.log").read_text()
            for name in ("breakdown-memory", "others")}
    assert "3 skipped, 4 deselected" in logs["breakdown-memory"], logs
    assert "4 skipped, 3 deselected" in logs["others"], logs
    assert "this machine has no CUDA device" in logs["others"]
    assert "gpu checks done in" in done.stdout
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    machine, *arms, summary = lines
    assert machine["kind"] == "machine" and machine["size"] == "smoke"
    assert machine["matmul_tflops"] > 0 and machine["copy_gbps"] > 0
    assert machine["torch"] and machine["gpu"] is None
    assert [a["arm"] for a in arms] == [a.name for a in ARMS]
    for arm in arms:
        assert arm["status"] == "ok", arm
        for key in FIGURES:
            assert arm[key] is not None, (arm["arm"], key)
        for key in GPU_ONLY:
            assert key in arm and arm[key] is None, (arm["arm"], key)
        warmup, window, windows, _ = STEPS["smoke"][arm["workload"]]
        assert len(arm["window_rates"]) == windows
        assert arm["steps"] == warmup + window * windows + 1
        # The loss of the first step, the warm-up's last and the last, each a finite number.
        assert sorted(map(int, arm["losses"])) == [1, warmup, arm["steps"]]
        assert arm["rate"] > 0 and 0 < arm["first_step_s"] < arm["wall_s"]
    # Every service arm's loss agrees with its peer's, and the ratios behind the floors exist.
    ratios = summary["ratios"]
    agreement = {k: v for k, v in ratios.items() if k.startswith("loss ")}
    assert set(agreement) == {f"loss {arm} vs {peer}" for arm, (peer, _) in PAIRS.items()}
    assert all(v["agrees"] for v in agreement.values()), agreement
    # The resnet and input peers read the service's batches in its order: the same training,
    # step by step, down to the last digits on a CPU.
    by_name = {a["arm"]: a for a in arms}
    for arm, plain in (("resnet/service", "resnet/plain"), ("resnet/lightning", "resnet/plain"),
                       ("input/service", "input/plain")):
        assert by_name[arm]["losses"] == pytest.approx(by_name[plain]["losses"], rel=1e-5), arm
    assert {"gpt/service / gpt/plain", "gpt/service-fsdp / gpt/service",
            "resnet/service / resnet/plain", "resnet/service / resnet/lightning",
            "input/service / input/plain"} <= set(ratios)
    # The table a docs/benchmarks.md section is made of, from the file alone.
    table = (folder / "gpu-table.md").read_text()
    assert all(f"| {a['arm']} |" in table for a in arms)


BLOCKED_IMPORTS = """
import sys


class Absent:
    \"\"\"A bare GPU node: these packages are not installed.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {"psutil", "antlr4", "pytest", "mlflow"}:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None


sys.meta_path.insert(0, Absent())
"""


def test_a_node_without_the_projects_packages_is_told_which_before_any_figure(
        tmp_path: Path) -> None:
    """A bare GPU node lacks the project's packages: without psutil every service arm failed
    after its start, one by one, and without pytest or mlflow every GPU test at collection.
    Now the checks say in one line each what is missing and how to bring it, start neither,
    and write no line of figures."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKED_IMPORTS)
    folder = tmp_path / "checks"
    done = subprocess.run(["bash", "bench/gpu_checks.sh", str(folder), "300"], cwd=REPO,
                          capture_output=True, text=True, timeout=280,
                          env={**os.environ, "PYTHONPATH": str(site), "PYTHON": sys.executable,
                               "BENCH_ARGS": "--device cpu --smoke"})
    assert done.returncode == 1, done.stdout + done.stderr
    said = done.stdout.splitlines()
    assert ("the GPU tests need pytest, mlflow, psutil here (bench/gpu_wheels.sh --tracking): "
            "not run") in said, done.stdout
    [refusal] = [line for line in said if "not importable here" in line]
    assert refusal.startswith("gpu.py: error: antlr4, psutil not importable here"), refusal
    assert "bash bench/gpu_wheels.sh" in refusal
    assert said[-1].endswith("failed: pytest-breakdown-memory bench-gpu pytest-others"), said
    assert not (folder / "gpu.jsonl").exists() and not (folder / "gpu-table.md").exists()
