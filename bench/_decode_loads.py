"""How ``bench_decode.py`` loads each variant: through ``load_for_xpu``'s own arguments, or with the
loop compiled another way for a same-run comparison (docs/decode.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Loads through load_for_xpu's own arguments: variant -> (quantize, fast_decode, warmup)
# (docs/decode.md "Fast by default", "Quantized models"; docs/decode-kernels.md "Fused projections").
LOADS: dict[str, tuple[str | None, bool | str, bool]] = {
    "xpukit": (None, "auto", False),  # bf16: the default leaves it plain
    "fast": (None, True, True),
    "fast-unfused": (None, "unfused", True),
    "nf4": ("nf4", "auto", False),
    "int4": ("4bit", "auto", False),  # the default: the fast path, compiled in the first generate
    "int8": ("8bit", "auto", False),
    "int4-plain": ("4bit", False, False),
    "int8-plain": ("8bit", False, False),
    "int4-fast": ("4bit", True, True),
    "int8-fast": ("8bit", True, True),
    "int4-fast-unfused": ("4bit", "unfused", True),
    "int8-fast-unfused": ("8bit", "unfused", True),
    # one decoder layer compiled for all of them (docs/decode-kernels.md "Regional compilation")
    "fast-regional": (None, "regional", True),
    "int4-fast-regional": ("4bit", "regional", True),
    "int4-regional": ("4bit", "regional", False),  # compiled inside the first generate
    "fast-untiered-regional": (None, "regional", False),
}
# fast_decode's load with the loop compiled the way it was before, for a same-run comparison:
# quantize=, then the compile settings: inductor's CUDA-graph trees instead of the loop's own step
# graph (docs/decode-internals.md "Own step graphs"), or inductor's pattern matcher on for torchao
# int8 (its rewrite to aten._weight_int8pack_mm, docs/decode.md "Quantized models").
# (quantize, mode, own step graph, warm-up); the *-untiered loads compile in the first generate.
RECOMPILED = {
    "fast-trees": (None, "reduce-overhead", False, True),
    "int4-fast-trees": ("4bit", "reduce-overhead", False, True),
    "int8-fast-patterns": ("8bit", "default", True, True),
    "int4-untiered": ("4bit", "default", True, False),
    "int8-untiered": ("8bit", "default", True, False),
    "fast-untiered": (None, "default", True, False),
}
# fast_decode's load with torchao's own products in the decode step instead of xpukit's weight-only
# kernels (docs/decode-kernels.md "Weight-only products"), for a same-run comparison: quantize=.
WITHOUT_KERNELS = {"int8-fast-torchao": "8bit", "int4-fast-torchao": "4bit"}


def load(variant: str, path: Path, device: str, cache_len: int) -> Any:
    """Load ``path`` the way ``variant`` does; ``cache_len`` sizes the measurement aids' static cache."""
    import torch
    from transformers import AutoModelForCausalLM, CompileConfig

    from xpukit.loading.load import load_for_xpu
    from xpukit.planning.plan import plan_load

    if variant in RECOMPILED:
        from xpukit.loading.decode.fast_decode import warm_up
        from xpukit.planning.device.decode import compile_settings

        quantize, mode, step_graphs, warm = RECOMPILED[variant]
        model = load_for_xpu(path, device=device, quantize=quantize, fast_decode=True)
        loop = getattr(model, "xpukit_decode_loop", None)
        if loop is not None and loop.compile_options:
            patterns = variant == "int8-fast-patterns" or loop.compile_options.get("options") is None
            options = compile_settings(mode, patterns=patterns)
            loop.set_compile(options, step_graphs=step_graphs and loop.step_graphs is not None)
            model.xpukit_bench_note = f"loop compiled, untiered: {loop.compile_options}"
        model.xpukit_bench_warmup = warm_up(model, model.xpukit_plan) if warm else []
        return model
    if variant in WITHOUT_KERNELS:
        from xpukit.loading.decode.fast_decode import warm_up
        from xpukit.loading.decode.woq_products import remove_weight_only_products

        model = load_for_xpu(path, device=device, quantize=WITHOUT_KERNELS[variant], fast_decode=True)
        removed = remove_weight_only_products(model)
        loop = getattr(model, "xpukit_decode_loop", None)
        if loop is not None:
            loop.cache_fields["weight_kernel"] = ""  # the step compiles with torchao's products
        model.xpukit_bench_note = f"torchao's own products ({removed} layers and groups given back)"
        model.xpukit_bench_warmup = warm_up(model, model.xpukit_plan)
        return model
    if variant in LOADS:
        quantize, fast, warmup = LOADS[variant]
        return load_for_xpu(path, device=device, quantize=quantize, fast_decode=fast, warmup=warmup)
    if variant == "raw":
        dtype = getattr(torch, plan_load(path, device=device).dtype)
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
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
    if variant in {"loop", "loop-tiered"}:  # loop-tiered: compiled ahead of time on a thread, any device
        from xpukit.loading.decode.install import install_decode_loop
        from xpukit.planning.device.decode import compile_settings

        options = compile_settings("default") if variant == "loop-tiered" else None
        tiered = options is not None
        install_decode_loop(model, max_cache_len=cache_len, compile_options=options, tiered=tiered)
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
