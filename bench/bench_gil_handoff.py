"""What a compiling thread costs the main thread's decoding, by Python's switch interval
(docs/decode.md "Tiered decoding").

While the compiled decode step is built on a thread, that thread is Python work on the same
interpreter: every torch operation and graph replay of the main thread gives the GIL up and waits to
get it back, up to one switch interval. This bench runs, beside a bytecode-bound thread (a stand-in
for dynamo and inductor), two kinds of main-thread work for each ``--intervals`` value:

- ``token``: a graph-tier token, stood in for by three small torch operations and a wait of
  ``--device-ms`` without the GIL (the replay and the device's time);
- ``forward``: an uncaptured step, a 36-layer eager forward of small linear/GELU/norm layers.

One JSON line per (interval, work): the work's milliseconds alone and beside the thread, and the
thread's speed beside it as a share of its speed alone. CPU only; a few seconds per line.

Usage::

    python bench/bench_gil_handoff.py
    python bench/bench_gil_handoff.py --intervals 0.005 0.0001 --seconds 3
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _harness import emit, today, versions_with_python


def _busy(stop: threading.Event, done: list[int]) -> None:
    """Bytecode-bound work that never gives the GIL up on its own (counted in units)."""
    total = 0
    while not stop.is_set():
        for i in range(1000):
            total += i * i % 7
        done[0] += 1


def _thread_rate(seconds: float) -> float:
    stop, done = threading.Event(), [0]
    thread = threading.Thread(target=_busy, args=(stop, done))
    thread.start()
    time.sleep(seconds)
    stop.set()
    thread.join()
    return done[0] / seconds


def _works(device_ms: float) -> dict[str, Callable[[], None]]:
    import torch

    torch.set_num_threads(1)
    block = lambda: torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.LayerNorm(64))  # noqa: E731
    layers = torch.nn.Sequential(*[block() for _ in range(36)])
    x, a, b = torch.randn(1, 64), torch.zeros(4), torch.ones(4)

    def token() -> None:
        a.copy_(b)
        a.add_(1)
        time.sleep(device_ms / 1000)  # the replay and the device's time: the GIL is free meanwhile
        a.mul_(1)

    def forward() -> None:
        with torch.no_grad():
            layers(x)

    return {"token": token, "forward": forward}


def _alone_ms(work: Callable[[], None], seconds: float) -> float:
    for _ in range(3):
        work()
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        work()
        n += 1
    return (time.perf_counter() - start) / n * 1000


def _beside_ms(work: Callable[[], None], seconds: float) -> tuple[float, float]:
    """The work's ms beside the busy thread, and the thread's units per second meanwhile."""
    stop, done = threading.Event(), [0]
    thread = threading.Thread(target=_busy, args=(stop, done))
    thread.start()
    time.sleep(0.05)
    start, before, n = time.perf_counter(), done[0], 0
    while time.perf_counter() - start < seconds:
        work()
        n += 1
    elapsed = time.perf_counter() - start
    units = (done[0] - before) / elapsed
    stop.set()
    thread.join()
    return elapsed / n * 1000, units


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--intervals", type=float, nargs="+", default=[5e-3, 1e-3, 5e-4, 2e-4, 1e-4])
    parser.add_argument("--device-ms", type=float, default=4.0, help="a token's GIL-free wait")
    parser.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    args = parser.parse_args()
    found = sys.getswitchinterval()
    works = _works(args.device_ms)
    alone = {name: _alone_ms(work, args.seconds / 2) for name, work in works.items()}
    rate = _thread_rate(args.seconds / 2)
    try:
        for interval in args.intervals:
            sys.setswitchinterval(interval)
            for name, work in works.items():
                ms, units = _beside_ms(work, args.seconds)
                emit(
                    {
                        "bench": "gil_handoff",
                        "date": today(),
                        "versions": versions_with_python(("torch",)),
                        "switch_interval_ms": interval * 1000,
                        "work": name,
                        "alone_ms": round(alone[name], 2),
                        "beside_ms": round(ms, 2),
                        "thread_speed_pct": round(units / rate * 100),
                    }
                )
    finally:
        sys.setswitchinterval(found)


if __name__ == "__main__":
    main()
