"""Device-kernel categories for the benchmarks' profiles (bench_qlora ``--profile``, bench_decode
``--breakdown``): one table, so both scripts count GEMM, attention, copies … the same way; and the
profiler readings of a training step (device kernels, host functions)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from _harness import synchronize

# Kernel-name fragments by category, checked in this order (lower-case).
KERNEL_CATEGORIES = (
    ("dequant_4bit", ("kdequantize", "dequant", "nf4")),
    ("gemm", ("gemm", "gemv", "cutlass", "cublas", "nvjet", "xmma", "matmul", "_mm_", "splitk")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "mha", "efficient")),
    ("optimizer", ("multi_tensor_apply", "adam", "fused_adam")),
    ("copy_cast", ("copy", "memcpy", "memset")),  # dtype casts are direct_copy_kernel on CUDA
    (
        "elementwise",
        (
            "elementwise",
            "vectorized",
            "reduce",
            "silu",
            "swiglu",
            "rms",
            "norm",
            "softmax",
            "mul",
            "add",
            "sigmoid",
            "cross_entropy",
            "rope",
            "fill",
            "triton",
        ),
    ),
)


def kernel_category(name: str) -> str:
    """The category of a device kernel, from its name; ``other`` when no fragment matches."""
    low = name.lower()
    for category, fragments in KERNEL_CATEGORIES:
        if any(f in low for f in fragments):
            return category
    return "other"


def ms_per_step_by_category(us_by_name: dict[str, float], steps: int, digits: int = 2) -> dict[str, float]:
    """Device milliseconds per step by category, from microseconds per kernel name."""
    out: dict[str, float] = {}
    for name, us in us_by_name.items():
        category = kernel_category(name)
        out[category] = out.get(category, 0.0) + us
    return {k: round(v / 1e3 / steps, digits) for k, v in sorted(out.items())}


def profile_steps(train_step: Any, device: str, steps: int) -> dict[str, Any]:
    """Run ``steps`` training steps under torch.profiler; per-step kernel count and time by category."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.XPU if device == "xpu" else ProfilerActivity.CUDA
    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, activity]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            train_step()
        synchronize(device)
        wall = time.perf_counter() - start
    return profile_summary(prof, wall, steps, device)


def profile_summary(prof: Any, wall: float, steps: int, device: str) -> dict[str, Any]:
    """The device's view of ``steps`` profiled steps of ``wall`` seconds: kernels per step, device time
    by category, and the share of the wall time the device was busy (the union of kernel intervals)."""
    import torch

    device_type = torch.autograd.DeviceType.XPU if device == "xpu" else torch.autograd.DeviceType.CUDA
    # Device events less the user annotations the profiler also draws on the device's timeline (the
    # optimizer's step range spans its kernels and the gaps between them).
    kernels = [
        e
        for e in prof.events()
        if e.device_type == device_type and not getattr(e, "is_user_annotation", False)
    ]
    by_name: dict[str, float] = {}
    intervals = []
    for event in kernels:
        us = event.time_range.elapsed_us()
        by_name[event.name] = by_name.get(event.name, 0.0) + us
        intervals.append((event.time_range.start, event.time_range.end))
    busy, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):  # the union of kernel intervals
        if hi > end:
            busy += hi - max(lo, end)
            end = hi
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:30]
    return {
        "steps": steps,
        "wall_ms_per_step": round(wall * 1e3 / steps, 2),
        "device_ms_per_step": round(sum(by_name.values()) / 1e3 / steps, 2),
        "gpu_busy_pct": round(100 * busy / 1e6 / wall, 1) if wall else None,
        "kernels_per_step": round(len(kernels) / steps),
        "ms_per_step_by_category": ms_per_step_by_category(by_name, steps),
        "top_kernels_ms_per_step": [[name[:120], round(us / 1e3 / steps, 2)] for name, us in top],
    }


def host_profile(train_step: Any, device: str, steps: int) -> list[list[Any]]:
    """cProfile over ``steps`` steps: the host's top functions, ``[name, own ms/step, calls/step,
    cumulative ms/step]``."""
    import cProfile
    import pstats

    synchronize(device)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        train_step()
    synchronize(device)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    rows = []
    for (file, line, name), (_, calls, own, cum, _) in stats.items():
        where = f"{Path(file).parent.name}/{Path(file).name}:{line}:{name}"
        per_step = [round(own * 1e3 / steps, 2), round(calls / steps), round(cum * 1e3 / steps, 2)]
        rows.append([where[-110:], *per_step])
    return sorted(rows, key=lambda r: -r[1])[:25]
