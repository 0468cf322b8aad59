"""The baseline of `python -m bench.tasks`: regression and segmentation in a plain DDP loop, as
the PyTorch tutorials write it.

Run it under torchrun, one process per rank:

    python -m torch.distributed.run --standalone --nproc_per_node=2 bench/plain_tasks.py \
        --task segmentation --batch-size 64 --epochs 3 --out /tmp/plain.json

It trains the SAME model class on the same Dataset class (bench/task_data.py) as the service
does in `python -m bench.tasks`, with nothing of the service around it: DistributedSampler +
DataLoader, SGD, the loss with its default mean reduction (MSELoss; CrossEntropyLoss with
ignore_index=255), `loss.item()` every step, no validation, no metrics, no tracking. Rank 0
writes a JSON file with throughput measured as the service measures it (global samples of an
epoch / that epoch's wall time on rank 0) and rank 0's CPU time per epoch, the unix time of
the first optimiser step, and every rank's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ as torchrun runs it

from bench.task_data import IGNORE, MLP, Features, SegNet, Shapes  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=("regression", "segmentation"), required=True)
    p.add_argument("--num-samples", type=int, help="training samples (Dataset's default)")
    p.add_argument("--width", type=int, help="MLP hidden / SegNet width (the class's default)")
    p.add_argument("--batch-size", type=int, default=256, help="GLOBAL batch, split over ranks")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--workers", type=int, default=1, help="DataLoader workers per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="JSON result (written by rank 0)")
    return p.parse_args()


def build(args: argparse.Namespace) -> tuple[torch.utils.data.Dataset, nn.Module, nn.Module]:
    """The training set, the model and the loss of the task."""
    data_kwargs = {} if args.num_samples is None else {"length": args.num_samples}
    if args.task == "regression":
        model_kwargs = {} if args.width is None else {"hidden": args.width}
        return (Features(split="train", **data_kwargs), MLP(num_classes=1, **model_kwargs),
                nn.MSELoss())
    model_kwargs = {} if args.width is None else {"width": args.width}
    dataset = Shapes(split="train", **data_kwargs)
    return (dataset, SegNet(num_classes=len(dataset.classes), **model_kwargs),
            nn.CrossEntropyLoss(ignore_index=IGNORE))


def main() -> None:
    args = parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))

    torch.manual_seed(args.seed)
    dataset, model, loss_fn = build(args)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True,
                                 seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size // world, sampler=sampler,
                        num_workers=args.workers, persistent_workers=args.workers > 0)
    model = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True,
                                weight_decay=5e-4)

    first_step_at: float | None = None
    epochs: list[dict[str, float]] = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        started, cpu, seen = time.perf_counter(), time.process_time(), 0
        for inputs, target in loader:
            optimizer.zero_grad(set_to_none=True)
            output = model(inputs)
            if args.task == "regression":
                output = output.squeeze(1)
            loss = loss_fn(output, target)
            loss.backward()
            optimizer.step()
            loss_value = loss.item()  # the tutorials' per-step host sync
            seen += target.shape[0]
            if first_step_at is None:
                first_step_at = time.time()
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        total = torch.tensor(seen)
        dist.all_reduce(total)  # outside the timed span, as the service's reduction is
        epochs.append({"samples": int(total), "seconds": seconds, "cpu_s": cpu,
                       "samples_per_sec": int(total) / seconds, "loss": loss_value})
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}  {int(total) / seconds:.1f} samples/s  "
                  f"loss={loss_value:.4g}", flush=True)

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
    peaks: list[float] | None = [0.0] * world if rank == 0 else None
    dist.gather_object(peak, peaks, dst=0)
    if rank == 0:
        result = {"epochs": epochs, "first_step_at": first_step_at, "peak_rss_mb": peaks,
                  "world_size": world, "torch_threads": torch.get_num_threads()}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    dist.barrier()  # no rank tears its connections down while another still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
