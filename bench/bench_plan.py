"""How long ``plan_load`` takes on a real-size config: first call in a fresh process, and warm calls.

The first call is dominated by imports (torch, transformers' model classes); a warm call is the
meta-device build of the model plus the size computations ("warm"), or reuses the facts of the same
config read before in the process ("warm-cached"). Target: warm < 200 ms for an 8B config.
Prints one JSON line per measurement (date, versions, machine, milliseconds).

``--cli`` times whole commands in fresh interpreters instead, best of ``--repeat``: the baseline
``python -c "import torch; from transformers import AutoConfig"``, ``xpukit plan MODEL`` and
``xpukit plan DIR`` for a local directory holding only MODEL's ``config.json``, each with its ratio
to the baseline (target ≤ 1.5, docs/planning.md "Model facts from the config alone"). The load
average before each run is recorded: on a shared machine, compare runs taken at similar load.

Usage::

    python bench/bench_plan.py                         # qwen3-8b on arc-b580 and on this machine
    python bench/bench_plan.py --model llama-3.1-70b --assume max-1550x2 --repeat 20
    python bench/bench_plan.py --cli --repeat 3        # xpukit plan qwen3-8b and a local directory
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from importlib import metadata

os.environ.setdefault("HF_HUB_OFFLINE", "1")

COLD = """
import json, sys, time
t0 = time.perf_counter()
from xpukit.planning.plan import plan_load
from xpukit.planning.model.reference_models import reference_config
t1 = time.perf_counter()
plan_load(reference_config(sys.argv[1]), facts=sys.argv[2] or None)
t2 = time.perf_counter()
print(json.dumps({"import_ms": (t1 - t0) * 1e3, "first_plan_ms": (t2 - t1) * 1e3}))
"""


def _record(**values: object) -> None:
    versions = {p: _version(p) for p in ("torch", "transformers", "accelerate", "kernels", "xpukit")}
    print(
        json.dumps(
            {
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "bench": "plan_load",
                "machine": f"{platform.machine()} {platform.processor() or platform.system()}, "
                f"{os.cpu_count()} CPUs",
                "python": platform.python_version(),
                "versions": versions,
                **values,
            }
        ),
        flush=True,
    )


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        default="qwen3-8b",
        help="a built-in shape (xpukit.planning.model.reference_models.REFERENCE_CONFIGS)",
    )
    parser.add_argument("--assume", default="arc-b580", help="profile to plan for ('' = this machine)")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--cli", action="store_true", help="time `xpukit plan` commands (best of --repeat)")
    args = parser.parse_args()
    if args.cli:
        _cli(args.model, args.repeat)
        return

    cold = subprocess.run(
        [sys.executable, "-c", COLD, args.model, args.assume], capture_output=True, text=True, check=True
    )
    _record(model=args.model, facts=args.assume or "detected", kind="cold", **json.loads(cold.stdout))

    from xpukit.planning.model import facts as model_facts
    from xpukit.planning.model.reference_models import reference_config
    from xpukit.planning.plan import plan_load

    config = reference_config(args.model)
    for facts in (args.assume or None, None) if args.assume else (None,):
        plan_load(config, facts=facts)  # warm-up: imports and lazy caches
        for kind in ("warm", "warm-cached"):
            times = []
            for _ in range(args.repeat):
                if kind == "warm":
                    model_facts._CACHE.clear()  # measure the meta-device build and sizing every time
                start = time.perf_counter()
                plan_load(config, facts=facts)
                times.append((time.perf_counter() - start) * 1e3)
            _record(
                model=args.model,
                facts=facts or "detected",
                kind=kind,
                repeat=args.repeat,
                median_ms=round(statistics.median(times), 1),
                min_ms=round(min(times), 1),
                max_ms=round(max(times), 1),
            )


def _cli(model: str, repeat: int) -> None:
    from xpukit.planning.model.reference_models import reference_config

    with tempfile.TemporaryDirectory(prefix="bench-plan-") as tmp:
        reference_config(model).save_pretrained(tmp)  # config.json only: a plan reads nothing else
        plan = [sys.executable, "-m", "xpukit.cli.main", "plan"]
        commands = {
            "import torch + transformers.AutoConfig": [
                sys.executable,
                "-c",
                "import torch; from transformers import AutoConfig",
            ],
            f"xpukit plan {model}": [*plan, model],
            "xpukit plan <local dir>": [*plan, tmp],
        }
        best = dict.fromkeys(commands, float("inf"))
        loads: list[float] = []
        for _ in range(repeat):  # interleaved, so a change of load on a shared machine hits all alike
            for label, argv in commands.items():
                loads.append(round(os.getloadavg()[0], 2))
                start = time.perf_counter()
                subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                best[label] = min(best[label], time.perf_counter() - start)
    baseline = best["import torch + transformers.AutoConfig"]
    for label, seconds in best.items():
        _record(
            kind="cli",
            command=label,
            model=model,
            repeat=repeat,
            best_s=round(seconds, 2),
            ratio_to_import=round(seconds / baseline, 2),
            load_1min=[min(loads), max(loads)],
        )


if __name__ == "__main__":
    main()
