"""Repeated work in one process: 20 ``load_for_xpu`` → forward → ``del`` cycles leave nothing behind.

Every loaded model must be gone after its ``del`` (a weak reference to it is dead after
``gc.collect()``), and the process's RSS after the last cycle may exceed the RSS after the warm-up
cycles by less than 5 %. ``bench/bench_repeat_load.py`` measures the same on any device
(docs/benchmarks.md "Repeated loads").
"""

from __future__ import annotations

import gc
import os
import weakref
from pathlib import Path

import pytest

CYCLES = 20
WARMUP = 2
MAX_GROWTH = 0.05


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
def test_repeated_loads_give_their_memory_back(tiny_model: Path) -> None:
    import torch

    from xpukit import load_for_xpu

    tokens = torch.arange(16).unsqueeze(0)
    dead: list[bool] = []
    baseline = 0
    try:
        for cycle in range(WARMUP + CYCLES):
            model = load_for_xpu(tiny_model, device="cpu")
            with torch.no_grad():
                logits = model(input_ids=tokens).logits
            assert logits.shape[:2] == (1, 16) and torch.isfinite(logits).all()
            ref = weakref.ref(model)
            del model, logits
            gc.collect()
            dead.append(ref() is None)
            if cycle == WARMUP - 1:
                baseline = _rss()
                gc.freeze()  # what lived before the cycles stays; each collect then scans only new objects
    finally:
        gc.unfreeze()
    assert all(dead), f"models still alive after del in cycles {[i for i, d in enumerate(dead) if not d]}"
    grown = (_rss() - baseline) / baseline
    assert grown < MAX_GROWTH, f"RSS grew {100 * grown:.2f} % over {CYCLES} cycles"
