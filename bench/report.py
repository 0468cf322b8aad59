"""`make bench`'s report: the machine, medians per variant, the ratios between variants."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
from importlib.metadata import version
from pathlib import Path
from typing import Any

VARIANTS = {"a": "plain", "b": "service", "c": "service+mlflow", "d": "+compile",
            "e": "+channels_last", "f": "+bf16", "g": "-stragglers"}


def machine_info(device: str) -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
               platform.processor())
    mem_kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                  if line.startswith("MemTotal"))
    info = {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(),
            "cores_usable": len(os.sched_getaffinity(0)), "memory_gb": round(mem_kb / 2**20, 1),
            "os": platform.platform(), "python": platform.python_version(),
            "torch": version("torch"), "mlflow": version("mlflow"),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}
    if device == "cuda":
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True)
        info["gpus"] = out.stdout.strip().splitlines()
    return info


def summarise(runs: list[Any]) -> dict[str, dict[str, Any]]:
    summary: dict[str, dict[str, Any]] = {}
    for key, name in VARIANTS.items():
        mine = [r for r in runs if r.variant == key]
        if not mine:
            continue
        sps = [r.samples_per_sec for r in mine]
        summary[key] = {
            "name": name, "samples_per_sec": statistics.median(sps),
            "samples_per_sec_min": min(sps), "samples_per_sec_max": max(sps),
            "time_to_first_step_s": statistics.median(r.time_to_first_step_s for r in mine),
            "peak_rss_mb": [statistics.median(rank) for rank in zip(*(r.peak_rss_mb for r in mine),
                                                                     strict=True)],
            "wall_s": statistics.median(r.wall_s for r in mine)}
        extras = [r.extra["first_epoch_extra_s"] for r in mine if "first_epoch_extra_s" in r.extra]
        if extras:
            summary[key]["first_epoch_extra_s"] = statistics.median(extras)
        shares = [r.extra["tracking_cpu_share"] for r in mine if "tracking_cpu_share" in r.extra]
        if shares:  # a steadier figure for the price of MLflow than c/b on a noisy machine
            summary[key]["tracking_cpu_share"] = statistics.median(shares)
    return summary


def ratios(summary: dict[str, dict[str, Any]]) -> dict[str, float]:
    out = {}
    for num, den in (("b", "a"), ("c", "b"), ("d", "b"), ("e", "b"), ("f", "b"), ("d", "a"),
                     ("e", "a"), ("f", "a"), ("b", "g")):
        if num in summary and den in summary:
            out[f"{num}/{den}"] = summary[num]["samples_per_sec"] / summary[den]["samples_per_sec"]
    if "d" in summary and "b" in summary:  # compiling, apart from the steady state
        out["compile_first_step_delay_s"] = (summary["d"]["time_to_first_step_s"]
                                             - summary["b"]["time_to_first_step_s"])
        out["compile_startup_s"] = (summary["d"]["first_epoch_extra_s"]
                                    - summary["b"]["first_epoch_extra_s"])
    return out


def print_table(summary: dict[str, dict[str, Any]], found: dict[str, float]) -> None:
    print(f"\n{'variant':<18} {'samples/s':>10} {'(min-max)':>17} {'1st step s':>11} "
          f"{'1st epoch +s':>13} {'peak RSS MB per rank':>22} {'wall s':>8}")
    for key, s in summary.items():
        spread = f"({s['samples_per_sec_min']:.0f}-{s['samples_per_sec_max']:.0f})"
        rss = ", ".join(f"{v:.0f}" for v in s["peak_rss_mb"])
        extra = f"{s['first_epoch_extra_s']:.1f}" if "first_epoch_extra_s" in s else "-"
        print(f"{key} {s['name']:<16} {s['samples_per_sec']:>10.1f} {spread:>17} "
              f"{s['time_to_first_step_s']:>11.1f} {extra:>13} {rss:>22} {s['wall_s']:>8.1f}")
    for name, value in found.items():
        if name == "compile_first_step_delay_s":
            print(f"torch.compile start-up: the first step {value:.1f} s later than b's "
                  "(importing the compiler, compiling the first graphs)")
        elif name == "compile_startup_s":
            print(f"  and the first epoch {value:.1f} s longer than its steady rate says, beyond "
                  "b's (later graphs, e.g. the last short batch); steady samples/s: d/b")
        else:
            print(f"samples/s {name} = {value:.3f}  ({(value - 1) * 100:+.1f}%)"
                  + ("  (the straggler check's cost: b has it, g not)" if name == "b/g" else ""))
    if "tracking_cpu_share" in summary.get("c", {}):
        print(f"MLflow thread on rank 0 after the first epoch: "
              f"{summary['c']['tracking_cpu_share'] * 100:.2f}% of one core")


def run_variant(cmd: list[str], env: dict[str, str], out: Path, timeout: float, name: str,
                plain: bool) -> tuple[float, float, dict[str, Any]]:
    """One variant's command, its output to `out`/output.log: (start time, wall seconds, its
    results - `plain` loop's plain.json, else the service's summary.json); a failure ends the
    bench with the command and its log's tail."""
    import json
    import time

    repo = Path(__file__).resolve().parent.parent
    log = out / "output.log"
    with log.open("w") as sink:
        started = time.time()
        proc = subprocess.run(cmd, cwd=repo, env=env, stdout=sink, stderr=subprocess.STDOUT,
                              timeout=timeout, check=False)
        wall = time.time() - started
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise SystemExit(f"{name} failed (exit {proc.returncode}):\n  {' '.join(cmd)}\n{tail}")
    results = out / ("plain.json" if plain else "summary.json")
    return started, wall, json.loads(results.read_text())
