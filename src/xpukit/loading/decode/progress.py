"""A progress line while a decode step compiles (docs/decode.md "Warm-up").

A cold compile of an 8B model's decode step took 59-120 s on the H200; with ``fast_decode`` taken by
default, that happens inside a user's first ``generate()``. So the compile is announced (info) and,
once it has run for :data:`FIRST_NOTICE_S`, a warning says what is happening, how long it has run and
how to skip it, then again every :data:`EVERY_S`; the end is logged with its duration. A compile
the compile cache makes short stays quiet. The ticker is a timer thread, stopped and joined before
the call returns.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

__all__ = ["EVERY_S", "FIRST_NOTICE_S", "compile_progress"]

logger = logging.getLogger("xpukit.loading.decode")

FIRST_NOTICE_S = 10.0
EVERY_S = 20.0


@contextlib.contextmanager
def compile_progress(
    what: str, *, first_s: float = FIRST_NOTICE_S, every_s: float = EVERY_S
) -> Iterator[None]:
    """Log the start of ``what``, a warning after ``first_s`` and every ``every_s`` after, and its end."""
    start = time.perf_counter()
    stop = threading.Event()

    def tick() -> None:
        wait = first_s
        while not stop.wait(wait):
            logger.warning(
                "xpukit: %s, %.0f s so far (a cold compile of an 8B model took 59-120 s on an H200; the "
                "compile cache makes the next process's short; fast_decode=False skips it)",
                what,
                time.perf_counter() - start,
            )
            wait = every_s

    logger.info("xpukit: %s", what)
    ticker = threading.Thread(target=tick, name="xpukit-compile-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join()
        logger.info("xpukit: %s: done in %.1f s", what, time.perf_counter() - start)
