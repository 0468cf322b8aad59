"""trainer.profile: torch.profiler over a window of training steps, on every rank.

torch.profiler's own schedule (wait, warm-up, active optimiser steps from this start's first)
decides what is recorded: CPU activities, and CUDA's on a GPU, with shapes and memory. When
the window closes each rank writes, into <output dir>/profile/:

  rank-<N>.json.gz  its trace, for Perfetto (ui.perfetto.dev) or chrome://tracing
  rank-<N>.txt      its operators by self time (the device's on a GPU, else the CPU's)

and rank 0 logs the folder as the run's `profile/` artifacts at the end (train/engine/
ending.py). The recorded steps are the run's `profile.steps` tag. Profiling slows the steps it
watches (warm-up included), so the time and samples of those steps are left out of the epoch's
rates (train/samples_per_sec and the like).

trainer.memory_snapshot (GPU only): the CUDA allocator records its history from the rank's
start, and a rank that runs out of GPU memory writes its snapshot to <output dir>/memory/
rank-<N>.pickle, for pytorch.org/memory_viz, as torchtitan does; the failure block names the
folder and rank 0 logs what is there with the failure.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from train.config.groups import ProfileConfig
from train.distributed.rankfiles import MEMORY_DIR

log = logging.getLogger("train")
FOLDER = "profile"
MEMORY_ENTRIES = 100_000
"""Allocator events kept (the newest), as torchtitan's default."""


def record_memory_history(wanted: bool, device: torch.device) -> None:
    """trainer.memory_snapshot: the allocator keeps its history from here on."""
    if wanted and device.type == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=MEMORY_ENTRIES)


def keep_memory_snapshot(error: BaseException, out: Path, rank: int) -> Path | None:
    """After `error`: where it is CUDA's out-of-memory, this rank's snapshot; None otherwise."""
    if not isinstance(error, torch.cuda.OutOfMemoryError):
        return None
    path = out / MEMORY_DIR / f"rank-{rank}.pickle"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._dump_snapshot(str(path))
    log.error("rank %d ran out of GPU memory: its allocator's history is in %s (open it at "
              "pytorch.org/memory_viz)", rank, path)
    return path


class StepProfiler:
    """One rank's profiler for one start of the job: `start` before its first step, `step`
    after each optimiser step, `stop` when training ends (or fails)."""

    def __init__(self, cfg: ProfileConfig, out: Path, rank: int, device: torch.device,
                 tag: Callable[[Mapping[str, str]], None]) -> None:
        self.cfg, self.rank, self.tag = cfg, rank, tag
        self.folder = out / FOLDER
        self.on_gpu = device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_gpu else [])
        self.prof = profile(activities=activities, record_shapes=cfg.record_shapes,
                            profile_memory=cfg.profile_memory, with_stack=cfg.with_stack,
                            schedule=schedule(wait=cfg.wait, warmup=cfg.warmup,
                                              active=cfg.active, repeat=1),
                            on_trace_ready=self._write)
        self.steps_done = 0
        self.first_step = 0
        self.step_began = 0.0
        self.excluded_s, self.excluded_steps = 0.0, 0
        self.written = False

    @property
    def watching(self) -> bool:
        """Whether the profiler is on (warm-up or recording) for the step under way."""
        begins = self.cfg.wait
        return begins <= self.steps_done < begins + self.cfg.warmup + self.cfg.active

    def start(self, step: int) -> None:
        """Before the first optimiser step of this start (the job's step `step` so far)."""
        self.first_step = step
        self.folder.mkdir(parents=True, exist_ok=True)
        self.prof.start()
        self.epoch_begins()

    def epoch_begins(self) -> None:
        """The next step's time counts from now (not from the last epoch's validation)."""
        self.step_began = time.perf_counter()

    def step(self) -> None:
        """After an optimiser step. The step that closes the window also writes the trace:
        that time is left out of the rates too."""
        watched = self.watching
        self.steps_done += 1
        if self.steps_done <= self.cfg.wait + self.cfg.warmup + self.cfg.active:
            self.prof.step()
        now = time.perf_counter()
        if watched:
            self.excluded_s += now - self.step_began
            self.excluded_steps += 1
        self.step_began = now

    def take_excluded(self) -> tuple[int, float]:
        """The profiled steps and their seconds since the last call (an epoch's)."""
        taken = self.excluded_steps, self.excluded_s
        self.excluded_steps, self.excluded_s = 0, 0.0
        return taken

    def stop(self) -> None:
        """Training ended: a window still open is written with the steps it recorded."""
        self.prof.stop()
        if not self.written and self.steps_done <= self.cfg.wait + self.cfg.warmup:
            log.warning("trainer.profile: training ended after %d steps of this start, before "
                        "the profiler's window (wait=%d, warmup=%d): nothing recorded",
                        self.steps_done, self.cfg.wait, self.cfg.warmup)

    def _write(self, prof: profile) -> None:
        if self.written:  # stop() after the window closed calls this again on some versions
            return
        first = self.first_step + self.cfg.wait + self.cfg.warmup + 1
        last = self.first_step + min(self.steps_done, self.cfg.wait + self.cfg.warmup
                                     + self.cfg.active)
        if last < first:  # stopped in the warm-up: nothing recorded (stop() says so)
            return
        steps = f"{first}-{last}" if last > first else str(first)
        trace = self.folder / f"rank-{self.rank}.json.gz"
        prof.export_chrome_trace(str(trace))
        by = "self_device_time_total" if self.on_gpu else "self_cpu_time_total"
        table = prof.key_averages(group_by_input_shape=self.cfg.record_shapes).table(
            sort_by=by, row_limit=self.cfg.top)
        (self.folder / f"rank-{self.rank}.txt").write_text(
            f"rank {self.rank}, optimiser step(s) {steps}, by {by}\n{table}\n")
        self.written = True
        self.tag({"profile.steps": steps})
        log.info("profiled step(s) %s: %s, and its summary beside it", steps, trace)
