"""`make bench-gpu`: the service against plain loops on one GPU, every figure from one command.

    python -m bench.gpu                      # ~8 minutes on one H100/H200
    python -m bench.gpu --quick              # ~3 minutes: fewer steps, nothing compiled
    python -m bench.gpu --device cpu --smoke # every arm and figure at tiny sizes (make test)

First the machine: GPU, memory, driver, torch and CUDA, and two ceilings measured on the spot (a
bf16 8192^3 matmul's TFLOP/s on random data, a device-to-device copy's GB/s). Then each arm of
bench/gpu_arms.py in a process of its own, under the same meter (bench/gpu_meter.py), with a
cold compiler cache of its own; each appends one JSON line to --out as soon as it ends, so a
run cut short keeps every finished arm. At the end, the table (bench/gpu_report.py): items/s
(median of the timed windows, CUDA events), MFU against the GPU's dense bf16 peak and against
the matmul ceiling, time from the command's start to the first optimiser step, compile time,
peak memory, host syncs in the timed windows and the loss at the last step, which must agree
between the service and its plain peer.

It runs on a bare GPU machine: whatever torch (2.11 or newer), torchvision and CUDA are there,
plus hydra-core, omegaconf, antlr4-python3-runtime and psutil, with PYTHONPATH at the
checkout (refused in one line, before anything is written, where one is missing).
Lightning's arm is skipped, with the reason, where Lightning does not import; the MLflow arm
(the service logging to a local SQLite store) where mlflow does not. Exit 1 if an arm failed
or a service's loss disagrees with its peer's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import gpu_arms, gpu_data, gpu_report
from bench.gpu_arms import ARMS, REPO, Arm
from bench.gpu_meter import Plan

NEEDED = ("hydra", "omegaconf", "antlr4", "psutil")
"""What the service's arms import beyond torch and torchvision: checked before
the first figure, so that a bare node says what it lacks once instead of failing every arm."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    sizes = p.add_mutually_exclusive_group()
    sizes.add_argument("--quick", action="store_true", help="fewer steps, no compile (~3 min)")
    sizes.add_argument("--smoke", action="store_true", help="tiny sizes: does every arm run?")
    p.add_argument("--arms", help="comma-separated arm names (default: all): "
                   + ", ".join(a.name for a in ARMS))
    p.add_argument("--out", type=Path, default=REPO / ".bench" / "gpu.jsonl",
                   help="JSON lines, appended: the machine, then one per arm")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no arm after this many seconds (it is recorded as skipped); "
                        "default 450 for the full size, none otherwise")
    p.add_argument("--timeout-s", type=float, default=None, help="seconds per arm")
    p.add_argument("--keep", action="store_true", help="keep the arms' directories")
    args = p.parse_args(argv)
    args.size = "smoke" if args.smoke else "quick" if args.quick else "full"
    if args.timeout_s is None:
        args.timeout_s = {"full": 240.0, "quick": 150.0, "smoke": 180.0}[args.size]
    if args.budget_s is None and args.size == "full":
        args.budget_s = 450.0  # an 8-minute window: the last arms are the least needed
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda: this machine has no CUDA device (torch "
                    f"{torch.__version__}); run where one is, or --device cpu --smoke")
    if absent := [name for name in NEEDED if not importable(name)]:
        p.error(f"{', '.join(absent)} not importable here (the service's arms need "
                f"{', '.join(NEEDED)}): make the wheels with `bash bench/gpu_wheels.sh` and "
                "install them with --target onto PYTHONPATH (docs/benchmarks.md)")
    chosen = args.arms.split(",") if args.arms else [a.name for a in ARMS]
    if unknown := set(chosen) - {a.name for a in ARMS}:
        p.error(f"--arms: unknown {sorted(unknown)}; choose from "
                + ", ".join(a.name for a in ARMS))
    args.chosen = [a for a in ARMS if a.name in chosen]
    return args


def append(out: Path, line: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(json.dumps(line) + "\n")


def importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def missing(arm: Arm) -> str | None:
    """Why an arm cannot run here, or None."""
    if arm.needs == "lightning" and not (importable("lightning")
                                         or importable("pytorch_lightning")):
        return "Lightning does not import here (neither lightning nor pytorch_lightning)"
    if arm.needs == "mlflow" and not importable("mlflow"):
        return "mlflow does not import here: this arm logs to a local SQLite MLflow store"
    return None


def plan_for(arm: Arm, args: argparse.Namespace, folder: Path, tokens: Path) -> Plan:
    warmup, window, windows, log_every = gpu_arms.STEPS[args.size][arm.workload]
    s = gpu_arms.settings(args.size, arm.workload, args.device, tokens)
    items = s["batch_size"] * (s["seq_len"] if arm.workload == "gpt" else 1)
    return Plan(arm=arm.name, result=str(folder / "meter.json"), device=args.device,
                warmup=warmup, window=window, windows=windows, items_per_step=items,
                log_every=log_every, settings=s)


def arm_env(folder: Path, arm: Arm) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(REPO), env.get("PYTHONPATH"))))
    # A cold compiler cache per arm: each pays the compile a first job on a fresh node pays.
    env["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "inductor")
    env["TRITON_CACHE_DIR"] = str(folder / "triton")
    env.pop("MLFLOW_TRACKING_URI", None)
    if arm.needs == "mlflow":
        env["MLFLOW_TRACKING_URI"] = f"sqlite:///{folder / 'mlflow.db'}"
    return env


def run_arm(arm: Arm, args: argparse.Namespace, tmp: Path, tokens: Path,
            machine: dict[str, Any]) -> dict[str, Any]:
    folder = tmp / arm.name.replace("/", "-")
    folder.mkdir(parents=True)
    plan = plan_for(arm, args, folder, tokens)
    overrides = (gpu_arms.service_overrides(arm, plan, folder / "out")
                 if arm.runner == "service" else [])
    plan_path = folder / "plan.json"
    cmd = gpu_arms.command(arm, plan_path, overrides)
    line: dict[str, Any] = {"kind": "arm", "arm": arm.name, "workload": arm.workload,
                            "runner": arm.runner, "settings": plan.settings,
                            "command": [c.replace(str(tmp), "$TMP") for c in cmd[1:]]}
    plan.started_at = time.time()
    plan.write(plan_path)
    with (folder / "output.log").open("w") as log:
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=arm_env(folder, arm), stdout=log,
                                  stderr=subprocess.STDOUT, timeout=args.timeout_s, check=False)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
    line["wall_s"] = time.time() - plan.started_at
    result = Path(plan.result)
    if code == 0 and result.exists():
        figures = json.loads(result.read_text())
        per_item = gpu_report.flops_per_item(plan.settings)
        return {**line, "status": "ok", **gpu_report.with_mfu(figures, per_item, machine)}
    tail = (folder / "output.log").read_text().splitlines()[-15:]
    why = f"timed out after {args.timeout_s:.0f} s" if code is None else f"exit {code}"
    return {**line, "status": "failed", "reason": why, "log_tail": tail}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="train-bench-gpu-"))
    print(f"bench.gpu: {args.size} on {args.device}, arms under {tmp}, lines to {args.out}",
          flush=True)
    record = {"kind": "machine", "date": datetime.now(UTC).isoformat(timespec="seconds"),
              "size": args.size, "argv": sys.argv[1:],
              **gpu_report.machine(args.device, args.size == "smoke")}
    append(args.out, record)
    print(f"  machine: {record.get('gpu') or record.get('cpu')}, matmul "
          f"{record['matmul_tflops']:.1f} TFLOP/s, copy {record['copy_gbps']:.0f} GB/s",
          flush=True)
    lines: list[dict[str, Any]] = []
    try:
        train_tokens, val_tokens = gpu_arms.tokens_needed(args.size)
        tokens = gpu_data.write_tokens(tmp / "tokens", train_tokens, val_tokens)
        for arm in args.chosen:
            if (why := missing(arm)) is None and args.budget_s is not None \
                    and time.time() - started > args.budget_s:
                why = f"out of time: --budget-s {args.budget_s:.0f} spent"
            line = ({"kind": "arm", "arm": arm.name, "status": "skipped", "reason": why}
                    if why else run_arm(arm, args, tmp, tokens, record))
            append(args.out, line)
            lines.append(line)
            print(f"  {arm.name:<24} {_shown(line)}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print("\n" + gpu_report.table(record, lines))
    found = gpu_report.ratios({a["arm"]: a for a in lines if a.get("status") == "ok"})
    append(args.out, {"kind": "summary", "ratios": found, "wall_s": time.time() - started})
    failed = [a["arm"] for a in lines if a.get("status") == "failed"]
    disagree = [k for k, v in found.items() if v.get("agrees") is False]
    for name in failed:
        print(f"FAILED: {name}", file=sys.stderr)
    for name in disagree:
        print(f"LOSS DISAGREES: {name}", file=sys.stderr)
    return 1 if failed or disagree else 0


def _shown(line: dict[str, Any]) -> str:
    if line["status"] != "ok":
        tail = "\n      ".join(line.get("log_tail", []))
        return f"{line['status']}: {line['reason']}" + (f"\n      {tail}" if tail else "")
    return (f"{line['rate']:12,.0f} items/s  first step {line['first_step_s']:.1f} s  compile "
            f"{line['compile_s']:.1f} s  syncs {line['host_syncs']}  wall {line['wall_s']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
