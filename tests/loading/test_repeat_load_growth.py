"""Repeated ``load_for_xpu`` cycles keep nothing alive: counted objects and live native memory, not RSS.

RSS after ``del`` moves with the allocator: casting a float32 checkpoint to bfloat16 (what
``load_for_xpu`` picks on most CPUs) leaves glibc's arenas holding a different amount of freed,
fragmented memory every cycle, which ``malloc_trim`` cannot give back, and transformers alone does
the same (``bench/bench_repeat_load.py --loader plain-map --dtype bfloat16``). What a leak would
change, and allocator noise does not: a weak reference to each model stays alive; the number of live
models, configs, tensors or xpukit objects grows; the bytes glibc has handed out and not had back
(``mallinfo2``) grow by a model's weights per cycle.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import weakref
from pathlib import Path

import pytest

CYCLES = 8
WARMUP = 2


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _live_malloc() -> int | None:
    """Bytes glibc's malloc has handed out and not had back (all arenas, mmapped chunks); else None."""
    name = ctypes.util.find_library("c")
    try:
        function = ctypes.CDLL(name).mallinfo2  # glibc 2.33+
    except (OSError, AttributeError, TypeError):
        return None
    function.restype = _Mallinfo2
    info = function()
    return int(info.uordblks + info.hblkhd)


def _live_counts() -> dict[str, int]:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

    kinds = {"models": PreTrainedModel, "configs": PretrainedConfig, "tensors": torch.Tensor}
    counts = dict.fromkeys([*kinds, "xpukit"], 0)
    for obj in gc.get_objects():
        cls = type(obj)  # never isinstance: it may run a module's __getattr__ (deprecation warnings)
        for key, kind in kinds.items():
            if issubclass(cls, kind):
                counts[key] += 1
        if str(getattr(cls, "__module__", "")).startswith("xpukit"):
            counts["xpukit"] += 1
    return counts


@pytest.mark.slow
def test_repeated_loads_keep_no_object_or_native_memory(tiny_model: Path) -> None:
    import torch

    from xpukit import load_for_xpu

    tokens = torch.arange(16).unsqueeze(0)
    alive: list[int] = []
    weights = 0
    baseline: dict[str, int] = {}
    live_before: int | None = None
    for cycle in range(WARMUP + CYCLES):
        model = load_for_xpu(tiny_model, device="cpu")
        with torch.no_grad():
            model(input_ids=tokens)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        ref = weakref.ref(model)
        del model
        gc.collect()
        if ref() is not None:
            alive.append(cycle)
        if cycle == WARMUP - 1:
            baseline, live_before = _live_counts(), _live_malloc()
    assert not alive, f"models still alive after del in cycles {alive}"
    assert _live_counts() == baseline, f"live objects after {CYCLES} cycles, against after the warm-up"
    live_after = _live_malloc()
    if live_before is not None and live_after is not None:
        # One model's weights kept per cycle would be CYCLES * weights; a few kB move with logging.
        grown = live_after - live_before
        assert grown < max(weights, 1 << 20), f"live malloc bytes grew {grown} over {CYCLES} cycles"
