"""Where a GPU rank's time goes, on the device's own clock: a CUDA event at each change of
phase (train/distributed/phase.py `enter`), read back only where the rank waits for the device
anyway (a logging step).

On a GPU the host runs ahead of the device: it queues forward's and backward's kernels and
moves on, so its clock puts the device's work wherever it next waits (the optimiser step, a
logging step). An event recorded on the training stream as a phase begins completes when the
device gets there; the time between two such events is how long the device spent in the phase
- working, or idle because the host was not there yet (waiting for data shows as data). A few
microseconds per phase change (four a step), no sync: `take` waits only for the last event,
just before the logging step reads its loss back, which waits for the same work.
"""

from __future__ import annotations

import torch


class DeviceClock:
    def __init__(self, device: torch.device, phase: str) -> None:
        self.device = device
        self._marks: list[tuple[str, torch.cuda.Event]] = []
        self.mark(phase)

    def mark(self, phase: str) -> None:
        """`phase` begins: an event on the current stream of the rank's device."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        self._marks.append((phase, event))

    def take(self) -> dict[str, float]:
        """Device seconds per phase since the last take, up to the last mark (whose phase goes
        on into the next interval)."""
        marks = self._marks
        if len(marks) < 2:
            return {}
        marks[-1][1].synchronize()
        spent: dict[str, float] = {}
        for (phase, start), (_, end) in zip(marks, marks[1:], strict=False):
            spent[phase] = spent.get(phase, 0.0) + start.elapsed_time(end) / 1e3
        self._marks = [marks[-1]]
        return spent

    def forget(self) -> None:
        """Drop what was marked before the last mark, without waiting for the device."""
        self._marks = self._marks[-1:]
