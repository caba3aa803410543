"""Regional against whole-step compilation of xpukit's decode step: the first call's compile and tokens/s.

Each (mode, round) runs in its own process with empty inductor and Triton caches and an empty xpukit
compile cache, so every first call is a cold compile. Modes: ``eager`` (the loop uncompiled),
``whole`` (the whole step compiled, as ``fast_decode=True`` compiles it) and ``regional`` (one decoder
layer compiled for all of them, ``fast_decode="regional"``; docs/decode-kernels.md "Regional compilation").
The loop is installed directly (the plan changes nothing on the CPU), compiled with the plan's
settings (``fullgraph``, static shapes, mode ``default``), without step graphs. One JSON line per run,
then one summary line per mode: the best first call and the best tokens/s over the rounds.

    python bench/bench_regional.py --device cpu --shape tiny-36 --repeat 2
    python bench/bench_regional.py --device cuda --shape qwen3-8b --repeat 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _harness as h  # bench/_harness.py: devices, timing, rows
from _caches import fresh_caches
from _shapes import build_decode_model as build

os.environ.setdefault("HF_HUB_OFFLINE", "1")
MODES = ("eager", "whole", "regional")


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One cold process: load, first call (the compile), then the best of two timed calls."""
    import torch
    from transformers import AutoModelForCausalLM

    from xpukit.loading.decode.install import install_decode_loop
    from xpukit.planning.device.decode import compile_settings

    torch.set_num_threads(args.threads)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype).to(args.device).eval()
    options = None if args.mode == "eager" else compile_settings("default")
    loop = install_decode_loop(
        model,
        max_cache_len=args.cache_len,
        compile_options=options,
        cache_dir=Path(tempfile.mkdtemp(prefix="xpukit-compile-")),
        regional=args.mode == "regional",
    )
    vocab = int(model.config.vocab_size)
    seeded = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, args.prompt), generator=seeded).to(args.device)
    first_s, out = h.timed_generate(model, ids, 4, args.device)
    times = []
    for _ in range(2):
        seconds, out = h.timed_generate(model, ids, args.new_tokens, args.device)
        times.append(seconds)
    assert model.xpukit_last_decode["loop"] == "xpukit", model.xpukit_last_decode
    return {
        "mode": args.mode,
        "first_call_s": round(first_s, 2),
        "tok_s": round(args.new_tokens / min(times), 1),
        "tokens": out[0, args.prompt :].tolist()[:16],
        "dynamo": h.dynamo_counters(),
        "compile_cache": [
            {k: r.get(k) for k in ("loaded", "saved", "artifacts")} for r in loop.cache_records
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default="tiny-36", help="tiny-36 (the tiny widths, 36 layers), qwen3-8b …")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--repeat", type=int, default=2, help="cold processes per mode (the best is kept)")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--cache-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model-dir", default=None, help="keep the random-weight model here")
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        h.emit(child(args))
        return 0
    root = Path(args.model_dir or tempfile.mkdtemp(prefix="xpukit-bench-regional-"))
    path = build(args.shape, root, args.device)
    common = {
        "bench": "regional",
        "date": h.today(),
        "device": args.device,
        "shape": args.shape,
        "versions": h.versions_with_python(("torch", "transformers", "xpukit")),
    }
    rows: dict[str, list[dict[str, Any]]] = {}
    for round_ in range(args.repeat):
        for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
            cmd = [sys.executable, __file__, *sys.argv[1:], "--mode", mode, "--model-path", str(path)]
            started = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, env=fresh_caches("xpukit-regional-"))
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode or not lines:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-4:]
                row = {"mode": mode, "error": " | ".join(tail)}
            else:
                row = json.loads(lines[-1])
            seconds = round(time.perf_counter() - started, 1)
            row.update(common, round=round_, load_before=load, process_s=seconds)
            rows.setdefault(mode, []).append(row)
            h.emit(row)
    for mode, runs in rows.items():
        good = [r for r in runs if "error" not in r]
        if good:
            h.emit(
                common
                | {
                    "mode": mode,
                    "summary": True,
                    "runs": len(good),
                    "best_first_call_s": min(r["first_call_s"] for r in good),
                    "best_tok_s": max(r["tok_s"] for r in good),
                }
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
