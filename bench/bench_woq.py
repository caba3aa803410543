"""Weight-only products of a decode step, one projection at a time: xpukit's Triton kernels against
torchao's own products and a bf16 cuBLAS product, in the same process (docs/decode-kernels.md
"Weight-only products").

For each Qwen3-8B projection shape (q/k/v fused, o, gate/up fused, down) and each row count (1: a
batch-1 decode step; 8), the product is captured 20 times in one CUDA graph and the graph replayed,
so launch overhead is out; the figure is the weight bytes read per second. ``--sweep`` also times
each tile setting of xpukit's kernels (the defaults are chosen from it). JSON lines.

    python bench/bench_woq.py --rows 1 --rows 8 --sweep
    python bench/bench_woq.py --tiny     # a CPU check in seconds: one small shape, int8 only, the references
"""

from __future__ import annotations

import argparse
import itertools
import os
from datetime import datetime, timezone
from typing import Any

import _harness as h  # bench/_harness.py: devices, timing, rows

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
CALLS = 20  # products per captured graph
_INT8_ONE_ROW = [(8, 512), (8, 1024), (16, 256), (16, 512), (32, 128), (32, 256)]  # BLOCK_N, BLOCK_K
SWEEP = {
    "int8": [
        {"BLOCK_M": 1, "BLOCK_N": n, "BLOCK_K": k, "num_warps": w}
        for (n, k), w in itertools.product(_INT8_ONE_ROW, [4, 8])
    ]
    + [
        {"BLOCK_M": 16, "BLOCK_N": n, "BLOCK_K": 128, "num_warps": w}
        for n, w in itertools.product([16, 32], [4, 8])
    ],
    "int4": [
        {"BLOCK_M": 1, "BLOCK_N": n, "TILES": t, "num_warps": w}
        for n, t, w in itertools.product([8, 16, 32], [1, 2, 4], [4, 8])
    ]
    + [
        {"BLOCK_M": 16, "BLOCK_N": n, "TILES": t, "num_warps": 4}
        for n, t in itertools.product([16, 32], [1, 2])
    ],
}


def _time(fn: Any) -> float:
    """Seconds one call takes: ``CALLS`` calls in one CUDA graph, best of 5 replays (on the CPU,
    ``CALLS`` calls timed by the clock)."""
    import time

    import torch

    if not torch.cuda.is_available():
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(CALLS):
                fn()
            best = min(best, (time.perf_counter() - start) / CALLS)
        return best

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1000 / CALLS)
    return best


def _products(x: Any, layers: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    import torch

    from xpukit.kernels._woq_triton import int4_tile_mm_triton, int8_mm_triton
    from xpukit.kernels.woq import int8_mm

    bf16, w8 = layers["bf16"].weight, layers["int8"].weight
    if "int4" not in layers:  # --tiny on the CPU: the op runs its reference there
        return {
            "bf16": ("bf16", lambda: torch.nn.functional.linear(x, bf16)),
            "torchao int8": ("int8", lambda: torch.nn.functional.linear(x, w8)),
            "xpukit int8 (reference)": ("int8", lambda: int8_mm(x, w8.qdata, w8.scale)),
        }
    w4 = layers["int4"].weight
    n = bf16.shape[0]
    return {
        "bf16 cuBLAS": ("bf16", lambda: torch.nn.functional.linear(x, bf16)),
        "torchao int8": ("int8", lambda: torch.nn.functional.linear(x, w8)),
        "torchao int4 (tinygemm)": ("int4", lambda: torch.nn.functional.linear(x, w4)),
        "xpukit int8": ("int8", lambda: int8_mm_triton(x, w8.qdata, w8.scale)),
        "xpukit int4": ("int4", lambda: int4_tile_mm_triton(x, w4.qdata, w4.scale_and_zero, 128, n)),
    }


def _tiled(fmt: str, x: Any, layers: dict[str, Any], blocks: dict[str, int]) -> Any:
    from xpukit.kernels._woq_triton import int4_tile_mm_triton, int8_mm_triton

    w8, w4 = layers["int8"].weight, layers["int4"].weight
    if fmt == "int8":
        return lambda: int8_mm_triton(x, w8.qdata, w8.scale, dict(blocks))
    return lambda: int4_tile_mm_triton(x, w4.qdata, w4.scale_and_zero, 128, w4.shape[0], dict(blocks))


def measure(common: dict[str, Any], name: str, rows: int, layers: dict[str, Any], sweep: bool) -> None:
    """One shape and row count: every product, then (``sweep``) every tile setting of xpukit's."""
    import torch

    from xpukit.kernels._woq_triton import pick_blocks

    n, k = layers["bf16"].weight.shape
    weight_bytes = {"bf16": n * k * 2, "int8": n * k + n * 4, "int4": n * k // 2 + (k // 128) * n * 4}
    where = {"shape": name, "n": n, "k": k, "rows": rows}
    x = torch.randn(rows, k, device=layers["bf16"].weight.device, dtype=torch.bfloat16)
    for label, (fmt, fn) in _products(x, layers).items():
        seconds = _time(fn)
        tb_s = round(weight_bytes[fmt] / seconds / 1e12, 3)
        h.emit(common | where | {"product": label, "us": round(seconds * 1e6, 2), "weight_tb_s": tb_s})
    if not sweep:
        return
    h.emit(common | where | {"int8_default": pick_blocks(rows, n, k)})
    for fmt, settings in SWEEP.items():
        best: tuple[float, Any] = (float("inf"), None)
        for blocks in settings:
            if (blocks["BLOCK_M"] == 1) != (rows == 1):
                continue
            try:
                seconds = _time(_tiled(fmt, x, layers, blocks))
            except Exception as exc:  # a tile setting the compiler refuses (registers, shared memory)
                h.emit(common | where | {"sweep": fmt, "blocks": blocks, "error": str(exc)[:200]})
                continue
            best = min(best, (seconds, blocks), key=lambda t: t[0])
            tb_s = round(weight_bytes[fmt] / seconds / 1e12, 3)
            h.emit(
                common
                | where
                | {"sweep": fmt, "blocks": blocks, "us": round(seconds * 1e6, 2), "weight_tb_s": tb_s}
            )
        h.emit(common | where | {"sweep_best": fmt, "blocks": best[1], "us": round(best[0] * 1e6, 2)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, action="append", help="repeatable; default 1 and 8")
    parser.add_argument("--sweep", action="store_true", help="also time every tile setting")
    parser.add_argument("--tiny", action="store_true", help="a CPU check in seconds (int8, the references)")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"

    import torch
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    common = {
        "bench": "woq",
        "date": datetime.now(timezone.utc).date().isoformat(),
        "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "versions": h.versions_with_python(("torch", "torchao", "triton")),
    }
    for name, (n, k) in ({"tiny": (64, 128)} if args.tiny else SHAPES).items():
        torch.manual_seed(0)
        base = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16).requires_grad_(False)
        layers = {"bf16": base}
        formats = [("int8", Int8WeightOnlyConfig())]
        if device == "cuda":  # tinygemm's int4 is CUDA's
            formats.append(
                ("int4", Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d"))
            )
        for fmt, config in formats:
            layer = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
            layer.requires_grad_(False)
            layer.weight.copy_(base.weight)
            quantize_(layer, config)
            layers[fmt] = layer
        for rows in args.rows or ([1] if args.tiny else [1, 8]):
            measure(common, name, rows, layers, args.sweep and not args.tiny)


if __name__ == "__main__":
    main()
