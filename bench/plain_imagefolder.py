"""The baseline of `python -m bench.imagefolder`: an ImageFolder loop as the PyTorch tutorials
write it. Run it under torchrun, one process per rank:

    python -m torch.distributed.run --standalone --nproc_per_node=2 bench/plain_imagefolder.py \
        --root DIR/train --image-size 64 --batch-size 128 --workers 1 --epochs 3 --out plain.json

torchvision's ImageFolder (PIL decoding) with the ImageNet-style training pipeline of the
service's defaults, as transforms.v2 in the workers (RandomResizedCrop, RandomHorizontalFlip,
ToDtype float32, Normalize with ImageNet's mean and std); DistributedSampler + set_epoch;
DataLoader with the given workers, persistent workers and pin_memory on CUDA; the SAME model
(train.models.build from the same ModelConfig), SGD as the service's defaults, `loss.item()` every
step,
no validation, no tracking. Rank 0 writes a JSON file with throughput measured as the service
measures it (global samples of an epoch / that epoch's time on rank 0), the unix time of the
first optimiser step, and every rank's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torchvision.datasets import ImageFolder
from torchvision.transforms import v2

from train.config.groups import ModelConfig
from train.models.build import InputSpec, build

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, required=True, help="class folders (the training set)")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--model", default="cnn", help="train.models.build registry name")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=128, help="GLOBAL batch, split over ranks")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--workers", type=int, default=1, help="DataLoader workers per rank")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--out", type=Path, required=True, help="JSON result (written by rank 0)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=120))

    transform = v2.Compose([v2.ToImage(), v2.RandomResizedCrop(args.image_size, antialias=True),
                            v2.RandomHorizontalFlip(), v2.ToDtype(torch.float32, scale=True),
                            v2.Normalize(MEAN, STD)])
    dataset = ImageFolder(str(args.root), transform=transform)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size // world, sampler=sampler,
                        num_workers=args.workers, pin_memory=device.type == "cuda",
                        persistent_workers=args.workers > 0)

    torch.manual_seed(0)
    spec = InputSpec(3, args.image_size, len(dataset.classes))
    cfg = ModelConfig(name=args.model, width=args.width, depth=args.depth)
    model = DDP(build(cfg, spec).to(device),
                device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True,
                                weight_decay=5e-4)
    loss_fn = nn.CrossEntropyLoss()

    first_step_at: float | None = None
    epochs: list[dict[str, float]] = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        started, seen = time.perf_counter(), 0
        for images, labels in loader:
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(images), labels)
            loss.backward()
            optimizer.step()
            loss_value = loss.item()  # the tutorials' per-step host sync
            seen += labels.shape[0]
            if first_step_at is None:
                first_step_at = time.time()
        seconds = time.perf_counter() - started
        total = torch.tensor(seen, device=device)
        dist.all_reduce(total)  # outside the timed span, as the service's reduction is
        epochs.append({"samples": int(total), "seconds": seconds,
                       "samples_per_sec": int(total) / seconds, "loss": loss_value})
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}  {int(total) / seconds:.1f} samples/s  "
                  f"loss={loss_value:.4g}", flush=True)

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
    peaks: list[float] | None = [0.0] * world if rank == 0 else None
    dist.gather_object(peak, peaks, dst=0)
    if rank == 0:
        result = {"samples_per_sec": epochs[-1]["samples_per_sec"], "epochs": epochs,
                  "first_step_at": first_step_at, "peak_rss_mb": peaks, "world_size": world,
                  "device": str(device), "workers": args.workers}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
