"""Model FLOPs and device peaks, for `train/tflops_per_sec` and `train/mfu`.

The FLOPs of one training step (forward and backward) are counted once, on a copy of the model
on the meta device, so nothing is computed and no memory is allocated. Model FLOP utilisation is
the achieved model FLOP rate over what the devices could do at their peak; peaks are known for
common data-centre GPUs, and `trainer.peak_tflops` supplies one for anything else (a CPU, say).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from train.models.copies import copy_on

log = logging.getLogger("train")

# Dense peak TFLOP/s of one device (vendor data sheets, no sparsity): (16-bit, fp32).
# Matched against torch.cuda.get_device_name(), first hit wins (so "H100 PCIe" before "H100").
PEAK_TFLOPS: tuple[tuple[str, float, float], ...] = (
    ("H200", 989.4, 66.9),
    ("H100 PCIe", 756.0, 51.2),
    ("H100", 989.4, 66.9),
    ("A100", 312.0, 19.5),
    ("L40S", 362.1, 91.6),
    ("L40", 181.0, 90.5),  # before "L4", a part of its name
    ("A10G", 70.0, 31.2),
    ("L4", 121.0, 30.3),
    ("V100", 125.0, 15.7),
)


def training_flops_per_sample(model: nn.Module, input_shape: tuple[int, ...],
                              tokens: bool = False) -> float | None:
    """FLOPs of forward + backward for one sample; None when they cannot be counted. `tokens`:
    the sample is a window of token ids (data=tokens, or data=arrow's texts); a model that
    says its FLOPs per token (model=gpt: 6N plus attention, as nanoGPT and PaLM count them) is
    taken at its word."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    per_token = getattr(model, "flops_per_token", None)
    if tokens and callable(per_token):
        return float(per_token(input_shape[0])) * input_shape[0]
    try:
        ghost = copy_on(model, "meta")
        ghost.train()
        batch = 2  # BatchNorm in training mode wants more than one value per channel
        # Fake tensors over the meta copy: a model that reads a value to choose its path sees
        # a trace, as under torch.compile, not a meta tensor's refusal (transformers asks
        # whether a padding mask masks anything, `padding_mask.all()`, unless it is traced).
        with FakeTensorMode(allow_non_fake_inputs=True):
            inputs = (torch.zeros(batch, *input_shape, dtype=torch.long, device="meta")
                      if tokens else torch.empty(batch, *input_shape, device="meta"))
            with FlopCounterMode(display=False) as counter:
                output = ghost(inputs)
                scores = output["out"] if isinstance(output, dict) else output
                scores.float().sum().backward()
        total = counter.get_total_flops()
    except Exception as e:  # noqa: BLE001 - an exotic layer must not stop training
        log.info("model FLOPs not counted (%s: %s); no train/mfu", type(e).__name__, e)
        return None
    return total / batch if total > 0 else None


def peak_tflops(device: torch.device, precision: str, configured: float | None) -> float | None:
    """One device's peak for this precision: the configured value, else a known GPU's."""
    if configured is not None:
        return configured
    if device.type != "cuda":
        return None
    return peak_of(torch.cuda.get_device_name(device), precision)


def peak_of(device_name: str, precision: str) -> float | None:
    """A GPU's data-sheet peak by the name CUDA gives it (None: not a known one)."""
    for key, half, single in PEAK_TFLOPS:
        if key in device_name:
            return single if precision == "fp32" else half
    return None


class Throughput:
    """train/tflops_per_sec and train/mfu of all ranks together. The FLOPs are counted at the
    first epoch end, so that counting (~1 s on a CPU) does not delay the first step."""

    def __init__(self, model: nn.Module, input_shape: tuple[int, ...], device: torch.device,
                 precision: str, configured_peak: float | None, world_size: int,
                 tokens: bool = False) -> None:
        self._model, self._shape, self._tokens = model, tuple(input_shape), tokens
        peak = peak_tflops(device, precision, configured_peak)
        self.peak_total = None if peak is None else peak * world_size
        self.flops_per_sample: float | None = None
        self._counted = False

    def metrics(self, samples: int, seconds: float) -> dict[str, float]:
        if not self._counted:
            self.flops_per_sample, self._counted = training_flops_per_sample(
                self._model, self._shape, self._tokens), True
        if not self.flops_per_sample or seconds <= 0:
            return {}
        tflops = self.flops_per_sample * samples / seconds / 1e12
        out = {"train/tflops_per_sec": tflops}
        if self.peak_total:
            out["train/mfu"] = tflops / self.peak_total
        return out
