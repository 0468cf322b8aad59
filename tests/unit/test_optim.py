"""The optimiser and the per-step learning-rate schedule, in process (no ranks, no MLflow)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from train.config.groups import OptimConfig
from train.engine import optim


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def _lrs(cfg: OptimConfig, steps_per_epoch: int, epochs: int) -> list[float]:
    """The lr the optimiser uses at each optimiser step, as the training loop steps it."""
    optimizer = optim.build_optimizer(cfg, _model())
    scheduler = optim.build_scheduler(cfg, optimizer, steps_per_epoch, epochs)
    seen = []
    for _ in range(steps_per_epoch * epochs):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen


def test_linear_warmup_reaches_the_peak_at_its_last_step() -> None:
    factors = [optim.lr_factor(s, 100, 10, "cosine", 0.0) for s in range(10)]
    assert factors == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert factors[-1] == 1.0
    assert all(b > a for a, b in zip(factors, factors[1:], strict=False))  # rising


@pytest.mark.parametrize("min_ratio", [0.0, 0.1, 0.5])
def test_cosine_falls_from_the_peak_to_min_ratio(min_ratio: float) -> None:
    total, warmup = 50, 5
    factors = [optim.lr_factor(s, total, warmup, "cosine", min_ratio) for s in range(total + 1)]
    assert factors[warmup] == pytest.approx(1.0)  # the peak right after warm-up
    assert factors[total] == pytest.approx(min_ratio)
    after = factors[warmup:]
    assert all(b <= a + 1e-12 for a, b in zip(after, after[1:], strict=False))  # never rises
    middle = warmup + (total - warmup) // 2
    assert factors[middle] == pytest.approx(min_ratio + (1 - min_ratio) * 0.5, abs=0.04)
    # Past the end (a resumed run with more steps than planned) it stays at the floor.
    assert optim.lr_factor(total + 7, total, warmup, "cosine", min_ratio) == pytest.approx(
        min_ratio)


def test_constant_stays_flat_after_warmup() -> None:
    assert [optim.lr_factor(s, 40, 0, "constant", 0.3) for s in range(40)] == [1.0] * 40
    with_warmup = [optim.lr_factor(s, 40, 4, "constant", 0.3) for s in range(40)]
    assert with_warmup[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert with_warmup[4:] == [1.0] * 36


def test_the_scheduler_steps_through_the_schedule_over_all_epochs() -> None:
    cfg = OptimConfig(name="sgd", lr=0.2, schedule="cosine", warmup_epochs=0.5,
                      min_lr_ratio=0.1)
    steps_per_epoch, epochs = 8, 3
    total, warmup = steps_per_epoch * epochs, 4  # 0.5 epoch of 8 steps
    seen = _lrs(cfg, steps_per_epoch, epochs)
    assert len(seen) == total
    expected = [0.2 * optim.lr_factor(s, total, warmup, "cosine", 0.1) for s in range(total)]
    assert seen == pytest.approx(expected)
    assert seen[0] == pytest.approx(0.2 / 4)  # warm-up starts at peak / warm-up steps
    assert seen[warmup - 1] == pytest.approx(0.2)  # and ends on the peak
    assert max(seen) == pytest.approx(0.2)
    # The last step is one step short of the floor: the cosine reaches min_lr_ratio x peak
    # at step `total`, the step after the run.
    progress = (total - 1 - warmup) / (total - warmup)
    assert seen[-1] == pytest.approx(0.2 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))))
    assert seen[-1] < 0.2 * 0.11


def test_the_constant_scheduler_keeps_the_peak() -> None:
    cfg = OptimConfig(name="adamw", lr=3e-4, schedule="constant", warmup_epochs=0)
    assert _lrs(cfg, 5, 2) == pytest.approx([3e-4] * 10)


def test_fractional_warmup_epochs_count_in_steps() -> None:
    cfg = OptimConfig(lr=1.0, schedule="constant", warmup_epochs=0.25)
    seen = _lrs(cfg, 12, 2)  # a quarter of the first epoch: 3 warm-up steps
    assert seen == pytest.approx([1 / 3, 2 / 3] + [1.0] * 22)


def test_sgd_gets_momentum_nesterov_and_weight_decay() -> None:
    cfg = OptimConfig(name="sgd", lr=0.05, momentum=0.8, nesterov=True, weight_decay=1e-3)
    optimizer = optim.build_optimizer(cfg, _model())
    assert isinstance(optimizer, torch.optim.SGD)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"], group["weight_decay"]) == (
        0.05, 0.8, True, 1e-3)


def test_nesterov_is_dropped_without_momentum() -> None:
    """torch refuses nesterov with momentum 0; the config's nesterov=true default must not
    break a plain-SGD run."""
    cfg = OptimConfig(name="sgd", momentum=0.0, nesterov=True)
    group = optim.build_optimizer(cfg, _model()).param_groups[0]
    assert group["nesterov"] is False and group["momentum"] == 0.0
    off = optim.build_optimizer(OptimConfig(name="sgd", momentum=0.9, nesterov=False), _model())
    assert off.param_groups[0]["nesterov"] is False


def test_adamw_gets_betas_and_weight_decay() -> None:
    cfg = OptimConfig(name="adamw", lr=1e-3, betas=[0.8, 0.95], weight_decay=0.05)
    optimizer = optim.build_optimizer(cfg, _model())
    assert isinstance(optimizer, torch.optim.AdamW)
    group = optimizer.param_groups[0]
    assert group["betas"] == (0.8, 0.95)
    assert (group["lr"], group["weight_decay"]) == (1e-3, 0.05)


def test_frozen_parameters_are_left_out() -> None:
    model = _model()
    model[0].weight.requires_grad_(False)
    optimizer = optim.build_optimizer(OptimConfig(), model)
    params = optimizer.param_groups[0]["params"]
    assert len(params) == 3 and all(p is not model[0].weight for p in params)


def test_an_sgd_step_moves_the_weights_by_lr_times_gradient() -> None:
    """With momentum and weight decay off, one step is w - lr * grad: the lr from the
    schedule is the one applied."""
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -2.0]]))
    cfg = OptimConfig(name="sgd", lr=0.5, momentum=0.0, weight_decay=0.0, schedule="constant",
                      warmup_epochs=1)
    optimizer = optim.build_optimizer(cfg, model)
    optim.build_scheduler(cfg, optimizer, steps_per_epoch=4, epochs=1)  # step 0: lr = 0.5 / 4
    model(torch.tensor([[3.0, 1.0]])).sum().backward()  # grad = input
    optimizer.step()
    assert model.weight.detach()[0].tolist() == pytest.approx([1.0 - 0.125 * 3, -2.0 - 0.125])


@pytest.mark.parametrize(("name", "preset"), [("sgd", torch.optim.SGD),
                                              ("adamw", torch.optim.AdamW)])
def test_the_kernels_chosen_for_a_gpu_step_fsdp_shards(one_rank_group: None, name: str,
                                                       preset: type) -> None:
    """What build_optimizer picks on GPUs, run on FSDP2's DTensor shards (on the CPU, whose
    fused kernels go through the same DTensor dispatch): an nccl FSDP job with optim=sgd
    failed at its first step with fused SGD. Plain parameters on GPUs keep the fused ones."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(nn.Linear(4, 2), mesh=init_device_mesh("cpu", (1,)))
    params = list(model.parameters())
    fused = optim.fused_kernels(name, params, on_gpu=True)
    optimizer = preset(params, lr=0.1, fused=fused)
    before = [p.full_tensor().clone() for p in params]
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    assert all(not torch.equal(b, p.full_tensor()) for b, p in zip(before, params, strict=True))
    assert fused is (None if name == "sgd" else True)
    assert optim.fused_kernels(name, list(nn.Linear(4, 2).parameters()), on_gpu=True) is True
    assert optim.fused_kernels(name, params, on_gpu=False) is None
    # Why SGD's are not fused there: torch has no DTensor rule for them (once this step runs,
    # fused_kernels can drop its exception).
    with pytest.raises(NotImplementedError, match="_fused_sgd_"):
        torch.optim.SGD(params, lr=0.1, fused=True).step()
