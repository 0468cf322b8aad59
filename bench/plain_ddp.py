"""The baseline of `make bench`: a plain DDP loop as the PyTorch tutorials write it.

Run it under torchrun, one process per rank:

    python -m torch.distributed.run --standalone --nproc_per_node=2 bench/plain_ddp.py \
        --model cnn --batch-size 256 --num-samples 8192 --epochs 2 --out /tmp/plain.json

It trains the SAME model (built by train.models.build from the same ModelConfig) on the same
synthetic
CIFAR-shaped data and training split as `python -m train data=synthetic`, with nothing of the
service around it: a TensorDataset, DistributedSampler + DataLoader, SGD, `loss.item()` every
step, no validation, no tracking. It stays fp32 on every device. Rank 0 writes a JSON file with
throughput measured as the service measures it (global samples of the last epoch / that epoch's
wall time on rank 0), the unix time of the first optimiser step, and every rank's peak RSS.
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
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from train.config.groups import ModelConfig
from train.models.build import InputSpec, build

# What conf/data/synthetic.yaml and DataConfig hold for the synthetic set: the same generator
# seed and train/val split give the same training samples (and so the same steps per epoch).
CHANNELS, IMAGE_SIZE, NUM_CLASSES = 3, 32, 10
SPLIT_SEED, VAL_FRACTION = 0, 0.1


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="cnn", help="train.models.build registry name")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=256, help="GLOBAL batch, split over ranks")
    p.add_argument("--num-samples", type=int, default=8192, help="before the 10%% validation cut")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers per rank")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--out", type=Path, required=True, help="JSON result (written by rank 0)")
    return p.parse_args()


def synthetic_train_set(num_samples: int) -> TensorDataset:
    """train/data/build.py's _synthetic and split(), normalised once up front as a tutorial
    would."""
    g = torch.Generator().manual_seed(SPLIT_SEED)
    shape = (num_samples, CHANNELS, IMAGE_SIZE, IMAGE_SIZE)
    images = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    labels = torch.randint(0, NUM_CLASSES, (num_samples,), generator=g)
    perm = torch.randperm(num_samples, generator=torch.Generator().manual_seed(SPLIT_SEED))
    train_idx = perm[max(1, round(num_samples * VAL_FRACTION)):]
    x = images[train_idx].float().div_(255.0)
    mean = x.mean(dim=(0, 2, 3), keepdim=True)
    std = x.std(dim=(0, 2, 3), keepdim=True).clamp_min(1e-6)
    return TensorDataset((x - mean) / std, labels[train_idx])


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

    dataset = synthetic_train_set(args.num_samples)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size // world, sampler=sampler,
                        num_workers=args.workers, pin_memory=device.type == "cuda",
                        persistent_workers=args.workers > 0)

    torch.manual_seed(0)
    spec = InputSpec(CHANNELS, IMAGE_SIZE, NUM_CLASSES)
    cfg = ModelConfig(name=args.model, width=args.width, depth=args.depth, dropout=args.dropout)
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
        seconds = time.perf_counter() - started  # loss.item() has waited for the device
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
                  "device": str(device), "torch_threads": torch.get_num_threads()}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
