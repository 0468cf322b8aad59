"""FSDP2 against DDP at world 2 on the CPU (gloo), with the service's own pieces: model=gpt's GPT,
train/engine/fsdp.py's sharding and its consolidated state dict, and AdamW.

For a GPT of >= 50 M parameters, each strategy in turn (2 ranks spawned here; FSDP built on
the meta device and initialised per shard, as distributed.fsdp.init_on=meta does):
- bytes per rank of parameters + gradients + optimiser state after a step (this rank's part:
  a DTensor's local shard), and the rank's peak RSS;
- steady tokens/s over --steps optimiser steps after a warm-up step;
- checkpoint time: the service's checkpoint (`checkpoint.whole_state`, i.e. the consolidated
  state dict under FSDP, then torch.save by rank 0), `dcp.save` (every rank writes its shard),
  and `dcp.async_save`'s time blocking training (staging) and until it is on disk.

    python -m bench.fsdp                     # ~3 minutes on a 2-core CPU
    python -m bench.fsdp --layers 4 --width 512 --steps 2   # smaller, quicker
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _cfg(strategy: str) -> Any:
    """What train/engine/fsdp.py and checkpoint.whole_state read of the config."""
    return SimpleNamespace(trainer=SimpleNamespace(precision="fp32"),
                           distributed=SimpleNamespace(strategy=strategy, fsdp=SimpleNamespace(
                               shard_modules=[], reshard_after_forward=True, cpu_offload=False,
                               init_on="cpu")))


def _local_bytes(tensors: Any) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.numel() * local.element_size()
    return total


def _state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())
    return {"params": _local_bytes(params),
            "grads": _local_bytes(p.grad for p in params if p.grad is not None),
            "optimiser": _local_bytes(v for s in optimizer.state.values() for v in s.values())}


def _rank(rank: int, strategy: str, args: argparse.Namespace, folder: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from torch.nn.parallel import DistributedDataParallel as DDP

    from train.engine import fsdp, fsdp_init
    from train.engine.state import TrainState
    from train.models.gpt import GPT

    torch.manual_seed(0)
    # FSDP as the service builds a model larger than host memory (init_on=meta): no whole
    # copy (the default, auto, builds one that fits whole first, as DDP does).
    with torch.device("meta" if strategy == "fsdp" else "cpu"):
        module = GPT(256, seq_len=args.seq, n_layer=args.layers, n_head=8, n_embd=args.width)
    n_params = sum(p.numel() for p in module.parameters())
    if strategy == "fsdp":
        model = fsdp.shard(module, _cfg(strategy), torch.device("cpu"))
        fsdp_init.materialise(module, torch.device("cpu"))
    else:
        model = DDP(module)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    times = []
    for step in range(args.steps + 1):
        idx = torch.randint(0, 256, (args.batch, args.seq), generator=g)
        started = time.perf_counter()
        logits = model(idx)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten())
        loss.backward()
        optimizer.step()
        dist.barrier()
        if step:  # the first step builds the optimiser's state: a warm-up
            times.append(time.perf_counter() - started)
        if step < args.steps:
            optimizer.zero_grad(set_to_none=True)
    held = _state_bytes(module, optimizer)
    training_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before saving
    state = TrainState(model, module, optimizer, None, None)  # type: ignore[arg-type]
    timing = _checkpoints(state, rank, folder)
    result = {"strategy": strategy, "rank": rank, "params": n_params, "bytes": held,
              "state_mb": sum(held.values()) / 2**20,
              "peak_rss_training_mb": training_rss,
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "tokens_per_s": WORLD * args.batch * args.seq * len(times) / sum(times),
              **timing}
    Path(out, f"{strategy}-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _checkpoints(state: Any, rank: int, folder: str) -> dict[str, float]:
    """Seconds: the service's checkpoint (consolidated, rank 0 writes), dcp.save (sharded),
    dcp.async_save (blocked: until it returns; total: until its future is done)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from train.engine import checkpoint

    dist.barrier()
    started = time.perf_counter()
    weights, optimiser = checkpoint.whole_state(state)
    if rank == 0:
        torch.save({"model": weights, "optimizer": optimiser}, Path(folder, "whole.pt"))
    dist.barrier()
    whole = time.perf_counter() - started
    model_sd, optim_sd = get_state_dict(state.module, state.optimizer)
    started = time.perf_counter()
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=Path(folder, "dcp"))
    dist.barrier()
    sharded = time.perf_counter() - started
    started = time.perf_counter()
    future = dcp.async_save({"model": model_sd, "optim": optim_sd},
                            checkpoint_id=Path(folder, "dcp-async"))
    blocked = time.perf_counter() - started
    future.result()
    dist.barrier()
    return {"save_whole_s": whole, "save_dcp_s": sharded, "async_blocked_s": blocked,
            "async_total_s": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--port", type=int, default=29611)
    parser.add_argument("--out", default="docs/bench-fsdp.json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for strategy in ("ddp", "fsdp"):
            with tempfile.TemporaryDirectory() as folder:
                mp.spawn(_rank, args=(strategy, args, folder, out), nprocs=WORLD)
            rows += [json.loads(Path(out, f"{strategy}-{r}.json").read_text())
                     for r in range(WORLD)]
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    by = {s: [r for r in rows if r["strategy"] == s] for s in ("ddp", "fsdp")}
    print(f"GPT {rows[0]['params'] / 1e6:.1f} M parameters, world {WORLD}, CPU gloo")
    for s, rs in by.items():
        print(f"{s:5s} state/rank {max(r['state_mb'] for r in rs):7.0f} MB  peak RSS/rank "
              f"{max(r['peak_rss_training_mb'] for r in rs):7.0f} MB training, "
              f"{max(r['peak_rss_mb'] for r in rs):7.0f} MB with checkpoints  "
              f"{rs[0]['tokens_per_s']:7.0f} tok/s  "
              f"checkpoint {rs[0]['save_whole_s']:.2f} s (whole), dcp {rs[0]['save_dcp_s']:.2f} s,"
              f" async blocked {rs[0]['async_blocked_s']:.2f} s of {rs[0]['async_total_s']:.2f} s")
    ratio = max(r["state_mb"] for r in by["fsdp"]) / max(r["state_mb"] for r in by["ddp"])
    print(f"FSDP/DDP state per rank: {ratio:.2f}x; throughput FSDP/DDP "
          f"{by['fsdp'][0]['tokens_per_s'] / by['ddp'][0]['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
