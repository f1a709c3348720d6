"""Per-step phase timers that do not lie about asynchronous devices.

On CPU every operator is synchronous, so host timestamps at phase boundaries measure
the phases. On CUDA, kernels run after the host has moved on; there the boundaries are
CUDA events on the current stream and the step's phases are read once its last event
has completed.
"""

from __future__ import annotations

import time

import torch


class StepTimer:
    """Mark the end of each phase; `phases_ms()` gives the duration of each in ms.

    Example::

        timer = StepTimer(device)
        timer.start()
        batch = next(it);            timer.mark("data_wait")
        loss = model(batch);         timer.mark("forward")
        phases = timer.phases_ms()   # {"data_wait": 1.2, "forward": 30.5}
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list[tuple[str, object]] = []

    def _stamp(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self._marks = [("start", self._stamp())]

    def mark(self, phase: str) -> None:
        self._marks.append((phase, self._stamp()))

    def phases_ms(self) -> dict[str, float]:
        if self.cuda:
            last = self._marks[-1][1]
            last.synchronize()  # type: ignore[attr-defined]
        out: dict[str, float] = {}
        for (_, before), (name, after) in zip(self._marks, self._marks[1:], strict=False):
            if self.cuda:
                out[name] = before.elapsed_time(after)  # type: ignore[attr-defined]
            else:
                out[name] = (after - before) * 1000.0  # type: ignore[operator]
        return out
