"""Step ends on the device's timeline (``StepClock``), for benchmarks that time ``Trainer`` steps."""

from __future__ import annotations

import time
from typing import Any

from _harness import synchronize


class StepClock:
    """Step ends on the device's timeline, without waiting for the device at each step.

    A host synchronization at every step end would keep the host from running ahead of the device
    (launching the next step while the optimizer's kernels run), which a user's run without the
    benchmark does: on CUDA and XPU each :meth:`mark` records a timing event on the device's stream,
    and :meth:`times` waits once and returns every mark in ``time.perf_counter`` seconds (the start's
    host time plus the device's elapsed time to the mark). On the CPU (and MPS) a mark is the host's
    time after a synchronization.
    """

    def __init__(self, device: str) -> None:
        import torch

        kind = device.split(":")[0]
        self._events = getattr(torch, kind).Event if kind in {"cuda", "xpu"} else None
        self._device = device
        self._marks: list[Any] = []
        synchronize(device)
        self.started = time.perf_counter()
        self._start = self._event()

    def _event(self) -> Any:
        if self._events is None:
            synchronize(self._device)
            return time.perf_counter()
        event = self._events(enable_timing=True)
        event.record()
        return event

    def mark(self) -> None:
        self._marks.append(self._event())

    def __len__(self) -> int:
        return len(self._marks)

    def times(self) -> list[float]:
        if self._events is None:
            return list(self._marks)
        synchronize(self._device)
        return [self.started + self._start.elapsed_time(e) / 1000 for e in self._marks]
