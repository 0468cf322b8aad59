"""Where this rank is: the phase it is in and the step, and the seconds spent in each phase.

The loop marks the phase it enters (`enter("data")`, ...) and the step: two attribute writes
and a clock read, no file and no host sync, cheap enough for every step. The watchdog
(watch.py) writes the beat to the rank's heartbeat file; the loop's logging step takes the
seconds spent (`take_spent`) for the step-time breakdown (report/breakdown.py). No torch at
import: the local launcher imports it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Beat:
    """This rank's place: the step and the phase it is in, and since when (time.time())."""

    step: int = 0
    phase: str = "start"
    since: float = field(default_factory=time.time)
    data_share: float | None = None
    """The share of the last logging interval this rank waited for data (None before one)."""


beat = Beat()
"""This rank's (the watchdog reads it from its thread)."""
_spent: dict[str, float] = {}
_clock: Any = None
"""A GPU rank's DeviceClock (`use_device_clock`): `take_spent` then reads the device's time."""


def enter(phase: str, step: int | None = None) -> None:
    """The rank enters `phase` (data, forward, backward, optimizer, collective, validation,
    checkpoint, ...), and the time spent in the one it leaves is added up (`take_spent`):
    cheap enough for every step (well under a microsecond)."""
    current = beat
    if phase != current.phase:
        now = time.time()
        _spent[current.phase] = _spent.get(current.phase, 0.0) + now - current.since
        current.phase, current.since = phase, now
        if _clock is not None:
            _clock.mark(phase)
    if step is not None:
        current.step = step


def note_data_share(share: float) -> None:
    """At a logging step: the share of the interval this rank waited for data, which its next
    heartbeat carries (`train status`)."""
    beat.data_share = share


def reading(batches: Iterable[Any]) -> Iterator[Any]:
    """The batches, the rank in phase "data" while the next is read, "forward" after."""
    iterator = iter(batches)
    while True:
        enter("data")
        try:
            batch = next(iterator)
        except StopIteration:
            return
        enter("forward")
        yield batch


def take_spent() -> dict[str, float]:
    """Seconds spent in each phase since the last call (the breakdown's, the straggler
    check's): the host's clock, or on a GPU rank the device's (device_clock.py), which waits
    for the device's queue - only where the rank is about to wait for it anyway."""
    spent = dict(_spent)
    _spent.clear()
    return _clock.take() if _clock is not None else spent


def forget_spent() -> None:
    """Start the next take_spent from here, without waiting for the device."""
    _spent.clear()
    if _clock is not None:
        _clock.forget()


def use_device_clock(device: Any) -> None:
    """Time this rank's phases on its device where it is a GPU (CUDA events), else the host."""
    global _clock
    _clock = None
    if getattr(device, "type", None) == "cuda":
        from train.distributed.device_clock import DeviceClock  # torch: not at import

        _clock = DeviceClock(device, beat.phase)


def use_host_clock() -> None:
    """Time the phases on the host again (the rank's watch stopped)."""
    global _clock
    _clock = None
