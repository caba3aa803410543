"""A quantized checkpoint on disk against quantizing at every load (docs/export.md "To another machine").

Builds the ``--shape`` model with random bf16 weights (Qwen3-8B by default; ``--tiny`` keeps its
family at tiny widths), writes its quantized checkpoint for this machine's device family the way
``xpukit merge --quantize`` does (:func:`xpukit.loading.quantized_checkpoint.write_quantized`: int4
tile-packed on CUDA, plain_int32 on XPU; int8 on the CPU, which has no on-disk int4), then loads
both ways, ``--repeat`` times in alternating order:

- ``at_load``: ``load_for_xpu(full, quantize=...)``, today's path (the full-precision weights are
  read and quantized as they load);
- ``saved``: ``load_for_xpu(saved)``, the quantized weights read as they are.

One JSON line per way: median and every load's seconds (to the model on the device, synchronized),
the checkpoint's size on disk, and whether the two models' logits on one prompt are identical.
The page cache is warm after the first round (as for a user who loads the same model again); the
first round's time is reported apart. Target (issue 47): the Qwen3-8B int4 checkpoint loads in <= 4 s
on an H200 (quantizing at load measured 13.2 s there).

Usage::

    python bench/bench_saved_quant.py                      # Qwen3-8B shape, int4 (a GPU), 3 rounds
    python bench/bench_saved_quant.py --tiny               # a CPU check in seconds (int8 there)
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _harness import emit, pick_device, synchronize, today, versions
from _shapes import SHAPES, build_model


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def timed_load(path: Path, device: str, quantize: str | None) -> tuple[float, Any]:
    from xpukit import load_for_xpu

    gc.collect()
    synchronize(device)
    start = time.perf_counter()
    model = load_for_xpu(str(path), device=device, dtype="bfloat16", quantize=quantize, fast_decode=False)
    synchronize(device)
    return time.perf_counter() - start, model


def profile_load(path: Path, device: str, top: int) -> None:
    """Where one load of the saved checkpoint spends its time: the top functions by their own time and
    by the time below them (cProfile; the device's work shows as the host's waits)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    seconds, model = timed_load(path, device, None)
    prof.disable()
    del model
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(top)
        emit({"bench": "saved_quant", "profile": key, "load_s": round(seconds, 2), "top": text.getvalue()})


def write_saved(full: Path, out: Path, kind: str, device: str) -> tuple[float, Any]:
    """The checkpoint ``xpukit merge --quantize`` writes, for ``device``'s family; its write time."""
    from transformers import AutoModelForCausalLM

    from xpukit.loading.quantized_checkpoint import write_quantized
    from xpukit.planning.device.saved_quant import saved_format
    from xpukit.planning.device.serve_quant import torchao_version

    saved = saved_format(kind, device.split(":")[0], "bfloat16", torchao_version())
    if not saved.on_disk:
        raise SystemExit(f"no on-disk format for {kind} on {device}: {saved.reason}")
    start = time.perf_counter()
    write_quantized(AutoModelForCausalLM, full, out, saved)
    return time.perf_counter() - start, saved


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3-8b")
    parser.add_argument("--tiny", action="store_true", help="the family at tiny widths (a CPU check)")
    parser.add_argument("--layers", type=int, default=0, help="override the layer count")
    parser.add_argument("--device", help="cuda, xpu or cpu (default: the first available)")
    parser.add_argument("--bits", choices=("int4", "int8"), help="default: int4 on a GPU, int8 on the CPU")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--root", help="a folder for the checkpoints (default: a temporary one)")
    parser.add_argument("--profile", type=int, default=0, help="then profile one saved load: top N functions")
    args = parser.parse_args()

    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    device = pick_device(args.device)
    bits = args.bits or ("int8" if device == "cpu" else "int4")
    kind = {"int4": "4bit", "int8": "8bit"}[bits]
    if args.root:
        Path(args.root).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="xpukit-bench-saved-", dir=args.root) as root:
        full, out = Path(root) / "full", Path(root) / "saved"
        shape = build_model(full, args)
        write_s, saved = write_saved(full, out, kind, device)
        paths = {"at_load": (full, kind), "saved": (out, None)}
        times: dict[str, list[float]] = {name: [] for name in paths}
        logits: dict[str, Any] = {}
        ids = torch.arange(3, 3 + 7 * 16, 7).remainder(1000).unsqueeze(0).to(device)
        for i in range(args.repeat):
            for name in paths if i % 2 == 0 else reversed(list(paths)):
                path, quantize = paths[name]
                seconds, model = timed_load(path, device, quantize)
                times[name].append(seconds)
                if name not in logits:
                    with torch.no_grad():
                        logits[name] = model(ids).logits.float().cpu()
                del model
        same = bool(torch.equal(logits["at_load"], logits["saved"]))
        if args.profile:
            profile_load(out, device, args.profile)
        for name, (path, _) in paths.items():
            emit(
                {
                    "date": today(),
                    "bench": "saved_quant",
                    "device": device,
                    "shape": args.shape + (" (tiny)" if args.tiny else ""),
                    "layers": shape["num_hidden_layers"],
                    "format": saved.label,
                    "way": name,
                    "load_median_s": round(statistics.median(times[name]), 2),
                    "first_load_s": round(times[name][0], 2),
                    "loads_s": [round(t, 2) for t in times[name]],
                    "disk_gb": round(disk_bytes(path) / 1e9, 3),
                    "write_s": round(write_s, 2) if name == "saved" else None,
                    "identical_logits": same,
                    "versions": versions(("torch", "transformers", "torchao", "xpukit")),
                }
            )


if __name__ == "__main__":
    main()
