"""What every benchmark repeats: the device and its memory, versions, child processes, interleaved
rounds, timing and JSON rows. A bench script keeps only its variants and imports the rest from here
(``import _harness as h``: this file sits beside the scripts, on ``sys.path`` when one runs).

Rows are JSON lines on stdout; a bench with variants runs each in a child process of its own (peak
memory its own, no patch leaking into the next variant), round after round with the order rotated,
then prints one summary line per variant (median and range over the rounds).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from _caches import add_cache_arguments, child_caches

# --- the device ----------------------------------------------------------------------------------


def pick_device(requested: str | None) -> str:
    """``requested``, else the first available of cuda, xpu, cpu."""
    import torch

    if requested:
        return requested
    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    return "cpu"


def device_facts(device: str) -> Any:
    """xpukit's facts of the device (the CPU's when ``device`` is ``cpu``)."""
    from xpukit.machine.probe import cpu_facts, detect

    if device == "cpu":
        return cpu_facts()
    return next(d for d in detect().devices if d.backend == device)


def synchronize(device: str) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    import torch

    kind = device.split(":")[0]
    if kind in {"cuda", "xpu", "mps"}:
        getattr(torch, kind).synchronize()


# --- memory readings -----------------------------------------------------------------------------


def memory_allocated(device: str) -> int | None:
    """Bytes allocated on a GPU now (``None`` on the CPU)."""
    import torch

    return None if device == "cpu" else int(getattr(torch, device).memory_allocated())


def allocated_gb(device: str, peak: bool = False, reset: bool = False) -> float | None:
    """Allocated (or peak allocated) memory in GB on CUDA/XPU; ``None`` elsewhere; ``reset``: start
    a new peak (and return ``None``)."""
    import torch

    kind = device.split(":")[0]
    module = getattr(torch, kind, None) if kind in {"cuda", "xpu"} else None
    if module is None:
        return None
    if reset:
        module.reset_peak_memory_stats()
        return None
    return round((module.max_memory_allocated() if peak else module.memory_allocated()) / 1e9, 3)


def reset_peak(device: str) -> None:
    """Start a new high-water mark (on the CPU: the process's VmHWM, via /proc/self/clear_refs)."""
    import torch

    if device == "cpu":
        with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return
    getattr(torch, device).reset_peak_memory_stats()


def current_memory(device: str) -> int | None:
    """Bytes allocated on a GPU, or the process's resident set on the CPU."""
    if device != "cpu":
        return memory_allocated(device)
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return None


def peak_reserved(device: str) -> int | None:
    """``max_memory_reserved`` of a GPU since the last reset (``None`` on the CPU)."""
    if device == "cpu":
        return None
    import torch

    return int(getattr(torch, device).max_memory_reserved())


def peak_memory(device: str) -> tuple[int, str]:
    """The peak since the last reset, and what kind of reading it is."""
    if device == "cpu":
        with contextlib.suppress(OSError), open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024, "cpu_rss_high_water_since_reset"
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "cpu_peak_rss"
    import torch

    return int(getattr(torch, device).max_memory_allocated()), f"{device}_max_memory_allocated"


def memory_pools(device: str) -> dict[str, dict[str, float]] | None:
    """CUDA: memory reserved and in use at the run's end, by allocator pool (the graphs' private
    pools apart from the default one), from ``torch.cuda.memory_snapshot``."""
    if device != "cuda":
        return None
    import torch

    pools: dict[str, dict[str, float]] = {}
    for segment in torch.cuda.memory_snapshot():
        pool = segment.get("segment_pool_id", (0, 0))
        name = "default" if tuple(pool) == (0, 0) else f"graphs {tuple(pool)}"
        row = pools.setdefault(name, {"reserved": 0.0, "allocated": 0.0, "segments": 0})
        row["reserved"] += segment["total_size"] / 1e9
        row["allocated"] += segment["allocated_size"] / 1e9
        row["segments"] += 1
    return {k: {a: round(b, 3) for a, b in v.items()} for k, v in pools.items()}


def graph_pool_slack(device: str, pools: dict[str, dict[str, float]] | None = None) -> int:
    """Bytes the device graphs' private pools hold but the allocator counts as free: a replay writes
    its activations there without allocating, so ``max_memory_allocated`` after a capture misses
    them (0 without graphs, and off CUDA). ``pools``: :func:`memory_pools`' answer, if taken already."""
    pools = (pools if pools is not None else memory_pools(device)) or {}
    return int(sum(1e9 * (v["reserved"] - v["allocated"]) for k, v in pools.items() if k != "default"))


# --- versions and rows ---------------------------------------------------------------------------

TRAINING_PACKAGES = (
    "torch",
    "transformers",
    "peft",
    "bitsandbytes",
    "liger-kernel",
    "triton",
    "unsloth",
    "trl",
)


def versions(names: tuple[str, ...] = TRAINING_PACKAGES) -> dict[str, str | None]:
    """The installed version of each distribution (``None`` when absent)."""
    from xpukit._compat import installed_version

    return {name: installed_version(name) for name in names}


def versions_with_python(names: tuple[str, ...]) -> dict[str, str]:
    """Python's version and each distribution's, ``"not installed"`` when absent."""
    out = {"python": platform.python_version()}
    for dist in names:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def today() -> str:
    """The date a row was measured, as rows write it."""
    return time.strftime("%Y-%m-%d")


def emit(row: dict[str, Any]) -> None:
    """One JSON line."""
    print(json.dumps(row), flush=True)


# --- timing --------------------------------------------------------------------------------------


@dataclass
class Timing:
    """What :func:`timed_steps` measured: the timed steps' seconds and every step's result."""

    times: list[float] = field(default_factory=list)
    results: list[Any] = field(default_factory=list)
    first_step_s: float | None = None
    base: int | None = None  # memory when the timed steps began (the peak above it is theirs)


def timed_steps(step: Callable[[], Any], device: str, warmup: int, steps: int) -> Timing:
    """``warmup`` untimed steps, then ``steps`` timed ones, each synchronised; the peak memory is
    reset where the timed steps begin."""
    out = Timing()
    for i in range(warmup + steps):
        synchronize(device)
        if i == warmup:  # gradients and optimizer state exist: the peak above this is the step's
            reset_peak(device)
            out.base = current_memory(device)
        start = time.perf_counter()
        out.results.append(step())
        synchronize(device)
        if i == 0:
            out.first_step_s = time.perf_counter() - start
        if i >= warmup:
            out.times.append(time.perf_counter() - start)
    return out


# --- variants in child processes, interleaved rounds ---------------------------------------------


def add_variant_arguments(
    parser: argparse.ArgumentParser, variants: tuple[str, ...], repeat: int = 3
) -> None:
    """``--repeat``, ``--variants`` and the child's hidden ``--variant-child`` / ``--model-dir``."""
    parser.add_argument("--repeat", type=int, default=repeat, help="rounds of all variants, interleaved")
    parser.add_argument("--variants", default=",".join(variants), help="comma-separated subset")
    parser.add_argument("--variant-child", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    add_cache_arguments(parser)


def chosen_variants(parser: argparse.ArgumentParser, text: str, known: tuple[str, ...]) -> list[str]:
    """The comma-separated variants, each one known (else the parser's error)."""
    variants = [v.strip() for v in text.split(",") if v.strip()]
    unknown = set(variants) - set(known)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(known)}")
    return variants


def run_child(
    args: argparse.Namespace, variant: str, model_dir: Path, *, script: str, bench: str, caches: Path
) -> dict[str, Any]:
    """Run one variant of ``script`` in its own process, with the compiled-kernel caches
    ``--kernel-caches`` gives it under ``caches`` (bench/_caches.py); its last JSON line is the row."""
    if variant.startswith("unsloth") and importlib.util.find_spec("unsloth") is None:
        return {"bench": bench, "variant": variant, "skipped": "unsloth is not installed"}
    child = [sys.executable, script, *sys.argv[1:], "--variant-child", variant, "--model-dir", str(model_dir)]
    env, held = child_caches(getattr(args, "kernel_caches", "shared"), variant, caches)
    proc = subprocess.run(child, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
        return {"bench": bench, "variant": variant, "error": " | ".join(tail), "kernel_caches": held}
    return {**json.loads(lines[-1]), "kernel_caches": held}


def ensure_model(
    args: argparse.Namespace, model_dir: Path, bench: str, build: Callable[..., dict[str, Any]]
) -> None:
    """Build the random-weight model into ``model_dir`` unless its weights are there (config.json
    is written first, so it alone does not mean a finished build)."""
    if any((model_dir / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")):
        return
    started = time.perf_counter()
    shape = build(model_dir, args)
    print(
        json.dumps(
            {
                "bench": bench,
                "event": "built",
                "shape": shape,
                "seconds": round(time.perf_counter() - started, 1),
            }
        ),
        flush=True,
    )


def interleaved_rounds(
    args: argparse.Namespace,
    variants: list[str],
    run: Callable[[str], dict[str, Any]],
    summarize: Any,
    bench: str,
    compare: Callable[[dict[str, list[dict[str, Any]]]], list[dict[str, Any]]] | None = None,
) -> int:
    """``--repeat`` rounds of every variant (each round starts one variant later), a JSON line per run
    (its ``profile`` on a line of its own), then a summary line per variant and ``compare``'s lines
    (ratios across variants); returns the failures."""
    rows: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    failed = 0
    for round_ in range(args.repeat):
        for variant in variants[round_ % len(variants) :] + variants[: round_ % len(variants)]:
            row = run(variant)
            row["round"] = round_ + getattr(args, "first_round", 0)
            profile = row.pop("profile", None)
            print(json.dumps(row), flush=True)
            if profile is not None:
                print(json.dumps({"bench": bench, "profile": variant, "round": round_, **profile}))
            if "error" in row:
                failed += 1
            elif "skipped" not in row:
                rows[variant].append(row)
    for variant, done in rows.items():
        if done:
            print(json.dumps(summarize(variant, done)), flush=True)
    for line in compare(rows) if compare is not None else []:
        print(json.dumps(line), flush=True)
    return failed


def rounds_of_children(
    args: argparse.Namespace,
    variants: list[str],
    *,
    script: str,
    bench: str,
    summarize: Any,
    build: Callable[..., dict[str, Any]],
    compare: Any = None,
) -> int:
    """The model built once (``--model-cache``, ``--workdir``), then the interleaved rounds of child
    processes; returns the process's exit status (1 when a variant failed)."""
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        model_dir = Path(args.model_cache) if args.model_cache else Path(tmp) / "model"
        ensure_model(args, model_dir, bench, build)
        if not variants:  # --variants '': only build the model (into --model-cache)
            return 0
        caches = Path(getattr(args, "kernel_cache_dir", None) or Path(tmp) / "kernel-caches")
        run = lambda v: run_child(args, v, model_dir, script=script, bench=bench, caches=caches)  # noqa: E731
        failed = interleaved_rounds(args, variants, run, summarize, bench, compare)
    return 1 if failed else 0


def summary(
    variant: str, rows: list[dict[str, Any]], *, bench: str, summed: tuple[str, ...], kept: tuple[str, ...]
) -> dict[str, Any]:
    """Median and spread over the rounds of one variant (``summed``), and the last round's ``kept``."""
    out: dict[str, Any] = {"bench": bench, "summary": variant, "rounds": len(rows)}
    for key in summed:
        values = [r[key] for r in rows if r.get(key) is not None]
        if values:
            out[key] = statistics.median(values)
            out[f"{key}_range"] = [min(values), max(values)]
    for key in kept:
        out[key] = rows[-1].get(key)
    return out


# --- decoding ------------------------------------------------------------------------------------

# Peak memory bandwidth per device, bytes/s, from the vendors' specification pages:
# NVIDIA H200 datasheet (4.8 TB/s HBM3e), NVIDIA H100 SXM datasheet (3.35 TB/s), Intel Data Center
# GPU Max 1550 product specifications (3.2768 TB/s), Intel Arc B580 product specifications
# (456 GB/s). Matched as a substring of the device name; anything else needs --bandwidth.
BANDWIDTH = {
    "H200": 4.8e12,
    "H100": 3.35e12,
    "Max 1550": 3.2768e12,
    "B580": 456e9,
}


def bandwidth_for(device: str, given: float | None) -> tuple[float | None, str]:
    import torch

    kind = device.split(":")[0]
    name = platform.processor() or "cpu"
    if kind in {"cuda", "xpu"}:
        name = getattr(torch, kind).get_device_name(torch.device(device))
    if given:
        return given, name
    return next((bw for key, bw in BANDWIDTH.items() if key in name), None), name


def timed_generate(model: Any, ids: Any, new_tokens: int, device: str) -> tuple[float, Any]:
    import torch

    synchronize(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    synchronize(device)
    return time.perf_counter() - start, out


def dynamo_counters() -> dict[str, int]:
    """The dynamo / inductor counters that say whether the timed calls compiled anything."""
    from torch._dynamo.utils import counters

    return {
        "graph_breaks": sum(counters["graph_break"].values()),
        "unique_graphs": counters["stats"]["unique_graphs"],
        "recompiles": sum(counters["recompiles"].values()),
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
        "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
    }


def copy_bandwidth(device: str) -> float | None:
    """Device-to-device copy of 2 GiB, best of 5: read + write bytes per second."""
    import torch

    if not device.startswith(("cuda", "xpu")):
        return None
    src = torch.empty(2**30, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    del src, dst
    return round(2 * 2**31 / best, -9)
