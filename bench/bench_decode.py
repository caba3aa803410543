"""Decoding speed: raw ``from_pretrained`` vs ``load_for_xpu`` vs ``load_for_xpu(fast_decode=True)``.

One process, random weights with the shape of a real model (no Hub): for every variant and batch
size, greedy ``generate`` of ``--new-tokens`` tokens (``min_new_tokens`` too, so EOS cannot cut a run
short) after a ``--prompt-len`` prompt; the first call is reported apart (``first_call_s``: for the
compiled variant, the compile), then ``--repeat`` timed calls. Tokens/s counts generated tokens of
all sequences; ``roofline_tok_s`` is ``batch × bandwidth / weight bytes`` (each decoding step reads
every weight once), from the table below or ``--bandwidth``. One JSON line per row.

Variants:

* ``raw``: ``AutoModelForCausalLM.from_pretrained(path, dtype=<the plan's dtype>).to(device)``;
* ``xpukit``: ``load_for_xpu(path, device=...)``;
* ``fast``: ``load_for_xpu(path, device=..., fast_decode=True, warmup=True)``: xpukit's decode loop;
* ``fast-sdpa``: ``fast`` with transformers' SDPA attention in the decode step too (its
  ``repeat_kv`` copy of the cache) instead of xpukit's grouped decode attention
  (``xpukit.loading.decode.attention``), to measure what that saves;
* ``fast-hf``: the same load with xpukit's loop switched off (``model.xpukit_decode_loop.enabled =
  False``): transformers' ``generate`` with the same static cache and compile settings;
* quantized weights (docs/decode.md "Quantized models"): ``nf4`` is ``load_for_xpu(path,
  quantize="nf4")`` (bitsandbytes); ``int4`` / ``int8`` are ``quantize="4bit"`` / ``"8bit"`` (the
  device's fastest format: torchao where it runs, the row's ``quantization`` says which);
  ``int4-fast`` / ``int8-fast`` add ``fast_decode=True, warmup=True`` (the row's ``fast_decode`` is
  the plan's decision: where the plan does not take it, nothing changes);
* ``fast-trees`` / ``int4-fast-trees``: ``fast`` / ``int4-fast`` with the loop's step compiled with
  ``mode="reduce-overhead"`` (inductor's CUDA-graph trees) instead of xpukit's own step graph;
  ``int8-fast-patterns``: ``int8-fast`` with inductor's pattern matcher on, as before xpukit turned
  it off for torchao int8 on CUDA (docs/decode.md "Quantized models");
* ``static`` / ``compiled`` (measurement aids, not what xpukit sets on a CPU): ``load_for_xpu``, then
  a static cache of the same length as ``fast``, and for ``compiled`` transformers' compiled decoding
  forced on every device (``CompileConfig._compile_all_devices``); ``loop``: xpukit's decode loop,
  eager, over a static cache of that length (what ``fast`` runs, uncompiled, on any device).

``--breakdown`` adds, per row, where a token's time goes (docs/decode.md "Where a token's time goes"):
one more call under ``torch.profiler`` (device busy fraction = kernel time / wall time of that call,
kernels and CUDA-graph launches per token, device time by category and the top kernels), dynamo's
counters over the timed calls (graph breaks,
new graphs, CUDA-graph skips), a call's fixed part (``ms_call_one_token``: a call for one new token,
the prefill and what surrounds it), and for xpukit's loop the decode step alone (``loop.replay``: 64
steps, one sync) against the per-token time of the whole call, and the same model with the
attention window and the captured prefill each switched off (``same_model_without``); plus a
measured copy bandwidth of the device.

``--second-process`` adds a row per shape: a fresh process (its own empty inductor and triton
caches, the same xpukit cache dir) loads with ``fast_decode=True, warmup=True`` and times its load,
warm-up and first call at each batch size, so only xpukit's compile cache can make it warm.

Caches: unless ``--keep-caches``, this process points ``XPUKIT_CACHE_DIR``, ``TORCHINDUCTOR_CACHE_DIR``
and ``TRITON_CACHE_DIR`` at fresh directories under its temporary root, so every warm-up here is cold.
``--model-dir`` keeps the random-weight models between runs (an 8B shape takes a minute to write).
Every row has ``weights_bytes`` (the stored bytes of the parameters, inner tensors of torchao's
quantized ones included), and on CUDA/XPU ``memory_gb`` (allocated after the load and warm-up) and
``peak_memory_gb`` (the most allocated from the load to the last call). ``--deadline-s`` skips the
variants that would start after that many seconds (a ``skipped`` row each), so a bounded run still
reports what it measured.

Usage::

    python bench/bench_decode.py --device cuda --shape qwen3-8b --shape qwen3-0.6b
    python bench/bench_decode.py --device cuda --shape qwen3-0.6b --variants fast,fast-hf --breakdown \
        --second-process
    python bench/bench_decode.py --tiny                 # a CPU check in seconds
    python bench/bench_decode.py --device cpu --shape tiny --new-tokens 32 --threads 1
    python bench/bench_decode.py --device cpu --shape small --variants raw,static,compiled --batch 1
    python bench/bench_decode.py --device cuda --shape qwen3-8b --batch 1 --repeat 1 \
        --variants int4-fast,int4,nf4,int8,fast --model-dir /dev/shm/xpukit-bench --deadline-s 150
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import _harness as h  # bench/_harness.py, beside this script: devices, memory, timing, rows
from _shapes import build_decode_model as build

os.environ.setdefault("HF_HUB_OFFLINE", "1")
_STARTED = time.perf_counter()  # the second process reports its start-up from here
DECODE_PACKAGES = ("torch", "transformers", "accelerate", "xpukit", "torchao", "bitsandbytes")

VARIANTS = (
    "raw", "xpukit", "fast", "fast-sdpa", "fast-hf", "static", "compiled", "loop",
    "nf4", "int4", "int8", "int4-fast", "int8-fast", "fast-trees", "int4-fast-trees", "int8-fast-patterns",
)  # fmt: skip
# The quantized variants: quantize= and fast_decode (docs/decode.md "Quantized models").
QUANTIZED = {
    "nf4": ("nf4", False),
    "int4": ("4bit", False),
    "int8": ("8bit", False),
    "int4-fast": ("4bit", True),
    "int8-fast": ("8bit", True),
}
# fast_decode's load with the loop compiled the way it was before, for a same-run comparison:
# quantize=, then the compile settings: inductor's CUDA-graph trees instead of the loop's own step
# graph (docs/decode.md "Own step graphs"), or inductor's pattern matcher on for torchao int8 (its
# rewrite to aten._weight_int8pack_mm, docs/decode.md "Quantized models").
RECOMPILED = {
    "fast-trees": (None, "reduce-overhead", False),
    "int4-fast-trees": ("4bit", "reduce-overhead", False),
    "int8-fast-patterns": ("8bit", "default", True),
}


def load(variant: str, path: Path, device: str, cache_len: int) -> Any:
    """Load ``path`` the way ``variant`` does; ``cache_len`` sizes the measurement aids' static cache."""
    import torch
    from transformers import AutoModelForCausalLM, CompileConfig

    from xpukit.loading.load import load_for_xpu
    from xpukit.planning.plan import plan_load

    if variant in RECOMPILED:
        from xpukit.loading.decode.fast_decode import warm_up
        from xpukit.planning.device.decode import compile_settings

        quantize, mode, step_graphs = RECOMPILED[variant]
        model = load_for_xpu(path, device=device, quantize=quantize, fast_decode=True)
        loop = getattr(model, "xpukit_decode_loop", None)
        if loop is not None and loop.compile_options:
            loop.set_compile(compile_settings(mode), step_graphs=step_graphs and loop.step_graphs is not None)
            model.xpukit_bench_note = f"loop compiled: {loop.compile_options}"
        model.xpukit_bench_warmup = warm_up(model, model.xpukit_plan)
        return model
    if variant in QUANTIZED:
        quantize, fast = QUANTIZED[variant]
        if fast:
            return load_for_xpu(path, device=device, quantize=quantize, fast_decode=True, warmup=True)
        return load_for_xpu(path, device=device, quantize=quantize)
    if variant == "raw":
        dtype = getattr(torch, plan_load(path, device=device).dtype)
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    if variant == "fast":
        return load_for_xpu(path, device=device, fast_decode=True, warmup=True)
    if variant == "fast-sdpa":  # fast, with transformers' SDPA in the decode step too
        from xpukit.loading.decode.fast_decode import warm_up

        model = load_for_xpu(path, device=device, fast_decode=True)
        model.config._attn_implementation = "sdpa"
        model.xpukit_bench_note = "transformers' SDPA attention (repeat_kv) in the decode step"
        model.xpukit_bench_warmup = warm_up(model, model.xpukit_plan)
        return model
    if variant == "fast-hf":
        from xpukit.loading.decode.fast_decode import warm_up

        model = load_for_xpu(path, device=device, fast_decode=True)
        loop = getattr(model, "xpukit_decode_loop", None)
        if loop is not None:
            loop.enabled = False
        model.xpukit_bench_warmup = warm_up(model, model.xpukit_plan)  # transformers' loop compiles
        return model
    model = load_for_xpu(path, device=device)
    if variant == "loop":
        from xpukit.loading.decode.loop import install_decode_loop

        install_decode_loop(model, max_cache_len=cache_len, compile_options=None)
    if variant in {"static", "compiled"}:
        config = model.generation_config
        config.cache_implementation = "static"
        config.max_cache_len = cache_len
        if variant == "compiled":
            compile_config = CompileConfig(fullgraph=True, dynamic=False, mode="default")
            compile_config._compile_all_devices = True
            config.compile_config = compile_config
        else:
            config.disable_compile = True
    return model


def cache_len(args: argparse.Namespace, path: Path) -> int:
    """The static cache length of the 'static', 'compiled' and 'loop' variants."""
    from xpukit.planning.device.decode import CACHE_LENGTH_STEP
    from xpukit.planning.plan import plan_load

    if args.cache_len:
        return int(args.cache_len)
    decode = plan_load(path, device=args.device, fast_decode=True).decode
    if decode is not None and decode.max_cache_len:
        return decode.max_cache_len
    return -(-(args.prompt_len + args.new_tokens) // CACHE_LENGTH_STEP) * CACHE_LENGTH_STEP


def stored_bytes(tensor: Any) -> int:
    """Bytes a tensor stores: a tensor subclass (torchao's quantized weights) counts its inner tensors."""
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is not None:
        names, _ = tensor.__tensor_flatten__()
        return sum(stored_bytes(getattr(tensor, name)) for name in names)
    return int(tensor.numel() * tensor.element_size())


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
    parser.add_argument(
        "--second-process", action="store_true", help="time a fresh process's warm-up and first call"
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
    args = parser.parse_args()
    if args.tiny:
        args.device, args.shape, args.batch = "cpu", args.shape or ["tiny"], args.batch or [1]
        args.new_tokens, args.repeat = min(args.new_tokens, 8), min(args.repeat, 1)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
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
        print(json.dumps(common | child_row(args)), flush=True)
        return
    if args.breakdown:
        print(json.dumps(common | {"measured_copy_bandwidth": h.copy_bandwidth(args.device)}), flush=True)
    for shape in args.shape or ["qwen3-8b"]:
        start = time.perf_counter()
        path = build(shape, args.model_dir or root, args.device)
        print(json.dumps(common | {"shape": shape, "build_s": round(time.perf_counter() - start, 1)}))
        reference: dict[int, Any] = {}
        outputs: dict[tuple[str, int], Any] = {}
        for variant in variants:
            if args.deadline_s and time.perf_counter() - _STARTED > args.deadline_s:
                print(json.dumps(common | {"shape": shape, "variant": variant, "skipped": "deadline"}))
                continue
            h.allocated_gb(args.device, reset=True)
            start = time.perf_counter()
            model = load(variant, path, args.device, cache_len(args, path))
            load_s = time.perf_counter() - start
            loaded_gb = h.allocated_gb(args.device)
            if (
                variant in {"fast", "fast-sdpa", "fast-hf"}
                and args.cache_len
                and model.generation_config.cache_implementation
            ):
                model.generation_config.max_cache_len = args.cache_len
            weights = sum(stored_bytes(p) for p in model.parameters())
            plan = getattr(model, "xpukit_plan", None)
            events = list(plan.events if plan else []) + list(getattr(model, "xpukit_bench_warmup", []))
            warmup = next((e.actual for e in events if e.what == "warmup"), None)
            vocab = model.config.get_text_config().vocab_size
            for batch in args.batch or [1, 8]:
                ids = prompt(batch, args.prompt_len, vocab).to(args.device)
                first, out = h.timed_generate(model, ids, args.new_tokens, args.device)
                counters = h.dynamo_counters()
                times = [
                    h.timed_generate(model, ids, args.new_tokens, args.device)[0] for _ in range(args.repeat)
                ]
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
                    "first_call_s": round(first, 3),
                    "tok_s": round(best, 2),
                    "tok_s_median": round(tokens / statistics.median(times), 2),
                    "roofline_tok_s": round(roofline, 1) if roofline else None,
                    "roofline_fraction": round(best / roofline, 4) if roofline else None,
                    "warmup": warmup,
                    "note": getattr(model, "xpukit_bench_note", None),
                    "step_graphs": _step_graph_stats(model),
                    "loop": (getattr(model, "xpukit_last_decode", None) or {}).get("loop", "transformers"),
                    "quantization": plan.decision("quantization").value if plan else None,
                    "fast_decode": (
                        plan.decision("fast_decode").to_dict()
                        if plan and any(d.name == "fast_decode" for d in plan.decisions)
                        else None
                    ),
                    "memory_gb": loaded_gb,
                    "peak_memory_gb": h.allocated_gb(args.device, peak=True),
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
                print(json.dumps(row), flush=True)
            del model
            gc.collect()
            if args.device.startswith(("cuda", "xpu")):
                getattr(torch, args.device.split(":")[0]).empty_cache()
        if args.second_process:
            print(json.dumps(common | second_process(args, shape, path)), flush=True)


def prompt(batch: int, length: int, vocab: int) -> Any:
    import torch

    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(0))


def _step_graph_stats(model: Any) -> dict[str, int] | None:
    """xpukit's own decode-step graphs: captures, replays, dropped (None where the loop has none)."""
    graphs = getattr(getattr(model, "xpukit_decode_loop", None), "step_graphs", None)
    return dict(graphs.stats) if graphs is not None else None


def second_process(args: argparse.Namespace, shape: str, path: Path) -> dict[str, Any]:
    """Run this script as a fresh process on ``path`` (its own empty inductor and triton caches)."""
    env = h.fresh_caches("xpukit-bench-child-")
    command = [sys.executable, __file__, "--child", str(path), "--device", args.device]
    command += [f"--new-tokens={args.new_tokens}", f"--prompt-len={args.prompt_len}"]
    for batch in args.batch or [1, 8]:
        command.append(f"--batch={batch}")
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    row: dict[str, Any] = {"shape": shape, "variant": "fast-second-process", "process_s": 0.0}
    row["process_s"] = round(time.perf_counter() - start, 2)
    if done.returncode != 0:
        row["error"] = done.stderr[-2000:]
        return row
    child = json.loads(done.stdout.strip().splitlines()[-1])
    return row | {k: v for k, v in child.items() if k not in {"bench", "date", "machine", "versions"}}


def child_row(args: argparse.Namespace) -> dict[str, Any]:
    """The second process: load with fast_decode + warm-up, then one call at each batch size."""
    from xpukit.loading.load import load_for_xpu

    start = time.perf_counter()
    model = load_for_xpu(args.child, device=args.device, fast_decode=True, warmup=True)
    loaded = time.perf_counter() - start
    warmup = next((e.actual for e in model.xpukit_plan.events if e.what == "warmup"), None)
    first_calls = {}
    for batch in args.batch or [1, 8]:
        ids = prompt(batch, args.prompt_len, model.config.get_text_config().vocab_size).to(args.device)
        first_calls[str(batch)] = round(h.timed_generate(model, ids, args.new_tokens, args.device)[0], 3)
    return {
        "startup_s": round(start - _STARTED, 2),
        "load_and_warmup_s": round(loaded, 2),
        "warmup": warmup,
        "first_call_s": first_calls,
        "counters": h.dynamo_counters(),
    }


if __name__ == "__main__":
    main()
