"""Decoding speed: raw ``from_pretrained`` vs ``load_for_xpu`` vs ``load_for_xpu(fast_decode=True)``.

One process, random weights with the shape of a real model (no Hub): for every variant and batch
size, greedy ``generate`` of ``--new-tokens`` tokens (``min_new_tokens`` too, so EOS cannot cut a run
short) after a ``--prompt-len`` prompt; the first call is reported apart (``first_call_s``: for the
compiled variant, the compile), then ``--repeat`` timed calls. Tokens/s counts generated tokens of
all sequences; ``roofline_tok_s`` is ``batch × bandwidth / weight bytes`` (each decoding step reads
every weight once), from the table below or ``--bandwidth``. One JSON line per row.

Variants (``VARIANTS``; the loads in ``_decode_loads.py``: ``LOADS``, ``RECOMPILED``, ``WITHOUT_KERNELS``):
``raw`` (``from_pretrained`` + ``.to``), ``xpukit`` (``load_for_xpu``, bf16 left plain), ``fast``
(``fast_decode=True, warmup=True``: xpukit's loop), ``fast-unfused``, ``fast-sdpa`` (transformers'
SDPA in the step), ``fast-hf`` (the loop off: transformers' compiled ``generate``); ``nf4``
(bitsandbytes), ``int4`` / ``int8`` (``quantize="4bit"``/``"8bit"`` and nothing else: the default
fast path, tiered), ``*-plain`` (``fast_decode=False``), ``*-fast`` (``fast_decode=True,
warmup=True``), ``*-fast-unfused``; ``*-untiered`` (the default load with the step compiled inside
the first ``generate()``, as before tiers), ``*-regional`` (``fast_decode="regional"``, no warm-up:
one layer compiled, the step captured whole), ``*-trees`` (inductor's CUDA-graph trees instead of the
loop's step graph), ``int8-fast-patterns`` (inductor's pattern matcher on), ``*-fast-torchao``
(torchao's products instead of xpukit's kernels); measurement aids ``static`` / ``compiled`` /
``loop`` (a static cache, transformers' compile forced, xpukit's loop eager), ``loop-tiered`` (the
loop tiered, inductor, on any device: the CPU's check of tiers). The row's
``fast_path`` says which decoding the load set up, or ``none:`` and why.

Per variant, before the timed calls (unless ``--no-speed-ramp``), a fresh load's ramp
(``_decode_rows.time_to_speed``): ``first_token_s`` (a one-token call right after the load),
``first_tokens_tok_s`` (the next ``--new-tokens`` tokens) and the tier of each token, calls until two
in a row are served by the compiled step alone (``full_speed_s`` after the load), and the prefill of a
``--prefill-len``-token prompt (2 048). The timed calls of a tiered load wait for its compiled step.

``--breakdown``: per row, where a token's time goes (docs/decode-internals.md "Where a token's time goes"; a
profiled call, dynamo's counters, a one-token call, the step alone by ``loop.replay``, the same model
without the window or the captured prefill, the device's copy bandwidth; ``_breakdown.py``).
``--second-process``: a fresh process (empty inductor and Triton caches, the same
``XPUKIT_CACHE_DIR``) loads with ``fast_decode=True, warmup=True`` and times its load, warm-up and
first call; ``--second-process-quantize Q`` (``none``, ``4bit``, ``8bit``) times a user's second
process, ``load_for_xpu(path, quantize=Q)`` and its first ``generate``, right after the variant that
fills that compile cache (``_decode_rows.CHILD_SOURCES``).

Caches: unless ``--keep-caches``, ``XPUKIT_CACHE_DIR``, ``TORCHINDUCTOR_CACHE_DIR`` and
``TRITON_CACHE_DIR`` point at fresh directories (each graph's first compile here is cold);
``--model-dir`` keeps the random-weight models. Rows carry the date, versions, ``weights_bytes``,
``first_call_s`` apart from ``tok_s`` (best of the timed calls), ``memory_gb`` and ``peak_memory_gb``;
a ``summary`` line per variant. ``--deadline-s`` skips what would start later (a ``skipped`` row).

Usage::

    python bench/bench_decode.py --device cuda --shape qwen3-0.6b --variants fast,fast-hf --breakdown
    python bench/bench_decode.py --tiny                 # a CPU check in seconds
    python bench/bench_decode.py --device cpu --shape tiny-36 --variants loop-tiered --batch 1 --threads 1
    python bench/bench_decode.py --device cuda --shape qwen3-8b --batch 1 --repeat 1 \
        --variants int4,int4-plain,xpukit,int8 --second-process-quantize 4bit --deadline-s 240
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import _decode_rows as rows  # bench/_decode_rows.py: fast path, summary line, the second process
import _harness as h  # bench/_harness.py, beside this script: devices, memory, timing, rows
from _decode_loads import load
from _shapes import build_decode_model as build

os.environ.setdefault("HF_HUB_OFFLINE", "1")
_STARTED = time.perf_counter()  # the second process reports its start-up from here
DECODE_PACKAGES = ("torch", "transformers", "accelerate", "xpukit", "torchao", "bitsandbytes")

VARIANTS = (
    "raw",
    "xpukit",
    "fast",
    "fast-unfused",
    "fast-sdpa",
    "fast-hf",
    "static",
    "compiled",
    "loop",
    "nf4",
    "int4",
    "int8",
    "int4-plain",
    "int8-plain",
    "int4-fast",
    "int8-fast",
    "int4-fast-unfused",
    "int8-fast-unfused",
    "fast-trees",
    "int4-fast-trees",
    "int8-fast-patterns",
    "fast-regional",
    "int4-fast-regional",
    "int8-fast-torchao",
    "int4-fast-torchao",
    "int4-untiered",
    "int8-untiered",
    "fast-untiered",
    "int4-regional",
    "fast-untiered-regional",
    "loop-tiered",
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", help="cuda, xpu, cpu … (default cuda)")
    parser.add_argument(
        "--shape",
        action="append",
        help="qwen3-0.6b, qwen3-8b (reference shapes), tiny or small (~100M); repeatable; default qwen3-8b",
    )
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--batch", type=int, action="append", help="repeatable; default 1 and 8")
    parser.add_argument("--repeat", type=int, default=3, help="timed calls after the first (default 3)")
    parser.add_argument(
        "--variants", default="raw,xpukit,fast", help=f"comma-separated of {', '.join(VARIANTS)}"
    )
    parser.add_argument("--bandwidth", type=float, help="peak memory bandwidth in bytes/s (else the table)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (CPU runs)")
    parser.add_argument(
        "--cache-len",
        type=int,
        help="static cache length: replaces the plan's for 'fast'/'fast-hf'; for 'static'/'compiled' the "
        "default is the plan's on a GPU, else prompt + new tokens rounded up to 256",
    )
    parser.add_argument("--breakdown", action="store_true", help="profile where a token's time goes")
    parser.add_argument("--no-speed-ramp", action="store_true", help="skip each load's first calls' ramp")
    parser.add_argument("--full-speed-s", type=float, default=300.0, help="the ramp's calls stop after this")
    parser.add_argument("--prefill-len", type=int, default=2048, help="the ramp's long prompt (tokens)")
    parser.add_argument(
        "--second-process", action="store_true", help="time a fresh process's bf16 warm-up and first call"
    )
    parser.add_argument(
        "--second-process-quantize",
        action="append",
        choices=sorted(rows.CHILD_LOADS),
        help="repeatable: a fresh process loads load_for_xpu(path, quantize=Q) (none: bf16 with "
        "fast_decode=True; 4bit-saved/8bit-saved: the checkpoint xpukit export --quantize writes first), "
        "no warm-up, and times its first generate, with this run's compile cache",
    )
    parser.add_argument("--model-dir", type=Path, help="build the random-weight models here and reuse them")
    parser.add_argument("--keep-caches", action="store_true", help="use the usual compile and xpukit caches")
    parser.add_argument(
        "--deadline-s", type=float, help="skip variants that would start after this many seconds"
    )
    parser.add_argument(
        "--torchao-inductor-config",
        action="store_true",
        help="apply torchao's recommended inductor settings first (xpukit's torchao loads do not)",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="a CPU check in seconds: --device cpu --shape tiny --batch 1 --new-tokens 8 --repeat 1",
    )
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # the second process's model
    parser.add_argument("--child-quantize", help=argparse.SUPPRESS)  # its --second-process-quantize
    args = parser.parse_args()
    if args.tiny:
        args.device, args.shape, args.batch = "cpu", args.shape or ["tiny"], args.batch or [1]
        args.new_tokens, args.repeat = min(args.new_tokens, 8), min(args.repeat, 1)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    for quantize in args.second_process_quantize or []:
        sources = rows.CHILD_SOURCES[quantize]
        if not args.keep_caches and not set(sources) & set(variants):
            parser.error(
                f"--second-process-quantize {quantize} reads the compile cache that one of the variants "
                f"{', '.join(sources)} fills in this run, and --variants has none of them. Fix: add one "
                "to --variants, or pass --keep-caches to use the usual caches"
            )
    with tempfile.TemporaryDirectory(prefix="xpukit-bench-decode-") as root:
        if not args.keep_caches and args.child is None:
            for name, sub in (
                ("XPUKIT_CACHE_DIR", "xpukit"),
                ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
                ("TRITON_CACHE_DIR", "triton"),
            ):
                os.environ[name] = str(Path(root) / sub)
        run(args, variants, Path(root))


def run(args: argparse.Namespace, variants: list[str], root: Path) -> None:
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.torchao_inductor_config:
        from torchao.quantization.utils import recommended_inductor_config_setter

        recommended_inductor_config_setter()
    bandwidth, device_name = h.bandwidth_for(args.device, args.bandwidth)
    common = {
        "bench": "decode",
        "date": datetime.now(timezone.utc).date().isoformat(),
        "machine": platform.node(),
        "device": args.device,
        "device_name": device_name,
        "threads": torch.get_num_threads(),
        "versions": h.versions_with_python(DECODE_PACKAGES),
        "new_tokens": args.new_tokens,
        "prompt_len": args.prompt_len,
        "torchao_inductor_config": args.torchao_inductor_config,
    }
    if args.child is not None:
        h.emit(common | rows.child_row(args, _STARTED))
        return
    late = lambda: bool(args.deadline_s) and time.perf_counter() - _STARTED > args.deadline_s  # noqa: E731
    if args.breakdown:
        h.emit(common | {"measured_copy_bandwidth": h.copy_bandwidth(args.device)})
    for shape in args.shape or ["qwen3-8b"]:
        start = time.perf_counter()
        path = build(shape, args.model_dir or root, args.device)
        h.emit(common | {"shape": shape, "build_s": round(time.perf_counter() - start, 1)})
        reference: dict[int, Any] = {}
        outputs: dict[tuple[str, int], Any] = {}
        children = list(args.second_process_quantize or [])

        for variant in variants:
            if late():
                h.emit(common | {"shape": shape, "variant": variant, "skipped": "deadline"})
                continue
            measure(args, variant, path, shape, common, bandwidth, reference, outputs, late)
            for quantize in [q for q in children if variant in rows.CHILD_SOURCES[q]]:
                children.remove(quantize)  # right after the variant that filled its compile cache
                second(args, common | {"shape": shape}, path, root, quantize, late())
        for quantize in children:  # --keep-caches: the usual cache, whatever filled it
            second(args, common | {"shape": shape}, path, root, quantize, late())
        if args.second_process:
            second(args, common | {"shape": shape}, path, root, None, late())


def second(
    args: argparse.Namespace, common: dict[str, Any], path: Path, root: Path, quantize: str | None, late: bool
) -> None:
    """A fresh process's first call (``rows.second_process``), or a ``skipped`` row past the deadline."""
    if late:
        name = f"second-process-{quantize}" if quantize else "fast-second-process"
        h.emit(common | {"variant": name, "skipped": "deadline"})
        return
    h.emit(common | rows.second_process(args, __file__, path, root, quantize))


def measure(
    args: argparse.Namespace,
    variant: str,
    path: Path,
    shape: str,
    common: dict[str, Any],
    bandwidth: float | None,
    reference: dict[int, Any],
    outputs: dict[tuple[str, int], Any],
    late: Any,
) -> None:
    """Load ``variant``, then per batch size a first call and ``--repeat`` timed calls: a row each
    (a batch size that would start after ``--deadline-s`` gets a ``skipped`` row), then its summary."""
    import torch

    h.reset_peak(args.device)
    start = time.perf_counter()
    model = load(variant, path, args.device, rows.cache_len(args, path))
    load_s = time.perf_counter() - start
    vocab = model.config.get_text_config().vocab_size
    ramp = None if args.no_speed_ramp else rows.time_to_speed(model, vocab, args, start + load_s)
    loaded_gb = h.allocated_gb(args.device)
    if (
        variant in {"fast", "fast-sdpa", "fast-hf"}
        and args.cache_len
        and model.generation_config.cache_implementation
    ):
        model.generation_config.max_cache_len = args.cache_len
    weights = sum(rows.stored_bytes(p) for p in model.parameters())
    plan = getattr(model, "xpukit_plan", None)
    events = list(plan.events if plan else []) + list(getattr(model, "xpukit_bench_warmup", []))
    warmup = next((e.actual for e in events if e.what == "warmup"), None)
    done: list[dict[str, Any]] = []
    skipped: list[int] = []
    for batch in args.batch or [1, 8]:
        if done and late():
            skipped.append(batch)
            h.emit(common | {"shape": shape, "variant": variant, "batch": batch, "skipped": "deadline"})
            continue
        ids = rows.prompt(batch, args.prompt_len, vocab).to(args.device)
        first, out = h.timed_generate(model, ids, args.new_tokens, args.device)
        waited = rows.wait_compiled(model, args.full_speed_s)  # tiered: time the compiled tier
        counters = h.dynamo_counters()
        times = [h.timed_generate(model, ids, args.new_tokens, args.device)[0] for _ in range(args.repeat)]
        tokens = batch * args.new_tokens
        roofline = batch * bandwidth / weights if bandwidth else None
        best = tokens / min(times)
        reference.setdefault(batch, out.cpu())
        outputs[(variant, batch)] = out.cpu()
        row = common | {
            "shape": shape,
            "params": sum(p.numel() for p in model.parameters()),
            "weights_bytes": weights,
            "dtype": str(model.dtype).removeprefix("torch."),
            "variant": variant,
            "batch": batch,
            "cache_len": getattr(model.generation_config, "max_cache_len", None),
            "load_s": round(load_s, 2),
            "first_call_s": round(first, 3),  # after the ramp (if any): a warm call
            "speed_ramp": ramp if not done else None,  # the load's first calls, batch 1
            "first_call_over_timed_s": round(first - min(times), 3),
            "waited_for_compiled_s": waited,
            "tiers": (getattr(model, "xpukit_last_decode", None) or {}).get("tiers"),  # the last call's
            "tok_s": round(best, 2),
            "tok_s_median": round(tokens / statistics.median(times), 2),
            "roofline_tok_s": round(roofline, 1) if roofline else None,
            "roofline_fraction": round(best / roofline, 4) if roofline else None,
            "warmup": warmup,
            "note": getattr(model, "xpukit_bench_note", None),
            "fast_path": rows.fast_path(model),
            "compile_cache": rows.cache_records(model, batch),
            "step_graphs": rows.step_graph_stats(model),
            "loop": (getattr(model, "xpukit_last_decode", None) or {}).get("loop", "transformers"),
            "quantization": plan.decision("quantization").value if plan else None,
            "fast_decode": (
                plan.decision("fast_decode").to_dict()
                if plan and any(d.name == "fast_decode" for d in plan.decisions)
                else None
            ),
            "memory_gb": loaded_gb,
            "peak_memory_gb": rows.peak_gb(args.device),
            "same_tokens_as_first_variant": bool(torch.equal(out.cpu(), reference[batch])),
            "same_tokens_as": [
                v
                for (v, b), o in outputs.items()
                if b == batch and v != variant and torch.equal(o, out.cpu())
            ],
        }
        if args.breakdown:
            from _breakdown import breakdown  # bench/_breakdown.py: where a token's time goes

            row["breakdown"] = breakdown(model, ids, args, counters, min(times))
        h.emit(row)
        done.append(row)
    h.emit(common | {"shape": shape} | rows.summary_row(variant, done, skipped))
    del model
    gc.collect()
    if args.device.startswith(("cuda", "xpu")):
        getattr(torch, args.device.split(":")[0]).empty_cache()


if __name__ == "__main__":
    main()
