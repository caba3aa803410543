"""The ``fast_decode`` decision's reasons in words (pure; ``decode.py`` decides): the static cache's
size, and how the decoding step is compiled, with the measurements behind each choice
(docs/decode.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xpukit.planning.budgets import format_bytes

if TYPE_CHECKING:
    from xpukit.planning.device.decode_plan import DecodePlan

__all__ = ["compiled_reason", "regional_reason", "sized_reason", "tiers_reason"]

_COMPILE_COST = (
    "the compile of the decode step (measured on the H200 for the 36-layer Qwen3-8B shape: 59-119 s cold "
    "for int4, 40-71 s for bf16; it grows with the layers)"
)
_WARMUP_COST = (
    f"the first generate() at a new batch size compiles the decode step: {_COMPILE_COST}; 11-15 s in a "
    "later process that finds the compile cache; with a progress line while it runs; "
    'warmup=True compiles at load instead (docs/decode.md "Warm-up")'
)


def tiers_reason(plan: DecodePlan) -> str:
    """How the tiers share the work (``plan``: a tiered :class:`.decode_plan.DecodePlan`)."""
    first = (
        "the uncompiled step captured as one CUDA graph (a capture, no compile)"
        if plan.step_graph
        else "the uncompiled step, eagerly (no device graph here)"
    )
    return (
        f"tiered: generate() decodes at once with {first}; when the first call at a batch size ends, the "
        "loop captures that step for every attention window and the call's prompt bucket, then a thread "
        f"compiles the step ahead of time ({_COMPILE_COST}; on the H200 the 8B int4 step: first token "
        "1.8 s after the load, 111 tokens/s on the first tier during the build, built in 55-74 s, then "
        "253 tokens/s; a later process loads the saved step from the compile cache instead, in 2-3 s); "
        "while it builds no new graph is captured (the compile runs kernels), so a step with no graph yet "
        "(a new prompt bucket) runs uncaptured beside it, and Python's switch interval is 0.1 ms so that "
        "the calls get the interpreter back quickly; the compiled step takes over between two tokens of "
        "the same static cache, so no call waits for the compile and none loses a token; "
        "model.xpukit_last_decode['tiers'] counts each tier's tokens; a failed compile leaves the first "
        "tier serving, with a decode_tiers fallback event; warmup=True "
        'waits for the compiled step at load (docs/decode.md "Tiered decoding")'
    )


# Why xpukit's own weight-only product serves the decode step (docs/decode-kernels.md "Weight-only products").
_KERNEL_REASON = {
    "int8": (
        "the decode step's int8 products (up to 16 rows) run xpukit's Triton kernel, which reads each "
        "weight once as stored and dequantizes in registers (H200, Qwen3-8B shape: 190 tokens/s at "
        "batch 1 and 1 389 at batch 8, against 93 and 718 with torchao's product earlier that day, which "
        "writes a bf16 copy of each weight first), each weight checked against torchao's product at load "
        '(docs/decode-kernels.md "Weight-only products")'
    ),
}


def sized_reason(length: int, kv_bytes: int, budget: str, weights: int) -> str:
    """The static cache's size and what it costs a step, in words."""
    return (
        f"static KV cache of {length} tokens per sequence ({format_bytes(kv_bytes)} at batch 1, "
        f"b times that at batch b; from the headroom's KV budget {budget}); every step "
        f"attends over all of it, {kv_bytes / max(weights, 1):.0%} of the weights' bytes at "
        'batch 1 (a shorter cache: docs/decode.md "Cache length")'
    )


def compiled_reason(plan: DecodePlan, backend: str) -> str:
    """Why and how the decoding step is compiled (``plan``: the :class:`.decode_plan.DecodePlan`)."""
    if plan.regional:
        return regional_reason(plan)
    graphs = (
        "xpukit's loop captures the step as one CUDA graph itself, one per attention window, and the "
        "prompt's prefill, one per prompt-length bucket (its compile mode default; "
        "transformers' generate, where it runs, mode reduce-overhead: "
        'docs/decode-internals.md "Own step graphs")'
        if backend == "cuda"
        else 'mode default (inductor\'s graph capture is CUDA-only: docs/decode.md "XPU")'
    )
    sizes = ", ".join(str(b) for b in plan.graph_batch_sizes)
    text = (
        "decoding step compiled (fullgraph, static shapes but the attention window's length, "
        f"{graphs}), "
        + (
            tiers_reason(plan)
            if plan.tiered
            else f"by the warm-up at batch {sizes}, other batch sizes on first use; " + _WARMUP_COST
        )
    )
    if plan.grouped_attention:
        text += (
            "; a decode step's attention over grouped key/value heads without transformers' repeat_kv "
            'copy (docs/decode-internals.md "Grouped decode attention")'
        )
    if not plan.inductor_patterns:
        text += (
            "; inductor's pattern matcher off for the step: it rewrites torchao's int8 weight-only "
            "product into aten._weight_int8pack_mm, which read the weights at 0.15 TB/s on an H200 "
            '(15.9 against 81.3 tokens/s without it: docs/decode.md "Quantized models")'
        )
    if backend == "xpu" and plan.weights.startswith("torchao"):
        text += (
            f"; {plan.weights} on XPU by the CUDA measurement's rule, not yet measured on an Intel GPU "
            "(xpukit doctor --selftest decodes a tiny int4 model this way)"
        )
    if plan.fused_projections:
        text += (
            "; q/k/v and gate/up fused into one product each at load, one read of their weights per "
            "layer (H200, Qwen3-8B shape, bf16, batch 1: 193 tokens/s against 172 apart; "
            'fast_decode="unfused" keeps them apart: docs/decode-kernels.md "Fused projections")'
        )
    elif "tile_packed_to_4d" in plan.weights:
        text += (
            f"; q/k/v and gate/up kept apart: {plan.weights}'s row slices leave its scales "
            "non-contiguous, which torchao's int4 product refuses (H200, torchao 0.18; "
            'docs/decode-kernels.md "Fused projections")'
        )
    elif plan.weights.startswith("torchao"):
        text += (
            f"; q/k/v and gate/up kept apart: {plan.weights} does not slice by rows "
            '(docs/decode-kernels.md "Fused projections")'
        )
    if plan.weight_kernel:
        text += "; " + _KERNEL_REASON.get(plan.weight_kernel, plan.weight_kernel)
    return text


def regional_reason(plan: DecodePlan) -> str:
    """The reason of regional compilation (``fast_decode="regional"``)."""
    sizes = ", ".join(str(b) for b in plan.graph_batch_sizes)
    captured = (
        "the whole step, compiled layers and eager rest, captured as one CUDA graph by xpukit's loop, so "
        "the layers' guards run at the capture, not at every token"
        if plan.step_graph
        else "the rest of the step runs eagerly, with no device graph"
    )
    return (
        "regional compilation: one decoder layer compiled (fullgraph, mode default) and its code run "
        "by every layer, each with its own weights and part of the static cache; "
        f"{captured}; compiled by the warm-up at batch {sizes}, other batch sizes in their first call. "
        "Its compile is short (2-core CPU, 36-layer Qwen3 of hidden size 64: a fifth of the whole "
        "step's); without the step graph its steps were slow (H200, Qwen3-8B shape, int4: 52 tokens/s "
        "against 249 for the whole step captured as one graph); captured, not yet measured, so it is "
        'not the default (docs/decode-kernels.md "Regional compilation")'
    )
