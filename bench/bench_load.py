"""``load_for_xpu`` against a raw ``from_pretrained`` with the same resolved kwargs, on tiny models.

Each repetition loads the same model both ways, alternating which goes first, so drift (page cache,
allocator, CPU frequency) hits both alike. The ratio of medians is the cost of planning (config read,
meta-device sizing, device facts) on top of the load. Target: ratio <= 1.05. Tiny models load in a
few tens of milliseconds, so this is the worst case; the fixed planning cost vanishes next to a real
model's load. Repeated loads reuse the model facts of the same config (xpukit.planning.model.facts caches the
last few), as repeated loads in a notebook do; ``--uncached`` measures a first load every time.
Prints one JSON line per architecture.

Usage::

    python bench/bench_load.py                  # every tiny architecture, 15 repetitions each
    python bench/bench_load.py --arch qwen3 --repeat 40
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import tempfile
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    from xpukit.demo.tiny import ARCHITECTURES, build_tiny_model

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", action="append", choices=list(ARCHITECTURES), help="default: all")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument(
        "--small",
        action="store_true",
        help="also a ~100M-parameter qwen3 (hidden 1024, 8 layers): a load that takes real time",
    )
    parser.add_argument(
        "--uncached", action="store_true", help="clear xpukit's model-facts cache before each load"
    )
    args = parser.parse_args()

    import transformers

    from xpukit.loading.load import load_for_xpu
    from xpukit.planning.model import facts as model_facts
    from xpukit.planning.plan import plan_load

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="xpukit-bench-") as root:
        cases: list[tuple[str, dict[str, int]]] = [(arch, {}) for arch in args.arch or list(ARCHITECTURES)]
        if args.small:
            small = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 8}
            cases.append(
                ("qwen3", small | {"num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64})
            )
        for arch, overrides in cases:
            name = arch + ("-small" if overrides else "")
            path = build_tiny_model(arch, Path(root) / name, **overrides)
            plan = plan_load(path)
            cls = getattr(transformers, plan.model_class)
            kwargs = plan.from_pretrained_kwargs()
            load_for_xpu(path), cls.from_pretrained(path, **kwargs)  # warm-up
            raw: list[float] = []
            ours: list[float] = []
            for i in range(args.repeat):
                for which in ("raw", "ours") if i % 2 == 0 else ("ours", "raw"):
                    gc.collect()  # free the previous model outside the timed region
                    if args.uncached:
                        model_facts._CACHE.clear()
                    start = time.perf_counter()
                    model = cls.from_pretrained(path, **kwargs) if which == "raw" else load_for_xpu(path)
                    (raw if which == "raw" else ours).append((time.perf_counter() - start) * 1e3)
                    del model
            raw_ms, ours_ms = statistics.median(raw), statistics.median(ours)
            print(
                json.dumps(
                    {
                        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        "bench": "load_for_xpu_vs_from_pretrained",
                        "machine": f"{platform.machine()} {platform.processor() or platform.system()}, "
                        f"{os.cpu_count()} CPUs",
                        "versions": {
                            p: _version(p) for p in ("torch", "transformers", "accelerate", "xpukit")
                        },
                        "arch": name,
                        "parameters": plan.model_facts.num_parameters,
                        "device_map": plan.device_map,
                        "dtype": plan.dtype,
                        "repeat": args.repeat,
                        "facts_cache": not args.uncached,
                        "raw_median_ms": round(raw_ms, 2),
                        "load_for_xpu_median_ms": round(ours_ms, 2),
                        "overhead_ms": round(ours_ms - raw_ms, 2),
                        "ratio": round(ours_ms / raw_ms, 3),
                    }
                ),
                flush=True,
            )


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
