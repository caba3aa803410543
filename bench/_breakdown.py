"""``bench_decode.py --breakdown``: where one generated token's time goes (docs/decode.md "Where a
token's time goes"): the profiler's view of one call, the compile counters, a call's fixed part, and for
xpukit's loop the decode step alone and the same model with one measure switched off at a time."""

from __future__ import annotations

import argparse
import time
from typing import Any

from _harness import dynamo_counters, synchronize, timed_generate
from _kernels import ms_per_step_by_category

REPLAY_STEPS = 64


def breakdown(
    model: Any, ids: Any, args: argparse.Namespace, before: dict[str, int], best_s: float
) -> dict[str, Any]:
    """Where one call's time goes: the profiler's view, the counters, and the step alone."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    after = dynamo_counters()
    out: dict[str, Any] = {
        "during_timed_calls": {k: after[k] - before[k] for k in after},
        "graph_breaks_total": after["graph_breaks"],
        "ms_per_step_generate": round(best_s / args.new_tokens * 1e3, 3),
    }
    activities = [ProfilerActivity.CPU]
    if args.device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    elif args.device.startswith("xpu") and hasattr(ProfilerActivity, "XPU"):
        activities.append(ProfilerActivity.XPU)
    with profile(activities=activities) as prof:
        wall, _ = timed_generate(model, ids, args.new_tokens, args.device)
    device_us, kernels, launches = 0.0, 0, 0
    by_name: dict[str, float] = {}
    for avg in prof.key_averages():
        self_device = float(getattr(avg, "self_device_time_total", 0.0) or 0.0)
        if self_device > 0 and getattr(avg, "device_type", None) != torch.autograd.DeviceType.CPU:
            device_us += self_device
            kernels += int(avg.count)
            by_name[avg.key] = by_name.get(avg.key, 0.0) + self_device
        if avg.key in {"cudaGraphLaunch", "cuGraphLaunch"}:
            launches += int(avg.count)
    steps = args.new_tokens
    out["profiled_call_s"] = round(wall, 4)
    if len(activities) > 1:  # a device the profiler sees (not on the CPU)
        out.update(
            device_busy_fraction=round(device_us / 1e6 / wall, 4) if wall else None,
            device_ms_per_step=round(device_us / 1e3 / steps, 3),
            kernels_per_step=round(kernels / steps, 1),
            graph_launches_per_step=round(launches / steps, 2),
            device_ms_per_step_by_category=ms_per_step_by_category(by_name, steps, digits=3),
            top_kernels_ms_per_step=[
                [name[:100], round(us / 1e3 / steps, 3)]
                for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:15]
            ],
        )
    out["ms_call_one_token"] = one_token_ms(model, ids, args.device)
    loop = getattr(model, "xpukit_decode_loop", None)
    if loop is not None and loop.enabled and getattr(model, "xpukit_last_decode", {}).get("loop") == "xpukit":
        out["same_model_without"] = ablations(model, loop, ids, args)
        synchronize(args.device)
        start = time.perf_counter()
        loop.replay(REPLAY_STEPS)
        synchronize(args.device)
        out["ms_per_step_alone"] = round((time.perf_counter() - start) / REPLAY_STEPS * 1e3, 3)
    return out


def one_token_ms(model: Any, ids: Any, device: str) -> float:
    """A call's fixed part, best of 3: a call for one new token (the prefill and what surrounds it)."""
    return round(min(timed_generate(model, ids, 1, device)[0] for _ in range(3)) * 1e3, 3)


def ablations(model: Any, loop: Any, ids: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The same loaded model with one of the loop's measures switched off at a time (same run): the
    attention window (the step attends over the whole cache) and the captured prefill."""
    found: dict[str, Any] = {}
    switches = {
        "window": ("window_smallest", 2**62),  # past any cache: every window is the whole cache
        "captured_prefill": ("capture_prefill", False),
    }
    for name, (attribute, off) in switches.items():
        kept = getattr(loop, attribute)
        setattr(loop, attribute, off)
        try:
            timed_generate(model, ids, args.new_tokens, args.device)  # warms and captures the new shape
            times = [timed_generate(model, ids, args.new_tokens, args.device)[0] for _ in range(2)]
            found[name] = {
                "tok_s": round(ids.shape[0] * args.new_tokens / min(times), 2),
                "ms_call_one_token": one_token_ms(model, ids, args.device),
            }
        finally:
            setattr(loop, attribute, kept)
    return found
