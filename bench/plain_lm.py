"""The baseline of `python -m bench.lm`: a nanoGPT-style plain DDP loop over a token file.

Run it under torchrun, one process per rank:

    python -m torch.distributed.run --standalone --nproc_per_node=2 bench/plain_lm.py \
        --data /tmp/tokens --seq-len 128 --batch-size 16 --steps 60 --epochs 3 --out /tmp/p.json

As nanoGPT's train.py does it: the token file memory-mapped (np.memmap, opened again for every
batch), random windows (`torch.randint` offsets) stacked into a batch, the SAME model class as
the service's model=gpt (train/models/gpt.py), AdamW, the loss's mean reduction, and
`loss.item()` every step; no validation, no checkpoints, no tracking. "Epochs" are spans of
--steps optimiser steps, each timed on rank 0 (tokens of all ranks / the span's wall time);
rank 0 writes the per-span rates, the unix time of the first optimiser step, and every rank's
peak RSS.
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

import numpy as np
import torch
import torch.distributed as dist
from torch.nn import functional as F  # noqa: N812
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # train/ as torchrun runs it

from train.models.gpt import GPT  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, required=True, help="prepare_text's directory")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16, help="GLOBAL windows, split over ranks")
    p.add_argument("--steps", type=int, default=60, help="optimiser steps per timed span")
    p.add_argument("--epochs", type=int, default=3, help="timed spans")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", choices=["gpt", "hf"], default="gpt",
                   help="gpt: train/models/gpt.py; hf: transformers' GPT2LMHeadModel of the "
                        "same sizes, as model=hf builds it (its logits)")
    p.add_argument("--out", type=Path, required=True, help="JSON result (written by rank 0)")
    return p.parse_args()


def get_batch(path: Path, seq_len: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """nanoGPT's: a new memmap every batch (it avoids a memory leak, nanoGPT notes)."""
    data = np.memmap(path, dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - seq_len, (batch,))
    x = torch.stack([torch.from_numpy(data[i:i + seq_len].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + seq_len].astype(np.int64)) for i in ix])
    return x, y


def build_model(args: argparse.Namespace, vocab: int) -> torch.nn.Module:
    if args.model == "gpt":
        return GPT(vocab_size=vocab, seq_len=args.seq_len, n_layer=args.n_layer,
                   n_head=args.n_head, n_embd=args.n_embd)
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=args.seq_len,
                                      n_layer=args.n_layer, n_head=args.n_head,
                                      n_embd=args.n_embd, bos_token_id=None,
                                      eos_token_id=None))


def main() -> None:
    args = parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    vocab = json.loads((args.data / "meta.json").read_text())["vocab_size"]
    torch.manual_seed(args.seed)
    model = DDP(build_model(args, vocab))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    torch.manual_seed(args.seed + rank)  # each rank its own windows
    per_rank = args.batch_size // world
    train = args.data / "train.bin"
    first_step_at: float | None = None
    epochs: list[dict[str, float]] = []
    for _ in range(args.epochs):
        started = time.perf_counter()
        for _ in range(args.steps):
            x, y = get_batch(train, args.seq_len, per_rank)
            logits = model(x) if args.model == "gpt" else model(input_ids=x).logits
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss_value = loss.item()  # nanoGPT reads it at its log interval; tutorials every step
            if first_step_at is None:
                first_step_at = time.time()
        seconds = time.perf_counter() - started
        tokens = args.steps * per_rank * world * args.seq_len
        epochs.append({"tokens": tokens, "seconds": seconds, "tokens_per_sec": tokens / seconds,
                       "samples_per_sec": tokens / seconds / args.seq_len, "loss": loss_value})
        if rank == 0:
            print(f"span {len(epochs)}/{args.epochs}  {tokens / seconds:.0f} tokens/s  "
                  f"loss={loss_value:.4g}", flush=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
    peaks: list[float] | None = [0.0] * world if rank == 0 else None
    dist.gather_object(peak, peaks, dst=0)
    if rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"epochs": epochs, "first_step_at": first_step_at,
                                        "peak_rss_mb": peaks, "world_size": world,
                                        "torch_threads": torch.get_num_threads()}, indent=2))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
