"""The plain loops `python -m bench.gpu` measures the service against, one GPU, no DDP.

    python -m bench.gpu_peers PLAN.json

Each is what a lab writes by hand, at its best: the same model class, seed, batch, dtype,
compile setting and optimiser as the service's arm (bench/gpu.py hands them in the plan's
`settings`), under the same meter (bench/gpu_meter.py), reading its loss back only every
`log_every` steps.

  gpt     nanoGPT's train.py: random windows of a memory-mapped token file, pinned and copied
          without blocking; train/models/gpt.py's GPT (the class model=gpt builds), bf16
          autocast, fused AdamW, torch.compile
  resnet  torchvision's reference classification script on synthetic data: the service's
          data=synthetic images (bench/gpu_data.py), held on the GPU as uint8, each batch
          converted and normalised there (by the training split's channel statistics, as the
          service's in-memory sets are) and drawn in the service's order, so that the two
          train on the same batches; channels_last, bf16 autocast, SGD
  input   the same script's loop over a DataLoader: uint8 images in host memory, augmented on
          the CPU in worker processes, pinned, copied without blocking (bench/gpu_data.py
          HostImages, the Dataset the service's arm reads as data=custom), in a seeded
          DistributedSampler's order, the service's
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812 - torch's own spelling

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # train/ and bench/, unpackaged

from bench import gpu_data  # noqa: E402
from bench.gpu_meter import Meter, Plan  # noqa: E402

Batches = Iterator[tuple[torch.Tensor, torch.Tensor]]


def autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def gpt_batches(s: dict[str, Any], device: torch.device) -> Batches:
    """nanoGPT's get_batch: a new memmap each batch, random offsets, pinned on a GPU."""
    path, seq, batch = Path(s["data"]) / "train.bin", s["seq_len"], s["batch_size"]
    while True:
        data = np.memmap(path, dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - seq, (batch,))
        x = torch.stack([torch.from_numpy(data[i:i + seq].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + seq].astype(np.int64)) for i in ix])
        if device.type == "cuda":
            x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(
                device, non_blocking=True)
        yield x, y


def gpt(s: dict[str, Any], device: torch.device) -> tuple[nn.Module, Any, Batches, Any]:
    from train.models.gpt import GPT

    vocab = json.loads((Path(s["data"]) / "meta.json").read_text())["vocab_size"]
    model = GPT(vocab_size=vocab, seq_len=s["seq_len"], n_layer=s["n_layer"],
                n_head=s["n_head"], n_embd=s["n_embd"]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=s["lr"], betas=(0.9, 0.999),
                                  weight_decay=s["weight_decay"], fused=device.type == "cuda")

    def loss_of(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    return model, optimizer, gpt_batches(s, device), loss_of


def resnet_model(s: dict[str, Any], device: torch.device) -> tuple[nn.Module, Any]:
    import torchvision

    model = torchvision.models.get_model(s["model"], weights=None, num_classes=s["classes"])
    model = model.to(device)
    if s["channels_last"]:
        model = model.to(memory_format=torch.channels_last)
    # SGD's fused kernel on a GPU, as the service's optim=sgd takes it (train/engine/optim.py).
    optimizer = torch.optim.SGD(model.parameters(), lr=s["lr"], momentum=s["momentum"],
                                weight_decay=s["weight_decay"], nesterov=False,
                                fused=True if device.type == "cuda" else None)
    return model, optimizer


def on_device_batches(s: dict[str, Any], device: torch.device) -> Batches:
    """The service's data=synthetic batches, in its order, made as its in-memory path makes
    them: uint8 rows gathered on the GPU, scaled and normalised by the training split's
    channel statistics there."""
    images, labels = gpu_data.synthetic_images(s["num_samples"], s["image_size"], s["classes"])
    order, train_idx = gpu_data.service_order(len(labels), seed=s["seed"])
    mean, std = gpu_data.channel_stats(images[train_idx])
    images, labels, mean, std, order = (t.to(device) for t in (images, labels, mean, std, order))
    size = s["batch_size"]
    for start in range(0, len(order) - size + 1, size):
        idx = order[start:start + size]
        x = images[idx].float().div_(255).sub_(mean).div_(std)
        yield x.contiguous(memory_format=torch.channels_last), labels[idx]


def host_batches(s: dict[str, Any], device: torch.device) -> Batches:
    dataset = gpu_data.HostImages(s["num_samples"], s["image_size"], classes=s["classes"])
    # The DDP tutorials' sampler (one replica here), seeded as the service seeds its own: both
    # read the same order, and the samples' crops are their index's (gpu_data.HostImages).
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True,
                                                  seed=s["seed"])
    loader = torch.utils.data.DataLoader(dataset, batch_size=s["batch_size"], sampler=sampler,
                                         num_workers=s["workers"], drop_last=True,
                                         pin_memory=device.type == "cuda",
                                         persistent_workers=s["workers"] > 0)
    while True:
        for x, y in loader:
            x = x.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
            yield x, y.to(device, non_blocking=True)


def resnet(s: dict[str, Any], device: torch.device) -> tuple[nn.Module, Any, Batches, Any]:
    torch.backends.cudnn.benchmark = True  # the reference script's, as the service's
    model, optimizer = resnet_model(s, device)
    batches = host_batches(s, device) if s.get("workers") is not None else \
        on_device_batches(s, device)
    return model, optimizer, batches, nn.CrossEntropyLoss()


WORKLOADS = {"gpt": gpt, "resnet": resnet, "input": resnet}


def train(plan: Plan) -> None:
    s, device = plan.settings, torch.device(plan.device)
    meter = Meter.install(plan)
    torch.manual_seed(s["seed"])
    model, optimizer, batches, loss_of = WORKLOADS[s["workload"]](s, device)
    model.train()
    if s["compile"]:
        model = torch.compile(model)
    for step in range(1, plan.last + 1):
        x, y = next(batches)
        with autocast(device, s["dtype"]):
            loss = loss_of(model(x), y)
        loss.backward()
        if meter.wants_loss():
            meter.note_loss(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % plan.log_every == 0:
            loss.item()  # the logging step's read-back, as nanoGPT's log interval has it


if __name__ == "__main__":
    train(Plan.read(sys.argv[1]))
