"""`python -m bench.recompute`: what model.activation_checkpointing saves and costs.

model=gpt's `GPT` as bench/fsdp.py builds it (8 layers, width 768, vocabulary 256: 56.9 M
parameters), one process, a batch of --batch sequences of --seq tokens. For each mode (none,
every second block, every block; then none and every block under torch.compile, as a job
with trainer.compile=true compiles them: the whole model, or each block where blocks
recompute; train/engine/recompute.py applies them as a job does):

  saved_mb   the bytes autograd keeps from forward for backward (every tensor packed by
             torch.autograd.graph.saved_tensors_hooks, counted once per storage): the
             activation memory checkpointing is there to cut, exact on any device
  step_s     forward + backward, best of --repeats after one warm-up (recomputing costs time)
  same_grads whether the gradients equal those without checkpointing (max abs difference)

    python -m bench.recompute --results .bench/recompute.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from bench.run import machine_info
from train.engine import recompute
from train.models.gpt import GPT

REPO = Path(__file__).resolve().parent.parent


def saved_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """Bytes autograd saves for backward in one forward (each storage once)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens)
    (logits[0] if isinstance(logits, tuple) else logits).float().mean().backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def step_seconds(model: torch.nn.Module, tokens: torch.Tensor, repeats: int) -> float:
    best = float("inf")
    for i in range(repeats + 1):
        started = time.perf_counter()
        out = model(tokens)
        (out[0] if isinstance(out, tuple) else out).float().mean().backward()
        model.zero_grad(set_to_none=True)
        if i:  # the first is the warm-up
            best = min(best, time.perf_counter() - started)
    return best


def gradients(model: torch.nn.Module, tokens: torch.Tensor) -> list[torch.Tensor]:
    out = model(tokens)
    (out[0] if isinstance(out, tuple) else out).float().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--results", type=Path, default=REPO / ".bench" / "recompute.json")
    args = p.parse_args()
    torch.manual_seed(0)
    plain = GPT(256, seq_len=args.seq, n_layer=args.layers, n_head=8, n_embd=args.width)
    tokens = torch.randint(0, 256, (args.batch, args.seq))
    reference = gradients(plain, tokens)
    rows = []
    for mode in ("none", "2", "blocks", "none+compile", "blocks+compile"):
        model = copy.deepcopy(plain)
        recompute.apply(model, mode.removesuffix("+compile"), [])
        if mode == "none+compile":
            model = torch.compile(model)
        elif mode == "blocks+compile":
            recompute.compile_blocks(model)
        grads = gradients(model, tokens)
        rows.append({"mode": mode, "what": recompute.applied(model) or "nothing",
                     "compiled": mode.endswith("+compile"),
                     "saved_mb": saved_bytes(model, tokens) / 2**20,
                     "step_s": step_seconds(model, tokens, args.repeats),
                     "max_grad_diff": max(float((a - b).abs().max())
                                          for a, b in zip(grads, reference, strict=True))})
        print(json.dumps(rows[-1]), flush=True)
    params = sum(t.numel() for t in plain.parameters())
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(
        {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": machine_info("cpu"),
         "load_avg": os.getloadavg(), "params": params, "args": vars(args) | {
             "results": str(args.results)}, "rows": rows}, indent=2))
    print(f"results: {args.results}")


if __name__ == "__main__":
    main()
