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
* ``fast``: ``load_for_xpu(path, device=..., fast_decode=True, warmup=True)``;
* ``static`` / ``compiled`` (measurement aids, not what xpukit sets on a CPU): ``load_for_xpu``, then
  a static cache of the same length as ``fast``, and for ``compiled`` transformers' compiled decoding
  forced on every device (``CompileConfig._compile_all_devices``).

Usage::

    python bench/bench_decode.py --device cuda --shape qwen3-8b --shape qwen3-0.6b
    python bench/bench_decode.py --device cpu --shape tiny --new-tokens 32 --threads 1
    python bench/bench_decode.py --device cpu --shape small --variants raw,static,compiled --batch 1
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
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

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
# Small shapes for the CPU: xpukit's tiny qwen3, and a ~100M-parameter qwen3 (hidden 1024, 8 layers).
SMALL_SHAPES: dict[str, dict[str, int]] = {
    "tiny": {},
    "small": {
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 64,
    },
}
VARIANTS = ("raw", "xpukit", "fast", "static", "compiled")


def build(shape: str, root: Path, device: str) -> Path:
    """Write a model of ``shape`` with random weights to ``root / shape``; return its directory."""
    import torch
    from transformers import AutoModelForCausalLM

    from xpukit.demo.tiny import build_tiny_model
    from xpukit.planning.model.reference_models import reference_config

    out = root / shape
    if shape in SMALL_SHAPES:
        return build_tiny_model("qwen3", out, **SMALL_SHAPES[shape])
    config = reference_config(shape)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out)
    del model
    gc.collect()
    return out


def load(variant: str, path: Path, device: str, cache_len: int) -> Any:
    """Load ``path`` the way ``variant`` does; ``cache_len`` sizes the measurement aids' static cache."""
    import torch
    from transformers import AutoModelForCausalLM, CompileConfig

    from xpukit.loading.load import load_for_xpu
    from xpukit.planning.plan import plan_load

    if variant == "raw":
        dtype = getattr(torch, plan_load(path, device=device).dtype)
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    if variant == "fast":
        return load_for_xpu(path, device=device, fast_decode=True, warmup=True)
    model = load_for_xpu(path, device=device)
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
    """The static cache length of the 'static' and 'compiled' variants."""
    from xpukit.planning.device.decode import CACHE_LENGTH_STEP
    from xpukit.planning.plan import plan_load

    if args.cache_len:
        return int(args.cache_len)
    decode = plan_load(path, device=args.device, fast_decode=True).decode
    if decode is not None and decode.max_cache_len:
        return decode.max_cache_len
    return -(-(args.prompt_len + args.new_tokens) // CACHE_LENGTH_STEP) * CACHE_LENGTH_STEP


def sync(device: str) -> None:
    import torch

    kind = device.split(":")[0]
    if kind in {"cuda", "xpu", "mps"}:
        getattr(torch, kind).synchronize()


def timed_generate(model: Any, ids: Any, new_tokens: int, device: str) -> tuple[float, Any]:
    import torch

    sync(device)
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
    sync(device)
    return time.perf_counter() - start, out


def bandwidth_for(device: str, given: float | None) -> tuple[float | None, str]:
    import torch

    kind = device.split(":")[0]
    name = platform.processor() or "cpu"
    if kind in {"cuda", "xpu"}:
        name = getattr(torch, kind).get_device_name(torch.device(device))
    if given:
        return given, name
    return next((bw for key, bw in BANDWIDTH.items() if key in name), None), name


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("torch", "transformers", "accelerate", "xpukit"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


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
        help="static cache length: replaces the plan's for 'fast'; for 'static'/'compiled' the default is "
        "the plan's on a GPU, else prompt + new tokens rounded up to 256",
    )
    args = parser.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")

    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    bandwidth, device_name = bandwidth_for(args.device, args.bandwidth)
    common = {
        "bench": "decode",
        "date": datetime.now(timezone.utc).date().isoformat(),
        "machine": platform.node(),
        "device": args.device,
        "device_name": device_name,
        "threads": torch.get_num_threads(),
        "versions": versions(),
        "new_tokens": args.new_tokens,
        "prompt_len": args.prompt_len,
    }
    with tempfile.TemporaryDirectory(prefix="xpukit-bench-decode-") as root:
        for shape in args.shape or ["qwen3-8b"]:
            path = build(shape, Path(root), args.device)
            reference: dict[int, Any] = {}
            for variant in variants:
                model = load(variant, path, args.device, cache_len(args, path))
                if variant == "fast" and args.cache_len and model.generation_config.cache_implementation:
                    model.generation_config.max_cache_len = args.cache_len
                weights = sum(p.numel() * p.element_size() for p in model.parameters())
                plan = getattr(model, "xpukit_plan", None)
                warmup = next((e.actual for e in plan.events if e.what == "warmup"), None) if plan else None
                vocab = model.config.get_text_config().vocab_size
                for batch in args.batch or [1, 8]:
                    ids = torch.randint(
                        3, vocab, (batch, args.prompt_len), generator=torch.Generator().manual_seed(0)
                    )
                    ids = ids.to(args.device)
                    first, out = timed_generate(model, ids, args.new_tokens, args.device)
                    times = [
                        timed_generate(model, ids, args.new_tokens, args.device)[0]
                        for _ in range(args.repeat)
                    ]
                    tokens = batch * args.new_tokens
                    roofline = batch * bandwidth / weights if bandwidth else None
                    best = tokens / min(times)
                    reference.setdefault(batch, out.cpu())
                    row = common | {
                        "shape": shape,
                        "params": sum(p.numel() for p in model.parameters()),
                        "weights_bytes": weights,
                        "dtype": str(model.dtype).removeprefix("torch."),
                        "variant": variant,
                        "batch": batch,
                        "cache_len": getattr(model.generation_config, "max_cache_len", None),
                        "first_call_s": round(first, 3),
                        "tok_s": round(best, 2),
                        "tok_s_median": round(tokens / statistics.median(times), 2),
                        "roofline_tok_s": round(roofline, 1) if roofline else None,
                        "roofline_fraction": round(best / roofline, 4) if roofline else None,
                        "warmup": warmup,
                        "same_tokens_as_first_variant": bool(torch.equal(out.cpu(), reference[batch])),
                    }
                    print(json.dumps(row), flush=True)
                del model
                gc.collect()
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
