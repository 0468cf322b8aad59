"""Precision in process: channels_last gives fp32's gradients, and the GradScaler skips an
overflowing step and counts it. The jobs: tests/e2e/test_precision.py."""

from __future__ import annotations

import torch


def test_channels_last_gives_the_same_gradients_in_process() -> None:
    """Fast: channels_last changes the layout, not the arithmetic (float32 rounding only)."""
    from train.config.groups import ModelConfig
    from train.models import build as models

    torch.manual_seed(0)
    images, labels = torch.randn(16, 3, 16, 16), torch.randint(0, 10, (16,))
    grads = []
    for channels_last in (False, True):
        torch.manual_seed(1)
        model = models.build(ModelConfig(), models.InputSpec.of((3, 16, 16), 10))
        x = images
        if channels_last:
            model, x = (t.to(memory_format=torch.channels_last) for t in (model, images))
        torch.nn.functional.cross_entropy(model(x), labels).backward()
        grads.append([p.grad for p in model.parameters()])
    for plain, last in zip(*grads, strict=True):
        assert torch.allclose(plain, last, rtol=1e-4, atol=1e-6)


def test_the_scaler_skips_an_overflowing_step_and_counts_it() -> None:
    """Fast, in-process: a real overflow (1e38 x the scale is inf in float32) through the real
    GradScaler. The step is not applied, the scale halves, the next step is; the count survives
    a checkpoint's state_dict."""
    from train.engine.state import GradScaler

    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scaler = GradScaler(torch.device("cpu"), enabled=True)
    for factor in (1e38, 1.0):  # the first step overflows once scaled, the second does not
        optimizer.zero_grad()
        scaler.scale((weight * factor).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        if factor > 1:
            assert torch.equal(weight.detach(), torch.ones(3))  # skipped: not applied
            assert scaler.get_scale() == 65536 / 2 and scaler.skipped_steps == 1
    assert torch.allclose(weight.detach(), torch.full((3,), 0.9))  # applied
    assert scaler.skipped_steps == 1
    restored = GradScaler(torch.device("cpu"), enabled=True)
    restored.load_state_dict(scaler.state_dict())
    assert restored.skipped_steps == 1 and restored.get_scale() == 65536 / 2
    off = GradScaler(torch.device("cpu"), enabled=False)
    assert off.state_dict() == {}  # fp32 and bf16 checkpoints hold no scaler state, as before
