"""Repeated ``load_for_xpu`` → forward → ``del`` cycles in one process: does memory come back?

Builds a tiny-architecture Qwen3 (default: hidden 512, 4 layers, ~50 MB in fp32), then runs
``--cycles`` cycles of load, one forward pass of 32 tokens, ``del`` and ``gc.collect()`` on the
device ``load_for_xpu`` picks (or ``--device``). After every cycle it reads the process's RSS
(``/proc/self/statm``) and, on CUDA or XPU, the device memory the allocator holds
(``memory_allocated``) and reserves (``memory_reserved``). The first ``--warmup`` cycles are the
baseline (imports, allocator pools); the growth is the last cycle against the first cycle after it.
Prints one JSON line per cycle and a summary line (``"kind": "summary"``).

Usage::

    python bench/bench_repeat_load.py                     # 20 cycles on the default device
    python bench/bench_repeat_load.py --device cuda --cycles 50 --hidden 1024 --layers 8
"""

from __future__ import annotations

import argparse
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
    args = parser.parse_args()

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
        for cycle in range(args.warmup + args.cycles):
            start = time.perf_counter()
            model = load_for_xpu(path, device=args.device)
            device = str(model.device)
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
                "seconds": round(time.perf_counter() - start, 4),
                "rss": rss(),
                **{f"device_{k}": v for k, v in device_memory(device).items()},
            }
            rows.append(row)
            print(json.dumps({**common, **row}), flush=True)
    measured = [r for r in rows if not r["warmup"]]
    first, last = measured[0], measured[-1]
    summary: dict[str, Any] = {
        **common,
        "kind": "summary",
        "device": first["device"],
        "cycles": len(measured),
        "parameters": first["parameters"],
        "rss_first": first["rss"],
        "rss_last": last["rss"],
        "rss_growth_pct": round(100 * (last["rss"] - first["rss"]) / first["rss"], 3),
        "rss_max": max(r["rss"] for r in measured),
    }
    for key in ("device_allocated", "device_reserved"):
        if first[key] is not None:
            summary[f"{key}_first"], summary[f"{key}_last"] = first[key], last[key]
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
