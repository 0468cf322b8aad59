"""The GPU bench's meter (bench/gpu_meter.py) on a loop in this process: it counts optimiser
steps through torch's global hook, times the windows it was asked for, keeps the noted losses,
starts the warm-up clock at the first forward on the arm's device only, and reads the
service's loss as the mean its peers compute."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from bench.gpu_meter import Meter, NotedCrossEntropy, Plan


def test_the_meter_times_windows_and_keeps_the_noted_losses(tmp_path: Path) -> None:
    plan = Plan(arm="unit", result=str(tmp_path / "meter.json"), device="cpu", warmup=2,
                window=3, windows=2, items_per_step=8, log_every=2)
    meter = Meter.install(plan)
    try:
        model = nn.Linear(4, 3)
        with torch.device("meta"):  # a pre-flight's shape check: not the training's start
            model.to("meta")(torch.empty(2, 4))
        model = nn.Linear(4, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(plan.last + 3):  # steps after the last are not measured
            loss = F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 3, (8,)))
            loss.backward()
            meter.note_loss(loss)
            losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad()
    finally:
        meter.remove()
    figures = json.loads(Path(plan.result).read_text())
    assert figures["steps"] == plan.last == 2 + 3 * 2 + 1
    assert len(figures["window_rates"]) == 2 and all(r > 0 for r in figures["window_rates"])
    assert figures["rate"] == pytest.approx(8 / figures["step_s"])
    assert figures["losses"] == {str(s): pytest.approx(losses[s - 1]) for s in (1, 2, 9)}
    assert figures["compile_s"] >= 0 and figures["first_step_s"] > 0
    assert figures["host_syncs"] is None  # no CUDA: nothing to count


def test_the_services_noted_loss_is_the_mean_over_the_items(tmp_path: Path) -> None:
    plan = Plan(arm="unit", result=str(tmp_path / "m.json"), device="cpu", warmup=1, window=1,
                windows=1, items_per_step=1, log_every=1)
    meter = Meter.install(plan)
    try:
        logits, target = torch.randn(6, 5), torch.tensor([0, 1, -100, 3, -100, 4])
        summed = NotedCrossEntropy(reduction="sum")(logits, target)  # as the service asks
    finally:
        meter.remove()
    assert float(meter.losses[1]) == pytest.approx(float(F.cross_entropy(logits, target)))
    assert float(summed) == pytest.approx(float(F.cross_entropy(logits, target)) * 4)


def _torch_warns_of_a_sync() -> None:
    warnings.warn("called a synchronizing CUDA operation", stacklevel=1)


def test_syncs_count_in_the_timed_windows_only_each_with_its_step_and_line(
        tmp_path: Path) -> None:
    """torch's warning under set_sync_debug_mode("warn") (raised here as torch raises it, for
    want of CUDA): every one counted, in the step under way, with the line that caused it."""
    plan = Plan(arm="unit", result=str(tmp_path / "m.json"), device="cpu", warmup=1, window=2,
                windows=1, items_per_step=1, log_every=2)
    syncs_in_step = {1: 1, 2: 2, 3: 1, 4: 1}  # steps 2 and 3 are the timed window
    meter = Meter.install(plan)
    try:
        param = nn.Parameter(torch.zeros(1))
        optimizer = torch.optim.SGD([param], lr=0.1)
        for step in range(1, plan.last + 1):
            for _ in range(syncs_in_step[step]):
                _torch_warns_of_a_sync()
            optimizer.step()
    finally:
        meter.remove()
    assert dict(meter.syncs) == {2: 2, 3: 1}
    assert dict(meter.sync_sites) == {
        f"test_bench_gpu.py:{_torch_warns_of_a_sync.__code__.co_firstlineno + 1} "
        "_torch_warns_of_a_sync": 3}
