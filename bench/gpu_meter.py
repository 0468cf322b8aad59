"""The one measurement every arm of `python -m bench.gpu` runs under, service and peers alike.

An arm's process installs a `Meter` before its training starts. The meter sees the training
only through torch's global hooks, so it measures a plain loop, a Lightning Trainer and
`python -m train` in the same way, without changing any of them:

- every optimiser step ends at `torch.optim.Optimizer`'s global post-step hook, where the
  meter records a CUDA event (on the CPU: the clock; its work is synchronous). Nothing is read
  back until the last measured step: the meter adds no host sync;
- the first forward of a module on the arm's device (a global forward pre-hook, removed at once)
  starts the clock for the warm-up: compiling, autotuning and the allocator's first steps;
- from the end of the warm-up to the end of the timed windows, `torch.cuda.set_sync_debug_mode`
  warns at every synchronising CUDA call; the meter counts them per step, with where they came
  from. A step's syncs are those between the end of the step before it and its own end, so a
  loop that reads its loss after a logging step's optimiser step has that sync in the step
  after a logging step (`after_logging`), the service and its peers alike;
- the loss of chosen steps (`Plan.noted`), as the loop hands it over (`note_loss`), kept as a
  device tensor until the end.

Steps 1..warmup warm up; then `windows` windows of `window` steps each are timed; the result
is written after step `last` (one step beyond the windows, so the loss noted there is that of
the most trained model), as JSON to `Plan.result`.

    python -m bench.gpu_meter PLAN.json -- [python -m train's arguments]

runs the service under a meter (bench/gpu.py writes the plan); a peer installs one itself
(`Meter.install(plan)`).
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

SYNC_WARNING = "called a synchronizing CUDA operation"
"""The text of torch's warning under set_sync_debug_mode("warn") (c10/cuda/CUDAFunctions)."""
OWN_FILES = ("bench/gpu_meter.py", "warnings.py")


@dataclass
class Plan:
    """What an arm measures, handed from bench/gpu.py to the arm's process as JSON."""

    arm: str
    result: str
    """Where the meter writes its JSON."""
    device: str
    """cuda or cpu."""
    warmup: int
    """Steps before the first timed window (compiling happens in the first)."""
    window: int
    """Steps per timed window."""
    windows: int
    items_per_step: int
    """Samples (images) or tokens of one optimiser step: the rates' unit."""
    log_every: int
    """The loop's logging interval (it reads its loss back every this many steps)."""
    settings: dict[str, Any] = field(default_factory=dict)
    """The workload's sizes, optimiser, dtype and compile setting (bench/gpu_arms.py)."""
    started_at: float = field(default_factory=time.time)
    """The arm's command's start (unix time): time to the first step counts from here."""

    @property
    def timed(self) -> tuple[int, int]:
        """The first and last step of the timed windows."""
        return self.warmup + 1, self.warmup + self.window * self.windows

    @property
    def last(self) -> int:
        return self.timed[1] + 1

    @property
    def noted(self) -> tuple[int, ...]:
        """Steps whose loss is kept: the first, the end of the warm-up, the last."""
        return (1, self.warmup, self.last)

    @staticmethod
    def read(path: str | Path) -> Plan:
        return Plan(**json.loads(Path(path).read_text()))

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))


_current: Meter | None = None


def current() -> Meter | None:
    """The meter of this process, if any (the service's noted loss asks for it)."""
    return _current


class Meter:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.cuda = plan.device == "cuda"
        self.step = 0
        self.marks: list[Any] = []
        """One per finished step: a CUDA event, or the clock on the CPU."""
        self.first_forward: Any = None
        self.first_step_at: float | None = None
        self.losses: dict[int, torch.Tensor] = {}
        self.syncs: Counter[int] = Counter()
        self.sync_sites: Counter[str] = Counter()
        self.done = False
        self._counting = False
        self._shown: Any = None
        """warnings.showwarning before the meter's (restored by `remove`)."""
        self._step_hook = register_optimizer_step_post_hook(self._after_step)
        self._forward_hook = nn.modules.module.register_module_forward_pre_hook(self._forward)

    @staticmethod
    def install(plan: Plan) -> Meter:
        global _current
        _current = Meter(plan)
        # Every sync warning reaches `counted` (not only a location's first), and only they.
        warnings.filterwarnings("always", message=SYNC_WARNING)
        shown = warnings.showwarning

        def counted(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
            if SYNC_WARNING in str(message) and _current is not None:
                _current._sync()
            else:
                shown(message, category, *args, **kwargs)

        warnings.showwarning = counted
        _current._shown = shown
        atexit.register(_current._left_early)
        return _current

    def remove(self) -> None:
        """Take the hooks away again (an arm's process keeps them to its end; a test may not)."""
        global _current
        for hook in (self._step_hook, self._forward_hook):
            hook.remove()
        atexit.unregister(self._left_early)
        if self._shown is not None:
            warnings.showwarning = self._shown
        if _current is self:
            _current = None

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _forward(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and first.device.type == self.plan.device:
            self.first_forward = self._mark()
            self._forward_hook.remove()

    def note_loss(self, loss: torch.Tensor) -> None:
        """The loss of the step under way (its mean over the step's items), kept if noted."""
        if self.step + 1 in self.plan.noted and not self.done:
            self.losses[self.step + 1] = loss.detach().float().clone()

    def wants_loss(self) -> bool:
        return not self.done and self.step + 1 in self.plan.noted

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.done:
            return
        self.step += 1
        self.marks.append(self._mark())
        if self.step == 1:
            self.first_step_at = time.time()
        first, last = self.plan.timed
        if self.step in (first - 1, last):
            self._counting = self.step < last
            if self.cuda:
                torch.cuda.set_sync_debug_mode("warn" if self._counting else "default")
        if self.step == self.plan.last:
            self.finish()

    def _sync(self) -> None:
        if not self._counting:
            return
        self.syncs[self.step + 1] += 1
        frames = [f for f in traceback.extract_stack()[:-2]
                  if not f.filename.endswith(OWN_FILES)]
        if frames:
            where = frames[-1]
            self.sync_sites[f"{_short(where.filename)}:{where.lineno} {where.name}"] += 1

    def _elapsed(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start

    def figures(self) -> dict[str, Any]:
        """What the arm measured; the loop's device is synchronised once, here."""
        if self.cuda:
            torch.cuda.synchronize()
        plan = self.plan
        first, _ = plan.timed
        windows = [self._elapsed(self.marks[first - 2 + i * plan.window],
                                 self.marks[first - 2 + (i + 1) * plan.window])
                   for i in range(plan.windows)]
        step_s = statistics.median(windows) / plan.window
        warmup_s = self._elapsed(self.first_forward, self.marks[plan.warmup - 1]) \
            if self.first_forward is not None else None
        after_logging = sum(n for s, n in self.syncs.items() if (s - 1) % plan.log_every == 0)
        out: dict[str, Any] = {
            "arm": plan.arm, "device": plan.device, "steps": self.step,
            "items_per_step": plan.items_per_step,
            "rate": plan.items_per_step / step_s,
            "window_rates": [plan.items_per_step * plan.window / w for w in windows],
            "step_s": step_s,
            "first_step_s": None if self.first_step_at is None
            else self.first_step_at - plan.started_at,
            # The warm-up's steps beyond what they would cost at the steady rate: compiling
            # (in an eager arm: cuDNN's and the allocator's first steps).
            "compile_s": None if warmup_s is None else max(0.0, warmup_s - plan.warmup * step_s),
            "host_syncs": sum(self.syncs.values()) if self.cuda else None,
            "host_syncs_outside_logging": (sum(self.syncs.values()) - after_logging)
            if self.cuda else None,
            "sync_sites": dict(self.sync_sites.most_common(8)),
            "losses": {str(s): float(v) for s, v in sorted(self.losses.items())},
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        }
        if self.cuda:
            out["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
            out["peak_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
        else:
            out["peak_allocated_gb"] = out["peak_reserved_gb"] = None
        return out

    def finish(self) -> None:
        """After step `last`: the figures to Plan.result (the arm may go on: the service
        validates and saves after its last step; nothing after it is measured)."""
        self.done = True
        Path(self.plan.result).write_text(json.dumps(self.figures(), indent=1))

    def _left_early(self) -> None:
        if not self.done:
            print(f"[gpu_meter] {self.plan.arm}: the loop ended after {self.step} optimiser "
                  f"steps, before step {self.plan.last}; nothing measured", file=sys.stderr)


def _short(filename: str) -> str:
    for anchor in ("/train/", "/bench/", "/site-packages/", "/lib/python"):
        if anchor in filename:
            return filename[filename.index(anchor) + 1:]
    return os.path.basename(filename)


class NotedCrossEntropy(nn.CrossEntropyLoss):
    """The service's loss under the bench (`trainer.loss._target_`): torch's cross-entropy,
    whose mean over the step's items it hands to the meter at the noted steps only (no kernel
    on the others). The service asks for reduction="sum", its peers use the mean."""

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # noqa: A002
        loss = super().forward(input, target)
        meter = current()
        if meter is not None and meter.wants_loss():
            items = (target != self.ignore_index).sum() if self.reduction == "sum" else 1
            meter.note_loss(loss / items)
        return loss


def main(argv: list[str]) -> None:
    """`python -m bench.gpu_meter PLAN.json -- ARGS`: `python -m train ARGS` under a meter."""
    if len(argv) < 2 or argv[1] != "--":
        raise SystemExit("usage: python -m bench.gpu_meter PLAN.json -- [python -m train args]")
    # This file runs as __main__; the service's loss (NotedCrossEntropy, found by _target_)
    # imports bench.gpu_meter, so the meter must live in that module, not in this one.
    from bench import gpu_meter
    from train.__main__ import cli

    gpu_meter.Meter.install(gpu_meter.Plan.read(argv[0]))

    sys.argv = ["train", *argv[2:]]
    cli()


if __name__ == "__main__":
    main(sys.argv[1:])
