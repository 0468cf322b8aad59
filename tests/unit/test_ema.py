"""trainer.ema's average (train/engine/ema.py) against torch's own AveragedModel, its swap in
and out of the model; a checkpoint of an EMA run evaluates its average. (Jobs of it:
tests/e2e/test_ema.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from train.config.ema import EmaConfig
from train.engine.ema import Ema


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(144, 2))


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(4, 3, 8, 8)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def test_the_average_is_torchs_ema_of_weights_and_batchnorm_statistics() -> None:
    """Updated every 2nd step, a copy up to step 4, then averaged: torch's AveragedModel (EMA
    rule, buffers too) fed the same steps holds the same floats; counters are copied."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model = _model()
    average = Ema(EmaConfig(enabled=True, decay=0.9, start_step=4, every=2), model)
    reference = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 12):
        _train_step(model, optimizer)
        average.update(step)
        if step % 2 == 0 and step >= 4:  # its first update copies, as ours up to start_step
            reference.update_parameters(model)
    ours = average.state_dict()
    for name, value in reference.module.state_dict().items():
        if value.is_floating_point():
            assert torch.equal(ours[name], value), name
    assert int(ours["1.num_batches_tracked"]) == 10  # the weights' own at step 10
    assert not torch.equal(ours["3.weight"], model.state_dict()["3.weight"])


def test_applied_swaps_the_average_in_and_the_trained_weights_back() -> None:
    model = _model()
    average = Ema(EmaConfig(enabled=True, decay=0.5), model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 4):
        _train_step(model, optimizer)
        average.update(step)
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    with average.applied():
        inside = model.state_dict()
        assert all(torch.equal(inside[k], v) for k, v in average.state_dict().items())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in trained.items())
    average.apply()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in average.state_dict().items())


def test_a_checkpoint_of_an_ema_run_evaluates_its_average(tmp_path: Path) -> None:
    """`python -m train eval eval.weights=<step-N.pt>`: the average the run validated."""
    from train.engine.evaluate import load_weights

    model, other = _model(), _model()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    torch.save({"model": model.state_dict(), "ema": other.state_dict(), "epoch": 3},
               tmp_path / "step-000000009.pt")
    loaded = _model()
    assert load_weights(loaded, tmp_path / "step-000000009.pt") == 3
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in other.state_dict().items())


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.5])
def test_a_decay_outside_0_1_is_named(decay: float) -> None:
    problem = EmaConfig(enabled=True, decay=decay).problem()
    assert problem is not None and f"trainer.ema.decay={decay}" in problem
    assert EmaConfig(enabled=False, decay=decay).problem() is None
