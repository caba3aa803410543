"""Repeated ``load_for_xpu`` → forward → ``del`` cycles in one process: does memory come back?

Builds a tiny-architecture Qwen3 (default: hidden 512, 4 layers, ~50 MB in fp32), then runs
``--cycles`` cycles of load, one forward pass of 32 tokens, ``del`` and ``gc.collect()`` on the
device ``load_for_xpu`` picks (or ``--device``). After every cycle it reads the process's RSS
(``/proc/self/statm``) and, on CUDA or XPU, the device memory the allocator holds
(``memory_allocated``) and reserves (``memory_reserved``). The first ``--warmup`` cycles are the
baseline (imports, allocator pools); the growth is the last cycle against the first cycle after it.
Prints one JSON line per cycle and a summary line (``"kind": "summary"``).

Whose growth is it? ``--loader plain`` runs the same cycles with transformers alone
(``from_pretrained(...).to(device)``), the control; ``--tracemalloc`` traces the Python heap and
reports its growth and the source files it grew in (xpukit's own files flagged), and every cycle
counts the live objects of xpukit's classes (a plan, event or cache kept per load would show there).
Growth that the control shares and the Python heap does not show is the runtime's (allocator
pools, CUDA/driver state, lazily loaded kernels), not xpukit's.

Compare like with like: ``load_for_xpu`` picks a dtype per device (bfloat16 on most CPUs and GPUs),
the plain loaders keep the checkpoint's (the tiny model's is float32); each row says which ran
(``dtype``), and ``--dtype`` sets it for every loader. Casting a float32 checkpoint to bfloat16
leaves glibc's arenas holding 0–25 MB of freed, fragmented memory that ``malloc_trim`` cannot give
back, a different amount every cycle: RSS moves in that band without a trend. ``live_malloc``
(glibc's ``mallinfo2``: bytes in use, arenas and mmapped chunks) does not move with it; a leak shows
there, and in ``rss_trimmed_slope_per_cycle`` (least squares over all measured cycles).

Usage::

    python bench/bench_repeat_load.py                     # 20 cycles on the default device
    python bench/bench_repeat_load.py --device cuda --cycles 50 --hidden 1024 --layers 8
    python bench/bench_repeat_load.py --device cuda --cycles 100 --loader plain --tracemalloc
    python bench/bench_repeat_load.py --device cuda --cycles 40 --loader plain-map --dtype bfloat16
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import tempfile
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def rss() -> int:
    """Resident set size of this process, in bytes (Linux)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def device_memory(device: str) -> dict[str, int | None]:
    """Allocated and reserved bytes on ``device`` (``None`` on the CPU and MPS)."""
    import torch

    backend = device.split(":")[0]
    module = getattr(torch, backend, None)
    if backend not in {"cuda", "xpu"} or module is None:
        return {"allocated": None, "reserved": None}
    module.synchronize()
    return {"allocated": int(module.memory_allocated()), "reserved": int(module.memory_reserved())}


def trimmed_rss() -> int:
    """RSS after glibc's ``malloc_trim(0)`` hands freed heap pages back to the OS (Linux/glibc).

    Without it, RSS also counts memory the allocator keeps for reuse after ``del``, which moves with
    fragmentation and says little about what is still alive."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name:
        with contextlib.suppress(OSError, AttributeError):  # not glibc
            ctypes.CDLL(name).malloc_trim(0)
    return rss()


def live_malloc() -> int | None:
    """Bytes glibc's malloc has handed out and not had back (all arenas and mmapped chunks), else ``None``.

    Unlike RSS this does not count freed memory the allocator keeps, so allocator noise leaves it be."""
    import ctypes
    import ctypes.util

    class Mallinfo2(ctypes.Structure):
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

    name = ctypes.util.find_library("c")
    try:
        function = ctypes.CDLL(name).mallinfo2  # glibc 2.33+
    except (OSError, AttributeError, TypeError):
        return None
    function.restype = Mallinfo2
    info = function()
    return int(info.uordblks + info.hblkhd)


def slope(values: list[int]) -> int:
    """Least-squares growth per cycle of ``values`` (one per cycle), rounded to an integer."""
    n = len(values)
    if n < 2:
        return 0
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    num = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values))
    return int(num / sum((x - mean_x) ** 2 for x in range(n)))


def xpukit_objects() -> int:
    """Live objects whose class is defined in xpukit (plans, decisions, events, facts)."""
    return sum(1 for o in gc.get_objects() if str(getattr(type(o), "__module__", "")).startswith("xpukit"))


def heap_growth(first: Any, last: Any, top: int = 8) -> list[dict[str, Any]]:
    """The source files the traced Python heap grew in most between two snapshots."""
    stats = last.compare_to(first, "filename")
    out = []
    for stat in stats[:top]:
        name = stat.traceback[0].filename
        out.append({"file": name, "growth": stat.size_diff, "xpukit": "/xpukit/" in name})
    return out


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in ("torch", "transformers", "accelerate", "peft", "xpukit"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", help="default: what load_for_xpu picks")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--loader",
        choices=("xpukit", "plain", "plain-map"),
        default="xpukit",
        help="xpukit: load_for_xpu; plain: transformers' from_pretrained(...).to(device), the control; "
        "plain-map: from_pretrained(..., device_map=device), transformers' own loading path with a map",
    )
    parser.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float16", "float32"),
        help="the dtype every loader loads in; default: load_for_xpu's choice for xpukit, the checkpoint's "
        "for plain and plain-map",
    )
    parser.add_argument("--tracemalloc", action="store_true", help="trace the Python heap's growth")
    args = parser.parse_args()
    import tracemalloc

    import torch
    import transformers

    from xpukit.demo.tiny import build_tiny_model
    from xpukit.loading.load import load_for_xpu

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    common: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "versions": versions(),
        "loader": args.loader,
    }
    with tempfile.TemporaryDirectory(prefix="xpukit-bench-") as root:
        path = build_tiny_model(
            "qwen3",
            Path(root) / "qwen3",
            hidden_size=args.hidden,
            intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers,
        )
        tokens = torch.arange(32).unsqueeze(0)
        rows = []
        snapshots: list[Any] = []
        if args.tracemalloc:
            tracemalloc.start()
        target = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        plain_dtype: dict[str, Any] = {}
        if args.dtype not in (None, "auto"):
            plain_dtype["dtype"] = getattr(torch, args.dtype)
        for cycle in range(args.warmup + args.cycles):
            start = time.perf_counter()
            if args.loader == "xpukit":
                model = load_for_xpu(path, device=args.device, dtype=args.dtype or "auto")
            elif args.loader == "plain-map":
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    path, device_map=target, **plain_dtype
                )
            else:
                model = transformers.AutoModelForCausalLM.from_pretrained(path, **plain_dtype).to(target)
            device = str(model.device)
            dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
            with torch.no_grad():
                model(input_ids=tokens.to(model.device))
            params = sum(p.numel() for p in model.parameters())
            del model
            gc.collect()
            row = {
                "kind": "cycle",
                "cycle": cycle,
                "warmup": cycle < args.warmup,
                "device": device,
                "parameters": params,
                "dtype": dtype,
                "seconds": round(time.perf_counter() - start, 4),
                "rss": rss(),
                "rss_trimmed": trimmed_rss(),
                "live_malloc": live_malloc(),
                "xpukit_objects": xpukit_objects(),
                **{f"device_{k}": v for k, v in device_memory(device).items()},
            }
            if args.tracemalloc:
                row["python_heap"] = tracemalloc.get_traced_memory()[0]
                if cycle in (args.warmup, args.warmup + args.cycles - 1):
                    snapshots.append(tracemalloc.take_snapshot())
            rows.append(row)
            print(json.dumps({**common, **row}), flush=True)
    measured = [r for r in rows if not r["warmup"]]
    first, last = measured[0], measured[-1]
    summary: dict[str, Any] = {
        **common,
        "kind": "summary",
        "device": first["device"],
        "dtype": first["dtype"],
        "cycles": len(measured),
        "parameters": first["parameters"],
        "rss_first": first["rss"],
        "rss_last": last["rss"],
        "rss_growth_pct": round(100 * (last["rss"] - first["rss"]) / first["rss"], 3),
        "rss_max": max(r["rss"] for r in measured),
        "rss_trimmed_first": first["rss_trimmed"],
        "rss_trimmed_last": last["rss_trimmed"],
        "rss_trimmed_growth_pct": round(
            100 * (last["rss_trimmed"] - first["rss_trimmed"]) / first["rss_trimmed"], 3
        ),
        "rss_trimmed_slope_per_cycle": slope([r["rss_trimmed"] for r in measured]),
        # The last fifth of the cycles: still growing, or levelled off?
        "rss_per_cycle_at_end": int(
            (last["rss"] - measured[-max(2, len(measured) // 5)]["rss"]) / max(1, len(measured) // 5 - 1)
        ),
        "xpukit_objects_first": first["xpukit_objects"],
        "xpukit_objects_last": last["xpukit_objects"],
    }
    if args.tracemalloc and len(snapshots) == 2:
        summary["python_heap_first"], summary["python_heap_last"] = first["python_heap"], last["python_heap"]
        summary["python_heap_growth_by_file"] = heap_growth(snapshots[0], snapshots[1])
    for key in ("live_malloc", "device_allocated", "device_reserved"):
        if first[key] is not None:
            summary[f"{key}_first"], summary[f"{key}_last"] = first[key], last[key]
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
